"""The netsig probe against real TCP traffic in a network namespace the test creates: each signal is
provoked for real and counted on the right port, and nothing is counted on a port not watched.

Independent counts: the peer that caused a reset for resets; for retransmits the server's own
sockets (TCP_INFO tcpi_total_retrans), an upper bound: the tracepoint fires once per skb resent
by tcp_retransmit_skb, while the socket also counts its SYN-ACK retransmits, loss probes (which
bypass that function) and segments, of which a resent skb can carry two once the MSS shrinks."""

from __future__ import annotations

import json
import os
import time

import pytest
from netsig_harness import WAIT_S, NetNamespace

from moescope.probes.netsig.loader import NetEvent, NetSignalProbe, NetsigOptions, reset_reason_name

pytestmark = pytest.mark.bpf


def wait_counts(probe: NetSignalProbe, want: dict[tuple[int, str], int]) -> dict[tuple[int, str], int]:
    """The probe's counts once they reach `want` (bounded wait; the assertion is the caller's)."""
    deadline = time.monotonic() + WAIT_S
    counts = probe.read_counts()
    while any(counts.get(key, 0) < n for key, n in want.items()) and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = probe.read_counts()
    return counts


def test_resets_sent_and_received_on_the_watched_port_only(netns: NetNamespace, probe: NetSignalProbe) -> None:
    watched = netns.server("reset")
    unwatched = netns.server("reset")
    probe.set_ports({watched.port})
    before_ns = time.monotonic_ns()
    sent = netns.client("reset-client", str(watched.port), "linger")  # the server resets it
    received = netns.client("reset-client", str(watched.port), "hold")  # the client resets the server
    for mode in ("linger", "hold"):
        netns.client("reset-client", str(unwatched.port), mode)
    after_ns = time.monotonic_ns()

    assert sent["error"] == "ConnectionResetError"  # the client saw the reset the probe counts
    counts = wait_counts(probe, {(watched.port, "reset_sent"): 1, (watched.port, "reset_received"): 1})
    assert counts.get((watched.port, "reset_sent")) == 1
    assert counts.get((watched.port, "reset_received")) == 1
    assert counts.get((watched.port, "established")) == 2
    assert {port for port, _ in counts} == {watched.port}  # neither the other server nor the clients

    events = probe.drain_events()
    by_kind: dict[str, list[NetEvent]] = {}
    for event in events:
        by_kind.setdefault(event.kind, []).append(event)
    assert sorted(by_kind) == ["reset_received", "reset_sent"]
    (reset_sent,) = by_kind["reset_sent"]
    (reset_received,) = by_kind["reset_received"]
    for event, client in ((reset_sent, sent), (reset_received, received)):
        # The connection's 4-tuple and a time inside the client's run: what ties it to a span.
        assert (event.local_addr, event.local_port) == ("127.0.0.1", watched.port)
        assert (event.remote_addr, event.remote_port) == ("127.0.0.1", client["local_port"])
        assert before_ns <= event.ts_ns <= after_ns
    assert reset_reason_name(reset_sent.detail) is not None  # the kernel's own name for why
    assert probe.drops() == {"counts_full": 0, "ringbuf_full": 0}


def test_retransmits_through_a_drop_rule_are_counted_per_port(
    netns: NetNamespace, probe: NetSignalProbe
) -> None:
    bulk = netns.server("bulk", str(1 << 18))
    probe.set_ports({bulk.port})
    netns.drop_packets(True)
    client = netns.popen("bulk-client", str(bulk.port), "4", str(1 << 18), stdin=True)
    assert client.stdin is not None and client.stdout is not None
    downloaded = client.stdout.readline()
    netns.drop_packets(False)  # no loss from here on: the servers' TCP_INFO is final
    client.stdin.write("go\n")
    client.stdin.flush()
    server_retrans = client.stdout.readline()
    client.wait(timeout=WAIT_S)

    assert '"downloaded": [262144, 262144, 262144, 262144]' in downloaded
    answers = json.loads(server_retrans)["server_total_retrans"]
    assert min(answers) >= 0, f"a bulk server closed without its TCP_INFO answer: {answers}"
    expected = sum(answers)
    assert expected > 0, "10 % loss over 1 MiB retransmitted nothing: the drop rule did not apply"
    counts = probe.read_counts()  # final: the servers' sockets were idle since their TCP_INFO
    data, synack = counts.get((bulk.port, "retransmit"), 0), counts.get((bulk.port, "synack_retransmit"), 0)
    assert 1 <= data and data + synack <= expected
    assert {port for port, _ in counts} == {bulk.port}  # the clients' own retransmits are not the target's
    events = [e for e in probe.drain_events() if e.kind == "retransmit"]
    client_ports = set(json.loads(downloaded)["local_ports"])
    assert events and all(e.local_port == bulk.port and e.remote_port in client_ports for e in events)
    drops = probe.drops()
    assert len(events) + drops["ringbuf_full"] == data  # every event recorded or its loss counted
    assert drops["counts_full"] == 0


