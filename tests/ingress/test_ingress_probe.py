"""The ingress eBPF program in the running kernel, against real HTTP servers and real clients."""

from __future__ import annotations

import math
import os
import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import pytest
from ingress_harness import ClientRequest, CPair, HttpClient, Server, Tracer

from moescope import errors
from moescope.probes.bpf import load_program
from moescope.probes.ingress import aggregate, loader
from moescope.probes.ingress.aggregate import RequestTotals
from moescope.probes.ingress.loader import IngressRecord


def assert_matches(record: IngressRecord, request: ClientRequest) -> None:
    """A record equals what the client did, and sits inside the client's own timing window."""
    assert record.peer_addr == "127.0.0.1"
    assert record.peer_port == request.local_port
    assert record.bytes_in == request.sent_bytes
    assert record.bytes_out == request.received_bytes
    assert 0 < record.start_ns <= record.first_response_ns <= record.end_ns
    # Same clock, and only bounds that causality guarantees (probes/ingress/README.md, "Which
    # edge"): the server's read returned bytes after the client began sending them, and the
    # server began writing the response before the client had received it. Not end_ns <=
    # recv_end_ns: the client can be woken by the data before the server's write returns.
    assert request.send_start_ns <= record.start_ns
    assert record.first_response_ns <= request.recv_end_ns
    assert record.answered


def match_records(records: list[IngressRecord], clients: list[HttpClient]) -> None:
    """Exactly one record per client request, in order per connection (seq 1, 2, ...)."""
    by_port: dict[int, list[IngressRecord]] = defaultdict(list)
    for r in records:
        by_port[r.peer_port].append(r)
    assert sorted(by_port) == sorted(c.local_port for c in clients)
    for client in clients:
        recs = sorted(by_port[client.local_port], key=lambda r: r.seq)
        assert [r.seq for r in recs] == list(range(1, len(client.requests) + 1))
        for record, request in zip(recs, client.requests, strict=True):
            assert_matches(record, request)
        assert len({(r.fd, r.generation) for r in recs}) == 1  # one connection, one identity


def assert_no_drops(tracer: Tracer) -> None:
    stats = tracer.probe.stats()
    assert {name: stats[name] for name in loader.DROP_NAMES.values()} == {
        name: 0 for name in loader.DROP_NAMES.values()
    }
    assert stats["callback_errors"] == 0


def assert_totals_match(totals: RequestTotals, records: list[IngressRecord]) -> None:
    """With nothing lost, the kernel aggregate is exactly the records: counts, bytes, the latency
    sum, the bucket of every latency; its percentiles are within 1/32 of the exact nearest rank."""
    answered = sorted(r.latency_ns for r in records if r.answered)
    assert totals.requests == len(records)
    assert totals.unanswered == len(records) - len(answered)
    assert totals.bytes_in == sum(r.bytes_in for r in records)
    assert totals.bytes_out == sum(r.bytes_out for r in records)
    assert totals.latency_sum_ns == sum(answered)
    assert np.array_equal(totals.histogram(), RequestTotals.of_latencies(answered).histogram())
    for pct in (0, 50, 90, 99, 100):
        exact = answered[max(1, math.ceil(pct / 100 * len(answered))) - 1]
        reported = totals.percentile_ns(pct)
        assert reported is not None and abs(reported - exact) <= exact / 32, (pct, exact, reported)


def test_keepalive_and_new_connections_each_request_once(tracer: Tracer, start_server: Callable[..., Server]) -> None:
    server = start_server("threaded")
    other = start_server("threaded")  # not a target: its traffic must never appear
    assert tracer.probe.add_target(server.pid) == 0

    keepalive = HttpClient(server.port)
    for size in (0, 10, 1000, 70_000, 5):
        keepalive.request(path=f"/size/{size}")
    keepalive.request(method="POST", path="/echo", body=b"b" * 3000, split=True)  # several reads
    fresh = []
    for _ in range(3):
        client = HttpClient(server.port)
        client.request(path="/size/33")
        client.close()
        fresh.append(client)
    bystander = HttpClient(other.port)
    for _ in range(4):
        bystander.request()
    keepalive.close()
    bystander.close()

    records = tracer.wait_count(server.pid, 9)
    match_records(records, [keepalive, *fresh])
    assert len(records) == 9
    assert all(r.tgid in (server.pid,) for r in tracer.records)  # nothing from `other` or from us
    assert_totals_match(tracer.probe.totals(), records)
    assert set(tracer.probe.totals_by_target()) == {server.pid}
    assert not any(r.tgid == os.getpid() for r in tracer.records)
    assert len({r.generation for r in records}) == 4  # four connections, four generations
    assert all(r.generation > 0 and not r.flags for r in records)
    assert_no_drops(tracer)


