"""Ranks panel: one row per producer process (an expert-parallel rank, each with its own NVTX ring),
sorted by pid — steps/s, step p50/p99, tokens/s over the window, steps seen, ring drops. Shown only
when more than one producer is seen. A rank stepping at under half the ranks' median rate is
marked (a straggler holds every all-to-all back), a rank that exited says so in its steps/s cell;
when rows run short, the last says "+K more", and with room for one line only the panel is a
summary (the slowest live rank, the worst p99, drops, how many exited)."""

from __future__ import annotations

import statistics

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moescope.agent.state import Rank, Ranks
from moescope.agent.tui import fmt

BORDER_ROWS = 2
HEADER_ROWS = 1  # the column header
MIN_ROWS = BORDER_ROWS + 1  # the one-line summary
TABLE_MIN_LINES = HEADER_ROWS + 2  # below this many lines inside the border: the summary instead
SLOW_RANK_RATIO = 0.5  # steps/s under this share of the ranks' median is marked
COMM_WIDTH = 15  # /proc/PID/comm is at most 15 characters
COLUMNS: tuple[tuple[str, int], ...] = (
    ("pid", 8), ("comm", COMM_WIDTH), ("steps/s", 7), ("p50 ms", 7), ("p99 ms", 7), ("tok/s", 7),
    ("steps", 7), ("drops", 6),
)


def step_ms(value: float | None) -> str:
    """Two decimals below a second, none above: at most 7 cells (the column's width, which would
    otherwise cut `12345.67` to `12345.…`) up to 10^7 ms."""
    return fmt.num(value, ".0f" if value is not None and abs(value) >= 1000 else ".2f")


def shows_ranks(ranks: Ranks | None) -> bool:
    """The panel is worth its rows only with more than one producer."""
    return ranks is not None and len(ranks.ranks) > 1


def slow_ranks(ranks: list[Rank]) -> set[int]:
    """Live pids stepping at under SLOW_RANK_RATIO of the live ranks' median step rate (a rank that
    exited is not a straggler: its rate only runs down)."""
    live = [r for r in ranks if r.steps_per_s is not None and not r.exited]
    if len(live) < 2:
        return set()
    floor = SLOW_RANK_RATIO * statistics.median(r.steps_per_s or 0.0 for r in live)
    return {r.pid for r in live if (r.steps_per_s or 0.0) < floor}


class RanksPanel:
    def __init__(self, ranks: Ranks | None, *, height: int | None = None) -> None:
        self.ranks = ranks if ranks is not None else Ranks()
        self.height = height

    def natural_rows(self) -> int:
        return BORDER_ROWS + HEADER_ROWS + max(1, len(self.ranks.ranks))

    def min_rows(self) -> int:
        return min(MIN_ROWS, self.natural_rows())

    def _title(self, width: int) -> Text:
        r = self.ranks
        parts: list[tuple[str, str | Text]] = [("", "Ranks"), (" · ", f"{len(r.ranks)} producers")]
        if r.window_s is not None:
            parts.append((" · ", f"{fmt.num(r.window_s, 'g')} s window"))
        if r.untracked_steps:
            parts.append((" · ", f"{fmt.count(r.untracked_steps)} steps of pids past {r.max_ranks}"))
        return fmt.panel_title(parts, width)

    def summary(self) -> Text:
        """One line: the slowest rank's rate, the worst p99 and its pid, every ring's drops."""
        rows = self.ranks.ranks
        t = Text(no_wrap=True, overflow="ellipsis")
        rated = [r for r in rows if r.steps_per_s is not None and not r.exited]
        exited = sum(1 for r in rows if r.exited)
        if not rated:
            t.append(fmt.NA, style=fmt.STYLE_NA)
        else:
            self._summary_rates(t, rows, rated)
        if exited:
            t.append(f" · {exited} exited", style=fmt.STYLE_BAD)
        return t

    @staticmethod
    def _summary_rates(t: Text, rows: list[Rank], rated: list[Rank]) -> None:
        slowest = min(rated, key=lambda r: (r.steps_per_s or 0.0, r.pid))
        style = fmt.STYLE_WARN if slowest.pid in slow_ranks(rows) else ""
        t.append(f"slowest pid {slowest.pid} ")
        t.append(f"{fmt.num(slowest.steps_per_s, '.1f')}/s", style=style)
        timed = [r for r in rows if r.step_p99_ms is not None]
        if timed:
            worst = max(timed, key=lambda r: (r.step_p99_ms or 0.0, -r.pid))
            t.append(f" · worst p99 pid {worst.pid} {fmt.num(worst.step_p99_ms, '.2f')} ms")
        known = [r.nvtx_drops_total for r in rows if r.nvtx_drops_total is not None]
        drops = sum(known) if known else None
        t.append(" · drops ")
        t.append(fmt.count(drops), style=fmt.STYLE_WARN if drops else "")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = self.ranks.ranks
        lines = None if self.height is None else max(1, self.height - BORDER_ROWS)
        body: Table | Text
        if lines is not None and lines < TABLE_MIN_LINES and len(rows) > 0:
            body = self.summary()
        else:
            body = self._table(rows, None if lines is None else lines - HEADER_ROWS)
        yield Panel(body, title=self._title(options.max_width), title_align="left", box=box.ROUNDED, padding=(0, 1),
                    height=self.height)

    def _table(self, rows: list[Rank], budget: int | None) -> Table:
        shown, hidden = rows, 0
        if budget is not None and len(rows) > budget:
            shown = rows[: max(0, budget - 1)]
            hidden = len(rows) - len(shown)
        slow = slow_ranks(rows)
        table = Table(box=None, padding=(0, 1), pad_edge=False, expand=False, show_edge=False)
        for name, width in COLUMNS:
            table.add_column(name, justify="left" if name == "comm" else "right", no_wrap=True,
                             header_style="bold", width=width, overflow="ellipsis")
        for rank in shown:
            rate_style = fmt.STYLE_WARN if rank.pid in slow else ""
            drops = rank.nvtx_drops_total
            rate = Text("exited", style=fmt.STYLE_BAD) if rank.exited else \
                Text(fmt.num(rank.steps_per_s, ".1f"), style=rate_style)
            table.add_row(
                str(rank.pid),
                rank.comm or fmt.NA,
                rate,
                step_ms(rank.step_p50_ms),
                step_ms(rank.step_p99_ms),
                fmt.count(rank.tokens_per_s),
                fmt.count(rank.steps_total),
                Text(fmt.count(drops), style=fmt.STYLE_WARN if drops else ""),
            )
        if not rows:
            table.add_row(Text(fmt.NA, style=fmt.STYLE_NA), *[""] * (len(COLUMNS) - 1))
        if hidden:
            table.add_row(Text(f"+{hidden} more", style=fmt.STYLE_DIM), *[""] * (len(COLUMNS) - 1))
        return table
