"""A command `agent start -- CMD` launches. `--control-socket PATH -- RUNTIME --control-socket PATH`:
the runtime makes its socket seconds later, so the policy waits for it (as it does for the socket it
finds by pid) and then starts with the runtime's state read; it used to start at once and warn
twice that the runtime was unreachable (a user trial). Beside a running server a missing explicit
socket stays an error. A /metrics port that cannot be bound ends the agent before the command
ever runs (a trial found the server orphaned, running on after the agent's error)."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

from moescope import errors
from tests.e2e.harness import PYTHON, Proc, agent_argv, run_cli, runtime_argv, wait_runtime_ready


def test_a_launched_runtime_s_explicit_socket_is_waited_for(tmp_path: Path) -> None:
    sock = tmp_path / "rt.sock"
    runtime = [*runtime_argv(), "--control-socket", str(sock)]
    agent = Proc(agent_argv(state_dir=tmp_path / "state", extra=[
        "--no-collector.ingress", "--control-socket", str(sock), "--policy-audit", str(tmp_path / "audit.jsonl"),
        "--", *runtime]))
    try:
        wait_runtime_ready(agent)
        agent.wait_for_line(rf"^agent: policy: 8 rules, acting, control socket {re.escape(str(sock))}, .*"
                            r"\(its control socket found\)$", stream="err")
        rc = agent.interrupt_and_wait()
    finally:
        agent.kill_group()
    assert rc == 0, agent.text()
    waiting = [line for line in agent.err if line.startswith("agent: policy waiting: ")]
    assert waiting == [f"agent: policy waiting: no control socket at {sock} (looking again every 1 s)"], agent.text()
    assert not any("WARNING" in line and "policy" in line for line in agent.err), agent.text()


def test_a_running_server_s_missing_explicit_socket_is_an_error(tmp_path: Path) -> None:
    sleeper = Proc([PYTHON, "-c", "import time; time.sleep(60)"])
    try:
        result = run_cli(["start", "--no-collector.ingress", "--control-socket", str(tmp_path / "none.sock"),
                          "--pid", str(sleeper.pid), "--duration", "5"])
    finally:
        sleeper.kill_group()
    assert result.returncode == errors.ControlError.exit_code, result
    assert f"no control socket at {tmp_path / 'none.sock'}" in result.stderr, result.stderr


def test_a_metrics_port_in_use_stops_the_command_before_it_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli(["start", "--no-collector.ingress", "--no-policy", "--metrics-port", str(port),
                          "--duration", "5", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert result.returncode == errors.EXIT_USAGE, result
    assert f"agent: error: cannot serve /metrics on 127.0.0.1:{port}: Address already in use" in result.stderr, result
    assert not marker.exists()  # held until the release, and stopped without it
