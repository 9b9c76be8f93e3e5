"""Ingress pieces that need no kernel: the C/ctypes struct contract, procfs parsing, the daemon's
sink handling, and the loader's error mapping."""

from __future__ import annotations

import ctypes as ct
import math
import mmap
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moescope import errors
from moescope.agent.daemon import OUTSIDE_PEEK_MAX_NS, Daemon
from moescope.collectors.registry import BACKLOG_FILL
from moescope.probes import bpf
from moescope.probes.ingress import aggregate, loader, procnet
from moescope.probes.ingress.aggregate import RequestTotals
from moescope.probes.ingress.sampling import RecordSampler

C_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include "ingress.h"
#define S(t) printf(#t " %zu\n", sizeof(struct t))
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(struct t, f))
#define C(n) printf(#n " %d\n", n)
int main(void) {
    S(ingress_event); S(ingress_conn_key); S(ingress_conn); S(ingress_inflight);
    O(ingress_event, tgid); O(ingress_event, fd); O(ingress_event, family); O(ingress_event, peer_addr);
    O(ingress_conn, tid); O(ingress_conn, peer_addr); O(ingress_inflight, kind); O(ingress_inflight, tid);
    C(INGRESS_F_NO_RESPONSE); C(INGRESS_F_SEEDED); C(INGRESS_F_FLUSHED);
    C(INGRESS_DROP_RINGBUF_FULL); C(INGRESS_DROP_CONN_EVICTED); C(INGRESS_DROP_INFLIGHT_FULL);
    C(INGRESS_DROP_NR); C(INGRESS_CC_USER_INSERTS); C(INGRESS_CC_USER_DELETES); C(INGRESS_CC_NR);
    S(ingress_stats); O(ingress_stats, latency); C(INGRESS_LAT_SUB_BITS); C(INGRESS_LAT_MIN_SHIFT);
    C(INGRESS_LAT_MAX_SHIFT); C(INGRESS_LAT_BUCKETS);
    C(INGRESS_K_ACCEPT); C(INGRESS_TARGET_SLOTS); printf("INGRESS_TARGET_SHARED %u\n", INGRESS_TARGET_SHARED); C(INGRESS_K_READ); C(INGRESS_K_WRITE);
    return 0;
}
"""


def test_ctypes_mirrors_match_the_c_header(tmp_path: Path) -> None:
    source = tmp_path / "layout.c"
    source.write_text(C_PROGRAM)
    binary = tmp_path / "layout"
    subprocess.run(["gcc", "-Wall", "-Werror", f"-I{loader.PROBE_DIR}", "-o", str(binary), str(source)], check=True)
    facts = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
    )
    c = {name: int(value) for name, value in facts.items()}

    assert c["ingress_event"] == ct.sizeof(loader.IngressEvent)
    assert c["ingress_conn_key"] == ct.sizeof(loader.IngressConnKey)
    assert c["ingress_conn"] == ct.sizeof(loader.IngressConn)
    assert c["ingress_inflight"] == ct.sizeof(loader.IngressInflight)
    for struct, py in (
        ("ingress_event", loader.IngressEvent),
        ("ingress_conn", loader.IngressConn),
        ("ingress_inflight", loader.IngressInflight),
    ):
        for key, value in c.items():
            if key.startswith(struct + "."):
                assert getattr(py, key.split(".")[1]).offset == value, key
    assert c["ingress_stats"] == ct.sizeof(aggregate.IngressStats)
    assert c["ingress_stats.latency"] == aggregate.IngressStats.latency.offset
    assert (c["INGRESS_LAT_SUB_BITS"], c["INGRESS_LAT_MIN_SHIFT"], c["INGRESS_LAT_MAX_SHIFT"], c["INGRESS_LAT_BUCKETS"]) == (
        aggregate.LAT_SUB_BITS, aggregate.LAT_MIN_SHIFT, aggregate.LAT_MAX_SHIFT, aggregate.LAT_BUCKETS
    )
    assert c["INGRESS_F_NO_RESPONSE"] == loader.F_NO_RESPONSE
    assert c["INGRESS_F_SEEDED"] == loader.F_SEEDED
    assert c["INGRESS_F_FLUSHED"] == loader.F_FLUSHED
    assert c["INGRESS_DROP_RINGBUF_FULL"] == loader.DROP_RINGBUF_FULL
    assert c["INGRESS_DROP_CONN_EVICTED"] == loader.DROP_CONN_EVICTED
    assert c["INGRESS_DROP_INFLIGHT_FULL"] == loader.DROP_INFLIGHT_FULL
    assert c["INGRESS_DROP_NR"] == loader.DROP_NR == len(loader.DROP_NAMES)
    assert c["INGRESS_CC_USER_INSERTS"] == loader.CC_USER_INSERTS
    assert c["INGRESS_CC_USER_DELETES"] == loader.CC_USER_DELETES
    assert c["INGRESS_CC_NR"] == loader.CC_NR
    assert (c["INGRESS_TARGET_SLOTS"], c["INGRESS_TARGET_SHARED"]) == (loader.TARGET_SLOTS, loader.TARGET_SHARED)
    assert (c["INGRESS_K_ACCEPT"], c["INGRESS_K_READ"], c["INGRESS_K_WRITE"]) == (
        loader.K_ACCEPT,
        loader.K_READ,
        loader.K_WRITE,
    )


TCP4 = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0 20 4 30 10 -1
   2: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 3333 1 0 20 4 30 10 -1
   3: garbage line
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0 100 0 0 10 0
   1: 00000000000000000000000001000000:1F91 00000000000000000000000001000000:C001 08 00000000:00000000 00:00000000 00000000     0        0 5555 1 0 100 0 0 10 0
"""


