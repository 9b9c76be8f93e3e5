"""Hostile input, thread and process exit, a target without the variable, and the CLI line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from nvtx_helpers import WAIT_S, Capture, Producer, drain_until_finished

from moescope.agent.cli import main as agent_main
from moescope.collectors.nvtx import (
    MAX_STRING_BYTES,
    PAYLOAD_EXT,
    THREAD_CHECK_PERIOD_NS,
    NvtxCollector,
    cleanup_stale_rings,
    injection_library_path,
    ring_path,
)
from moescope.errors import NoSuchProcess, NvtxUnavailable


def test_hostile_strings_and_payloads_are_counted_never_fatal(start_producer: Callable[..., Producer]) -> None:
    producer = start_producer("--mode", "hostile", "--count", "3000",
                              extra_env={"MOESCOPE_NVTX_STRING_BYTES": "65536"})
    producer.expect_line("ready")
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        producer.expect_line("done")
        # the thread that pushed "left.open" has exited; the process is still alive
        # (the kernel may list the joined thread a moment longer: poll as the daemon would)
        now = time.monotonic_ns()
        deadline = time.monotonic() + WAIT_S
        while collector.stats()["ranges_open_at_thread_exit"] == 0 and time.monotonic() < deadline:
            now += 2 * THREAD_CHECK_PERIOD_NS
            collector.poll(now)
            time.sleep(0.01)
        mid = collector.stats()
        producer.go()
        drain_until_finished(collector)
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    log = producer.log()
    strings = collector.strings
    assert mid["ranges_open_at_thread_exit"] == 1
    assert stats["ranges_open_at_exit"] == 0

    marks = capture.marks()
    huge_id = int(marks["string_id"][0])
    huge = strings.name(huge_id)
    assert huge is not None and huge_id in strings.truncated
    assert len(huge.encode()) <= MAX_STRING_BYTES and huge == "h" * len(huge)
    assert log["huge_bytes"] > MAX_STRING_BYTES
    assert stats["strings_truncated"] == 1
    bad = strings.name(int(marks["string_id"][1]))
    assert bad is not None and bad.startswith("bad ") and "\ufffd" in bad
    assert stats["invalid_utf8_strings"] == 1
    # schema (extension) payloads: copied into the blob region, decoded, counted
    ext_batch = next(b for b in capture.batches if len(b.ranges))
    ext_range = ext_batch.ranges[0]
    assert strings.name(int(ext_range["string_id"])) == "ext"
    assert ext_range["payload_type"] == PAYLOAD_EXT
    decoded = ext_batch.payload_array(ext_range)
    assert decoded is not None and decoded.dtype == np.int64 and decoded.tolist() == [0, 1, 2, 3]
    ext_mark = next((b, m) for b in capture.batches for m in b.marks if strings.name(int(m["string_id"])) == "ext.mark")
    mark_values = ext_mark[0].payload_array(ext_mark[1])
    assert mark_values is not None and mark_values.tolist() == [1.5, 2.5]
    assert stats["ext_payload_records"] == stats["ext_payloads"] == stats["ext_payloads_recorded"] == 2
    # 3000 unique strings do not fit a 64 KiB string region: the rest are counted, the events kept
    assert stats["dropped_string_full"] > 0
    assert stats["messages_lost"] == stats["dropped_string_full"]
    assert len(marks) == 3 + 3000
    named_unique = [s for s in strings.strings.values() if s.startswith("unique-")]
    assert 0 < len(named_unique) < 3000
    # "left.open", registered after the region filled, is the one other text that did not fit
    assert "left.open" not in strings.strings.values()
    assert len(named_unique) + stats["dropped_string_full"] == 3000 + 1


def test_target_without_the_variable_gets_a_clear_error(start_producer: Callable[..., Producer]) -> None:
    producer = start_producer("--mode", "steady", inject=False)
    producer.expect_line("ready")
    with pytest.raises(NvtxUnavailable) as info:
        NvtxCollector(producer.pid, sink=Capture())
    message = str(info.value)
    assert "NVTX_INJECTION64_PATH" in message and "agent nvtx-env" in message and str(producer.pid) in message
    assert "\n" not in message
    assert not ring_path(producer.pid, directory=producer.ring_dir).exists()


def test_no_such_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(NoSuchProcess):
        NvtxCollector(proc.pid, sink=Capture())


def test_killed_producer_is_drained_and_its_file_removed(start_producer: Callable[..., Producer]) -> None:
    """SIGKILL skips the library's exit handler: the agent notices the dead pid, drains what was
    committed, counts the open ranges, and removes the stale file."""
    producer = start_producer("--mode", "steady")
    producer.expect_line("ready")
    producer.expect_line("steady")
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    path = ring_path(producer.pid, directory=producer.ring_dir)
    try:
        deadline = time.monotonic() + WAIT_S
        while collector.stats()["records_received"] < 100:
            assert time.monotonic() < deadline
            collector.poll(time.monotonic_ns())
            time.sleep(0.002)
        os.killpg(producer.pid, signal.SIGKILL)
        producer.proc.wait(timeout=10)
        assert path.exists()  # no exit handler ran
        drain_until_finished(collector)
        stats = collector.stats()
    finally:
        collector.close()
    assert not path.exists()
    assert stats["finished"] == 1
    assert stats["ranges_completed"] > 0
    assert stats["ranges_open_at_exit"] <= 2  # whatever was open at the kill, counted


def test_stale_rings_of_dead_processes_are_removed(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / f"moescope-nvtx.{proc.pid}"
    stale.write_bytes(b"\0" * 64)
    half = tmp_path / f"moescope-nvtx.{proc.pid}.tmp"
    half.write_bytes(b"")
    alive = tmp_path / f"moescope-nvtx.{os.getpid()}"
    alive.write_bytes(b"")
    assert cleanup_stale_rings(directory=tmp_path) == 2
    assert not stale.exists() and not half.exists() and alive.exists()


def test_nvtx_env_prints_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["nvtx-env"]) == 0
    out = capsys.readouterr().out
    assert out == f"NVTX_INJECTION64_PATH={injection_library_path()}\n"
    assert Path(out.strip().split("=", 1)[1]).is_absolute()


def test_forked_child_gets_its_own_ring_with_the_parents_strings(start_producer: Callable[..., Producer]) -> None:
    producer = start_producer("--mode", "fork")
    producer.expect_line("ready")
    parent_capture = Capture()
    parent = NvtxCollector(producer.pid, sink=parent_capture, directory=producer.ring_dir)
    child_capture = Capture()
    child = None
    try:
        producer.go()
        assert producer.proc.stdout is not None
        line = producer.proc.stdout.readline().split()
        assert line[0] == "child"
        child_pid = int(line[1])
        child = NvtxCollector(child_pid, sink=child_capture, directory=producer.ring_dir)
        deadline = time.monotonic() + WAIT_S
        while not child.attached:  # the child creates its ring in its fork handler
            assert time.monotonic() < deadline
            child.poll(time.monotonic_ns())
            time.sleep(0.005)
        Path(str(producer.log_path) + ".go").touch()
        drain_until_finished(child)
        producer.expect_line("done")
        drain_until_finished(parent)
        assert producer.wait() == 0
    finally:
        parent.close()
        if child is not None:
            child.close()
    assert producer.log()["child_status"] == 0
    ranges = child_capture.ranges()
    assert len(ranges) == 1 and child.strings.name(int(ranges["string_id"][0])) == "before.fork"
    assert int(ranges["tid"][0]) == child_pid
    marks = child_capture.marks()
    assert [child.strings.name(int(s)) for s in marks["string_id"]] == ["in.child"]
    assert marks["parent_uid"][0] == ranges["uid"][0]
    # the parent's ring saw its own range only (before the fork), nothing from the child
    names = parent.strings.names(parent_capture.ranges()["string_id"]).tolist()
    assert names == ["before.fork"] and len(parent_capture.marks()) == 0
    assert child.stats()["unknown_string_id"] == 0
    assert not ring_path(child_pid, directory=producer.ring_dir).exists()  # died without its handler


def test_unusable_ring_directory_leaves_the_host_running(
    start_producer: Callable[..., Producer], tmp_path: Path
) -> None:
    """The library cannot create its file: it says so once and declines the injection (NVTX then
    runs with no tool); the serving process carries on."""
    producer = start_producer("--mode", "flood", "--threads", "2", "--count", "6000",
                              extra_env={"MOESCOPE_NVTX_DIR": str(tmp_path / "missing" / "dir")})
    producer.expect_line("ready")
    producer.go()
    producer.expect_line("done")
    assert producer.wait() == 0
    assert producer.log()["emitted"] == 2 * 6000
    assert not (tmp_path / "missing").exists()


def test_a_zombie_target_is_no_such_process() -> None:
    """/proc/PID/environ of a zombie answers ESRCH (ProcessLookupError), not ENOENT: the agent
    must read it as a vanished target, never raise it (it exited 1 where it should report 8)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(200):  # bounded: until it is a zombie (exited, not reaped)
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        with pytest.raises(NoSuchProcess):
            NvtxCollector._find_directory(child.pid)
    finally:
        child.wait()
