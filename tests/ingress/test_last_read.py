"""The ingress probe's ``last_read_ns`` in the running kernel: the return of a request's last read
before its first response byte (where the "receive" phase ends, agent/request_phases.py).

A raw-socket client sends each request in two writes with a pause between them, so the server
reads it in two reads; causality gives the bounds asserted (never a timed upper bound): the last
read returned after the client's second write began, and the response began after it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from ingress_harness import WAIT_S, Server, Tracer

from moescope.probes.ingress import loader
from moescope.probes.ingress.loader import IngressRecord

PAUSE_S = 0.3  # between the two writes of one request
PAUSE_NS = int(PAUSE_S * 1e9)


@dataclass
class SplitRequest:
    first_write_ns: int  # CLOCK_MONOTONIC, as the probe's times
    second_write_ns: int
    response_end_ns: int
    sent_bytes: int


class SplitClient:
    """One keep-alive connection; each request goes out as two writes, ``PAUSE_S`` apart."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.local_port: int = self.sock.getsockname()[1]

    def request(self, *, body: bytes = b"x" * 200, split: bool = True) -> SplitRequest:
        head = f"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        data = head + body
        cut = len(head) // 2 if split else len(data)  # mid-head: the server cannot answer before the rest
        first_ns = time.monotonic_ns()
        self.sock.sendall(data[:cut])
        second_ns = first_ns
        if split:
            time.sleep(PAUSE_S)
            second_ns = time.monotonic_ns()
            self.sock.sendall(data[cut:])
        self._read_response()
        return SplitRequest(first_ns, second_ns, time.monotonic_ns(), len(data))

    def _read_response(self) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(4096)
            assert chunk, "server closed mid-response"
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                      if line.lower().startswith(b"content-length:"))
        while len(rest) < length:
            chunk = self.sock.recv(length - len(rest))
            assert chunk, "server closed mid-body"
            rest += chunk

    def close(self) -> None:
        self.sock.close()


def assert_split_timing(record: IngressRecord, request: SplitRequest) -> None:
    assert record.bytes_in == request.sent_bytes
    assert 0 < record.start_ns < record.last_read_ns < record.first_response_ns <= record.end_ns
    # causality: the second half was read after the client began writing it
    assert record.last_read_ns >= request.second_write_ns
    assert record.start_ns >= request.first_write_ns
    # the gap is the client's pause (a generous lower bound: the server may read the first half late)
    assert record.last_read_ns - record.start_ns >= PAUSE_NS // 2


def assert_one_read(record: IngressRecord, request: SplitRequest) -> None:
    """A request that arrived in one segment: its first read is its last."""
    assert record.bytes_in == request.sent_bytes
    assert 0 < record.start_ns <= record.last_read_ns < record.first_response_ns <= record.end_ns
    assert record.last_read_ns - record.start_ns < PAUSE_NS // 2  # no pause in it (not a timing bound)


@pytest.mark.parametrize("kind", ["threaded", "asyncio"])
def test_split_request_last_read_is_the_second_write(
    tracer: Tracer, start_server: Callable[..., Server], kind: str
) -> None:
    server = start_server(kind)
    tracer.probe.add_target(server.pid)
    client = SplitClient(server.port)
    split_first = client.request()
    whole = client.request(split=False)
    split_again = client.request()
    client.close()  # the last request ends at close (asyncio) or at the next read attempt (threaded)
    records = sorted(tracer.wait_count(server.pid, 3), key=lambda r: r.seq)
    assert [r.peer_port for r in records] == [client.local_port] * 3
    assert_split_timing(records[0], split_first)
    assert_one_read(records[1], whole)
    assert_split_timing(records[2], split_again)
    # each request's own reads: keep-alive resets last_read_ns with the request
    assert records[0].last_read_ns < records[1].start_ns and records[1].last_read_ns < records[2].start_ns
    assert all(r.flags == 0 for r in records)


def test_seeded_connection_and_flushed_record_carry_last_read(
    tracer: Tracer, start_server: Callable[..., Server]
) -> None:
    # asyncio: the last request of an idle keep-alive connection stays open until removal flushes it
    server = start_server("asyncio")
    client = SplitClient(server.port)
    client.request(split=False)  # before attach: the connection is seeded from /proc at attach
    assert tracer.probe.add_target(server.pid) == 1
    seeded_request = client.request()
    flushed_request = client.request()
    records = tracer.wait_count(server.pid, 1)
    assert tracer.probe.remove_target(server.pid) == 1
    records = sorted(tracer.of(server.pid), key=lambda r: r.seq)
    assert [r.flags for r in records] == [loader.F_SEEDED, loader.F_SEEDED | loader.F_FLUSHED]
    assert_split_timing(records[0], seeded_request)
    assert_split_timing(records[1], flushed_request)
    assert records[1].to_json_dict()["last_read_ns"] == records[1].last_read_ns
    client.close()
