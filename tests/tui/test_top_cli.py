"""`agent top` as users run it: error paths (one line, exit 9 / 2), --once, --pid, --state."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moescope.agent.state import StatePublisher
from moescope.agent.top_cmd import FRESH_AFTER_S

from .conftest import FIXTURES, load_fixture

REPO = Path(__file__).resolve().parents[2]
AGENT = str(REPO / ".venv" / "bin" / "agent")


def agent_top(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "100", "LINES": "30", **(env or {})}
    return subprocess.run([AGENT, "top", *args], capture_output=True, text=True, timeout=60, env=full_env, cwd=REPO)


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, words: str) -> None:
    assert result.returncode == code, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agent: error: ") and words in lines[0], result.stderr


def test_no_running_agent_exits_9(tmp_path: Path) -> None:
    assert_one_line_error(agent_top("--state-dir", str(tmp_path)), 9, "no running agent found")
    # the env var is the default state dir
    assert_one_line_error(agent_top(env={"MOESCOPE_STATE_DIR": str(tmp_path / "x")}), 9, str(tmp_path / "x"))


def test_only_a_dead_agents_file_exits_9(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    StatePublisher(state_dir=tmp_path, pid=dead.pid).publish(load_fixture("gpu_busy"))
    assert_one_line_error(agent_top("--state-dir", str(tmp_path)), 9, "no running agent found")


def test_unreadable_or_foreign_state_exits_9(tmp_path: Path) -> None:
    garbage = tmp_path / "agent-1.state.json"
    garbage.write_text("not json at all")
    assert_one_line_error(agent_top("--state", str(garbage)), 9, "not JSON")
    future = tmp_path / "future.json"
    data = json.loads((FIXTURES / "gpu_busy.json").read_text())
    data["version"] = 99
    future.write_text(json.dumps(data))
    assert_one_line_error(agent_top("--state", str(future)), 9, "schema version 99")
    assert_one_line_error(agent_top("--state", str(tmp_path / "nope.json")), 9, "not found")
    directory_instead = tmp_path / "dir.json"
    directory_instead.mkdir()
    assert_one_line_error(agent_top("--state", str(directory_instead)), 9, "cannot read")


def test_bad_interval_is_usage_error() -> None:
    assert_one_line_error(agent_top("--interval", "0", "--state", str(FIXTURES / "gpu_busy.json")), 2, "--interval")


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.tui.publish_driver",
            str(tmp_path),
            str(FIXTURES / "host_large_model.json"),
            "0.1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ready ")
        yield tmp_path, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_once_prints_a_frame_of_the_running_agent(driver: tuple[Path, int]) -> None:
    state_dir, pid = driver
    result = agent_top("--once", "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    assert f"agent {pid}" in result.stdout
    assert "DRY-RUN" in result.stdout and "MoE routing · 48 layers · E=16384" in result.stdout
    # not a terminal: natural heights, nothing hidden
    assert "hidden" not in result.stdout and "L47" in result.stdout


def test_once_shows_the_snapshot_its_open_asked_for_not_the_idle_one(driver: tuple[Path, int]) -> None:
    """Nobody read the driver's file, so it wrote once (seq 1, rate 1001) and sleeps up to its idle
    10 s; `--once` opens the file (the publisher wakes and writes at once) and shows that write,
    not the snapshot that may be ten seconds old."""
    state_dir, _pid = driver
    time.sleep(FRESH_AFTER_S + 0.5)  # older than what is shown as read
    result = agent_top("--once", "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    rates = re.findall(r"│\s+(\d+)\.0\s+48\.0", result.stdout)
    assert rates and int(rates[0]) >= 1002, result.stdout


def test_pid_chooses_among_several_agents(driver: tuple[Path, int]) -> None:
    state_dir, pid = driver
    # a second live "agent": this test process publishes a snapshot under its own pid
    mine = StatePublisher(state_dir=state_dir, pid=os.getpid())
    mine.publish(load_fixture("just_started"))
    try:
        chosen = agent_top("--once", "--state-dir", str(state_dir), "--pid", str(pid))
        assert chosen.returncode == 0 and f"agent {pid}" in chosen.stdout
        other = agent_top("--once", "--state-dir", str(state_dir), "--pid", str(os.getpid()))
        assert other.returncode == 0 and "target 2024 vllm" in other.stdout
        both = agent_top("--once", "--state-dir", str(state_dir))
        assert both.returncode == 0 and "also running" in both.stderr
        assert_one_line_error(agent_top("--state-dir", str(state_dir), "--pid", "1"), 9, "no running agent with pid 1")
    finally:
        mine.close()