def test_tcp_tables_parse_addresses_ports_states() -> None:
    v4 = procnet.parse_tcp_table(TCP4, family=procnet.AF_INET)
    assert [(s.inode, s.state, s.local_port, s.remote_port) for s in v4] == [
        (1111, procnet.TCP_LISTEN, 8080, 0),
        (2222, procnet.TCP_ESTABLISHED, 8080, 54321),
        (3333, procnet.TCP_ESTABLISHED, 54321, 8080),
    ]
    assert v4[1].remote_addr == bytes([127, 0, 0, 1])
    v6 = procnet.parse_tcp_table(TCP6, family=procnet.AF_INET6)
    assert v6[1].remote_addr == bytes(15) + b"\x01"  # ::1
    assert (v6[1].state, v6[1].local_port, v6[1].remote_port) == (procnet.TCP_CLOSE_WAIT, 8081, 0xC001)


def test_accepted_connections_leave_out_outbound_sockets(tmp_path: Path) -> None:
    # A fixture /proc: pid 42 holds the listener (fd 3), an accepted socket (fd 5) and an
    # outbound one (fd 6, ephemeral local port), plus a file.
    (tmp_path / "42" / "net").mkdir(parents=True)
    (tmp_path / "42" / "net" / "tcp").write_text(TCP4)
    (tmp_path / "42" / "net" / "tcp6").write_text(TCP6)
    fd_dir = tmp_path / "42" / "fd"
    fd_dir.mkdir()
    (fd_dir / "3").symlink_to("socket:[1111]")
    (fd_dir / "5").symlink_to("socket:[2222]")
    (fd_dir / "6").symlink_to("socket:[3333]")
    (fd_dir / "7").symlink_to("/var/log/x.log")
    found = procnet.accepted_connections(42, proc_root=tmp_path)
    assert [(fd, s.inode, s.remote_port) for fd, s in found] == [(5, 2222, 54321)]


def test_daemon_counts_sink_errors_and_keeps_going() -> None:
    daemon = Daemon(period_ns=1_000_000)
    seen: list[int] = []

    def broken(_record: object) -> None:
        raise RuntimeError("sink down")

    daemon.add_sink(broken)
    daemon.add_sink(seen.append)
    for i in range(3):
        daemon.emit(i)
    assert seen == [0, 1, 2]
    assert daemon.sink_errors == 3
    stops = iter([None, None, "done"])
    daemon.add_tick_hook(lambda _now: next(stops))
    assert daemon.run() == "done"
    assert daemon.ticks == 3


def test_missing_kernel_headers_is_a_probe_load_error(tmp_path: Path) -> None:
    with pytest.raises(errors.ProbeLoadError, match="kernel headers missing") as info:
        bpf.check_kernel_headers(tmp_path / "no-such-build")
    assert info.value.exit_code == errors.EXIT_PROBE_LOAD


def test_bad_options_are_usage_errors() -> None:
    with pytest.raises(errors.UsageError, match="power of two"):
        loader.IngressOptions(ringbuf_pages=3).validate()
    with pytest.raises(errors.UsageError, match="max_conns"):
        loader.IngressOptions(max_conns=0).validate()
    with pytest.raises(errors.UsageError, match="rate_hint_per_s"):
        loader.IngressOptions(rate_hint_per_s=0).validate()
    with pytest.raises(errors.UsageError, match="records_per_s"):
        loader.IngressOptions(records_per_s=-1).validate()
    assert "-DMAX_CONNS=65536" in loader.cflags(loader.IngressOptions())


