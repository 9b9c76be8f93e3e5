"""CPU of one /metrics scrape in the live agent, at the reference load and at DeepSeek-V3 shape with
eight producers, A/B between two checkouts of the agent.

A scrape runs the agent's refresh hooks (held-back metrics written, its own CPU and threads read)
and writes the exposition; Prometheus does it every 15 s by default, a dashboard at 1–5 s. Shapes:

  reference     `agent start --pid` beside the reference runtime (benchmarks.agent_ab's agent:
                e2e_overhead's arguments), after 4 s of the load generator; the load is stopped
                while scrapes are measured, so what is measured is the scrape
  deepseek-v3   the agent `benchmarks.moe_scale` starts beside its eight Python producers
                (`--shape deepseek-v3 --convention v2-compact --vectors held --producers 8
                --steps-per-s 25`: the issue-15 bar's configuration), measured 12 s into the run

For each arm: the exposition's lines and bytes, then `--windows` windows of `--scrapes` scrapes
back to back, each against a quiet window of the same length just before it (the agent's own CPU
then): ms of agent CPU a scrape = (scrape window - quiet window) / scrapes. Medians over windows,
then over runs (arms alternate A, B, B, A, ...). CPU from /proc/PID/stat: the per-request server
threads come and go, and a process's total keeps theirs.

    sudo .venv/bin/python -m benchmarks.metrics_scrape [--shapes reference deepseek-v3] [--runs 2]
    sudo .venv/bin/python -m benchmarks.metrics_scrape --baseline-tree /work/base   # A = that tree

A baseline tree as for benchmarks.agent_ab (its docstring: `git worktree add`, native libraries
copied in, its own compiled build). Writes bench-results/metrics_scrape.json. Exit status: 0 done,
2 bad options, 4 a run could not be carried out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.agent_ab import agent_beside_runtime
from benchmarks.common import REPO, write_result
from benchmarks.e2e_overhead import BenchError, cpu_s, run_loadgen, stop_group
from moescope import procfs

SHAPES = ("reference", "deepseek-v3")
LOAD_S = 4.0  # reference: load before measuring, so every family has its series
DEEPSEEK_SETTLE_S = 12.0  # deepseek-v3: into the run before measuring (every rank's series made)
DEEPSEEK_RUN_S = 30  # the moe_scale run's length: past the measurement, which is then waited out
DEEPSEEK_END_S = 300.0  # (its producers and agent are its own children's sessions: it stops them)
AGENT_FIND_S = 120.0
MOE_SCALE_ARGS = ("--shape", "deepseek-v3", "--convention", "v2-compact", "--vectors", "held", "--producer", "python",
                  "--producers", "8", "--steps-per-s", "25", "--rounds", "1")


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return bytes(resp.read())


def measure(pid: int, port: int, *, scrapes: int, windows: int) -> dict[str, Any]:
    """The exposition's size and the agent's CPU a scrape (median over windows)."""
    body = _scrape(port)
    per_scrape = []
    for _ in range(windows):
        t0, c0 = time.monotonic(), cpu_s(pid)
        for _ in range(scrapes):
            _scrape(port)
        busy_s, busy_cpu = time.monotonic() - t0, cpu_s(pid) - c0
        t0, c0 = time.monotonic(), cpu_s(pid)
        time.sleep(busy_s)
        quiet_cpu = (cpu_s(pid) - c0) * busy_s / max(time.monotonic() - t0, 1e-9)
        per_scrape.append(1000.0 * (busy_cpu - quiet_cpu) / scrapes)
    return {"lines": body.count(b"\n"), "bytes": len(body), "ms_per_scrape": statistics.median(per_scrape),
            "ms_per_scrape_windows": per_scrape}


def _metrics_port(argv: list[str]) -> int | None:
    """The `--metrics-port` an agent was started with (None: none on its command line)."""
    if "--metrics-port" not in argv:
        return None
    return int(argv[argv.index("--metrics-port") + 1])


def _agent_under(root_pid: int) -> tuple[int, int] | None:
    """(pid, metrics port) of an `agent` process descending from root_pid, if one is up."""
    parents: dict[int, int] = {}
    agents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat, argv = procfs.read_stat(int(entry)), procfs.read_cmdline(int(entry))
        if stat is None or argv is None:
            continue
        parents[stat.pid] = stat.ppid
        port = _metrics_port(argv) if "moescope.agent" in argv else None
        if port is not None:
            agents[stat.pid] = port
    for pid, port in agents.items():
        up, hops = pid, 0
        while up in parents and hops < 16:
            up, hops = parents[up], hops + 1
            if up == root_pid:
                return pid, port
    return None


def run_reference(tree: Path, *, scrapes: int, windows: int) -> dict[str, Any]:
    with agent_beside_runtime(tree, name="scrape") as (runtime, proc, port):
        load = run_loadgen(runtime.port, duration_s=LOAD_S, concurrency=8, out=None)
        if int(load["failures"]):
            raise BenchError(f"the load generator saw {load['failures']} failed requests")
        return measure(proc.pid, port, scrapes=scrapes, windows=windows)


def run_deepseek(tree: Path, *, scrapes: int, windows: int) -> dict[str, Any]:
    bench = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.moe_scale", *MOE_SCALE_ARGS, "--duration-s", str(DEEPSEEK_RUN_S),
         "--json-out", os.devnull],
        cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + AGENT_FIND_S
        found = None
        while found is None and time.monotonic() < deadline and bench.poll() is None:
            found = _agent_under(bench.pid)
            time.sleep(0.2)
        if found is None:
            raise BenchError(f"moe_scale from {tree} started no agent within {AGENT_FIND_S:.0f} s")
        time.sleep(DEEPSEEK_SETTLE_S)
        got = measure(*found, scrapes=scrapes, windows=windows)
        bench.wait(timeout=DEEPSEEK_END_S)
        return got
    finally:
        stop_group(bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics_scrape",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help="default: both")
    parser.add_argument("--runs", type=int, default=2, help="runs per arm and shape (default 2)")
    parser.add_argument("--scrapes", type=int, default=50,
                        help="scrapes per window (default 50: CPU is read in 10 ms ticks)")
    parser.add_argument("--windows", type=int, default=3, help="windows per run (default 3)")
    parser.add_argument("--baseline-tree", type=Path, help="A: another checkout of the agent (default: none, B only)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.scrapes < 1 or args.windows < 1:
        parser.error("--runs, --scrapes and --windows must be at least 1")
    if args.baseline_tree is not None and not (args.baseline_tree / "agent").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree}: not a checkout of moescope (no agent/)")
    arms = {"B": REPO} if args.baseline_tree is None else {"A": args.baseline_tree.resolve(), "B": REPO}
    results: dict[str, Any] = {}
    try:
        for shape in args.shapes:
            run = run_reference if shape == "reference" else run_deepseek
            by_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
            for i in range(args.runs):
                order = list(arms) if i % 2 == 0 else list(reversed(arms))
                for arm in order:
                    got = run(arms[arm], scrapes=args.scrapes, windows=args.windows)
                    by_arm[arm].append(got)
                    print(f"{shape} {arm}: {got['ms_per_scrape']:.2f} ms a scrape, {got['lines']} lines, "
                          f"{got['bytes'] / 1e3:.0f} kB", flush=True)
            summary: dict[str, Any] = {"runs": by_arm}
            for arm, runs in by_arm.items():
                summary[f"{arm}_ms_per_scrape"] = statistics.median(r["ms_per_scrape"] for r in runs)
                summary[f"{arm}_lines"] = runs[-1]["lines"]
                summary[f"{arm}_bytes"] = runs[-1]["bytes"]
            if "A" in arms:
                summary["B_over_A"] = summary["B_ms_per_scrape"] / summary["A_ms_per_scrape"]
                print(f"{shape}: A {summary['A_ms_per_scrape']:.2f} -> B {summary['B_ms_per_scrape']:.2f} ms a "
                      f"scrape (B/A {summary['B_over_A']:.3f}); lines {summary['A_lines']} -> {summary['B_lines']}")
            results[shape] = summary
    except BenchError as exc:
        print(f"metrics_scrape: {exc}", file=sys.stderr)
        return 4
    path = write_result("metrics_scrape", {"trees": {arm: str(tree) for arm, tree in arms.items()}, "shapes": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
