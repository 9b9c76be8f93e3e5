"""`agent start`'s policy options, and `agent policy show` through the real CLI."""

from __future__ import annotations

import argparse
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from policy_helpers import REPO, StartRuntime

from moescope.agent.policy.wiring import add_policy_arguments, build_policy
from moescope.errors import ControlError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_policy_arguments(parser)
    return parser.parse_args(list(argv))


def test_no_policy_and_dry_run(tmp_path: Path) -> None:
    assert build_policy(parse("--no-policy"), runtime_pid=None) is None
    engine = build_policy(parse("--dry-run", "--policy-audit", str(tmp_path / "a.jsonl")), runtime_pid=None)
    assert engine is not None and engine.dry_run and engine.actuator is None
    with pytest.raises(ControlError, match="control socket"):
        build_policy(parse(), runtime_pid=None)
    # A pid with no runtime socket anywhere: a clear error unless dry-run.
    with pytest.raises(ControlError, match="no control socket for pid 999999999"):
        build_policy(parse(), runtime_pid=999_999_999)


def test_builds_against_a_real_runtime(tmp_path: Path, start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    args = parse("--control-socket", rt.socket_path, "--policy-audit", str(tmp_path / "audit.jsonl"),
                 "--policy-state-dir", str(tmp_path / "state"))
    engine = build_policy(args, runtime_pid=rt.proc.pid)
    assert engine is not None
    try:
        assert engine.start() is True and engine.runtime_state_read
        assert engine.state_path == tmp_path / "state" / f"policy-state-{rt.proc.pid}.json"
        assert (tmp_path / "audit.jsonl").exists()
    finally:
        engine.close()


def test_cli_policy_show_and_bad_config(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "moescope.agent", "policy", "show"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert sum(1 for line in ok.stdout.splitlines() if line.split()[:1] and line.split()[-1] == "yes") == 8
    bad = tmp_path / "p.toml"
    bad.write_text("[rules.expert_offload]\nwindow_s = -5\n")
    out = subprocess.run([sys.executable, "-m", "moescope.agent", "policy", "show", "--config", str(bad)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"agent: error: {bad}: rule 'expert_offload': key 'window_s': must be > 0 seconds, got -5"
    ]


def test_cli_policy_run_acts_on_a_real_runtime_until_sigint(tmp_path: Path, start_runtime: StartRuntime) -> None:
    rt = start_runtime("--device-memory-budget-bytes", "644618")  # all resident = 0.97 of budget
    policy = tmp_path / "fast.toml"
    policy.write_text("[rules.expert_offload]\nwindow_evals = 2\n[rules.memory_alert]\nwindow_evals = 1\n")
    audit = tmp_path / "audit.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moescope.agent", "policy", "run", "--control-socket", rt.socket_path,
         "--config", str(policy), "--audit", str(audit)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        stdout = proc.stdout
        got: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            for line in stdout:
                got.put(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while not any("expert_offload" in line for line in lines):
            try:
                lines.append(got.get(timeout=60))
            except queue.Empty:
                pytest.fail(f"no output for 60 s; so far: {lines}")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        err = proc.stderr.read() if proc.stderr else ""
        reader.join(timeout=60)
        while not got.empty():
            lines.append(got.get())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert lines[0] == f"policy: 8 rules on {rt.socket_path}; every 200 ms"
    decisions = [line.split() for line in lines[1:-1]]
    assert [(d[1], d[2], d[4], d[5]) for d in decisions[:2]] == [
        ("fire", "memory_alert", "fire", "alert"),
        ("fire", "expert_offload", "fire", "ok"),
    ]
    assert lines[-1].startswith("policy: ") and lines[-1].endswith("decisions, 0 failed stats polls")
    assert len(audit.read_text().splitlines()) == len(decisions)
    assert rt.stats()["memory"]["devices"]["cpu"]["used_ratio"] < 0.90


def test_cli_policy_run_without_a_runtime_is_one_line_exit_9(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moescope.agent", "policy", "run", "--control-socket", str(tmp_path / "none.sock")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 9
    assert out.stderr.strip().splitlines() == [
        f"agent: error: cannot read the runtime's state: runtime unreachable at {tmp_path / 'none.sock'}: "
        "No such file or directory"
    ]
