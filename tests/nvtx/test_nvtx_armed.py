"""A ring armed by its launcher (`agent start -- CMD`: MOESCOPE_NVTX_ARMED names the launched pid)
records from the producer's first event, and the agent's first attach takes it whole: nothing the
process emitted before the agent found its ring is lost, and a range opened before the attach
closes after it under the same parent. A variable naming another pid (a forked worker inherits it)
arms nothing.

Real library, real producer (the `nvtx` package), real collector."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from nvtx_helpers import Capture, kill_group, producer_env

from moescope.collectors.nvtx import ARMED_ENV, NvtxCollector

HOUR_NS = 3600 * 10**9
BEFORE, AFTER = 100, 50

# argv[1]: "self" (arm this process, as the agent's trampoline does) or a pid to write instead.
# One range opened, BEFORE marks, "ready"; a line on stdin; AFTER marks inside the same range, the
# pop, "done"; a line on stdin, exit.
_PRODUCER = f"""
import os, sys
os.environ[{ARMED_ENV!r}] = str(os.getpid()) if sys.argv[1] == "self" else sys.argv[1]
import nvtx
domain = nvtx.get_domain("moe")
domain.push_range(message="open across the attach")
for _ in range({BEFORE}):
    domain.mark(message="before")
print("ready", flush=True)
sys.stdin.readline()
for _ in range({AFTER}):
    domain.mark(message="after")
domain.pop_range()
print("done", flush=True)
sys.stdin.readline()
"""


def _run(ring_dir: Path, arm: str) -> tuple[Capture, dict[str, int]]:
    """The producer run to its end around one attach (after its first events); what was captured."""
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, arm], env=producer_env(ring_dir),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    capture = Capture()
    collector = None
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        collector = NvtxCollector(proc.pid, sink=capture, directory=ring_dir, drain_period_ns=HOUR_NS)
        assert collector.attached
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        collector.poll(time.monotonic_ns(), force=True)
        return capture, collector.stats()
    finally:
        if collector is not None:
            collector.close()
        kill_group(proc)


def test_an_armed_ring_is_taken_whole_with_its_open_range(ring_dir: Path) -> None:
    capture, stats = _run(ring_dir, "self")
    assert stats["skipped_at_attach"] == 0 and stats["dropped_ring_full"] == 0, stats
    marks = capture.marks()
    assert len(marks) == BEFORE + AFTER  # the marks made before the agent attached are there
    ranges = capture.ranges()
    assert len(ranges) == 1, ranges  # the range opened before the attach, closed after it
    assert stats["pop_without_push"] == 0 and stats["ranges_lost_end"] == 0, stats
    # every mark, before and after the attach, nested in that range
    assert set(marks["parent_uid"].tolist()) == {int(ranges["uid"][0])}


def test_a_variable_naming_another_pid_arms_nothing(ring_dir: Path) -> None:
    capture, stats = _run(ring_dir, "1")
    # the library recorded nothing before the attach (its idle path): only what came after it
    assert len(capture.marks()) == AFTER, stats
    assert stats["skipped_at_attach"] == 0, stats
