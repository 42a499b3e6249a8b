"""Where every benchmark leaves its results: ``<stem>.json`` for tools and ``<stem>.md`` for people, side by side.

The Markdown (command, machine, date, table) is what bench/results keeps in git; the JSON stays on the machine that
measured (.gitignore). Stems are stable names, so a rerun replaces the result it repeats."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(stem: Path, data: dict, markdown: str) -> Path:
    """Write both files (the folder created); a benchmark calls it again after each section, so a cut run keeps what it measured."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    # appended, not with_suffix: a stem such as budget-bits2.5 has a dot that is not an extension
    (stem.parent / f"{stem.name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (stem.parent / f"{stem.name}.md").write_text(markdown)
    return stem