def test_ring_is_sized_from_the_rate_hint() -> None:
    # 0.23 s of records at the hinted rate (a peek every 200 ms finds it under its mark, an
    # eighth, and drains it before it is full), rounded up to a power of two of pages
    assert loader.RING_HOLD_S * (1 - BACKLOG_FILL) >= OUTSIDE_PEEK_MAX_NS / 1e9
    assert loader.IngressOptions().ring_pages() == 1024  # 100k/s: 4 MiB
    assert loader.IngressOptions(rate_hint_per_s=1).ring_pages() == 1
    for rate in (1000, 30_000, 100_000, 250_000):
        pages = loader.IngressOptions(rate_hint_per_s=rate).ring_pages()
        held = pages * mmap.PAGESIZE // loader.EVENT_SLOT_BYTES
        assert pages & (pages - 1) == 0 and rate * 0.23 <= held < 2 * rate * 0.23 + 64
    assert loader.IngressOptions(rate_hint_per_s=1, ringbuf_pages=8).ring_pages() == 8
    assert "-DRINGBUF_PAGES=128" in loader.cflags(loader.IngressOptions(rate_hint_per_s=12_000))


def test_histogram_buckets_percentiles_and_prometheus_mapping() -> None:
    for value in (0, 1, 1023, 1024, 1025, 5000, 10**6, 999_999, 2**36 + 5, 2**37, 10**12):
        bucket = aggregate.bucket_of(value)
        assert aggregate.BUCKET_LOW_NS[bucket] <= value < aggregate.BUCKET_HIGH_NS[bucket]
        if 1024 <= value < 2**37:  # each bucket at most 1/16 of its lower bound wide
            assert aggregate.BUCKET_HIGH_NS[bucket] - aggregate.BUCKET_LOW_NS[bucket] <= value / 16
    values = [2_000 + 37 * i * i for i in range(2000)]  # from 2 us (the range the bound holds over)
    totals = RequestTotals.of_latencies(values, unanswered=3)
    assert (totals.requests, totals.answered, totals.latency_sum_ns) == (2003, 2000, sum(values))
    ordered = sorted(values)
    for pct in (0, 25, 50, 99, 99.9, 100):
        exact = ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]
        reported = totals.percentile_ns(pct)
        assert reported is not None and abs(reported - exact) <= exact / 32
    assert RequestTotals().percentile_ns(50) is None
    # Prometheus: each kernel bucket goes to the first bound at or above its midpoint
    bounds = (0.001, 0.01, 0.1)
    counts = totals.prometheus_buckets(bounds)
    assert sum(counts) == 2000 and len(counts) == 4
    midpoints_s = [aggregate.BUCKET_VALUE_NS[aggregate.bucket_of(v)] / 1e9 for v in values]
    expected = [sum(1 for m in midpoints_s if lo < m <= hi) for lo, hi in
                zip((-1.0, *bounds), (*bounds, math.inf), strict=True)]
    assert counts == expected
    # ... so only requests within 1/32 of a bound can land on its other side
    for (lo, hi), count in zip(zip((0.0, *bounds), (*bounds, math.inf), strict=True), counts, strict=True):
        exact = sum(1 for v in values if lo < v / 1e9 <= hi)
        near = sum(1 for v in values for b in (lo, hi) if abs(v / 1e9 - b) <= b / 32)
        assert abs(count - exact) <= near


def _events(latencies_ns: list[int], *, unanswered: frozenset[int] = frozenset()) -> np.ndarray:
    events = np.zeros(len(latencies_ns), dtype=loader.EVENT_DTYPE)
    events["start_ns"] = 1_000_000
    events["end_ns"] = 1_000_000 + np.asarray(latencies_ns, dtype=np.uint64)
    for index in unanswered:
        events["flags"][index] = loader.F_NO_RESPONSE
    return events


def test_sampling_rule_keeps_errors_and_the_slowest_then_one_in_n() -> None:
    sampler = RecordSampler(records_per_s=100, flag_no_response=loader.F_NO_RESPONSE)
    first = _events([1000] * 80)
    assert sampler.select(first, now_ns=0) is None  # fits the budget: no sampling
    latencies = [1000 + i for i in range(1000)]
    batch = _events(latencies, unanswered=frozenset({3, 500}))
    kept = sampler.select(batch, now_ns=100_000_000)  # 0.1 s later: 20 + 10 tokens left
    assert kept is not None
    kept_set = set(kept.tolist())
    assert {3, 500} <= kept_set  # every unanswered request
    assert set(range(990, 1000)) <= kept_set  # the slowest 1 %
    rest = sorted(kept_set - {3, 500} - set(range(990, 1000)))
    assert rest and len(kept) <= 30  # then 1 in N of the rest, within what the bucket held
    gaps = {b - a for a, b in zip(rest, rest[1:])}
    assert len(gaps) <= 2  # evenly spread (a skipped must-keep row may widen one gap)
    assert sampler.select(_events([1000] * 5), now_ns=100_000_000) is not None  # the bucket is empty now
    off = RecordSampler(records_per_s=0, flag_no_response=loader.F_NO_RESPONSE)
    assert off.select(batch, now_ns=0) is None  # 0: every record


