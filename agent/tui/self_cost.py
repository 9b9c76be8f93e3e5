"""Agent self-cost: CPU % of one core and RSS, marked against the performance bars (5 %, 100 MB)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from moescope.agent.state import SelfCost
from moescope.agent.tui import fmt

CPU_BAR_PCT = 5.0
RSS_BAR_BYTES = 100 * 10**6


class SelfCostText:
    def __init__(self, self_cost: SelfCost | None) -> None:
        self.self_cost = self_cost if self_cost is not None else SelfCost()

    def text(self) -> Text:
        sc = self.self_cost
        t = Text(no_wrap=True)
        t.append("cpu ")
        over_cpu = not fmt.missing(sc.cpu_pct) and sc.cpu_pct is not None and sc.cpu_pct > CPU_BAR_PCT
        t.append(fmt.num(sc.cpu_pct, ".1f", suffix="%"), style=fmt.STYLE_WARN if over_cpu else "")
        t.append(" rss ")
        over_rss = sc.rss_bytes is not None and sc.rss_bytes > RSS_BAR_BYTES
        t.append(fmt.mib(sc.rss_bytes), style=fmt.STYLE_WARN if over_rss else "")
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text()
