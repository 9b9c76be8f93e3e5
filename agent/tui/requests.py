"""Requests panel: kernel-measured request rate, p50/p95/p99 latency, errors; the kernel's network
signals (listen overflows, retransmits, resets per second) in its title, or in its bottom border
when the title has no room for them."""

from __future__ import annotations

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.text import Text

from moescope.agent.state import Network, Requests
from moescope.agent.tui import fmt
from moescope.agent.tui.columns import Column, FittedTable

# p99 above the slo_latency rule's default fire threshold is shown as bad.
SLO_P99_MS = 870.0
REQUESTS_ROWS = 4  # border 2 + header + values


class RequestsPanel:
    def __init__(
        self, requests: Requests | None, *, network: Network | None = None, height: int | None = None
    ) -> None:
        self.requests = requests if requests is not None else Requests()
        self.network = network if network is not None else Network()
        self.height = height

    @staticmethod
    def natural_rows() -> int:
        return REQUESTS_ROWS

    def table(self) -> FittedTable:
        r = self.requests
        p99_style = fmt.STYLE_BAD if r.latency_p99_ms is not None and r.latency_p99_ms > SLO_P99_MS else ""
        err_style = fmt.STYLE_WARN if r.errors_per_s else ""

        def column(header: str, value: Text | str, rank: int | None = None) -> Column:
            cell = value if isinstance(value, Text) else Text(value)
            return Column(header, [cell], justify="right", rank=rank, droppable=rank is not None)

        # Rate, p50 and p99 always; when narrow the total errors go first (err/s says whether they
        # are still happening), then p95 (between p50 and p99).
        return FittedTable([
            column("req/s", fmt.num(r.rate_per_s, ".1f")),
            column("p50", fmt.latency(r.latency_p50_ms)),
            column("p95", fmt.latency(r.latency_p95_ms), rank=2),
            column("p99", Text(fmt.latency(r.latency_p99_ms), style=p99_style)),
            column("errors", Text(fmt.count(r.errors_total), style=err_style), rank=1),
            column("err/s", Text(fmt.num(r.errors_per_s, ".1f"), style=err_style), rank=3),
        ], even=True)

    def titles(self, width: int) -> tuple[Text, Text | None]:
        """(title, subtitle) for a panel `width` cells wide: the network rates in the title when they
        fit there whole, else in the bottom border; parts that fit nowhere are dropped whole."""
        r = self.requests
        head: list[tuple[str, str | Text]] = [("", "Requests · kernel")]
        if r.window_s is not None:
            head.append((" · ", f"{fmt.num(r.window_s, 'g')} s window"))
        n = self.network
        if n.retransmits_per_s is None:  # only where the netsig source reads
            return fmt.panel_title(head, width), None
        # the kernel refusing connections is shown as bad
        overflow_style = fmt.STYLE_BAD if n.listen_overflows_per_s else ""
        net: list[tuple[str, str | Text]] = [
            ("", Text(f"overflow {fmt.num(n.listen_overflows_per_s, '.1f')}/s", style=overflow_style)),
            (" ", f"retrans {fmt.num(n.retransmits_per_s, '.1f')}/s"),
            (" ", f"reset {fmt.num(n.resets_per_s, '.1f')}/s"),
        ]
        whole = fmt.join_parts([*head, (" · ", net[0][1]), *net[1:]])
        if cell_len(whole.plain) <= width - fmt.PANEL_TITLE_MARGIN:
            return whole, None
        return fmt.panel_title(head, width), fmt.panel_title(net, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        title, subtitle = self.titles(options.max_width)
        yield Panel(
            self.table(),
            title=title,
            title_align="left",
            subtitle=subtitle,
            subtitle_align="right",
            box=box.ROUNDED,
            padding=(0, 1),
            height=self.height,
        )
