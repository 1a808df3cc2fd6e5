"""Tables for a terminal or a Markdown file, laid out by tabulate (the library behind
`DataFrame.to_markdown`), so that no command pads, aligns or rules a table by hand.

Cells arrive formatted (units, percentages, "n/a"): number parsing is off, so a cell is printed as
its command wrote it. tabulate is imported where a table is made: a run that prints none (a sweep's job,
output.print_table=false) loads it for nothing (25 ms with the modules it brings)."""
from __future__ import annotations

from collections.abc import Sequence


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[object]], align: Sequence[str] | None = None) -> str:
    """A Markdown (pipe) table; `align`: "left" / "right" per column (default: left)."""
    from tabulate import tabulate

    return tabulate(rows, headers=list(head), tablefmt="pipe", disable_numparse=True,
                    colalign=tuple(align) if align else None)


def text_table(rows: Sequence[tuple[str, str]]) -> str:
    """Label and value, one pair a line, the values in one column."""
    from tabulate import tabulate

    return tabulate(rows, tablefmt="plain", disable_numparse=True, colalign=("left", "left"))
