"""netsig pieces that need no kernel: the C/ctypes struct contract, procfs parsing on fixture trees,
the metric families, the policy/live-view window, the span-event index, options and registration."""

from __future__ import annotations

import argparse
import ctypes as ct
import functools
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moescope import errors
from moescope.agent.metrics import SPECS, Metrics
from moescope.collectors import netsig
from moescope.collectors.registry import add_collector_flags, enabled_collectors, registered
from moescope.probes.netsig import loader

C_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include "netsig.h"
#define S(t) printf(#t " %zu\n", sizeof(struct t))
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(struct t, f))
#define C(n) printf(#n " %d\n", n)
int main(void) {
    S(netsig_key); S(netsig_event);
    O(netsig_key, kind); O(netsig_event, kind); O(netsig_event, family); O(netsig_event, local_port);
    O(netsig_event, remote_port); O(netsig_event, local_addr); O(netsig_event, remote_addr);
    C(NETSIG_K_RETRANSMIT); C(NETSIG_K_RESET_SENT); C(NETSIG_K_RESET_RECEIVED); C(NETSIG_K_ESTABLISHED);
    C(NETSIG_K_SYNACK_RETRANSMIT); C(NETSIG_K_NR); C(NETSIG_DROP_COUNTS_FULL); C(NETSIG_DROP_RINGBUF_FULL);
    C(NETSIG_DROP_NR); C(NETSIG_PORTS);
    return 0;
}
"""


def test_ctypes_mirrors_match_the_c_header(tmp_path: Path) -> None:
    source = tmp_path / "layout.c"
    source.write_text(C_PROGRAM)
    binary = tmp_path / "layout"
    subprocess.run(["gcc", "-Wall", "-Werror", f"-I{loader.PROBE_DIR}", "-o", str(binary), str(source)], check=True)
    values = dict(line.split() for line in subprocess.run([str(binary)], capture_output=True, text=True,
                                                          check=True).stdout.splitlines())
    assert int(values["netsig_key"]) == ct.sizeof(loader.NetsigKey)
    assert int(values["netsig_event"]) == ct.sizeof(loader.NetsigEvent) == loader.EVENT_DTYPE.itemsize
    for field in ("kind",):
        assert int(values[f"netsig_key.{field}"]) == getattr(loader.NetsigKey, field).offset
    for field in ("kind", "family", "local_port", "remote_port", "local_addr", "remote_addr"):
        assert int(values[f"netsig_event.{field}"]) == getattr(loader.NetsigEvent, field).offset
    mirrors = {
        "NETSIG_K_RETRANSMIT": loader.K_RETRANSMIT, "NETSIG_K_RESET_SENT": loader.K_RESET_SENT,
        "NETSIG_K_RESET_RECEIVED": loader.K_RESET_RECEIVED, "NETSIG_K_ESTABLISHED": loader.K_ESTABLISHED,
        "NETSIG_K_SYNACK_RETRANSMIT": loader.K_SYNACK_RETRANSMIT, "NETSIG_K_NR": loader.K_NR,
        "NETSIG_DROP_COUNTS_FULL": loader.DROP_COUNTS_FULL, "NETSIG_DROP_RINGBUF_FULL": loader.DROP_RINGBUF_FULL,
        "NETSIG_DROP_NR": loader.DROP_NR, "NETSIG_PORTS": loader.PORTS,
    }
    assert {name: int(values[name]) for name in mirrors} == mirrors
    assert sorted(loader.KIND_NAMES) == list(range(1, loader.K_NR))


def test_events_decode_with_addresses_as_ingress_writes_peers() -> None:
    rows = np.zeros(2, dtype=loader.EVENT_DTYPE)
    rows[0]["ts_ns"], rows[0]["kind"], rows[0]["family"] = 5, loader.K_RESET_SENT, loader.AF_INET
    rows[0]["local_port"], rows[0]["remote_port"], rows[0]["detail"] = 8000, 51000, 11
    rows[0]["local_addr"][:4] = [127, 0, 0, 1]
    rows[0]["remote_addr"][:4] = [10, 1, 2, 3]
    rows[1]["kind"], rows[1]["family"] = loader.K_RETRANSMIT, loader.AF_INET6
    rows[1]["remote_addr"][10:16] = [0xFF, 0xFF, 192, 168, 0, 9]  # IPv4-mapped: written as IPv4
    first, second = loader.decode_events(rows)
    assert first == loader.NetEvent(5, "reset_sent", 11, 2, "127.0.0.1", 8000, "10.1.2.3", 51000)
    assert (second.kind, second.local_addr, second.remote_addr) == ("retransmit", "::", "192.168.0.9")


def test_reset_reason_names_come_from_the_tracefs_format() -> None:
    text = 'print fmt: "x", __print_symbolic(REC->reason, { 0, "NOT_SPECIFIED" }, { 11, "TCP_ABORT_ON_CLOSE" })'
    assert loader.parse_symbolic(text, "reason") == {0: "NOT_SPECIFIED", 11: "TCP_ABORT_ON_CLOSE"}
    assert loader.parse_symbolic(text, "state") == {}


def test_options_are_validated_into_typed_cflags() -> None:
    assert loader.cflags(loader.NetsigOptions()) == [
        f"-I{loader.PROBE_DIR}", "-DMAX_COUNTS=4096", "-DRINGBUF_PAGES=16",
    ]
    with pytest.raises(errors.UsageError, match="ringbuf_pages must be a power of two, got 3"):
        loader.NetsigOptions(ringbuf_pages=3).validate()
    with pytest.raises(errors.UsageError, match="max_counts must be a positive integer"):
        loader.NetsigOptions(max_counts=0).validate()


def test_ebpf_flag_prints_the_program_as_compiled(capsys: pytest.CaptureFixture[str]) -> None:
    assert loader.main(["--ebpf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("// cflags: ") and "TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)" in out
    assert "struct netsig_event" in out


NETSTAT = """TcpExt: SyncookiesSent ListenOverflows ListenDrops TCPRcvQDrop
TcpExt: 0 17 21 3
IpExt: InNoRoutes InOctets
IpExt: 0 12345
"""


def _fixture_process(root: Path, pid: int, *, netns_inode: int, port: int, inode: int) -> None:
    proc = root / str(pid)
    (proc / "net").mkdir(parents=True)
    (proc / "fd").mkdir()
    (proc / "ns").mkdir()
    (proc / "net" / "netstat").write_text(NETSTAT)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 {inode} 1\n"
    other = f"   1: 0100007F:{port + 1:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 {inode + 1} 1\n"
    (proc / "net" / "tcp").write_text(header + listen + other)  # the second listener is another process's
    os.symlink(f"socket:[{inode}]", proc / "fd" / "3")
    os.symlink("/dev/null", proc / "fd" / "0")
    os.symlink(f"net:[{netns_inode}]", proc / "ns" / "net")


def test_procfs_readers_on_a_fixture_tree(tmp_path: Path) -> None:
    _fixture_process(tmp_path, 42, netns_inode=4026532000, port=8000, inode=777)
    assert netsig.parse_netstat(NETSTAT) == {
        "TcpExt": {"SyncookiesSent": 0, "ListenOverflows": 17, "ListenDrops": 21, "TCPRcvQDrop": 3},
        "IpExt": {"InNoRoutes": 0, "InOctets": 12345},
    }
    assert netsig.parse_netstat("TcpExt: A B\nIpExt: 1 2\n") == {}  # a misaligned pair is skipped
    assert netsig.read_listen_counters(42, proc_root=tmp_path) == (17, 21)
    assert netsig.read_listen_counters(43, proc_root=tmp_path) is None  # gone
    assert netsig.netns_id(42, proc_root=tmp_path) == "4026532000"
    assert netsig.netns_id(43, proc_root=tmp_path) is None
    assert netsig.listening_ports(42, proc_root=tmp_path) == {8000}
    assert netsig.listening_ports(43, proc_root=tmp_path) == frozenset()


def _record(at_ns: int, *, port: int = 8000, retransmits: int = 0, sent: int = 0, received: int = 0,
            established: int = 0, overflows: int = 0, drops: int = 0) -> netsig.NetSignalRecord:
    return netsig.NetSignalRecord(
        at_ns=at_ns,
        ports=(netsig.PortSignals(port, retransmits=retransmits, resets_sent=sent, resets_received=received,
                                  established=established),),
        netns=(netsig.NetnsSignals("4026532000", listen_overflows=overflows, listen_drops=drops),),
    )


def test_published_counters_sum_the_records_and_exist_at_zero() -> None:
    metrics = Metrics()
    netsig.publish_net_signals(metrics, _record(1, port=9000))  # nothing happened: every series at 0
    for name, labels in (("moescope_tcp_retransmits", {"port": "9000"}),
                         ("moescope_tcp_synack_retransmits", {"port": "9000"}),
                         ("moescope_tcp_resets", {"port": "9000", "direction": "sent"}),
                         ("moescope_tcp_resets", {"port": "9000", "direction": "received"}),
                         ("moescope_tcp_connections_established", {"port": "9000"}),
                         ("moescope_listen_overflows", {"netns": "4026532000"}),
                         ("moescope_listen_drops", {"netns": "4026532000"})):
        assert metrics.get(name, **labels) == 0.0, name
    netsig.publish_net_signals(metrics, _record(2, retransmits=3, sent=1, received=2, established=5, overflows=4,
                                                drops=6))
    netsig.publish_net_signals(metrics, _record(3, retransmits=2, overflows=1))
    assert metrics.get("moescope_tcp_retransmits", port="8000") == 5
    assert metrics.get("moescope_tcp_resets", port="8000", direction="sent") == 1
    assert metrics.get("moescope_tcp_resets", port="8000", direction="received") == 2
    assert metrics.get("moescope_tcp_connections_established", port="8000") == 5
    assert metrics.get("moescope_listen_overflows", netns="4026532000") == 5
    assert metrics.get("moescope_listen_drops", netns="4026532000") == 6


def test_every_published_family_is_declared_with_its_labels() -> None:
    for _, name, fixed in netsig.PORT_COUNTERS:
        assert SPECS[name].kind == "counter" and set(SPECS[name].labels) == {"port", *fixed}
    for _, name in netsig.NETNS_COUNTERS:
        assert SPECS[name].kind == "counter" and SPECS[name].labels == ("netns",)


def test_window_rates_are_per_second_over_the_window() -> None:
    window = netsig.NetSignalWindow(window_ns=10_000_000_000)
    assert math.isnan(window.rates(0).listen_overflows_per_s)  # no data yet
    window.add(_record(1_000_000_000, overflows=20, drops=30, retransmits=5, sent=1, received=1))
    window.add(netsig.NetSignalRecord(at_ns=2_000_000_000))  # an events-only record carries no counts
    window.add(_record(6_000_000_000, overflows=10))
    rates = window.rates(6_000_000_000)
    assert (rates.listen_overflows_per_s, rates.listen_drops_per_s) == (3.0, 3.0)
    assert (rates.retransmits_per_s, rates.resets_per_s) == (0.5, 0.2)
    later = window.rates(11_500_000_000)  # the first record left the window
    assert (later.listen_overflows_per_s, later.retransmits_per_s) == (1.0, 0.0)
    assert (later.listen_overflows_total, later.retransmits_total, later.resets_total) == (30, 5, 2)


def _event(ts_ns: int, kind: str = "retransmit", *, peer_port: int = 51000) -> loader.NetEvent:
    return loader.NetEvent(ts_ns, kind, 0, 2, "127.0.0.1", 8000, "127.0.0.1", peer_port)


def test_event_index_ties_events_to_a_connection_and_an_interval() -> None:
    index = netsig.NetEventIndex(max_events=3, retention_ns=100)
    index.add([_event(10), _event(20, "reset_received"), _event(15, peer_port=52000)])
    assert [e.ts_ns for e in index.for_request(peer_addr="127.0.0.1", peer_port=51000, start_ns=0, end_ns=20)] == [
        10, 20]
    assert index.for_request(peer_addr="127.0.0.1", peer_port=51000, start_ns=11, end_ns=19) == []
    assert index.for_request(peer_addr="10.0.0.1", peer_port=51000, start_ns=0, end_ns=99) == []
    assert index.for_request(peer_addr=None, peer_port=0, start_ns=0, end_ns=99) == []  # peer unknown
    index.add([_event(30, peer_port=53000)])  # over max_events: the oldest leaves, counted
    assert len(index) == 3 and index.evicted == 1
    assert [e.ts_ns for e in index.for_request(peer_addr="127.0.0.1", peer_port=51000, start_ns=0, end_ns=99)] == [
        20]
    index.add([_event(200, peer_port=54000)])  # retention: everything older than 100 ns before it goes
    assert len(index) == 1 and index.evicted == 1


def test_span_event_fields() -> None:
    name, attributes = netsig.span_event_fields(_event(1, "reset_sent"), reset_reasons={0: "NOT_SPECIFIED"}.get)
    assert name == "tcp.reset.sent"
    assert attributes == {"network.local.port": 8000, "network.peer.port": 51000,
                          "network.local.address": "127.0.0.1", "network.peer.address": "127.0.0.1",
                          "tcp.reset.reason": "NOT_SPECIFIED"}
    assert netsig.span_event_fields(_event(1))[0] == "tcp.retransmit"


def test_registered_as_a_stream_source_with_generated_flags() -> None:
    spec = registered()["netsig"]
    assert (spec.kind, spec.default_enabled, spec.always_on) == ("stream", True, False)
    parser = argparse.ArgumentParser()
    add_collector_flags(parser)
    assert "netsig" in enabled_collectors(parser.parse_args([]))
    assert "netsig" not in enabled_collectors(parser.parse_args(["--no-collector.netsig"]))


def test_source_needs_a_loaded_probe_and_positive_periods() -> None:
    with pytest.raises(errors.ProbeLoadError, match="must be loaded"):
        netsig.NetSignalSource(emit=lambda _r: None, probe=loader.NetSignalProbe())
    with pytest.raises(errors.UsageError, match="must be positive"):
        netsig.NetSignalSource(emit=lambda _r: None, probe=loader.NetSignalProbe(), period_s=0)


def test_a_probe_that_cannot_load_leaves_the_source_off_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(errors.SourceUnavailable, match=r"^netsig probe not loaded: kernel headers missing: "):
        netsig.open_netsig(emit=lambda _r: None, build_dir=tmp_path)
    pending = netsig.PendingNetsig(functools.partial(netsig.open_netsig, emit=lambda _r: None, build_dir=tmp_path))
    with pytest.raises(errors.SourceUnavailable, match="kernel headers missing"):
        pending.wait()
    pending.cancel()  # nothing was loaded: nothing to unload, no error

    def broken() -> netsig.NetSignalSource:
        raise RuntimeError("a bug")

    with pytest.raises(errors.SourceUnavailable, match=r"^netsig probe not loaded: RuntimeError: a bug$"):
        netsig.PendingNetsig(broken).wait()
