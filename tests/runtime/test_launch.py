"""examples/moe_runtime/launch.py: the banner of a real runtime started with launch(), its parser, and
the failure paths (silent child, early exit, usage error): each raises LaunchError and leaves no
process behind."""

from __future__ import annotations

import http.client
import io
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moescope.collectors.nvtx import INJECTION_ENV
from moescope.examples.moe_runtime.launch import Banner, LaunchError, LineReader, launch, parse_banner, runtime_argv

SMALL_MODEL = ("--d-model", "32", "--d-ff", "64", "--layers", "2", "--experts", "4", "--n-heads", "2",
               "--threads", "1")
START_TIMEOUT_S = 120.0  # generous: only bounds the wait on a shared 2-core machine
GONE_WAIT_S = 30.0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: UNIX socket paths are limited to 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mslaunch-"))
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def live_group_members(pgid: int) -> list[int]:
    """Pids of processes in group pgid that are not zombies (a zombie is dead, only unreaped)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2:].split()  # comm may hold spaces; fields resume after ')'
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def wait_group_gone(pgid: int) -> list[int]:
    """Waits (bounded) until no live process is left in pgid; returns those still alive."""
    deadline = time.monotonic() + GONE_WAIT_S
    alive = live_group_members(pgid)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = live_group_members(pgid)
    return alive


def env_without_nvtx_tool() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != INJECTION_ENV}


@pytest.mark.parametrize(("extra", "nvtx"), [((), "inactive (no NVTX tool attached)"), (("--no-nvtx",), "disabled")])
def test_banner_of_a_real_runtime(short_dir: Path, extra: tuple[str, ...], nvtx: str) -> None:
    sock = str(short_dir / "rt.sock")
    rt = launch(runtime_argv("--port", "0", "--control-socket", sock, *SMALL_MODEL, *extra),
                timeout_s=START_TIMEOUT_S, env=env_without_nvtx_tool())
    try:
        banner = rt.banner
        assert banner.control_socket == sock
        assert banner.nvtx == nvtx and not banner.nvtx_active and banner.nvtx_line == f"nvtx: {nvtx}"
        # the four lines, in the order the runtime documents
        assert banner.lines == (f"http port: {banner.http_port}", f"control socket: {sock}", f"nvtx: {nvtx}", "ready")
        # the values are the live ones: the port serves HTTP, the path is a socket
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        conn = http.client.HTTPConnection("127.0.0.1", banner.http_port, timeout=60)
        try:
            conn.request("GET", "/stats")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
        finally:
            conn.close()
        # the same lines parse alike when read back, also interleaved with another process's output
        assert parse_banner(banner.lines) == banner
        mixed = ["agent: tracing pid 1", banner.lines[0], "agent: nvtx ring attached", *banner.lines[1:], "later"]
        again = parse_banner(mixed)
        assert (again.http_port, again.control_socket, again.nvtx) == (banner.http_port, sock, nvtx)
        assert again.lines == tuple(mixed[:-1])
    finally:
        status = rt.stop()
    assert status == 0  # SIGTERM: a clean exit
    assert not os.path.exists(sock)
    assert wait_group_gone(rt.pid) == []


def test_silent_child_times_out_and_its_group_is_killed(short_dir: Path) -> None:
    pid_file = short_dir / "grandchild.pid"
    # prints nothing on stdout; a grandchild in the same process group must die too
    argv = ["sh", "-c", f'sleep 30 & echo $! > "{pid_file}"; wait']
    with pytest.raises(LaunchError, match=r"no banner within 5 s") as caught:
        launch(argv, timeout_s=5)
    exc = caught.value
    assert exc.pid is not None and exc.returncode == -signal.SIGKILL
    assert exc.lines == ()
    assert not Path(f"/proc/{exc.pid}").exists()  # reaped
    grandchild = int(pid_file.read_text())
    assert grandchild != exc.pid
    assert wait_group_gone(exc.pid) == []  # the sleep grandchild included


def test_child_exiting_before_ready() -> None:
    code = "print('http port: 1234'); print('control socket: /tmp/x.sock')"
    with pytest.raises(LaunchError, match=r"stdout closed before the banner's 'ready'") as caught:
        launch([sys.executable, "-c", code], timeout_s=START_TIMEOUT_S)
    assert caught.value.returncode == 0
    assert caught.value.lines == ("http port: 1234", "control socket: /tmp/x.sock")


def test_runtime_usage_error_is_reported_with_its_exit_status() -> None:
    with pytest.raises(LaunchError) as caught:
        launch(runtime_argv("--port", "0", "--control-socket-mode", "9", *SMALL_MODEL), timeout_s=START_TIMEOUT_S,
               stderr=subprocess.DEVNULL)
    assert caught.value.returncode == 2  # the runtime's UsageError exit code
    assert "exit status 2" in str(caught.value)


def test_parser_rejects_incomplete_or_malformed_banners() -> None:
    with pytest.raises(LaunchError, match="without control socket, nvtx"):
        parse_banner(["http port: 80", "ready"])
    with pytest.raises(LaunchError, match="malformed banner line 'http port: eighty'"):
        parse_banner(["http port: eighty"])
    with pytest.raises(LaunchError, match="malformed banner line 'http port: 70000'"):
        parse_banner(["http port: 70000"])
    with pytest.raises(LaunchError, match="no 'ready' line"):
        parse_banner(["http port: 80", "control socket: /s", "nvtx: disabled"])
    banner = parse_banner(["http port: 80\n", "control socket: /s\n", "nvtx: active\n", "ready\n", "http port: 81"])
    assert banner == Banner(http_port=80, control_socket="/s", nvtx="active",
                            lines=("http port: 80", "control socket: /s", "nvtx: active", "ready"))
    assert banner.nvtx_active


def test_line_reader_waits_for_prefix_or_pattern_then_eof() -> None:
    seen: list[str] = []
    reader = LineReader(io.StringIO("one\ntwo 2\nthree\n"), on_line=seen.append, keep_lines=None)
    assert reader.wait_for("two", timeout_s=30) == "two 2"
    assert reader.wait_for(re.compile(r"^th"), timeout_s=30) == "three"
    with pytest.raises(LaunchError, match="stream ended before 'four'"):
        reader.wait_for("four", timeout_s=30)
    assert reader.join(30)
    assert reader.lines() == seen == ["one", "two 2", "three"]
