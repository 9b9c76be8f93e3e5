"""collectors/host.py's per-sample reads: one /proc/PID/status read gives liveness and RSS, whole
files are read however procfs hands them over, and MemTotal is cached between refreshes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moescope.collectors import host
from moescope.collectors.host import HostCollector, TargetGone, read_live_rss_bytes, read_rss_bytes

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KIB = 1 << 10


def _status(root: Path, pid: int, text: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "status").write_text(text)


def test_live_rss_matches_the_plain_reader_and_state_letters_mean_gone(tmp_path: Path) -> None:
    _status(tmp_path, 1, "Name:\tserver\nState:\tS (sleeping)\nVmPeak:\t 9 kB\nVmRSS:\t  2048 kB\nThreads:\t3\n")
    _status(tmp_path, 2, "Name:\tgone\nState:\tX (dead)\n")
    _status(tmp_path, 3, "Name:\tkthreadd\nState:\tS (sleeping)\nThreads:\t1\n")  # no VmRSS line
    _status(tmp_path, 4, "State:\tZ (zombie)\nVmRSS:\t 5 kB")  # first line, no trailing newline
    assert read_live_rss_bytes(1, proc_root=tmp_path) == read_rss_bytes(1, proc_root=tmp_path) == 2048 * KIB
    assert read_live_rss_bytes(3, proc_root=tmp_path) == 0
    for pid in (2, 4, 5):  # dead, zombie, no such process
        with pytest.raises(TargetGone):
            read_live_rss_bytes(pid, proc_root=tmp_path)


def test_read_text_reads_past_one_chunk(tmp_path: Path) -> None:
    big = tmp_path / "big"
    text = "".join(f"line {i} é\n" for i in range(20_000))  # ~220 KB, over the 64 KiB chunk
    big.write_text(text, encoding="utf-8")
    assert host._read_text(big) == text
    with pytest.raises(FileNotFoundError):
        host._read_text(tmp_path / "absent")


def test_mem_total_is_cached_until_the_refresh_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "tree"
    shutil.copytree(FIXTURES / "cgroup_v2", root)
    collector = HostCollector(101, proc_root=root / "proc", rootfs=root)
    first = collector.collect()
    assert first.host_total_bytes == 16777216 * KIB
    (root / "proc" / "meminfo").write_text("MemTotal:       8388608 kB\nMemFree:  1 kB\n")
    assert collector.collect().host_total_bytes == 16777216 * KIB  # within the period: the cached value
    monkeypatch.setattr(host, "MOUNTS_REFRESH_NS", -1)  # every sample is past the period now
    again = collector.collect()
    assert again.host_total_bytes == 8388608 * KIB
