"""Overload and agent failure: the producer never blocks, and every event is accounted for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from nvtx_helpers import HERE, Capture, Producer, drain_until_finished

from moescope.collectors.nvtx import (
    OFF_CONSUMER_ATTACHED,
    OFF_COUNTERS,
    OFF_HEAD,
    NvtxCollector,
    ring_path,
)

REPO = HERE.parent.parent
SMALL_RING = {"MOESCOPE_NVTX_RING_RECORDS": "256"}


def test_flood_balances_exactly(start_producer: Callable[..., Producer]) -> None:
    """A tiny ring and a slow consumer: emitted = received + dropped, exactly."""
    producer = start_producer("--mode", "flood", "--threads", "4", "--count", "150000", extra_env=SMALL_RING)
    producer.expect_line("ready")
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        drain_until_finished(collector, poll_sleep_s=0.02)  # polls rarely on purpose: the ring overflows
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    emitted = producer.log()["emitted"]
    assert emitted == 4 * (150000 // 3) * 3
    assert stats["dropped_ring_full"] > 0, stats
    assert stats["records_received"] > 0, stats
    assert stats["records_received"] + stats["dropped_ring_full"] == emitted, stats
    assert stats["lost_uncommitted"] == 0
    # every received mark is the flood mark, every received range is a flood range
    assert np.all(collector.strings.names(capture.ranges()["string_id"]) == "flood")
    assert np.all(collector.strings.names(capture.marks()["string_id"]) == "flood.mark")


def test_nesting_stays_exact_when_drops_cut_through_it(start_producer: Callable[..., Producer]) -> None:
    """Drops remove pushes and pops at random points of nested ranges: every range that is
    reported still pairs its own push and pop, at its own depth, under its own parent."""
    producer = start_producer("--mode", "nested-flood", "--threads", "3", "--count", "20000", extra_env=SMALL_RING)
    producer.expect_line("ready")
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        drain_until_finished(collector, poll_sleep_s=0.005)
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    assert stats["dropped_ring_full"] > 0
    assert stats["records_received"] + stats["dropped_ring_full"] == producer.log()["emitted"]
    ranges = capture.ranges()
    names = collector.strings.names(ranges["string_id"])
    by_uid = {int(u): i for i, u in enumerate(ranges["uid"])}
    outer = names == "nest.outer"
    inner = names == "nest.inner"
    assert outer.sum() > 0 and inner.sum() > 0
    assert (ranges["depth"][outer] == 0).all() and (ranges["parent_uid"][outer] == 0).all()
    assert (ranges["depth"][inner] == 1).all()
    lost = capture.lost_uids()
    assert stats["ranges_lost_end"] == len(lost) - stats["ranges_open_at_exit"]
    with_parent = 0
    for r in ranges[inner]:
        parent = int(r["parent_uid"])
        if parent in by_uid:
            p = ranges[by_uid[parent]]
            assert (int(p["payload"]), int(p["tid"])) == (int(r["payload"]), int(r["tid"]))
            assert p["start_ns"] <= r["start_ns"] <= r["end_ns"] <= p["end_ns"]
            with_parent += 1
        else:
            assert parent == 0 or parent in lost  # a parent whose own end was dropped
    assert with_parent > 0
    marks = capture.marks()
    inner_uids = {int(u): int(p) for u, p in zip(ranges["uid"][inner], ranges["payload"][inner], strict=True)}
    for m in marks:
        parent = int(m["parent_uid"])
        if parent in inner_uids:
            assert inner_uids[parent] == int(m["payload"])
        else:
            assert parent == 0 or parent in lost
    # nothing piles up: what is still open at the end is at most one nest per thread
    assert stats["ranges_open_at_exit"] <= 3 * 2


def _start_consumer(pid: int, ring_dir: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("NVTX_INJECTION64_PATH", None)
    return subprocess.Popen(
        [sys.executable, str(HERE / "consumer.py"), "--pid", str(pid), "--dir", str(ring_dir)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )


def _ring_state(fd: int) -> tuple[int, int, int]:
    """(consumer_attached, head, dropped_ring_full) read through an open descriptor."""
    raw = os.pread(fd, OFF_COUNTERS + 8, 0)
    attached = int(np.frombuffer(raw, dtype="<u4", count=1, offset=OFF_CONSUMER_ATTACHED)[0])
    head = int(np.frombuffer(raw, dtype="<u8", count=1, offset=OFF_HEAD)[0])
    dropped = int(np.frombuffer(raw, dtype="<u8", count=1, offset=OFF_COUNTERS)[0])
    return attached, head, dropped


def test_producer_never_blocks_when_the_agent_is_killed(start_producer: Callable[..., Producer]) -> None:
    """SIGKILL the agent mid-flood (the producer paused at half-way until it is dead): the producer
    finishes the second half into a ring nobody drains: it drops and counts, never waits."""
    producer = start_producer("--mode", "flood", "--pause", "--threads", "2", "--count", "300000",
                              extra_env=SMALL_RING)
    producer.expect_line("ready")
    consumer = _start_consumer(producer.pid, producer.ring_dir)
    fd = -1
    try:
        assert consumer.stdout is not None
        assert consumer.stdout.readline().strip() == "attached"
        fd = os.open(ring_path(producer.pid, directory=producer.ring_dir), os.O_RDONLY)
        producer.go()
        producer.expect_line("half")
        attached, head_at_kill, _ = _ring_state(fd)
        assert attached == 1 and head_at_kill > 0
        os.killpg(consumer.pid, signal.SIGKILL)
        consumer.wait(timeout=10)
        producer.go()  # second half, with a dead agent still marked attached
        producer.expect_line("done")
        assert producer.wait() == 0
        assert producer.log()["emitted"] == 2 * (300000 // 6) * 2 * 3
        _, head_end, dropped_end = _ring_state(fd)
        # the dead agent freed at most one ring's worth after "half"; everything else was dropped
        assert head_end - head_at_kill <= 256
        assert dropped_end >= 2 * (300000 // 6) * 3 - 256
    finally:
        if fd >= 0:
            os.close(fd)
        if consumer.poll() is None:
            os.killpg(consumer.pid, signal.SIGKILL)
            consumer.wait(timeout=10)
        if consumer.stdout is not None:
            consumer.stdout.close()


def test_producer_detaches_a_dead_agent_by_its_stale_heartbeat(start_producer: Callable[..., Producer]) -> None:
    """After a killed agent's heartbeat goes stale the producer lowers the flag itself and returns
    to the idle path, instead of dropping (and paying for) every event forever."""
    producer = start_producer("--mode", "flood", "--pause", "--threads", "1", "--count", "300000",
                              extra_env={**SMALL_RING, "MOESCOPE_NVTX_STALE_MS": "50"})
    producer.expect_line("ready")
    consumer = _start_consumer(producer.pid, producer.ring_dir)
    fd = -1
    try:
        assert consumer.stdout is not None
        assert consumer.stdout.readline().strip() == "attached"
        fd = os.open(ring_path(producer.pid, directory=producer.ring_dir), os.O_RDONLY)
        producer.go()
        producer.expect_line("half")
        os.killpg(consumer.pid, signal.SIGKILL)
        consumer.wait(timeout=10)
        time.sleep(0.3)  # let the dead agent's last heartbeat age past 50 ms
        _, head_kill, dropped_kill = _ring_state(fd)
        producer.go()
        producer.expect_line("done")
        assert producer.wait() == 0
        attached, head_end, dropped_end = _ring_state(fd)
        assert attached == 0
        second_half = 300000 // 6 * 3
        # what was emitted before the producer noticed: at most a ring and one check interval
        assert head_end - head_kill <= 256
        assert dropped_end - dropped_kill <= 2 * 1024 + 256 < second_half
    finally:
        if fd >= 0:
            os.close(fd)
        if consumer.poll() is None:
            os.killpg(consumer.pid, signal.SIGKILL)
            consumer.wait(timeout=10)
        if consumer.stdout is not None:
            consumer.stdout.close()


def test_producer_runs_on_when_the_agent_detaches(start_producer: Callable[..., Producer]) -> None:
    """A clean agent stop lowers the flag: the producer goes back to the idle path, so nothing is
    written or dropped after the stop."""
    producer = start_producer("--mode", "flood", "--pause", "--threads", "2", "--count", "300000",
                              extra_env=SMALL_RING)
    producer.expect_line("ready")
    collector = NvtxCollector(producer.pid, sink=Capture(), directory=producer.ring_dir)
    fd = os.open(ring_path(producer.pid, directory=producer.ring_dir), os.O_RDONLY)
    try:
        producer.go()
        producer.expect_line("half")
        collector.poll(time.monotonic_ns())
        collector.close()
        attached, head_stop, dropped_stop = _ring_state(fd)
        assert attached == 0
        producer.go()
        producer.expect_line("done")
        assert producer.wait() == 0
        assert producer.log()["emitted"] == 2 * (300000 // 6) * 2 * 3
        _, head_end, dropped_end = _ring_state(fd)
        assert (head_end, dropped_end) == (head_stop, dropped_stop)
    finally:
        os.close(fd)
        collector.close()
