"""Helpers every benchmark shares: alternating A/B runs, medians, JSON results, building C helpers.

Runs on this machine swing by +-25 %, so a benchmark never compares single runs: it alternates
A and B (swapping the order every pair so drift hits both equally) and compares medians.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench-results"
BUILD_DIR = REPO / "build" / "bench"
# The kernel's per-program accounting (run_time_ns / run_cnt of every loaded eBPF program) is kept
# while this is 1: two clock reads a program run, so benchmarks turn it on for their window only.
BPF_STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


Metrics = dict[str, float]


@dataclass
class ABResult:
    """Per-run metrics of A (baseline) and B (treatment), in run order."""

    a: list[Metrics] = field(default_factory=list)
    b: list[Metrics] = field(default_factory=list)

    def median(self, side: str, metric: str) -> float:
        return statistics.median(run[metric] for run in getattr(self, side))

    def minimum(self, side: str, metric: str) -> float:
        """Contention on a shared machine only ever adds time, so the minimum is the least noisy."""
        return min(run[metric] for run in getattr(self, side))

    def delta(self, metric: str) -> float:
        """median(B) - median(A)."""
        return self.median("b", metric) - self.median("a", metric)

    def ratio(self, metric: str) -> float:
        """median(B) / median(A): > 1 means B costs more (NaN where A's median is 0)."""
        a = self.median("a", metric)
        return self.median("b", metric) / a if a else math.nan

    def to_dict(self) -> dict[str, Any]:
        metrics = sorted(set(self.a[0]) & set(self.b[0])) if self.a and self.b else []
        return asdict(self) | {
            "medians": {m: {"a": self.median("a", m), "b": self.median("b", m)} for m in metrics},
            "minimums": {m: {"a": self.minimum("a", m), "b": self.minimum("b", m)} for m in metrics},
            "delta": {m: self.delta(m) for m in metrics},
            "ratio": {m: self.ratio(m) for m in metrics},
        }


MIN_INTERVAL_RUNS = 5


def median_ratio_interval(a: list[float], b: list[float], *, level: float = 0.95, resamples: int = 4000,
                          seed: int = 0, min_runs: int = MIN_INTERVAL_RUNS) -> tuple[float, float]:
    """A percentile-bootstrap interval for median(b) / median(a): each arm's runs resampled with
    replacement on their own (the arms are separate processes), ``resamples`` times, seeded. It says
    whether a reading resolves its bar: an interval that straddles the bar is the machine's swing
    between runs, not a measured cost either way. (NaN, NaN) with fewer than ``min_runs`` runs an
    arm: a median's bootstrap over fewer runs is too narrow (simulated, normal runs with no
    difference: the 95 % interval missed the true ratio in 13 % of trials at 3 runs an arm, 2-4 %
    at 5, 8 and 15)."""
    if len(a) < min_runs or len(b) < min_runs or not 0.0 < level < 1.0 or resamples < 1:
        return math.nan, math.nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        base = statistics.median(rng.choices(a, k=len(a)))
        if base:
            ratios.append(statistics.median(rng.choices(b, k=len(b))) / base)
    if not ratios:
        return math.nan, math.nan
    ratios.sort()
    tail = (1.0 - level) / 2.0
    last = len(ratios) - 1
    return ratios[round(tail * last)], ratios[round((1.0 - tail) * last)]


def alternate_ab(
    *, run_a: Callable[[], Metrics], run_b: Callable[[], Metrics], pairs: int,
    progress: Callable[[str], None] | None = None,
) -> ABResult:
    """Run A and B `pairs` times each, alternating AB, BA, AB, ... Each run returns its metrics."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    result = ABResult()
    for index in range(pairs):
        order = (("a", run_a), ("b", run_b)) if index % 2 == 0 else (("b", run_b), ("a", run_a))
        for label, run in order:
            metrics = run()
            getattr(result, label).append(metrics)
            if progress is not None:
                shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
                progress(f"pair {index + 1}/{pairs} {label.upper()}: {shown}")
    return result


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write bench-results/<name>.json (latest) with host facts; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {
        "benchmark": name,
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"kernel": platform.release(), "machine": platform.machine(), "cpus": os.cpu_count()},
        **payload,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def build_c(source: Path, *, name: str) -> Path:
    """Compile a benchmark's C helper with gcc -O2 into build/bench/ (rebuilt when the source changes)."""
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    binary = BUILD_DIR / name
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(binary), str(source)], check=True)
    return binary


@contextmanager
def bpf_stats_enabled() -> Iterator[bool]:
    """kernel.bpf_stats_enabled=1 for the block, the previous value restored after; yields whether
    it could be turned on (False: not root, or a kernel without it: the run times then read 0)."""
    try:
        previous = BPF_STATS_SYSCTL.read_text().strip()
        BPF_STATS_SYSCTL.write_text("1")
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        BPF_STATS_SYSCTL.write_text(previous)


def bpf_run_time_ns(pid: int) -> int:
    """The kernel-measured run time (ns) of every eBPF program process `pid` holds a descriptor of,
    summed (/proc/PID/fdinfo of its `bpf-prog` descriptors; root reads another process's). A program
    runs in the context of whatever fired its hook (a syscall tracepoint: the thread in that syscall),
    so this CPU is charged to those threads, never to the process that loaded it. Counts only while
    kernel.bpf_stats_enabled is 1 (``bpf_stats_enabled``); 0 for a process gone or holding none."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf-prog":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                for line in info:
                    if line.startswith("run_time_ns:"):
                        total += int(line.split(":", 1)[1])
                        break
        except (OSError, ValueError):
            continue  # closed meanwhile
    return total
