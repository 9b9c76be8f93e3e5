"""The live view's network line (the requests panel's title), rendered exactly; needs the wiring
of agent/state.py (Network) and agent/tui/requests.py."""

from __future__ import annotations

import io

from rich.console import Console

from moescope.agent.state import Network, Requests
from moescope.agent.tui.requests import RequestsPanel


def _first_line(panel: RequestsPanel) -> str:
    out = io.StringIO()
    Console(file=out, width=110, color_system=None).print(panel)
    return out.getvalue().splitlines()[0]


def test_network_rates_in_the_title_only_when_measured() -> None:
    requests = Requests(window_s=10.0)
    assert _first_line(RequestsPanel(requests)) == _first_line(RequestsPanel(requests, network=Network(window_s=10.0)))
    line = _first_line(RequestsPanel(requests, network=Network(
        window_s=10.0, listen_overflows_per_s=0.3, retransmits_per_s=1.25, resets_per_s=0.0, listen_overflows_total=3)))
    assert "─ Requests · kernel · 10 s window · overflow 0.3/s retrans 1.2/s reset 0.0/s ─" in line
