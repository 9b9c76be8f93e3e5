"""Hostile NVTX producers, for real: a process using the `nvtx` package with the injection library
(NVTX_INJECTION64_PATH) sends huge texts, invalid UTF-8, unknown payload types, unbalanced pops,
a unique text per event and events from 1200 threads alive at once, while the real NvtxCollector
drains it. No crash on either side, every anomaly counted exactly, conservation holds, and what
the agent keeps stays under the caps in docs/hardening.md."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moescope.collectors import nvtx
from moescope.collectors.nvtx import MAX_STRING_BYTES, NvtxBatch, NvtxCollector, injection_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WAIT_S = 120.0  # generous: only bounds waiting on a shared, noisy 2-core machine
STRING_REGION_BYTES = 128 * 1024  # small, so 5000 unique texts overflow it
THREADS = 1200
THREAD_CHECK_STEP_NS = 2 * nvtx.THREAD_CHECK_PERIOD_NS  # the daemon's period, before any test changes it


@pytest.fixture
def producer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, Path]]:
    ring_dir = Path(
        tempfile.mkdtemp(prefix="moescope-fuzz-rings-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    log_path = tmp_path / "producer.json"
    env = dict(os.environ)
    env.update(injection_env())
    env["MOESCOPE_NVTX_DIR"] = str(ring_dir)
    env["MOESCOPE_NVTX_STRING_BYTES"] = str(STRING_REGION_BYTES)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, str(HERE / "hostile_producer.py"), "--log", str(log_path),
                             "--threads", str(THREADS)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield proc, log_path, ring_dir
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        shutil.rmtree(ring_dir, ignore_errors=True)


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    assert proc.stdout is not None
    stdout = proc.stdout
    out: queue.Queue[str] = queue.Queue()

    def reader() -> None:
        for line in stdout:
            out.put(line.strip())
        out.put("<eof>")

    threading.Thread(target=reader, daemon=True).start()
    return out


@pytest.mark.parametrize("eager", [False, True], ids=["daemon-periods", "drain-and-check-threads-every-poll"])
def test_hostile_producer_is_survived_counted_and_bounded(producer: tuple[subprocess.Popen[str], Path, Path],
                                                          eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """eager: every poll drains and checks which threads are gone, so a check often falls while the
    1200 threads pop their ranges and exit: a thread gone after its pops is not one with ranges open."""
    proc, log_path, ring_dir = producer
    lines = lines_of(proc)
    assert lines.get(timeout=WAIT_S) == "ready"
    batches: list[NvtxBatch] = []
    if eager:
        monkeypatch.setattr(nvtx, "THREAD_CHECK_PERIOD_NS", 0)
    collector = NvtxCollector(proc.pid, sink=batches.append, directory=ring_dir,
                              drain_period_ns=0 if eager else nvtx.DRAIN_PERIOD_NS)
    peak_open = 0
    try:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + WAIT_S
        while True:  # drain as the daemon does while the producer runs
            assert time.monotonic() < deadline, f"producer never finished: {collector.stats()}"
            collector.poll(time.monotonic_ns())
            assert collector.stats()["open_ranges"] <= 2 * THREADS + 1
            try:
                line = lines.get(timeout=0.005)
            except queue.Empty:
                continue
            if line == "held":  # every thread holds two ranges open: the agent must see them all
                while collector.stats()["open_ranges"] < 2 * THREADS:
                    assert time.monotonic() < deadline, f"open ranges never seen: {collector.stats()}"
                    collector.poll(time.monotonic_ns())
                    time.sleep(0.005)
                peak_open = collector.stats()["open_ranges"]
                proc.stdin.write("release\n")
                proc.stdin.flush()
                continue
            assert line == "done", f"producer said {line!r} (rc={proc.poll()})"
            break
        # the thread that left "t.open" open has exited; the process lives on until told
        now = time.monotonic_ns()
        while collector.stats()["ranges_open_at_thread_exit"] == 0:
            assert time.monotonic() < deadline, f"exited thread never noticed: {collector.stats()}"
            now += THREAD_CHECK_STEP_NS
            collector.poll(now)
            time.sleep(0.01)
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=WAIT_S) == 0  # the producer did not crash
        while not collector.finished:
            assert time.monotonic() < deadline, f"collector never finished: {collector.stats()}"
            now += nvtx.PROCESS_CHECK_PERIOD_NS
            collector.poll(now)
            time.sleep(0.005)
        stats = collector.stats()
        table = collector.strings
    finally:
        collector.close()
    log = json.loads(log_path.read_text())

    # conservation: every event the producer emitted while attached was received or counted dropped
    assert stats["records_received"] + stats["dropped_ring_full"] + stats["lost_uncommitted"] == log["emitted"] + 0
    assert stats["dropped_ring_full"] == 0  # the default ring holds this run: nothing may be missing

    # each anomaly counted exactly
    assert stats["strings_truncated"] == log["huge_texts"]
    assert stats["invalid_utf8_strings"] == log["invalid_utf8"]
    assert stats["unknown_payloads"] == stats["unknown_payload_records"] == log["unknown_payloads"]
    assert stats["pop_without_push"] == log["unbalanced_pops"]
    assert stats["ranges_open_at_thread_exit"] == 1 and stats["ranges_open_at_exit"] == 0
    assert stats["dropped_string_full"] > 0  # the unique texts overflowed the region...
    assert stats["messages_lost"] == stats["dropped_string_full"]  # ...each lost text is a counted event
    assert stats["sink_errors"] == 0 and stats["unknown_kind"] == 0

    # every thread's ranges, each under its own parent
    names = {int(sid): text for sid, text in table.strings.items()}
    ranges = [r for b in batches for r in b.ranges.tolist()]
    by_name: dict[str, int] = {}
    for r in ranges:
        text = names.get(r[8])
        by_name[text or ""] = by_name.get(text or "", 0) + 1
    assert by_name.get("t.outer") == by_name.get("t.inner") == THREADS
    marks = sum(len(b.marks) for b in batches)
    assert marks == 3 + log["invalid_utf8"] + log["unknown_payloads"] + THREADS + log["unique"]
    assert stats["parent_unknown"] == 0

    # bounded: the string table is under its caps, the per-thread state was never more than the
    # threads' own nesting, and nothing is left open
    assert table.entries <= nvtx.MAX_STRING_ENTRIES
    assert sum(len(t.encode("utf-8", "surrogatepass")) for t in table.strings.values()) <= STRING_REGION_BYTES
    assert all(len(t.encode("utf-8", "surrogatepass")) <= MAX_STRING_BYTES for t in table.strings.values())
    unique_kept = sum(1 for t in table.strings.values() if t.startswith("u-"))
    assert 0 < unique_kept < log["unique"]
    assert unique_kept + stats["dropped_string_full"] == log["unique"]
    assert peak_open == 2 * THREADS < nvtx.MAX_OPEN_RANGES  # two per thread, exactly: no leak per thread
    assert stats["open_ranges"] == 0
