"""The one style of table every command prints, made to keep each row on one line at 80 columns.

A terminal is often 80 columns wide, and a table wider than its terminal is not cut but
folded: rich narrows the columns it may wrap until the table fits, and a cell that no longer
fits its column runs onto a second and third line (``63.214`` over ``ms``, a layer range over
three lines), so a reader loses which figure is whose. The rules that keep a row on one line:

- units go in the heading (``step ms``, ``peak MiB``), the cells hold plain numbers;
- borders are a rule under the heading only (rich's ``SIMPLE_HEAD``), with one space between
  columns and none at the edges, which leaves the columns the width;
- layer names are shortened (gpipe_plan/layer_names.py) and every column but the names keeps
  its cells whole (``no_wrap``): where a table must give, it is at a long name.

The tests render each table at width 80 (rich ``Console(width=80)``) and check that no row
wraps. Pure Python: ``solve``, ``show`` and ``explore`` print these without torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


class NarrowTable(Table):
    """A rich ``Table`` whose title and caption are lines of their own, wrapped at the terminal's
    width rather than the table's: a narrow table would fold a long title over three lines."""

    def __init__(self, heading: str | None, **options: Any) -> None:
        super().__init__(**options)
        self.heading = heading
        self.note: str | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("")                          # a blank line sets it off from what is above
        if self.heading:
            yield Text(self.heading, style="table.title")
        yield from super().__rich_console__(console, options)
        if self.note:
            yield Text(self.note, style="table.caption")


def narrow_table(title: str | None, columns: Sequence[str], left: Sequence[str] = (),
                 wrap: Sequence[str] = ("layers", "layer")) -> NarrowTable:
    """A table of ``columns`` under ``title``: numbers right-aligned, the ``left`` columns
    (names, settings) left-aligned, and only the ``wrap`` columns allowed to wrap. Its
    ``note`` is printed under it."""
    table = NarrowTable(title, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False,
                        header_style="bold")
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=column not in wrap)
    return table
