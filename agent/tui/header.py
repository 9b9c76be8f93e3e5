"""Header bar (no border, 2 lines): agent, targets, uptime, probes, per-source events/s and drops,
agent self-cost, and the data status (live / stale / error)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from moescope.agent.state import Header, SelfCost
from moescope.agent.tui import fmt
from moescope.agent.tui.self_cost import SelfCostText

HEADER_ROWS = 2
# Data older than this many publish intervals (and at least STALE_MIN_S) is flagged stale.
STALE_INTERVALS = 3
STALE_MIN_S = 2.0


class HeaderBar:
    def __init__(
        self,
        header: Header | None,
        self_cost: SelfCost | None,
        *,
        taken_unix_s: float | None,
        now_unix_s: float,
        seq: int | None = None,
        publish_interval_s: float | None = None,
        error: str | None = None,
    ) -> None:
        self.header = header
        self.self_cost = self_cost
        self.taken_unix_s = taken_unix_s
        self.now_unix_s = now_unix_s
        self.seq = seq
        self.publish_interval_s = publish_interval_s
        self.error = error

    def _line1(self, width: int) -> Text:
        """`moescope  target 4101 python, 4102 python  up 1m22s  probes: ...` in `width` cells: the
        uptime whole (it was cut to `up 1m0…` at 80 columns in dry-run); targets past the room are
        counted (`+6 more`), then without the word `target`, then by pid alone; the probe list
        only where it fits whole."""
        h = self.header
        if h is None:
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append("moescope", style="bold cyan")
            t.append("  waiting for agent data", style=fmt.STYLE_DIM)
            return t
        uptime = None if self.taken_unix_s is None else self.taken_unix_s - h.started_unix_s
        up = f"  up {fmt.duration(uptime)}"
        named = [f"{tg.pid} {tg.comm}" for tg in h.targets]
        for lead, names in (("  target ", named), ("  ", named), ("  ", [str(tg.pid) for tg in h.targets])):
            room = width - len("moescope") - len(lead) - len(up)
            targets = fmt.fit_parts([("" if i == 0 else ", ", n) for i, n in enumerate(names or [fmt.NA])], room,
                                    more_sep=", ")
            if targets.cell_len <= room:
                break
        targets.stylize("bold")
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("moescope", style="bold cyan")
        t.append(lead)
        t.append_text(targets)
        t.append(up)
        if h.probes_attached:
            probes = "  probes: " + ",".join(h.probes_attached)
            if t.cell_len + len(probes) <= width:
                t.append(probes, style=fmt.STYLE_DIM)
        return t

    def _right1(self) -> Text:
        t = Text(no_wrap=True)
        h = self.header
        if h is not None:
            if h.dry_run:
                t.append("DRY-RUN ", style=fmt.STYLE_WARN)
            t.append(f"agent {h.agent_pid} ")
        t.append_text(SelfCostText(self.self_cost).text())
        return t

    def _line2(self, width: int) -> Text:
        """`probes N │ nvtx 4.9k/s drop 0 │ ...`: the sources that fit `width` whole; a source cut
        short would cut its drop count (`drop…`), so the ones past the width are left out and
        counted (`│ +2 more`)."""
        h = self.header
        probes = fmt.NA if h is None else str(len(h.probes_attached))
        if h is None or not h.sources:
            t = Text(f"probes {probes}", no_wrap=True, overflow="ellipsis")
            t.append("  │ events N/A", style=fmt.STYLE_NA)
            return t
        parts: list[tuple[str, str | Text]] = [("", f"probes {probes}")]
        for src in h.sources:
            part = Text(f"{src.name} {fmt.count(src.events_per_s)}/s")
            part.append(" drop ", style=fmt.STYLE_DIM)
            part.append(fmt.count(src.drops_total), style=fmt.STYLE_WARN if src.drops_total else "")
            parts.append(("  │ ", part))
        return fmt.fit_parts(parts, width, more_sep="  │ ")

    def _status(self) -> Text:
        """Empty while the data is fresh; otherwise why it is not."""
        if self.error:
            return Text(f"⚠ {self.error}", style=fmt.STYLE_BAD, no_wrap=True, overflow="ellipsis")
        if self.taken_unix_s is None:
            return Text("no data", style=fmt.STYLE_NA)
        age_s = self.now_unix_s - self.taken_unix_s
        limit_s = max(STALE_MIN_S, STALE_INTERVALS * (self.publish_interval_s or 0.0))
        if age_s > limit_s:
            return Text(f"STALE {fmt.duration(age_s)}", style=fmt.STYLE_BAD)
        return Text("")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        status = self._status()
        if self.error:
            # An error gets the whole second line: it matters more than the rates.
            right1 = self._right1()
            rows = [(self._line1(options.max_width - right1.cell_len - 2), right1), (status, Text(""))]
        else:
            # (the grid below pads each side of the gap between the line and its status, empty or not)
            line2 = self._line2(options.max_width - status.cell_len - 2)
            right1 = self._right1()
            rows = [(self._line1(options.max_width - right1.cell_len - 2), right1), (line2, status)]
        for left, right in rows:
            # One grid per line so each line's right part takes only the room it needs.
            grid = Table.grid(expand=True, padding=(0, 1))
            grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
            grid.add_column(justify="right", no_wrap=True)
            grid.add_row(left, right)
            yield grid
