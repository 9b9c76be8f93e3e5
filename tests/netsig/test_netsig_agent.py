"""`agent start` end to end with the network signals wired in: a target in a namespace the test
creates, resets and listen overflows provoked for real, and the agent's /metrics, exit summary
and stderr read back. Needs the wiring of agent/start.py, agent/join.py and agent/outputs."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from netsig_harness import WAIT_S, NetNamespace, stop

from moescope.collectors.netsig import netns_id

pytestmark = pytest.mark.bpf
AGENT = Path(sys.executable).parent / "agent"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _value(text: str, series: str) -> float | None:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def test_agent_exports_resets_and_overflows_of_its_target(bpf: None, netns: NetNamespace) -> None:
    target = netns.server("backlog", "1")
    metrics_port = _free_port()
    agent = subprocess.Popen(
        [str(AGENT), "start", "--pid", str(target.pid), "--metrics-port", str(metrics_port), "--no-policy",
         "--no-collector.nvtx"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert agent.stderr is not None
        lines = []
        for _ in range(50):  # bounded: the attach line, after notes from other sources
            line = agent.stderr.readline()
            lines.append(line)
            if not line or line.startswith("agent: tracing"):
                break
        assert not any("network signals off" in line for line in lines), lines
        ident = netns_id(target.pid)
        overflows_before = netns.nstat("TcpExtListenOverflows")
        netns.client("flood", str(target.port), "16", "1.5")
        overflows = netns.nstat("TcpExtListenOverflows") - overflows_before
        assert overflows > 0
        series = f'moescope_listen_overflows_total{{netns="{ident}"}}'
        deadline = time.monotonic() + WAIT_S
        text = _scrape(metrics_port)
        while (_value(text, series) or 0) < overflows and time.monotonic() < deadline:
            time.sleep(0.2)
            text = _scrape(metrics_port)
        assert _value(text, series) == overflows
        port_label = f'port="{target.port}"'
        assert _value(text, f"moescope_tcp_retransmits_total{{{port_label}}}") == 0
        assert _value(text, 'moescope_agent_collector_success{collector="netsig"}') == 1
        agent.send_signal(signal.SIGINT)
        agent.wait(timeout=WAIT_S)
        assert agent.returncode == 0
    finally:
        stop(agent)
