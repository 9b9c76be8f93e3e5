"""Tables that fit their width without cutting a number or a key word.

Each column is as wide as its widest cell, header included. When a row is too wide, columns give
up room in their `rank` order: a column that may be cut (free text, names) is cut with `…` down to
its floor, then, if that is not enough and it may go, it is dropped whole. Numbers, units and
states are never cut. Left to itself, rich shrinks every column of a table that is too wide, so
`8858.2` became `885…` and `actions` became `act…`: worse than a column less.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

GAP = 2  # cells between two columns: padding 1 on either side


def ellipsize(text: Text, width: int) -> Text:
    cut = text.copy()
    cut.truncate(width, overflow="ellipsis")
    return cut


def ellipsize_words(text: Text, width: int) -> Text:
    """Free text cut after its last whole word that fits, then ` …` (`… L3 E201 …`, not `… L3 E201 0…`,
    which reads as a number); mid-word only where that would leave less than half the width."""
    plain = text.plain
    if cell_len(plain) <= width:
        return text
    space = plain.rfind(" ", 0, width - 1)
    if space < width // 2 or cell_len(plain[:space]) != space:
        return ellipsize(text, width)
    cut = text.copy()
    cut.truncate(space + 1)
    cut.append("…")
    return cut


@dataclass(slots=True)
class Column:
    header: str
    cells: list[Text] = field(default_factory=list)
    justify: JustifyMethod = "left"
    # Order in which the column gives up room when the row is too wide, lowest first; None: never.
    rank: int | None = None
    # Narrowest it may be cut to (never narrower than its header); None: never cut.
    shrink_to: int | None = None
    # Dropped whole when cutting it is not enough.
    droppable: bool = False
    # How a cell is cut to a width (e.g. a rule name keeps its target).
    cut: Callable[[Text, int], Text] = ellipsize
    # Takes the width left over (free text at the end of a row).
    stretch: bool = False

    def natural_width(self) -> int:
        return max([cell_len(self.header), *(c.cell_len for c in self.cells)])

    def floor(self) -> int:
        natural = self.natural_width()
        if self.shrink_to is None:
            return natural
        return min(natural, max(self.shrink_to, cell_len(self.header)))


def fit(columns: Sequence[Column], width: int) -> list[tuple[Column, int]]:
    """The columns kept and their widths so that the row fits `width` (as far as cutting what may
    be cut and dropping what may go allows; the rest is left to rich)."""
    widths = {id(c): c.natural_width() for c in columns}
    kept = list(columns)

    def excess() -> int:
        return sum(widths[id(c)] for c in kept) + GAP * max(0, len(kept) - 1) - width

    for col in sorted((c for c in columns if c.rank is not None), key=lambda c: c.rank or 0):
        if excess() <= 0:
            break
        widths[id(col)] = max(col.floor(), widths[id(col)] - excess())
        if excess() > 0 and col.droppable:
            kept.remove(col)
    return [(c, widths[id(c)]) for c in kept]


class FittedTable:
    """A borderless table of `columns` (cells listed per column, rows of equal length), fitted to
    the width it is rendered at. `expand`: spread over the whole width when no column stretches;
    `even`: the columns kept as wide as each other where that fits (a row of numbers spreads evenly
    rather than by the width of each)."""

    def __init__(self, columns: Sequence[Column], *, expand: bool = True, even: bool = False) -> None:
        self.columns = list(columns)
        self.expand = expand
        self.even = even

    def table(self, width: int) -> Table:
        fitted = fit(self.columns, width)
        if self.even and fitted:
            widest = max(w for _, w in fitted)
            if widest * len(fitted) + GAP * (len(fitted) - 1) <= width:
                fitted = [(col, widest) for col, _ in fitted]
        stretches = any(col.stretch for col, _ in fitted)
        table = Table(box=None, padding=(0, GAP // 2), pad_edge=False, show_edge=False,
                      expand=self.expand or stretches)
        for col, w in fitted:
            table.add_column(col.header, justify=col.justify, no_wrap=True, header_style="bold", width=w,
                             ratio=1 if col.stretch else None)
        rows = len(self.columns[0].cells) if self.columns else 0
        for i in range(rows):
            table.add_row(*(col.cells[i] if col.cells[i].cell_len <= w else col.cut(col.cells[i], w)
                            for col, w in fitted))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        natural = sum(c.natural_width() for c in self.columns) + GAP * max(0, len(self.columns) - 1)
        return Measurement(min(natural, options.max_width), natural).with_maximum(options.max_width)
