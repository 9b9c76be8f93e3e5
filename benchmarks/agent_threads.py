"""Where the agent's CPU goes at the reference load, by thread: idle beside the runtime, then loaded.

The agent's threads carry OS names (moescope.procfs.name_thread: `ms-policy`, `ms-export-file`,
`ms-state`, `ms-host`, ...; the main loop is `main`), so /proc/PID/task/TID/stat tells the parts
apart without a profiler attached. Each run: a fresh reference runtime (NVTX injection on, rings on
tmpfs), `agent start --pid` with e2e_overhead's arguments (every probe, traces to OTLP-JSON files,
/metrics, policy in --dry-run), then every thread's CPU over `--idle-s` with no load and over
`--duration-s` of the load generator (balanced, 8 clients) after a 3 s warm-up. Medians over
`--runs`, per thread as % of one core and, loaded, as ms of CPU per request.

    sudo .venv/bin/python -m benchmarks.agent_threads [--runs 3] [--idle-s 10] [--duration-s 15]

Writes bench-results/agent_threads.json. Exit status: 0 done, 2 bad options, 4 a run could not be
carried out (the runtime or the agent did not come up, or a request failed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from benchmarks.agent_ab import CONCURRENCY, WARMUP_S, agent_beside_runtime
from benchmarks.common import REPO, write_result
from benchmarks.e2e_overhead import BenchError, run_loadgen
from moescope.procfs import task_cpu_by_name

ByThread = dict[str, float]
BAR_MS_PER_REQUEST = 0.5  # the agent's CPU per request at the reference load (issue 15; e2e_overhead's bar)


def _pct(before: ByThread, after: ByThread, seconds: float) -> ByThread:
    return {name: 100.0 * (cpu_s - before.get(name, 0.0)) / seconds for name, cpu_s in after.items()}


def one_run(*, idle_s: float, duration_s: float) -> dict[str, Any]:
    with agent_beside_runtime(REPO, name="agent-threads") as (runtime, proc):
        before, t0 = task_cpu_by_name(proc.pid), time.monotonic()
        time.sleep(idle_s)
        idle = _pct(before, task_cpu_by_name(proc.pid), time.monotonic() - t0)
        run_loadgen(runtime.port, duration_s=WARMUP_S, concurrency=CONCURRENCY, out=None)
        before, t0 = task_cpu_by_name(proc.pid), time.monotonic()
        load = run_loadgen(runtime.port, duration_s=duration_s, concurrency=CONCURRENCY, out=None)
        loaded = _pct(before, task_cpu_by_name(proc.pid), time.monotonic() - t0)
    if int(load["failures"]):
        raise BenchError(f"the load generator saw {load['failures']} failed requests")
    return {"idle_pct_of_core": idle, "loaded_pct_of_core": loaded, "throughput_rps": float(load["throughput_rps"])}


def _medians(runs: list[dict[str, Any]], key: str) -> ByThread:
    names = sorted({name for run in runs for name in run[key]})
    return {name: statistics.median(run[key].get(name, 0.0) for run in runs) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs, each with a fresh runtime and agent (default 3)")
    parser.add_argument("--idle-s", type=float, default=10.0, help="the idle window per run (default 10)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="the loaded window per run (default 15)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.idle_s <= 0 or args.duration_s <= 0:
        print("agent_threads: error: --runs, --idle-s and --duration-s must be positive", file=sys.stderr)
        return 2
    runs = []
    try:
        for i in range(args.runs):
            run = one_run(idle_s=args.idle_s, duration_s=args.duration_s)
            runs.append(run)
            print(f"agent_threads: run {i + 1}/{args.runs}: {run['throughput_rps']:.1f} req/s, agent "
                  f"{sum(run['idle_pct_of_core'].values()):.2f} % of a core idle, "
                  f"{sum(run['loaded_pct_of_core'].values()):.2f} % loaded", flush=True)
    except BenchError as exc:
        print(f"agent_threads: error: {exc}", file=sys.stderr)
        return 4
    idle, loaded = _medians(runs, "idle_pct_of_core"), _medians(runs, "loaded_pct_of_core")
    rps = statistics.median(run["throughput_rps"] for run in runs)
    # % of a core at R requests/s is 10 * pct / R ms of CPU per request
    per_request = {name: 10.0 * pct / rps for name, pct in loaded.items()} if rps > 0 else {}
    print(f"agent_threads: medians of {args.runs} runs, {rps:.1f} req/s loaded:")
    print(f"  {'thread':<16} {'idle %':>8} {'loaded %':>9} {'ms/request':>11}")
    for name in sorted(loaded, key=lambda n: -loaded[n]):
        print(f"  {name:<16} {idle.get(name, 0.0):8.2f} {loaded[name]:9.2f} {per_request.get(name, 0.0):11.3f}")
    # the whole agent: the median of each run's sum (not the sum of the threads' medians)
    idle_all = statistics.median(sum(run["idle_pct_of_core"].values()) for run in runs)
    loaded_all = statistics.median(sum(run["loaded_pct_of_core"].values()) for run in runs)
    all_per_request = 10.0 * loaded_all / rps if rps > 0 else 0.0
    print(f"  {'whole agent':<16} {idle_all:8.2f} {loaded_all:9.2f} {all_per_request:11.3f}")
    path = write_result("agent_threads", {
        "runs": runs, "idle_s": args.idle_s, "duration_s": args.duration_s, "throughput_rps": rps,
        "idle_pct_of_core": idle, "loaded_pct_of_core": loaded, "loaded_ms_per_request": per_request,
        "agent_idle_pct_of_core": idle_all, "agent_loaded_pct_of_core": loaded_all,
        "agent_loaded_ms_per_request": all_per_request, "bar_ms_per_request": BAR_MS_PER_REQUEST,
        "bar_met": 0 < all_per_request <= BAR_MS_PER_REQUEST,
    })
    print(f"agent_threads: -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
