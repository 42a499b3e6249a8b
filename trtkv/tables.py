"""Result tables that stay readable in logs and in 80-column terminals.

Numbers and names are never truncated: when the output is not a terminal (a log, a pipe, a file)
the table is plain Markdown, one row per line; in a terminal it is a rich table whose text cells
wrap (``overflow="fold"``) while number cells are never wrapped or cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    header: str
    numeric: bool = True  # right-aligned, never wrapped


def markdown(columns: Sequence[Column], rows: Sequence[Sequence[str]], title: str | None = None) -> str:
    """The table as Markdown (title as a plain line above it)."""
    def esc(cell: str) -> str:
        return str(cell).replace("|", "\\|")

    lines = [title, ""] if title else []
    lines.append("| " + " | ".join(esc(c.header) for c in columns) + " |")
    lines.append("|" + "|".join("---:" if c.numeric else "---" for c in columns) + "|")
    lines += ["| " + " | ".join(esc(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


_GAP = 2  # characters between two columns (right padding + the box's blank separator)


def _widths(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> tuple[list[int], int]:
    """Per column the width it gets (numbers: the widest cell; text: at most 12, it folds), and the table's width."""
    widest = [max([len(c.header)] + [len(str(r[i])) for r in rows]) for i, c in enumerate(columns)]
    widths = [w if c.numeric else min(w, 12) for c, w in zip(columns, widest)]
    return widths, sum(widths) + _GAP * (len(columns) - 1)


def fits(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> bool:
    """Whether every number cell fits side by side in ``width`` characters (text cells may fold)."""
    return _widths(columns, rows)[1] <= width


def rich_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], title: str | None = None):
    """A rich Table: text columns fold, number columns keep their full width (check ``fits`` first)."""
    from rich import box
    from rich.table import Table

    widths, _ = _widths(columns, rows)
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left")
    for c, w in zip(columns, widths):
        table.add_column(c.header, justify="right" if c.numeric else "left", no_wrap=c.numeric, overflow="fold", min_width=w)
    for row in rows:
        table.add_row(*[str(x) for x in row])
    return table


def print_table(console, columns: Sequence[Column], rows: Sequence[Sequence[str]], title: str | None = None) -> None:
    """A rich table in a terminal wide enough for every number, else Markdown (never a cut number or name)."""
    if console.is_terminal and fits(columns, rows, console.width):
        console.print(rich_table(columns, rows, title))
    else:
        console.file.write(markdown(columns, rows, title) + "\n")
        console.file.flush()