def test_reused_fd_is_a_new_connection(tracer: Tracer, start_server: Callable[..., Server]) -> None:
    server = start_server("threaded")
    tracer.probe.add_target(server.pid)
    clients = []
    for i in range(6):
        client = HttpClient(server.port)
        client.request(path="/size/1", close=True)  # the server closes, freeing its fd
        client.close()
        clients.append(client)
        tracer.wait_count(server.pid, i + 1)  # its close was traced before the next accept
    records = tracer.wait_count(server.pid, 6)
    match_records(records, clients)
    by_fd: dict[int, set[int]] = defaultdict(set)
    for r in records:
        by_fd[r.fd].add(r.generation)
    assert max(len(gens) for gens in by_fd.values()) >= 2, f"no fd was reused: {dict(by_fd)}"
    assert len({r.generation for r in records}) == 6
    assert_no_drops(tracer)


def test_connection_opened_before_attach_is_seeded_and_timed(
    tracer: Tracer, start_server: Callable[..., Server]
) -> None:
    server = start_server("threaded")
    early = HttpClient(server.port)
    early.request(path="/size/3")  # before attach: not recorded
    assert tracer.probe.add_target(server.pid) == 1  # the one established connection
    early.requests.clear()
    for _ in range(3):
        early.request(path="/size/44")
    late = HttpClient(server.port)
    late.request(path="/size/2")
    early.close()
    late.close()
    records = tracer.wait_count(server.pid, 4)
    match_records(records, [early, late])
    seeded = [r for r in records if r.peer_port == early.local_port]
    assert all(r.generation == 0 and r.flags == loader.F_SEEDED for r in seeded)
    assert [r.generation > 0 for r in records if r.peer_port == late.local_port] == [True]
    assert_no_drops(tracer)


def test_asyncio_server_concurrent_clients(tracer: Tracer, start_server: Callable[..., Server]) -> None:
    server = start_server("asyncio")
    tracer.probe.add_target(server.pid)
    clients = [HttpClient(server.port) for _ in range(4)]
    failures: list[BaseException] = []

    def drive(client: HttpClient, index: int) -> None:
        try:
            for n in range(10):
                client.request(path=f"/size/{index * 100 + n}")
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=drive, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures
    for c in clients:
        c.close()  # the asyncio server reads EOF: each connection's last request ends
    records = tracer.wait_count(server.pid, 40)
    match_records(records, clients)
    assert len(records) == 40
    assert_no_drops(tracer)
    assert_totals_match(tracer.probe.totals(), records)


def test_idle_keepalive_request_is_flushed_when_target_removed(
    tracer: Tracer, start_server: Callable[..., Server]
) -> None:
    # asyncio reads a connection only when it is readable, so the last request of an idle
    # keep-alive connection stays open in the kernel until removal flushes it.
    server = start_server("asyncio")
    tracer.probe.add_target(server.pid)
    client = HttpClient(server.port)
    for _ in range(3):
        client.request(path="/size/9")
    records = tracer.wait_count(server.pid, 2)
    assert len(records) == 2
    assert tracer.probe.remove_target(server.pid) == 1
    records = tracer.of(server.pid)
    match_records(records, [client])
    assert [r.flags for r in sorted(records, key=lambda r: r.seq)] == [0, 0, loader.F_FLUSHED]
    client.close()
    assert_no_drops(tracer)


