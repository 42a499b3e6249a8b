"""Where every benchmark leaves its results: ``<stem>.json`` for tools and ``<stem>.md`` for people, side by side."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(stem: Path, data: dict, markdown: str) -> Path:
    """Write both files (the folder created); a benchmark calls it again after each section, so a cut run keeps what it measured."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    return stem
