"""NvtxCollector.health(): the last drain of a real producer's ring, timed; polls that wait for the
drain period leave it as it was."""

from __future__ import annotations

import time
from collections.abc import Callable

from nvtx_helpers import Capture, Producer

from moescope.collectors.nvtx import NvtxCollector
from moescope.collectors.registry import SourceHealth

HOUR_NS = 3600 * 10**9


def test_health_is_the_last_drain(start_producer: Callable[..., Producer]) -> None:
    producer = start_producer("--mode", "flood", "--pause", "--threads", "1", "--count", "600")
    producer.expect_line("ready")
    collector = NvtxCollector(producer.pid, sink=Capture(), directory=producer.ring_dir, drain_period_ns=HOUR_NS)
    try:
        assert collector.health() == SourceHealth()  # attached, not drained yet
        t0 = time.monotonic_ns()
        collector.poll(t0)  # the first poll always drains
        first = collector.health()
        assert first.last_success is True and first.last_error is None
        assert first.last_duration_ns is not None and first.last_duration_ns > 0
        producer.go()
        producer.expect_line("half")  # 300 records wait in the ring
        assert collector.poll(t0 + 1) == 0  # inside the period, ring far from full: no drain
        assert collector.health() is first
        assert collector.poll(t0 + HOUR_NS) == 300  # the period is over: a drain, timed again
        second = collector.health()
        assert second is not first and second.last_success is True and second.last_duration_ns is not None
    finally:
        collector.close()
        producer.go()
        producer.wait()
