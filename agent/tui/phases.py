"""'Where the time goes' panel: the model requests of the window broken down (agent/phase_table.py):
per phase p50 / p99 / share of the total on the left (receive, queue, prefill, decode, write: they
add up to the request), "of which" inference (prefill + decode), expert load and routing, and TTFT /
TPOT on the right; tokens per second in the bottom border.

Full (9 rows) or, when the screen is short, one summary line (3 rows); "no model requests yet" until
a request that a moe.step carried has finished in the window.
"""

from __future__ import annotations

from typing import NamedTuple

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moescope.agent.phase_table import PHASE_LABELS, Phases, PhaseStat
from moescope.agent.request_phases import PHASES
from moescope.agent.tui import fmt

BORDER_ROWS = 2
FULL_ROWS = BORDER_ROWS + 1 + len(PHASES) + 1  # borders, header, five phases, the request
SUMMARY_ROWS = BORDER_ROWS + 1
# p99 above the default rules' fire thresholds is shown as bad (docs/policy.md: fp16_fallback,
# expert_load_slow, slo_latency).
BAD_P99_MS = {"inference": 430.0, "expert_load": 200.0, "request": 870.0}
RIGHT_ROWS = ("inference", "expert_load", "routing")


def ms(value: float | None) -> str:
    """One decimal below 1 s, none above (the column stays narrow)."""
    if fmt.missing(value):
        return fmt.NA
    assert value is not None
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.1f}"


def share_text(share: float | None) -> str:
    if fmt.missing(share):
        return ""
    assert share is not None
    pct = share * 100
    return f"{pct:.1f}%" if pct < 9.95 else f"{pct:.0f}%"


class Line(NamedTuple):
    """One half-row of the table: a phase (or TTFT, TPOT, the request) and its numbers."""

    label: str
    p50_ms: float | None
    p99_ms: float | None
    share: str
    key: str  # phase name, "request", "ttft" or "tpot"


def p99_cell(name: str, value: float | None) -> Text:
    limit = BAD_P99_MS.get(name)
    bad = limit is not None and value is not None and value > limit
    return Text(ms(value), style=fmt.STYLE_BAD if bad else "")


class PhasesPanel:
    def __init__(self, phases: Phases | None, *, height: int | None = None) -> None:
        self.phases = phases if phases is not None else Phases()
        self.height = height

    def natural_rows(self) -> int:
        return FULL_ROWS if self.phases.requests else SUMMARY_ROWS

    def min_rows(self) -> int:
        return SUMMARY_ROWS

    def _title(self, width: int) -> Text:
        p = self.phases
        parts: list[tuple[str, str | Text]] = [("", "Where the time goes")]
        if p.window_s is not None:
            parts.append((" · ", f"{fmt.num(p.window_s, 'g')} s window"))
        if p.requests:
            parts.append((" · ", f"{fmt.count(p.requests)} model requests"))
            if p.ttft_wire:
                parts.append((" ", f"({fmt.count(p.ttft_wire)} streamed)"))
        return fmt.panel_title(parts, width)

    def _tokens(self) -> str | None:
        p = self.phases
        if not p.requests:
            return None
        inbound = f"in {fmt.count(p.input_tokens_per_s)}" if p.input_tokens_per_s is not None else "in N/A"
        return f"tokens/s {inbound} · out {fmt.count(p.output_tokens_per_s)}"

    def _summary(self, width: int) -> Text:
        """One line in `width` cells; its parts left out whole (cut, it read `out 38.4…`)."""
        p = self.phases
        if not p.requests:
            return Text("no model requests yet (requests a moe.step carried appear here)", style=fmt.STYLE_NA)
        inference = p.row("inference") or PhaseStat("inference")
        first = Text("inference p99 ")
        first.append_text(p99_cell("inference", inference.p99_ms))
        first.append(f" ms ({share_text(inference.share)})")
        t = fmt.fit_parts([("", first), ("  ", f"TTFT p99 {ms(p.ttft_p99_ms)} ms"),
                           ("  ", f"TPOT p99 {ms(p.tpot_p99_ms)} ms"),
                           ("  ", Text(f"out {fmt.count(p.output_tokens_per_s)} tok/s", style=fmt.STYLE_DIM))], width)
        t.no_wrap, t.overflow = True, "ellipsis"
        return t

    def _table(self) -> Table:
        p = self.phases
        table = Table(box=None, padding=(0, 1), pad_edge=False, expand=False, show_edge=False)
        for name, justify in (("phase", "left"), ("p50 ms", "right"), ("p99 ms", "right"), ("share", "right"),
                              ("", "center"), ("of which", "left"), ("p50 ms", "right"), ("p99 ms", "right"),
                              ("share", "right")):
            table.add_column(name, justify=justify, no_wrap=True, header_style="bold")  # type: ignore[arg-type]

        def phase_line(name: str) -> Line:
            r = p.row(name) or PhaseStat(name)
            return Line(PHASE_LABELS[name], r.p50_ms, r.p99_ms, share_text(r.share), name)

        left = [phase_line(name) for name in PHASES]
        left.append(Line("request", p.duration_p50_ms, p.duration_p99_ms, "100%", "request"))
        right: list[Line | None] = [phase_line(name) for name in RIGHT_ROWS]
        right += [Line("TTFT", p.ttft_p50_ms, p.ttft_p99_ms, "", "ttft"),
                  Line("TPOT", p.tpot_p50_ms, p.tpot_p99_ms, "", "tpot"), None]
        for a, b in zip(left, right, strict=True):
            table.add_row(
                Text(a.label, style="bold" if a.key == "request" else ""), ms(a.p50_ms), p99_cell(a.key, a.p99_ms),
                a.share, Text("│", style=fmt.STYLE_DIM),
                *((b.label, ms(b.p50_ms), p99_cell(b.key, b.p99_ms), b.share) if b is not None else ("", "", "", "")),
            )
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        full = self.phases.requests > 0 and (self.height is None or self.height >= FULL_ROWS)
        body: Table | Text = self._table() if full else self._summary(max(1, options.max_width - 4))
        yield Panel(
            body,
            title=self._title(options.max_width),
            title_align="left",
            subtitle=self._tokens() if full else None,
            subtitle_align="right",
            box=box.ROUNDED,
            padding=(0, 1),
            height=self.height if self.height is None or not full else FULL_ROWS,
        )
