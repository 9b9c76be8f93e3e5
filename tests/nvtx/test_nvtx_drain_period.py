"""The collector drains its ring fully at most every drain period, sooner when the ring fills, and
always at close: batching drains never loses or delays a record past those bounds. Its backlog
check (the quiet daemon's peek between rounds) says "filling" exactly when a poll would drain early.

Real producer (tests/nvtx/producer.py, flood mode paused at half), real ring, real collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nvtx_helpers import Capture, Producer, drain_until_finished, kill_group, producer_env

from moescope.collectors.nvtx import EARLY_DRAIN_FRACTION, NvtxCollector, injection_library_path

MOE_SCALE_PRODUCER = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_scale_producer.py"

HOUR_NS = 3600 * 10**9


def _paused_flood(start_producer: Callable[..., Producer], *, events: int) -> Producer:
    # one thread; `events` NVTX calls (push, mark, pop) before it stops at "half"
    producer = start_producer("--mode", "flood", "--pause", "--threads", "1", "--count", str(2 * events))
    producer.expect_line("ready")
    return producer


def test_a_small_backlog_waits_for_the_period_and_the_close_drains_it(start_producer: Callable[..., Producer]) -> None:
    producer = _paused_flood(start_producer, events=300)
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir, drain_period_ns=HOUR_NS)
    try:
        t0 = time.monotonic_ns()
        collector.poll(t0)  # the first poll always drains
        assert collector.drained_through_ns == t0
        before = collector.stats()["records_received"]
        producer.go()
        producer.expect_line("half")
        # 300 records wait in a 65536-record ring: below 1/8 full, inside the period -> not drained,
        # and the quiet daemon's peek (backlogged) does not ask for a round either
        assert not collector.backlogged()
        assert collector.poll(t0 + 1) == 0
        assert collector.stats()["records_received"] == before
        assert collector.drained_through_ns == t0
        collector.close()  # ... but a closing collector drains what is there
        assert collector.stats()["records_received"] == before + 300
        assert len(capture.ranges()) == 100 and len(capture.marks()) == 100
    finally:
        collector.close()
        producer.go()
        producer.wait()


def test_a_filling_ring_is_drained_before_the_period_ends(start_producer: Callable[..., Producer]) -> None:
    events = 65536 // EARLY_DRAIN_FRACTION + 3000  # past the early-drain mark of the default ring
    producer = _paused_flood(start_producer, events=events - events % 3)
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir, drain_period_ns=HOUR_NS)
    try:
        t0 = time.monotonic_ns()
        collector.poll(t0)
        producer.go()
        producer.expect_line("half")
        assert collector.backlogged()  # the daemon's peek brings a round forward ...
        drained = collector.poll(t0 + 1)  # ... and that round drains it
        assert not collector.backlogged()
        stats = collector.stats()
        assert drained == stats["records_received"] == events - events % 3, stats
        assert stats["dropped_ring_full"] == 0, stats
        assert collector.drained_through_ns == t0 + 1
        producer.go()
        drain_until_finished(collector)  # the producer exited: drained regardless of the period
        assert producer.wait() == 0
        assert collector.stats()["records_received"] == 2 * (events - events % 3)
    finally:
        collector.close()


def test_a_filling_payload_blob_is_drained_before_the_period_ends(ring_dir: Path) -> None:
    # 20 DeepSeek-V3 compact steps: ~2.4 MB of routing vectors (past a quarter of the 8 MiB blob)
    # in ~2,400 records (far below 1/8 of the ring): the blob alone must trigger the drain
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(injection_library_path()), MOESCOPE_NVTX_DIR=str(ring_dir))
    proc = subprocess.Popen([sys.executable, str(MOE_SCALE_PRODUCER), "--layers", "58", "--experts", "256",
                             "--top-k", "8", "--convention", "v2-compact", "--steps-per-s", "200",
                             "--duration-s", "0.1"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    capture = Capture()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        pid = json.loads(proc.stdout.readline())["pid"]
        collector = NvtxCollector(pid, sink=capture, directory=ring_dir, drain_period_ns=HOUR_NS)
        t0 = time.monotonic_ns()
        collector.poll(t0)  # the first poll always drains
        before = collector.stats()["records_received"]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        assert result["steps_emitted"] == 20
        assert collector.backlogged()  # the blob alone makes the daemon's peek ask for a round
        drained = collector.poll(t0 + 1)  # inside the period, few records: the blob is past its mark
        assert drained > 0 and collector.stats()["records_received"] == before + drained
        assert collector.stats()["ext_payload_blob_full_dropped"] == 0
        proc.stdin.write("\n")
        proc.stdin.flush()
        drain_until_finished(collector)
        assert proc.wait(timeout=30) == 0
        collector.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


# Started with the injection variable, its first NVTX call only after a line on stdin: the ring
# file appears then (the library creates it on that call), while the collector already waits.
_LATE_FIRST_CALL = """
import sys
sys.stdin.readline()
import nvtx
nvtx.mark(message="first")
print("ready", flush=True)
sys.stdin.readline()
"""


def test_the_peek_asks_for_the_round_that_attaches_a_ring_that_just_appeared(ring_dir: Path) -> None:
    # The library records nothing before an agent attaches, so the round that attaches must come
    # when the ring appears: not at the next quiet round, up to 4 s later (a process launched under
    # `agent start -- CMD` lost the steps of its first seconds that way)
    proc = subprocess.Popen([sys.executable, "-c", _LATE_FIRST_CALL], env=producer_env(ring_dir),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    collector = None
    try:
        assert proc.stdin is not None and proc.stdout is not None
        collector = NvtxCollector(proc.pid, sink=Capture(), directory=ring_dir, drain_period_ns=HOUR_NS)
        assert not collector.attached
        assert not collector.backlogged()  # no ring yet: nothing to attach
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ready"
        assert collector.backlogged()  # the ring is there: the daemon's peek brings the round forward ...
        collector.poll(time.monotonic_ns())  # ... and that round attaches
        assert collector.attached and collector.stats()["attaches"] == 1
        assert not collector.backlogged()  # attached, its ring empty: no round asked for
    finally:
        if collector is not None:
            collector.close()
        kill_group(proc)

