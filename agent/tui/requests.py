"""Requests panel: kernel-measured request rate, p50/p95/p99 latency, errors, in flight; the
kernel's network signals (listen overflows, retransmits, resets per second) in its title."""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moescope.agent.state import Network, Requests
from moescope.agent.tui import fmt

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

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        r = self.requests
        table = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False)
        for name in ("req/s", "p50 ms", "p95 ms", "p99 ms", "errors", "err/s", "in flight"):
            table.add_column(name, justify="right", no_wrap=True, header_style="bold")
        p99_style = fmt.STYLE_BAD if r.latency_p99_ms is not None and r.latency_p99_ms > SLO_P99_MS else ""
        err_style = fmt.STYLE_WARN if r.errors_per_s else ""
        table.add_row(
            fmt.num(r.rate_per_s, ".1f"),
            fmt.num(r.latency_p50_ms, ".1f"),
            fmt.num(r.latency_p95_ms, ".1f"),
            Text(fmt.num(r.latency_p99_ms, ".1f"), style=p99_style),
            Text(fmt.count(r.errors_total), style=err_style),
            Text(fmt.num(r.errors_per_s, ".1f"), style=err_style),
            fmt.count(r.in_flight),
        )
        title = "Requests · kernel"
        if r.window_s is not None:
            title += f" · {fmt.num(r.window_s, 'g')} s window"
        n = self.network
        if n.retransmits_per_s is not None:  # only where the netsig source reads
            overflow = f"overflow {fmt.num(n.listen_overflows_per_s, '.1f')}/s"
            if n.listen_overflows_per_s:  # the kernel is refusing connections: shown as bad
                overflow = f"[{fmt.STYLE_BAD}]{overflow}[/]"
            title += (f" · {overflow} retrans {fmt.num(n.retransmits_per_s, '.1f')}/s "
                      f"reset {fmt.num(n.resets_per_s, '.1f')}/s")
        yield Panel(
            table,
            title=title,
            title_align="left",
            box=box.ROUNDED,
            padding=(0, 1),
            height=self.height,
        )
