"""The one writer / checker of generated blocks in the docs: text between a begin and an end marker comment.

Every ``docs/gen_*.py`` generator calls ``run``, so that rewriting, ``--check`` and the stale message are the same for
all of them (the test suite runs each with ``--check``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path


def replace_block(doc: str, where: Path, begin: str, end: str, body: str) -> str:
    """``doc`` with the text between ``begin`` and ``end`` replaced by ``body``; a doc without the markers is an error."""
    if begin not in doc or end not in doc:
        raise SystemExit(f"{where} lacks the markers {begin!r} ... {end!r}")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def run(argv: Sequence[str], docs: Sequence[Path], render: Callable[[str, Path], str], stale: str) -> int:
    """Rewrite each of ``docs`` with ``render(text, path)``, or with ``--check`` in ``argv`` exit 1 when one differs,
    printing ``stale`` (``{path}`` is the doc)."""
    out_of_date = []
    for path in docs:
        doc = path.read_text()
        new = render(doc, path)
        if "--check" in argv:
            if new != doc:
                out_of_date.append(path)
        else:
            path.write_text(new)
    for path in out_of_date:
        print(stale.format(path=path))
    return 1 if out_of_date else 0