def test_a_port_no_longer_watched_stops_counting(netns: NetNamespace, probe: NetSignalProbe) -> None:
    server = netns.server("reset")
    probe.set_ports({server.port})
    netns.client("reset-client", str(server.port), "hold")
    assert wait_counts(probe, {(server.port, "reset_received"): 1}).get((server.port, "reset_received")) == 1
    probe.set_ports(set())
    netns.client("reset-client", str(server.port), "hold")
    netns.client("reset-client", str(server.port), "linger")
    assert probe.read_counts() == {}  # its counters left with it, and nothing new was counted
    assert [e.kind for e in probe.drain_events()] == ["reset_received"]


def test_a_full_counts_map_and_a_full_ring_are_counted(bpf: None, netns: NetNamespace) -> None:
    server = netns.server("reset")
    small = NetSignalProbe(options=NetsigOptions(max_counts=2, ringbuf_pages=1))
    small.load()
    try:
        small.set_ports({server.port})
        netns.client("reset-client", str(server.port), "hold")  # keys: established, reset_received
        netns.client("reset-client", str(server.port), "linger")  # reset_sent: no room for its key
        counts = small.read_counts()
        assert counts == {(server.port, "established"): 2, (server.port, "reset_received"): 1}
        assert small.drops()["counts_full"] == 1
        assert [e.kind for e in small.drain_events()] == ["reset_received", "reset_sent"]  # the event still went
        assert small.ring_fill() == 0.0
        # One page of ring holds 4096 / 64 = 64 events: 80 resets without a drain overflow it.
        resets = 80
        netns.client("resets", str(server.port), str(resets))
        assert small.ring_fill() >= 0.9  # what the source's backlog check (the daemon's peek) reads
        drained = [e for e in small.drain_events() if e.kind == "reset_received"]
        assert small.read_counts()[(server.port, "reset_received")] == 1 + resets
        assert small.drops()["ringbuf_full"] > 0
        assert len(drained) + small.drops()["ringbuf_full"] == resets
    finally:
        small.close()


def test_the_benchmarks_read_a_process_s_program_run_time_from_its_descriptors(
        netns: NetNamespace, probe: NetSignalProbe) -> None:
    """benchmarks.common.bpf_run_time_ns (what e2e_overhead reads of the agent from outside it) against
    the loader's own accounting through bpf(2) (BPF_OBJ_GET_INFO_BY_FD): the run time this process's
    programs spend on connections the test makes, while bpf_stats_enabled holds the sysctl at 1 and
    puts it back after."""
    from benchmarks.common import BPF_STATS_SYSCTL, bpf_run_time_ns, bpf_stats_enabled

    previous = BPF_STATS_SYSCTL.read_text().strip()
    watched = netns.server("reset")
    probe.set_ports({watched.port})
    with bpf_stats_enabled() as on:
        assert on and BPF_STATS_SYSCTL.read_text().strip() == "1"
        before_fds = bpf_run_time_ns(os.getpid())
        before_own = sum(ns for ns, _ in probe.run_stats().values())
        for mode in ("linger", "hold"):  # state changes and resets: the probe's programs run
            netns.client("reset-client", str(watched.port), mode)
        own = sum(ns for ns, _ in probe.run_stats().values()) - before_own
        fds = bpf_run_time_ns(os.getpid()) - before_fds
    assert BPF_STATS_SYSCTL.read_text().strip() == previous
    assert own > 0
    # every program this process holds is summed (the probe's, and any another test left loaded)
    assert fds >= own
    assert bpf_run_time_ns(2**22 + 1) == 0  # no such process: nothing, no error
