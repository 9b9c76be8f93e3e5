"""NVTX capture overhead and drain rate (DESIGN.md bars: <= +100 ns per range over no tool with the
agent attached; >= 1M events/s drained with 0 drops).

Cost per push+pop, measured in fresh producer processes, configurations alternated A/B/C within
each round (the machine is shared and noisy), medians reported:
  none      no NVTX tool (NVTX_INJECTION64_PATH unset)
  idle      moescope's injection library loaded, no agent attached
  attached  library loaded and an NvtxCollector attached and draining (in this process)
from Python (`nvtx` package, Domain API with reused attributes) and from C (the function-pointer
call NVTX's generated code makes; benchmarks/nvtx_cdriver.c).

Drain rate: a C producer emits at a paced rate into the default ring while the collector polls
every millisecond; the highest rate of the ladder with zero drops is reported, with the
collector's processing throughput (records per second of time spent inside poll()).

    .venv/bin/python -m benchmarks.nvtx_overhead            # JSON to bench-results/nvtx_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moescope.collectors.nvtx import NvtxBatch, NvtxCollector, injection_env  # noqa: E402

PY_PRODUCER = """\
import json, sys, time
import nvtx
n = int(sys.argv[1])
d = nvtx.get_domain("bench")
attrs = d.get_event_attributes(message="bench.range", payload=42)
push, pop = d.push_range, d.pop_range
print("ready", flush=True)
sys.stdin.readline()
for _ in range(20000):
    push(attrs); pop()
c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
for _ in range(n):
    push(attrs); pop()
t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
print(json.dumps({"ns_per_pushpop": (t1 - t0) / n, "cpu_ns_per_pushpop": (c1 - c0) / n, "iterations": n}),
      flush=True)
"""

# One mark per iteration with a 256 x int32 numpy payload (the nvtx package sends it through the
# payload extension); reported in the same keys as push+pop, per mark.
PY_EXT_PRODUCER = """\
import json, sys, time
import numpy as np
import nvtx
n = int(sys.argv[1])
d = nvtx.get_domain("bench")
attrs = d.get_event_attributes(message="bench.ext", payload=np.arange(256, dtype=np.int32))
mark = d.mark
print("ready", flush=True)
sys.stdin.readline()
for _ in range(2000):
    mark(attrs)
c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
for _ in range(n):
    mark(attrs)
t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
print(json.dumps({"ns_per_pushpop": (t1 - t0) / n, "cpu_ns_per_pushpop": (c1 - c0) / n, "iterations": n}),
      flush=True)
