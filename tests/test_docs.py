"""README.md and docs/ agree with the code: the commands' help, the pasted error of a bad --kv (with the real preset
list), links that resolve, and no development history (issue / round numbers) in the product's text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = re.compile(r"issue[ -]?[0-9]+|round[ -]?[0-9]+", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _commands() -> dict[str, str]:
    """Each registered command's name and the first line of its help."""
    from trtkv.cli import app

    return {c.name or c.callback.__name__: (c.callback.__doc__ or "").strip().splitlines()[0] for c in app.registered_commands}


def test_readme_lists_every_command_with_its_help():
    readme = (ROOT / "README.md").read_text()
    commands = _commands()
    assert len(commands) >= 9
    for name, first_line in commands.items():
        assert f"| `trtkv {name}` | {first_line} |" in readme, f"README's command table lacks `trtkv {name}`: {first_line!r}"


def test_the_pasted_format_error_is_what_trtkv_prints():
    """A doc that shows the error of an unknown --kv shows the real line, whose preset list is PRESETS (computed, not
    restated: the presets change)."""
    from trtkv.cli import app
    from trtkv.formats import PRESETS

    args = ["plan", "--kv", "int5", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2
    [real] = [line for line in out.output.splitlines() if line.startswith("error:")]
    assert "(" + ", ".join(PRESETS) in real  # the error names every preset, in order
    shown = 0
    for doc in DOCS:
        text = doc.read_text()
        if "$ trtkv " + " ".join(args) not in text:
            continue
        pasted = text.split("$ trtkv " + " ".join(args), 1)[1].splitlines()[1]
        assert pasted == real, f"{doc.relative_to(ROOT)} shows another error than trtkv prints now; paste:\n{real}"
        shown += 1
    assert shown >= 1  # README shows it


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_describe_the_code_without_its_history(doc):
    hits = [line for line in doc.read_text().splitlines() if HISTORY.search(line)]
    assert not hits, f"{doc.relative_to(ROOT)} names issues or rounds (history goes to CHANGELOG.md): {hits[:3]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    missing = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to files that are not there: {missing}"