def test_launched_command_is_held_then_execs_in_the_same_pid(tmp_path: Path) -> None:
    from moescope.agent.targets import LaunchedCommand
    from moescope.procfs import read_comm

    out = tmp_path / "out"
    command = LaunchedCommand(
        ["sh", "-c", f'echo "$MOESCOPE_TEST_VAR $$ $MOESCOPE_TEST_PID" > {out}; kill -TERM $$'],
        extra_env={"MOESCOPE_TEST_VAR": "seen"}, pid_env=("MOESCOPE_TEST_PID",),
    )
    try:
        # Held: still the trampoline (python), nothing of the command has run yet.
        comm = read_comm(command.popen.pid)
        assert comm is not None and comm.startswith("python")
        assert not out.exists()
        assert command.target.alive()
        command.release()
        assert command.exit_status() == 128 + 15  # killed by SIGTERM, shell style
        # same pid after exec, and that pid in the pid_env variable (what arms its NVTX ring)
        assert out.read_text().split() == ["seen", str(command.popen.pid), str(command.popen.pid)]
        assert not command.target.alive()
    finally:
        command.stop()


def test_unknown_command_is_a_usage_error() -> None:
    from moescope.agent.targets import LaunchedCommand

    with pytest.raises(errors.UsageError, match="command not found"):
        LaunchedCommand(["no-such-command-moescope"])


def test_kernel_totals_reach_metrics_as_deltas() -> None:
    from moescope.agent.metrics import LATENCY_BUCKETS_S, Metrics
    from moescope.agent.outputs.metrics import MetricsOutput

    metrics = Metrics()
    output = MetricsOutput(metrics)
    first = RequestTotals.of_latencies([2_000_000, 40_000_000], unanswered=1, bytes_in=300, bytes_out=5000)
    readings = [first, first + RequestTotals.of_latencies([600_000_000], bytes_in=100, bytes_out=50)]
    output.use_kernel_totals(lambda: readings[0])
    metrics.refresh()
    metrics.refresh()  # a second read of the same totals adds nothing

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert sample("moescope_requests_total") == 3
    assert sample("moescope_request_duration_seconds_count") == 2
    readings.pop(0)
    metrics.refresh()
    assert sample("moescope_requests_total") == 4
    assert (sample("moescope_request_received_bytes_total"), sample("moescope_response_sent_bytes_total")) == (400, 5050)
    assert sample("moescope_request_duration_seconds_count") == 3
    assert sample("moescope_request_duration_seconds_sum") == pytest.approx(0.642)
    # cumulative buckets on the family's own bounds: 2 ms <= 0.0025, 40 ms <= 0.05, 600 ms <= 0.8
    for le, expected in ((0.001, 0), (0.0025, 1), (0.05, 2), (0.5, 2), (0.8, 3), (10.0, 3)):
        assert le in LATENCY_BUCKETS_S and sample("moescope_request_duration_seconds_bucket", le=str(le)) == expected


def test_kernel_request_window_rates_and_percentiles() -> None:
    from moescope.agent.outputs.kernel_requests import KernelRequestWindow

    current = [RequestTotals()]
    window = KernelRequestWindow(lambda: current[0], window_ns=10_000_000_000, period_ns=1_000_000_000)
    assert window.panel().rate_per_s is None  # one reading is no rate yet
    window.tick(0)
    for second in range(1, 21):  # 100 requests a second, one unanswered, latencies 1..100 us
        current[0] = current[0] + RequestTotals.of_latencies([1000 * i for i in range(1, 100)], unanswered=1)
        window.tick(second * 1_000_000_000)
        window.tick(second * 1_000_000_000 + 1)  # within the period: no new reading
    panel = window.panel()
    assert panel.rate_per_s == pytest.approx(100.0) and panel.errors_per_s == pytest.approx(1.0)
    assert panel.errors_total == 20 and panel.window_s == 10.0
    assert panel.latency_p50_ms is not None and abs(panel.latency_p50_ms - 0.050) <= 0.050 / 32
    assert panel.latency_p99_ms is not None and abs(window.p99_ms() - 0.099) <= 0.099 / 32
