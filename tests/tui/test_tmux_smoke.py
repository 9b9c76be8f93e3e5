"""Smoke test: a real publisher process, `.venv/bin/agent top` in a real terminal (tmux), the
screen read back, `q` pressed, the shell prompt back and the terminal modes restored."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import FIXTURES

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / ".venv" / "bin" / "agent"
WAIT_S = 60.0  # generous: only bounds waits on a shared 2-core machine, never asserted on


class Tmux:
    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True, timeout=10)
        return out.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "smoke")

    def wait_for(self, pattern: str, *, timeout_s: float = WAIT_S) -> str:
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if re.search(pattern, screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not on screen within {timeout_s}s; screen was:\n{screen}")


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    state_dir = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tui.publish_driver", str(state_dir), str(FIXTURES / "gpu_busy.json"), "0.1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        yield state_dir, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    assert shutil.which("tmux"), "tmux is required for the TUI smoke test"
    t = Tmux(f"moescope-test-{uuid.uuid4().hex[:8]}")
    rcfile = tmp_path / "bashrc"
    rcfile.write_text("PS1='READY$ '\n")
    t(
        "-f",
        "/dev/null",
        "new-session",
        "-d",
        "-s",
        "smoke",
        "-x",
        "100",
        "-y",
        "30",
        f"env -i PATH=/usr/bin:/bin HOME={tmp_path} TERM=xterm-256color bash --noprofile --rcfile {rcfile} -i",
    )
    try:
        t.wait_for(r"READY\$")
        yield t
    finally:
        subprocess.run(["tmux", "-L", t.socket, "kill-server"], capture_output=True, timeout=10)


def rate_on(screen: str) -> float:
    # The requests row: the first number under "req/s" is 1000 + seq, changing every publish.
    m = re.search(r"│\s+(1\d{3}\.\d)\s", screen)
    assert m, f"no request rate on screen:\n{screen}"
    return float(m.group(1))


def test_agent_top_live_and_quits_on_q(publisher: tuple[Path, subprocess.Popen[str]], tmux: Tmux) -> None:
    state_dir, proc = publisher
    cmd = f"cd {REPO} && {AGENT} top --state-dir {state_dir} --interval 0.1; echo EXIT=$?; stty -a | tr -d '\\n'"
    tmux("send-keys", "-t", "smoke", cmd, "Enter")
    first = tmux.wait_for(r"Requests · kernel")
    assert "moescope" in first
    assert f"agent {proc.pid}" in first
    assert "target 5151 moe_server" in first
    assert "MoE routing" in first and "Policy" in first and "Devices" in first
    assert "READY$" not in first  # alternate screen: the shell is hidden while the view is up
    rate1 = rate_on(first)
    # wait for a later capture where the published value has moved on
    deadline = time.monotonic() + WAIT_S
    rate2 = rate1
    while rate2 == rate1 and time.monotonic() < deadline:
        time.sleep(0.2)
        rate2 = rate_on(tmux.screen())
    assert rate2 > rate1
    tmux("send-keys", "-t", "smoke", "q")
    after = tmux.wait_for(r"EXIT=\d+")
    assert "EXIT=0" in after
    assert "Requests · kernel" not in after  # left the alternate screen
    assert "READY$" in after
    # terminal modes restored: canonical mode and echo back on
    modes = tmux.wait_for(r"icanon").split("EXIT=0", 1)[1]
    assert re.search(r"(?<![-\w])icanon", modes), modes
    assert re.search(r"(?<![-\w])echo(?![\w])", modes), modes


def test_agent_top_ctrl_c_restores_terminal(publisher: tuple[Path, subprocess.Popen[str]], tmux: Tmux) -> None:
    state_dir, _ = publisher
    cmd = f"cd {REPO} && {AGENT} top --state-dir {state_dir}; echo EXIT=$?; stty -a | tr -d '\\n'"
    tmux("send-keys", "-t", "smoke", cmd, "Enter")
    tmux.wait_for(r"MoE routing")
    tmux("send-keys", "-t", "smoke", "C-c")
    after = tmux.wait_for(r"EXIT=\d+")
    assert "EXIT=0" in after
    modes = tmux.wait_for(r"icanon").split("EXIT=0", 1)[1]
    assert re.search(r"(?<![-\w])icanon", modes), modes


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def test_agent_top_sigterm_restores_terminal(publisher: tuple[Path, subprocess.Popen[str]], tmux: Tmux) -> None:
    state_dir, _ = publisher
    cmd = f"cd {REPO} && {AGENT} top --state-dir {state_dir}; echo EXIT=$?; stty -a | tr -d '\\n'"
    tmux("send-keys", "-t", "smoke", cmd, "Enter")
    tmux.wait_for(r"MoE routing")
    shell_pid = int(tmux("list-panes", "-t", "smoke", "-F", "#{pane_pid}").split()[0])
    kids = _children(shell_pid)
    assert len(kids) == 1, kids
    os.kill(kids[0], signal.SIGTERM)
    after = tmux.wait_for(r"EXIT=\d+")
    assert "EXIT=0" in after and "MoE routing" not in after
    modes = tmux.wait_for(r"icanon").split("EXIT=0", 1)[1]
    assert re.search(r"(?<![-\w])icanon", modes), modes