"""
# A blob region that holds a whole EXT run (1048 bytes per event), so "attached" measures the copy
# path, not the blob-full drop path.
EXT_BLOB_BYTES = 1 << 27

CONFIGS: tuple[str, ...] = ("none", "idle", "attached")
# The push+pop loops emit faster than any agent drains (10M+ events/s from C); a ring that holds a
# whole run makes "attached" measure the producer's write path with zero drops while the agent
# drains concurrently, instead of measuring the (cheaper) drop path. The drain-rate ladder uses the
# default ring.
ATTACHED_RING_RECORDS = 1 << 20
POLL_SLEEP_S = 0.001
WAIT_S = 120.0


class Drainer:
    """The agent side during a run: polls a collector from a thread like the daemon loop does."""

    def __init__(self, pid: int) -> None:
        self.records = 0
        self.poll_ns = 0
        self.collector = NvtxCollector(pid, sink=self._sink)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sink(self, batch: NvtxBatch) -> None:
        self.records += len(batch.ranges) + len(batch.marks)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter_ns()
            self.collector.poll(time.monotonic_ns())
            self.poll_ns += time.perf_counter_ns() - t0
            time.sleep(POLL_SLEEP_S)

    def finish(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not self.collector.finished and time.monotonic() < deadline:
            t0 = time.perf_counter_ns()
            self.collector.poll(time.monotonic_ns())
            self.poll_ns += time.perf_counter_ns() - t0
            time.sleep(POLL_SLEEP_S)
        stats = self.collector.stats()
        self.collector.close()
        stats["poll_ns"] = self.poll_ns
        return stats


def run_producer(cmd: Sequence[str], *, config: str, ring_dir: Path, ring_records: int = 0,
                 blob_bytes: int = 0) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("NVTX_INJECTION64_PATH", None)
    env["MOESCOPE_NVTX_DIR"] = str(ring_dir)
    if config != "none":
        env.update(injection_env())
    if config == "attached" and ring_records:
        env["MOESCOPE_NVTX_RING_RECORDS"] = str(ring_records)
    if config == "attached" and blob_bytes:
        env["MOESCOPE_NVTX_BLOB_BYTES"] = str(blob_bytes)
    proc = subprocess.Popen(list(cmd), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    drainer: Drainer | None = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"producer {cmd[0]} did not start")
        if config == "attached":
            drainer = Drainer(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result: dict[str, Any] = json.loads(proc.stdout.readline())
        proc.wait(timeout=WAIT_S)
        if drainer is not None:
            stats = drainer.finish()
            result.update({k: stats[k] for k in ("records_received", "dropped_ring_full", "poll_ns",
                                                 "ext_payloads_recorded", "ext_payload_blob_full_dropped")})
        return result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def build_cdriver(out_dir: Path) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) for the C benchmark driver")
    exe = out_dir / "nvtx_cdriver"
    subprocess.run([cc, "-O2", "-std=c11", "-o", str(exe), str(REPO / "benchmarks" / "nvtx_cdriver.c"), "-ldl"],
                   check=True)
    return exe


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def pushpop_series(name: str, cmd: Sequence[str], *, rounds: int, ring_dir: Path,
                   blob_bytes: int = 0) -> dict[str, Any]:
    samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu_samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    drops: list[int] = []
    received: list[int] = []
    for r in range(rounds):
        order = CONFIGS[r % 3:] + CONFIGS[: r % 3]  # rotate so no config always runs first
        for config in order:
            result = run_producer(cmd, config=config, ring_dir=ring_dir, ring_records=ATTACHED_RING_RECORDS,
                                  blob_bytes=blob_bytes)
            samples[config].append(result["ns_per_pushpop"])
            cpu_samples[config].append(result["cpu_ns_per_pushpop"])
            if config == "attached":
                drops.append(int(result["dropped_ring_full"]) + int(result["ext_payload_blob_full_dropped"]))
                received.append(int(result["records_received"]))
        print(f"  {name} round {r + 1}/{rounds}: " + ", ".join(
            f"{c} {cpu_samples[c][-1]:.1f} ns cpu ({samples[c][-1]:.1f} wall)" for c in CONFIGS), flush=True)
    medians = {c: median(samples[c]) for c in CONFIGS}
    cpu = {c: median(cpu_samples[c]) for c in CONFIGS}
    return {
        # wall: elapsed per push+pop, includes being descheduled (the machine is shared);
        # cpu: the producer thread's CPU time per push+pop, the cost to the host. Bars use cpu.
        "samples_wall_ns": samples,
        "samples_cpu_ns": cpu_samples,
        "median_wall_ns": medians,
        "median_cpu_ns": cpu,
        "added_idle_wall_ns": medians["idle"] - medians["none"],
        "added_attached_wall_ns": medians["attached"] - medians["none"],
        "added_idle_ns": cpu["idle"] - cpu["none"],
        "added_attached_ns": cpu["attached"] - cpu["none"],
        "ratio_attached_over_none": cpu["attached"] / cpu["none"],
        "attached_dropped": drops,
        "attached_received": received,
    }


def drain_ladder(exe: Path, *, rates: Sequence[float], seconds: float, ring_dir: Path) -> dict[str, Any]:
    steps = []
    best = 0.0
    for rate in rates:
        result = run_producer([str(exe), "rate", str(rate), str(seconds)], config="attached", ring_dir=ring_dir)
        achieved = result["emitted"] / result["seconds"]
        drops = int(result["dropped_ring_full"])
        processing = result["records_received"] / (result["poll_ns"] / 1e9) if result["poll_ns"] else 0.0
        steps.append({"target_per_s": rate, "achieved_per_s": achieved, "emitted": result["emitted"],
                      "received": result["records_received"], "dropped": drops,
                      "processing_per_s": processing})
        print(f"  drain at {rate / 1e6:.2f}M/s target ({achieved / 1e6:.2f}M/s achieved): "
              f"{drops} dropped, collector processes {processing / 1e6:.2f}M records/s while polling", flush=True)
        if drops == 0 and result["records_received"] == result["emitted"]:
            best = max(best, achieved)
    return {"steps": steps, "max_rate_zero_drops_per_s": best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="A/B/C rounds per series (default 5)")
    parser.add_argument("--py-iterations", type=int, default=200_000)
    parser.add_argument("--c-iterations", type=int, default=400_000)
    parser.add_argument("--rates", default="250000,500000,1000000,2000000,4000000",
                        help="drain-rate ladder, events per second")
    parser.add_argument("--rate-seconds", type=float, default=1.0)
    parser.add_argument("--ext-iterations", type=int, default=50_000,
                        help="marks with a 256 x int32 extension payload per run (0: skip)")
    parser.add_argument("--out", default=str(REPO / "bench-results" / "nvtx_overhead.json"))
    args = parser.parse_args(argv)

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # rings live on tmpfs in production too
    with tempfile.TemporaryDirectory(prefix="moescope-bench-") as build, \
            tempfile.TemporaryDirectory(prefix="moescope-bench-rings-", dir=shm) as rings:
        ring_dir = Path(rings)
        exe = build_cdriver(Path(build))
        print("Python Domain API push+pop:", flush=True)
        py = pushpop_series("python", [sys.executable, "-c", PY_PRODUCER, str(args.py_iterations)],
                            rounds=args.rounds, ring_dir=ring_dir)
        print("C (NVTX function-pointer call) push+pop:", flush=True)
        c = pushpop_series("c", [str(exe), "pushpop", str(args.c_iterations)], rounds=args.rounds, ring_dir=ring_dir)
        py_ext = c_ext = None
        if args.ext_iterations:
            print("Python mark with a 256 x int32 numpy payload (payload extension):", flush=True)
            py_ext = pushpop_series("python-ext", [sys.executable, "-c", PY_EXT_PRODUCER, str(args.ext_iterations)],
                                    rounds=args.rounds, ring_dir=ring_dir, blob_bytes=EXT_BLOB_BYTES)
            print("C mark with a 256 x int32 extension payload:", flush=True)
            c_ext = pushpop_series("c-ext", [str(exe), "extmark", str(2 * args.ext_iterations)],
                                   rounds=args.rounds, ring_dir=ring_dir, blob_bytes=EXT_BLOB_BYTES)
        print("Drain rate (C producer, paced, default ring):", flush=True)
        drain = drain_ladder(exe, rates=[float(r) for r in args.rates.split(",")], seconds=args.rate_seconds,
                             ring_dir=ring_dir)

    bars = {
        "python_added_attached_ns_le_100": py["added_attached_ns"] <= 100.0,
        "c_added_attached_ns_le_100": c["added_attached_ns"] <= 100.0,
        "drain_ge_1M_per_s_zero_drops": drain["max_rate_zero_drops_per_s"] >= 1e6,
    }
    report = {
        "benchmark": "nvtx_overhead",
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.nvtx_overhead", *(argv or sys.argv[1:])]),
        "when_unix": time.time(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "python_pushpop": py,
        "c_pushpop": c,
        "drain": drain,
        # per mark (keys say pushpop for the series' shared shape); drops = blob full + ring full
        "python_ext_mark_256xint32": py_ext,
        "c_ext_mark_256xint32": c_ext,
        "bars": bars,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print()
    for name, series in (("python", py), ("c", c), ("py-ext", py_ext), ("c-ext", c_ext)):
        if series is None:
            continue
        m = series["median_cpu_ns"]
        w = series["median_wall_ns"]
        print(f"{name:6s} push+pop median CPU: none {m['none']:.1f} ns, idle {m['idle']:.1f} ns "
              f"(+{series['added_idle_ns']:.1f}), attached {m['attached']:.1f} ns "
              f"(+{series['added_attached_ns']:.1f}, x{series['ratio_attached_over_none']:.2f}); "
              f"wall: none {w['none']:.1f}, idle {w['idle']:.1f}, attached {w['attached']:.1f} ns; "
              f"attached drops per run {series['attached_dropped']}")
    print(f"drain: max paced rate with 0 drops {drain['max_rate_zero_drops_per_s'] / 1e6:.2f}M events/s")
    print("bars: " + ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in bars.items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
