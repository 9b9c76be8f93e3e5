"""The netsig source on real targets in a namespace the test creates: it finds the target's
listening ports itself, reads the target's namespace counters through /proc/<pid>/net, and what it
emits (and what the metrics then say) matches what iproute2's nstat reads in that namespace."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from netsig_harness import WAIT_S, NetNamespace

from moescope.agent.metrics import Metrics
from moescope.collectors.netsig import (
    NetEventIndex,
    NetSignalRecord,
    NetSignalSource,
    netns_id,
    open_netsig,
    publish_net_signals,
    start_netsig,
)

pytestmark = pytest.mark.bpf


class Records(list[NetSignalRecord]):
    """The source's emit callback, keeping what it emits."""

    def __call__(self, record: object) -> None:
        assert isinstance(record, NetSignalRecord)
        self.append(record)


def poll_until(source: NetSignalSource, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    source.poll_now()
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)
        source.poll_now()


def test_listen_overflows_of_the_targets_namespace(bpf: None, netns: NetNamespace) -> None:
    records = Records()
    source = open_netsig(emit=records)
    try:
        server = netns.server("backlog", "1")  # listen(1), never accepts
        assert source.add_target(server.pid) == {server.port}
        ident = netns_id(server.pid)
        assert ident is not None and ident != netns_id(1)  # the test's namespace, not the host's
        overflows_before = netns.nstat("TcpExtListenOverflows")
        drops_before = netns.nstat("TcpExtListenDrops")
        netns.client("flood", str(server.port), "16", "1.5")
        overflows = netns.nstat("TcpExtListenOverflows") - overflows_before
        drops = netns.nstat("TcpExtListenDrops") - drops_before
        assert overflows > 0  # 16 connects at a queue of 2: the kernel refused some

        def seen() -> int:
            return sum(n.listen_overflows for r in records for n in r.netns)

        poll_until(source, lambda: seen() >= overflows)
    finally:
        source.close()
    assert seen() == overflows
    assert sum(n.listen_drops for r in records for n in r.netns) == drops
    assert {n.netns for r in records for n in r.netns} == {ident}
    established = sum(p.established for r in records for p in r.ports if p.port == server.port)
    assert 1 <= established <= 16  # handshakes the queue took (the rest overflowed)
    assert all({p.port for p in r.ports} == {server.port} for r in records if r.periodic)

    metrics = Metrics()
    for record in records:
        publish_net_signals(metrics, record)
    assert metrics.get("moescope_listen_overflows", netns=ident) == overflows
    assert metrics.get("moescope_listen_drops", netns=ident) == drops
    port = str(server.port)
    assert metrics.get("moescope_tcp_connections_established", port=port) == established
    assert metrics.get("moescope_tcp_retransmits", port=port) == 0  # present, and zero: nothing was resent
    assert metrics.get("moescope_tcp_resets", port=port, direction="sent") == 0


def test_resets_on_the_targets_ports_tie_to_the_connection(bpf: None, netns: NetNamespace) -> None:
    records = Records()
    source = open_netsig(emit=records)
    try:
        target = netns.server("reset")
        bystander = netns.server("reset")  # same namespace, not a target
        assert source.add_target(target.pid) == {target.port}
        received = netns.client("reset-client", str(target.port), "hold")  # the target receives a reset
        sent = netns.client("reset-client", str(target.port), "linger")  # the target sends one
        netns.client("reset-client", str(bystander.port), "hold")
        netns.client("reset-client", str(bystander.port), "linger")

        def resets() -> tuple[int, int]:
            ports = [p for r in records for p in r.ports if p.port == target.port]
            return sum(p.resets_sent for p in ports), sum(p.resets_received for p in ports)

        poll_until(source, lambda: resets() == (1, 1))
        stats = source.stats()
    finally:
        source.close()
    assert resets() == (1, 1)
    assert {p.port for r in records for p in r.ports} == {target.port}
    events = [e for r in records for e in r.events]
    assert sorted(e.kind for e in events) == ["reset_received", "reset_sent"]
    assert stats["events"] == 2
    assert stats["events_dropped_ringbuf_full"] == 0 and stats["signals_dropped_counts_full"] == 0

    index = NetEventIndex()
    index.add(events)
    for client, kind in ((received, "reset_received"), (sent, "reset_sent")):
        # What the traces output asks for a request span: its peer and its kernel-timed interval.
        found = index.for_request(peer_addr="127.0.0.1", peer_port=int(client["local_port"]),
                                  start_ns=int(client["start_ns"]), end_ns=int(client["end_ns"]))
        assert [e.kind for e in found] == [kind]
        assert index.for_request(peer_addr="127.0.0.1", peer_port=int(client["local_port"]),
                                 start_ns=0, end_ns=int(client["start_ns"]) - 1) == []


def test_a_target_that_exits_leaves_the_watched_ports(bpf: None, netns: NetNamespace) -> None:
    records = Records()
    source = start_netsig(emit=records).wait()  # the agent's way: compiled on a thread, joined
    try:
        server = netns.server("reset")
        source.add_target(server.pid)
        assert source.ports() == {server.port}
        server.popen.kill()
        server.popen.wait(timeout=WAIT_S)
        source.ports_refresh_ns = 0  # refresh on the next poll
        source.poll_now()
        assert source.ports() == frozenset()
        assert source.stats()["netstat_unreadable"] == 1  # its namespace can no longer be read through it
    finally:
        source.close()
