"""Fixtures for the reference MoE runtime tests: real server processes on loopback, real sockets."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from moescope.examples.moe_runtime.launch import LaunchError, LineReader, read_banner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small model: the tests are about behaviour, not size, and share 2 cores.
SMALL_MODEL = ["--d-model", "64", "--d-ff", "128", "--layers", "2", "--experts", "8", "--n-heads", "2",
               "--threads", "1"]


@dataclasses.dataclass
class RunningServer:
    proc: subprocess.Popen[str]
    port: int
    socket_path: str
    banner: dict[str, str]

    def post(self, body: Any, *, raw: bytes | None = None, conn: http.client.HTTPConnection | None = None,
             path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
        own = conn is None
        c = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = raw if raw is not None else json.dumps(body).encode()
            c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = c.getresponse()
            return response.status, json.loads(response.read())
        finally:
            if own:
                c.close()

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            c.request("GET", path)
            response = c.getresponse()
            return response.status, json.loads(response.read())
        finally:
            c.close()


def _read_banner(proc: subprocess.Popen[str], *, timeout_s: float) -> dict[str, str]:
    """The banner up to `ready`, read with moescope.examples.moe_runtime.launch (bounded: a reader thread)."""
    assert proc.stdout is not None
    reader = LineReader(proc.stdout)
    try:
        banner = read_banner(reader, timeout_s=timeout_s)
    except LaunchError as exc:
        raise AssertionError(f"runtime did not become ready (rc={proc.poll()}): {exc}") from None
    reader.drain()  # keeps reading to EOF, queues nothing more
    return {"http port": str(banner.http_port), "control socket": banner.control_socket, "nvtx": banner.nvtx}


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def socket_dir() -> Iterator[str]:
    """A 0755 directory under /tmp, so a subprocess under another uid can reach the socket path."""
    path = tempfile.mkdtemp(prefix="moe-rt-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


@pytest.fixture
def start_server(socket_dir: str) -> Iterator[Callable[..., RunningServer]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*extra: str, small: bool = True, name: str = "control.sock") -> RunningServer:
        path = os.path.join(socket_dir, name)
        cmd = [sys.executable, "-m", "moescope.examples.moe_runtime", "--port", "0", "--control-socket", path,
               *(SMALL_MODEL if small else []), *extra]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=None, text=True,
                                start_new_session=True)
        procs.append(proc)
        banner = _read_banner(proc, timeout_s=90)
        return RunningServer(proc=proc, port=int(banner["http port"]), socket_path=banner["control socket"],
                             banner=banner)

    try:
        yield start
    finally:
        for proc in procs:
            _stop(proc)
