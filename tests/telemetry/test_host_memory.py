"""collectors/host.py against fixture procfs/cgroup trees (v1, v2, unlimited, missing files) and a real child."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from telemetry_helpers import Child

from moescope.collectors.host import (
    HostCollector,
    HostSample,
    MemorySignal,
    TargetGone,
    parse_mountinfo,
    process_tree,
    read_cgroup_memory,
    read_rss_bytes,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MIB = 1 << 20
KIB = 1 << 10
HOST_TOTAL = 16777216 * KIB  # MemTotal in the fixtures' meminfo


def _collect(tree: str, pid: int, *, budget_bytes: int | None = None) -> HostSample:
    root = FIXTURES / tree
    return HostCollector(pid, proc_root=root / "proc", rootfs=root, budget_bytes=budget_bytes).collect()


def test_memory_signal_ratio() -> None:
    assert MemorySignal(3, 4, "rss", "x").ratio == 0.75


def test_v2_limit_on_own_cgroup_uses_working_set() -> None:
    sample = _collect("cgroup_v2", 101)
    assert sample.alive and sample.rss_bytes == 204800 * KIB
    cg = sample.cgroup
    assert cg is not None and cg.version == 2 and cg.path == "/limited.slice/app.scope"
    assert (cg.current_bytes, cg.max_bytes, cg.inactive_file_bytes) == (600 * MIB, 1024 * MIB, 100 * MIB)
    signal = sample.signal
    assert signal == MemorySignal(500 * MIB, 1024 * MIB, "cgroup", "cgroup v2 /limited.slice/app.scope")
    assert signal.ratio == 500 / 1024


def test_v2_unlimited_leaf_under_limited_parent_reads_the_parent() -> None:
    sample = _collect("cgroup_v2", 102)
    assert sample.cgroup is not None and sample.cgroup.path == "/parent.slice"
    assert sample.signal is not None and sample.signal.source == "cgroup"
    assert (sample.signal.used_bytes, sample.signal.total_bytes) == (1900 * MIB, 2048 * MIB)


def test_v2_unlimited_everywhere_falls_back_to_rss_over_host_ram() -> None:
    sample = _collect("cgroup_v2", 103)
    assert sample.cgroup is not None and sample.cgroup.max_bytes is None and sample.cgroup.current_bytes == 150 * MIB
    assert sample.signal == MemorySignal(102400 * KIB, HOST_TOTAL, "rss", "pid 103 RSS / host RAM")


def test_v2_missing_memory_files_is_reported_not_raised() -> None:
    sample = _collect("cgroup_v2", 104)
    assert sample.alive and sample.cgroup is None
    assert sample.cgroup_error == "cgroup v2 /nomem.scope: memory.current missing"
    assert sample.signal is not None and sample.signal.source == "rss"


def test_zombie_target_counts_as_gone() -> None:
    sample = _collect("cgroup_v2", 105)
    assert not sample.alive and sample.signal is None


def test_v1_limited_hybrid_host_prefers_the_v1_memory_controller() -> None:
    sample = _collect("cgroup_v1", 201)
    cg = sample.cgroup
    assert cg is not None and cg.version == 1 and cg.path == "/serving/a"
    assert cg.directory.endswith("cgroup_v1/sys/fs/cgroup/memory/serving/a")
    assert sample.signal == MemorySignal(256 * MIB, 512 * MIB, "cgroup", "cgroup v1 /serving/a")


def test_v1_huge_limit_means_unlimited() -> None:
    sample = _collect("cgroup_v1", 202)
    assert sample.cgroup is not None and sample.cgroup.max_bytes is None
    assert sample.signal is not None and sample.signal.source == "rss" and sample.signal.total_bytes == HOST_TOTAL


def test_v1_vanished_cgroup_directory() -> None:
    sample = _collect("cgroup_v1", 203)
    assert sample.cgroup is None and sample.cgroup_error == "cgroup v1 /gone: memory.usage_in_bytes missing"
    assert sample.signal is not None and sample.signal.source == "rss"


def test_v1_inside_a_container_with_escaped_mount_point() -> None:
    root = FIXTURES / "cgroup_v1_container"
    mounts = parse_mountinfo((root / "proc/self/mountinfo").read_text())
    assert mounts[0].mount_point == "/sys/fs/cgroup/my memory" and mounts[0].root == "/docker/c0ffee"
    cg = read_cgroup_memory(1, proc_root=root / "proc", rootfs=root)
    assert cg.directory.endswith("sys/fs/cgroup/my memory") and cg.max_bytes == 256 * MIB
    assert cg.current_bytes == 200 * MIB


def test_budget_overrides_the_cgroup() -> None:
    sample = _collect("cgroup_v2", 101, budget_bytes=400 * MIB)
    assert sample.signal == MemorySignal(204800 * KIB, 400 * MIB, "budget", "pid 101 RSS / budget")
    assert sample.signal.ratio == 200 / 400


def test_missing_target_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    root = FIXTURES / "cgroup_v2"
    collector = HostCollector(999, proc_root=root / "proc", rootfs=root)
    with caplog.at_level(logging.WARNING, logger="moescope.host"):
        samples = [collector.collect() for _ in range(3)]
    assert all(not s.alive and s.signal is None and s.rss_bytes is None for s in samples)
    assert samples[0].host_total_bytes == HOST_TOTAL
    assert len(caplog.records) == 1 and "999" in caplog.records[0].getMessage()
    with pytest.raises(TargetGone):
        read_rss_bytes(999, proc_root=root / "proc")


def test_real_child_rss_grows_when_it_allocates_and_exit_is_reported(child: Child) -> None:
    collector = HostCollector(child.pid)
    before = collector.collect()
    assert before.alive and before.rss_bytes is not None and before.signal is not None
    # On a real host the cgroup is either read or its absence explained.
    assert (before.cgroup is None) != (before.cgroup_error is None)
    assert child.ask("alloc 64") == "ok"
    after = collector.collect()
    assert after.rss_bytes is not None and after.rss_bytes - before.rss_bytes >= 60 * MIB
    assert read_rss_bytes(child.pid, source="smaps_rollup") >= after.rss_bytes - 4 * MIB
    child.proc.kill()
    child.proc.wait(timeout=30)
    gone = collector.collect()
    assert not gone.alive and gone.signal is None


def test_process_tree_of_a_real_child(child: Child) -> None:
    grandchild = int(child.ask("spawn"))
    tree = process_tree(child.pid)
    assert tree == {child.pid, grandchild}
    assert process_tree(os.getpid()) >= {os.getpid(), child.pid, grandchild}
    assert process_tree(40_000_000) == frozenset()