def test_target_exit_mid_run_keeps_what_was_served(tracer: Tracer, start_server: Callable[..., Server]) -> None:
    server = start_server("threaded")
    tracer.probe.add_target(server.pid)
    client = HttpClient(server.port)
    for _ in range(3):
        client.request()
    client.request(path="/exit")  # answered, then the server exits with its connections open
    assert server.popen.wait(timeout=30) == 3
    tracer.probe.remove_target(server.pid)
    records = tracer.of(server.pid)
    match_records(records, [client])
    assert len(records) == 4
    assert tracer.probe.targets() == []
    assert_no_drops(tracer)


def test_the_agent_cannot_target_itself(tracer: Tracer) -> None:
    with pytest.raises(errors.UsageError, match="its own process"):
        tracer.probe.add_target(os.getpid())


def test_compile_failure_is_a_probe_load_error(bpf: None) -> None:
    # compiled in the child process; the one-line error carries clang's first error with its line
    with pytest.raises(errors.ProbeLoadError, match=r"failed to compile.*\(/virtual/main\.c:1:\d+: error: "):
        load_program(text="int this is not C;", flags=[])


def test_targets_sharing_a_filter_slot_are_told_apart(bpf: None, start_server: Callable[..., Server]) -> None:
    # One filter slot: every process lands in it, so the exact hash check decides.
    tracer = Tracer(options=loader.IngressOptions(target_slots=1))
    probe, records = tracer.probe, tracer.records
    probe.load()
    try:
        first, second, bystander = (start_server("threaded") for _ in range(3))
        probe.add_target(first.pid)
        probe.add_target(second.pid)
        clients = {server.pid: HttpClient(server.port) for server in (first, second, bystander)}
        for client in clients.values():
            for _ in range(3):
                client.request()
            client.close()
        tracer.wait_count(first.pid, 3)
        tracer.wait_count(second.pid, 3)
        probe.remove_target(first.pid)  # second stays traced: the slot keeps pointing at the hash
        extra = HttpClient(second.port)
        extra.request()
        extra.close()
        tracer.wait_count(second.pid, 4)
        assert sorted(r.tgid for r in records) == sorted([first.pid] * 3 + [second.pid] * 4)
        match_records([r for r in records if r.tgid == second.pid], [clients[second.pid], extra])
    finally:
        probe.close()


def test_small_ring_wraps_and_every_loss_is_counted(bpf: None, start_server: Callable[..., Server]) -> None:
    # One page holds ~36 records (104 B + 8 B header): draining every 10 requests wraps the ring many times without
    # loss; 100 requests with no drain overflow it, and every lost record is counted.
    tracer = Tracer(options=loader.IngressOptions(ringbuf_pages=1))
    tracer.probe.load()
    try:
        server = start_server("threaded")
        tracer.probe.add_target(server.pid)
        client = HttpClient(server.port)
        for i in range(100):
            client.request(path="/size/1")
            if i % 10 == 9:
                tracer.wait_count(server.pid, i)  # request i ends at the server's next read
        client.close()
        records = tracer.wait_count(server.pid, 100)
        match_records(records, [client])
        assert_no_drops(tracer)
        assert not tracer.probe.backlogged()  # drained: the quiet daemon's peek asks for no round

        flood = HttpClient(server.port)
        for _ in range(100):
            flood.request(path="/size/1")
        flood.close()
        # 99 records at least (each request ends at the next read) filled the page: the peek sees it
        assert tracer.probe.backlogged()
        tracer.wait_for(
            lambda _: len(tracer.of(server.pid)) - 100 + tracer.probe.stats()["ringbuf_full"] >= 100,
            what="all 100 flood requests delivered or counted lost",
        )
        delivered = sorted(r.seq for r in tracer.of(server.pid) if r.peer_port == flood.local_port)
        lost = tracer.probe.stats()["ringbuf_full"]
        assert lost > 0 and len(delivered) + lost == 100
        assert set(delivered) <= set(range(1, 101))  # seq keeps counting across the lost ones
        # The kernel aggregate counted every request, the lost records' included.
        totals = tracer.probe.totals()
        assert totals.requests == 200 and totals.unanswered == 0 and totals.answered == 200
        assert totals.bytes_in == sum(q.sent_bytes for c in (client, flood) for q in c.requests)
        assert totals.bytes_out == sum(q.received_bytes for c in (client, flood) for q in c.requests)
        assert int(totals.histogram().sum()) == 200
        assert tracer.probe.stats()["sampled_out"] == 0
    finally:
        tracer.probe.close()


