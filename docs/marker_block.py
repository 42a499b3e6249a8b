"""The one writer / checker of generated blocks in the docs: text between a begin and an end marker comment.

Every ``docs/gen_*.py`` generator declares one ``Block`` and runs its ``main``, so that rewriting, ``--check`` and
the stale message are the same for all of them (the test suite runs each with ``--check``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Block:
    """The text ``body()`` between ``begin`` and ``end`` in each of ``docs``; ``stale`` is printed (``{path}``: the
    doc) when ``--check`` finds a doc out of date."""

    begin: str
    end: str
    body: Callable[[], str]  # called on every render, so that it reads the table as it is now
    docs: Sequence[Path]
    stale: str

    def render(self, doc: str, where: Path) -> str:
        """``doc`` with its block regenerated; a doc without the markers is an error."""
        if self.begin not in doc or self.end not in doc:
            raise SystemExit(f"{where} lacks the markers {self.begin!r} ... {self.end!r}")
        head, rest = doc.split(self.begin, 1)
        _, tail = rest.split(self.end, 1)
        return f"{head}{self.begin}\n{self.body()}\n{self.end}{tail}"

    def main(self, argv: Sequence[str]) -> int:
        """Rewrite every doc, or with ``--check`` in ``argv`` change nothing and return 1 when one differs."""
        out_of_date = []
        for path in self.docs:
            doc = path.read_text()
            new = self.render(doc, path)
            if "--check" in argv:
                if new != doc:
                    out_of_date.append(path)
            else:
                path.write_text(new)
        for path in out_of_date:
            print(self.stale.format(path=path))
        return 1 if out_of_date else 0
