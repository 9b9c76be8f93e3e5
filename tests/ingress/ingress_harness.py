"""Harness for the ingress tests: real HTTP servers in subprocesses, a raw-socket HTTP/1.1 client
that knows exactly what it sent and received, the real probe, and the real `agent` CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from moescope.probes.ingress.loader import IngressOptions, IngressProbe, IngressRecord

HERE = Path(__file__).resolve().parent
HTTP_SERVERS = HERE / "http_servers.py"
AGENT = Path(sys.executable).parent / "agent"
WAIT_S = 30.0  # generous: only bounds waiting, never asserted on


def stop_process_group(popen: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class Server:
    pid: int
    port: int
    popen: subprocess.Popen[bytes]


@pytest.fixture
def start_server() -> Iterator[Callable[..., Server]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(kind: str = "threaded", *extra: str) -> Server:
        popen = subprocess.Popen(
            [sys.executable, str(HTTP_SERVERS), kind, *extra],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        started.append(popen)
        assert popen.stdout is not None
        line = popen.stdout.readline().decode()
        assert line.startswith("PORT "), f"server did not start: {line!r}"
        return Server(pid=popen.pid, port=int(line.split()[1]), popen=popen)

    try:
        yield start
    finally:
        for popen in started:
            stop_process_group(popen)


@dataclass
class ClientRequest:
    local_port: int
    sent_bytes: int
    received_bytes: int
    send_start_ns: int  # CLOCK_MONOTONIC, like the probe's timestamps
    recv_end_ns: int


class HttpClient:
    """One TCP connection; requests are written and read with raw syscalls so byte counts are exact."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.local_port: int = self.sock.getsockname()[1]
        self.requests: list[ClientRequest] = []

    def request(
        self,
        *,
        method: str = "GET",
        path: str = "/size/10",
        body: bytes = b"",
        split: bool = False,
        close: bool = False,
    ) -> ClientRequest:
        head = f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
        if close:
            head += "Connection: close\r\n"
        data = head.encode() + b"\r\n" + body
        start_ns = time.monotonic_ns()
        if split:
            # Two segments: the server sees the request in more than one read.
            half = len(data) // 2
            self.sock.sendall(data[:half])
            time.sleep(0.05)
            self.sock.sendall(data[half:])
        else:
            self.sock.sendall(data)
        received = self._read_response()
        end_ns = time.monotonic_ns()
        if close:
            while self.sock.recv(4096):
                pass
        result = ClientRequest(self.local_port, len(data), received, start_ns, end_ns)
        self.requests.append(result)
        return result

    def _read_response(self) -> int:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(4096)
            assert chunk, "server closed mid-response"
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            chunk = self.sock.recv(length - len(rest))
            assert chunk, "server closed mid-body"
            rest += chunk
        assert len(rest) == length, "server sent more than one response"
        return len(head) + 4 + len(rest)

    def close(self) -> None:
        self.sock.close()


class Tracer:
    """The real ingress probe, its records kept in a list."""

    def __init__(self, *, options: IngressOptions | None = None) -> None:
        self.records: list[IngressRecord] = []
        self.probe = IngressProbe(on_record=self.records.append, options=options)

    def of(self, pid: int) -> list[IngressRecord]:
        return [r for r in self.records if r.tgid == pid]

    def wait_for(self, predicate: Callable[[list[IngressRecord]], bool], *, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            self.probe.poll(time.monotonic_ns())
            if predicate(self.records):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; have {len(self.records)} records")
            time.sleep(0.02)

    def wait_count(self, pid: int, count: int) -> list[IngressRecord]:
        self.wait_for(lambda _: len(self.of(pid)) >= count, what=f"{count} records of pid {pid}")
        self.probe.poll(time.monotonic_ns())
        return self.of(pid)


@pytest.fixture
def tracer(bpf: None) -> Iterator[Tracer]:
    t = Tracer()
    t.probe.load()
    try:
        yield t
    finally:
        t.probe.close()


@dataclass
class AgentRun:
    popen: subprocess.Popen[str]
    attach_line: str


@pytest.fixture
def run_agent() -> Iterator[Callable[..., AgentRun]]:
    """Start `agent start ARGS...`; returns once it printed its attach line (or exited)."""
    started: list[subprocess.Popen[str]] = []

    def run(*args: str, wait_attach: bool = True, prefix: tuple[str, ...] = ()) -> AgentRun:
        # /metrics off unless asked for: the default port is shared by every agent on the machine
        metrics = () if any(a.startswith("--metrics-port") for a in args) else ("--metrics-port", "0")
        popen = subprocess.Popen(
            [*prefix, str(AGENT), "start", *metrics, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(popen)
        line = ""
        if wait_attach:
            assert popen.stderr is not None
            # Notes from other sources (e.g. "no NVIDIA driver") may come first; bounded read.
            for _ in range(50):
                line = popen.stderr.readline()
                if not line or line.startswith("agent: tracing") or "error" in line:
                    break
        return AgentRun(popen=popen, attach_line=line)

    try:
        yield run
    finally:
        for popen in started:
            stop_process_group(popen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


KEEPALIVE_C = HERE.parent.parent / "benchmarks" / "ingress_keepalive.c"


@dataclass
class CPair:
    """benchmarks/ingress_keepalive.c: a C keep-alive responder (the target) and its client, fast
    enough (~100k requests/s) to fill the probe's ring between two drains."""

    binary: Path
    server: Server

    def requests(self, count: int) -> None:
        """`count` requests on one connection, then close (so the last one ends too)."""
        subprocess.run([str(self.binary), "client", str(self.server.port), str(count)], check=True,
                       stdout=subprocess.DEVNULL, timeout=WAIT_S)


@pytest.fixture
def c_pair(tmp_path: Path) -> Iterator[CPair]:
    binary = tmp_path / "ingress_keepalive"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(binary), str(KEEPALIVE_C)], check=True)
    popen = subprocess.Popen([str(binary), "server"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert popen.stdout is not None
        line = popen.stdout.readline().decode()
        assert line.startswith("PORT "), f"responder did not start: {line!r}"
        yield CPair(binary=binary, server=Server(pid=popen.pid, port=int(line.split()[1]), popen=popen))
    finally:
        stop_process_group(popen)