def test_ring_overflow_under_a_fast_client_loses_records_never_counts(bpf: None, c_pair: CPair) -> None:
    # The C pair makes requests far faster than one page of ring (~36 records) between drains.
    tracer = Tracer(options=loader.IngressOptions(ringbuf_pages=1))
    tracer.probe.load()
    try:
        tracer.probe.add_target(c_pair.server.pid)
        c_pair.requests(5000)
        tracer.wait_for(
            lambda _: len(tracer.records) + tracer.probe.stats()["ringbuf_full"] >= 5000,
            what="all 5000 requests delivered or counted lost",
        )
        stats = tracer.probe.stats()
        assert stats["ringbuf_full"] > 0 and stats["records"] + stats["ringbuf_full"] == 5000
        totals = tracer.probe.totals()
        assert totals.requests == 5000 and totals.answered == 5000
        assert int(totals.histogram().sum()) == 5000
        tracer.probe.remove_target(c_pair.server.pid)  # its counts are kept once it is gone
        assert tracer.probe.totals().requests == 5000
    finally:
        tracer.probe.close()
    assert tracer.probe.totals().requests == 5000  # and after the probe is unloaded


def test_sampling_keeps_the_slowest_and_counts_what_it_leaves_out(bpf: None, c_pair: CPair) -> None:
    # A budget of 50 records/s and 3000 requests drained at once: an overloaded batch.
    tracer = Tracer(options=loader.IngressOptions(records_per_s=50))
    tracer.probe.load()
    try:
        tracer.probe.add_target(c_pair.server.pid)
        c_pair.requests(3000)
        tracer.wait_for(
            lambda _: len(tracer.records) + tracer.probe.stats()["sampled_out"] >= 3000,
            what="all 3000 requests delivered or sampled out",
        )
        stats = tracer.probe.stats()
        assert_no_drops(tracer)  # sampled out is not a loss
        assert stats["sampled_out"] > 0 and stats["records"] + stats["sampled_out"] == 3000
        totals = tracer.probe.totals()
        assert totals.requests == 3000
        # The slowest request the kernel saw is among the kept records (its bucket is the highest).
        top = int(np.flatnonzero(totals.histogram())[-1])
        assert max(aggregate.bucket_of(r.latency_ns) for r in tracer.records) == top
    finally:
        tracer.probe.close()


UNIX_AND_TCP_SERVER = r"""
import os, socket, socketserver, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Http(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

class Line(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)

path = sys.argv[1]
uds = socketserver.ThreadingUnixStreamServer(path, Line)
http = ThreadingHTTPServer(("127.0.0.1", 0), Http)
threading.Thread(target=uds.serve_forever, daemon=True).start()
print(http.server_address[1], flush=True)
http.serve_forever()
"""


def test_unix_domain_connections_are_not_requests(tracer: Tracer, tmp_path: os.PathLike[str]) -> None:
    """A serving process's control socket (AF_UNIX) is accepted like TCP but is never HTTP ingress."""
    import socket
    import subprocess
    import sys

    from ingress_harness import stop_process_group

    path = os.path.join(tmp_path, "ctl.sock")
    server = subprocess.Popen([sys.executable, "-c", UNIX_AND_TCP_SERVER, path], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        tracer.probe.add_target(server.pid)
        for _ in range(3):  # three UNIX connections, each several request/response round trips
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
                f = s.makefile("rwb")
                for i in range(4):
                    f.write(b"stats %d\n" % i)
                    f.flush()
                    assert f.readline() == b"stats %d\n" % i
        client = HttpClient(port)
        client.request(path="/a")
        client.request(path="/b")
        client.close()
        records = tracer.wait_count(server.pid, 2)
        tracer.probe.remove_target(server.pid)  # flushes anything still open: nothing from AF_UNIX
        records = tracer.of(server.pid)
        assert len(records) == 2
        assert {r.peer_port for r in records} == {client.local_port}
        assert_no_drops(tracer)
    finally:
        stop_process_group(server)
