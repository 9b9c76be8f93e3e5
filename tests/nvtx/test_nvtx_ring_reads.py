"""The agent maps a ring's header only: records, texts and payload bytes are copied out with
preadv. Its RSS does not take in the producers' rings (13.3 MB each by default), and a ring file
cut short under it reads as zeros, counted, where a mapping would have raised SIGBUS."""

from __future__ import annotations

import argparse
import os
import time
import types
from collections.abc import Callable
from pathlib import Path

from nvtx_helpers import WAIT_S, Capture, Producer, drain_until_finished

from moescope.agent.daemon import Daemon
from moescope.agent.export.processor import ExportStats
from moescope.agent.metrics import Metrics
from moescope.agent.observe import Observers
from moescope.agent.pipeline import Pipeline
from moescope.collectors.nvtx import HEADER_BYTES, OFF_RING_OFFSET, RECORD_BYTES, NvtxCollector, ring_path


def _mapped_rss_bytes(path: Path) -> int | None:
    """This process's resident bytes of its mappings of ``path`` (None: not mapped)."""
    total, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total = (total or 0) + int(fields[1]) * 1024
    return total


def test_the_agent_maps_a_rings_header_only(start_producer: Callable[..., Producer]) -> None:
    """Payload arrays from four threads go through a default-sized ring: the agent receives them,
    and what it holds resident of the ring file is its header page, not the ring."""
    producer = start_producer("--mode", "ext", "--threads", "4", "--rounds", "8")
    producer.expect_line("ready")
    path = ring_path(producer.pid, directory=producer.ring_dir)
    ring_bytes = path.stat().st_size
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        peak = 0
        deadline = time.monotonic() + WAIT_S
        while not collector.finished:  # drain_until_finished, with the mapping read at every poll
            assert time.monotonic() < deadline, collector.stats()
            collector.poll(time.monotonic_ns())
            resident = _mapped_rss_bytes(path)
            if resident is not None:
                peak = max(peak, resident)
            time.sleep(0.002)
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    assert ring_bytes > 12 << 20  # the library's default ring: 4 MiB of records, 8 MiB of payloads
    assert stats["ext_payload_records"] > 1000 and stats["ext_payloads_lost"] == 0, stats
    assert stats["ring_short_reads"] == 0
    assert 0 < peak <= HEADER_BYTES, peak  # a mapping of the whole file held all 13 MB resident


def test_a_ring_cut_short_under_the_agent_reads_as_zeros_counted(start_producer: Callable[..., Producer]) -> None:
    """The file truncated inside its records after the producer wrote them: what lay before the cut
    is received, the records past it are counted lost (never committed), and nothing faults."""
    producer = start_producer("--mode", "flood", "--threads", "1", "--count", "3000")
    producer.expect_line("ready")
    fd = os.open(ring_path(producer.pid, directory=producer.ring_dir), os.O_RDWR)  # (unlinked at its exit)
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        producer.expect_line("done")
        assert producer.wait() == 0
        ring_offset = int.from_bytes(os.pread(fd, 8, OFF_RING_OFFSET), "little")
        keep = 100
        os.ftruncate(fd, ring_offset + keep * RECORD_BYTES)  # (the producer is gone: nothing else maps it)
        drain_until_finished(collector)
        stats = collector.stats()
    finally:
        collector.close()
        os.close(fd)
    emitted = producer.log()["emitted"]
    assert emitted == 3000 and ring_offset >= HEADER_BYTES
    assert stats["ring_short_reads"] > 0, stats
    assert stats["records_received"] == keep, stats
    assert stats["lost_uncommitted"] == emitted - keep, stats
    assert stats["dropped_ring_full"] == 0


def test_records_lost_on_the_agents_side_are_reported_as_drops(start_producer: Callable[..., Producer]) -> None:
    """The cut-short ring's lost records reach the agent's drop reports: its summary line, the
    per-source drop counter on /metrics and the per-pid drops of the ranks panel."""
    producer = start_producer("--mode", "flood", "--threads", "1", "--count", "3000")
    producer.expect_line("ready")
    fd = os.open(ring_path(producer.pid, directory=producer.ring_dir), os.O_RDWR)
    metrics = Metrics()
    no_export = types.SimpleNamespace(stats=lambda: ExportStats(0, 0, 0, 0, 0, 0, 0, 0))  # (traces off here)
    obs = Observers(args=argparse.Namespace(no_policy=True), daemon=Daemon(),
                    pipeline=Pipeline(spans=None, metrics=metrics), tracing=no_export,  # type: ignore[arg-type]
                    metrics=metrics, metrics_server=None)
    collector = NvtxCollector(producer.pid, sink=Capture(), directory=producer.ring_dir)
    try:
        producer.go()
        producer.expect_line("done")
        assert producer.wait() == 0
        ring_offset = int.from_bytes(os.pread(fd, 8, OFF_RING_OFFSET), "little")
        os.ftruncate(fd, ring_offset + 100 * RECORD_BYTES)
        drain_until_finished(collector)
    finally:
        collector.close()
        os.close(fd)
    obs.nvtx.append(collector)
    lost = collector.stats()["lost_uncommitted"]
    assert lost == 2900
    assert obs._nvtx_drops_per_pid() == {producer.pid: lost}
    row = next(s for s in obs._source_stats() if s.name == "nvtx")
    assert row.drops_total == lost
    assert metrics.get("moescope_agent_events_dropped", source="nvtx", reason="lost_uncommitted") == lost
