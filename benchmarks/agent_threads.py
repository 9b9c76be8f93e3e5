"""Where the agent's CPU goes at the reference load, by thread: idle beside the runtime, then loaded.

The agent's threads carry OS names (moescope.procfs.name_thread: `ms-policy`, `ms-export-file`,
`ms-state`, `ms-host`, ...; the main loop is `main`), so /proc/PID/task/TID/schedstat tells the parts
apart without a profiler attached. Each run: a fresh reference runtime (NVTX injection on, rings on
tmpfs), `agent start --pid` with e2e_overhead's arguments (every probe, traces to OTLP-JSON files,
/metrics, policy in --dry-run), then every thread's CPU over `--idle-s` with no load and over
`--duration-s` of the load generator (balanced, 8 clients) after a 3 s warm-up. Medians over
`--runs`, per thread as % of one core and, loaded, as ms of CPU per request.

    sudo .venv/bin/python -m benchmarks.agent_threads [--runs 3] [--idle-s 10] [--duration-s 15]
    sudo .venv/bin/python -m benchmarks.agent_threads --per-step     # + the per-step / per-request split
    sudo .venv/bin/python -m benchmarks.agent_threads --parts        # + the CPU by part of each thread

--parts reads the agent's own moescope_agent_work_cpu_seconds from its /metrics at each window's
ends: the main loop's CPU by part (each source's poll with the sinks it feeds, each round hook) and
the policy thread's by part of its wake-ups (wake, signals, evaluate, peeks), in ms a second idle and
loaded (and, with --per-step, solved per step and per request like the threads).

--per-step adds a second loaded window with one client (requests alone: each its own prefill and
decode steps, where 8 clients share steps in batches), counts the steps of both windows from the
agent's own /metrics (moescope_steps_total) and solves, per thread and for the whole agent, loaded
CPU less idle CPU = a cost per step x steps/s + a cost per request x requests/s (two windows, two
unknowns): what a change to the step path or to the request path would move.

Writes bench-results/agent_threads.json. Exit status: 0 done, 2 bad options, 4 a run could not be
carried out (the runtime or the agent did not come up, or a request failed).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from typing import Any

from benchmarks.agent_ab import CONCURRENCY, WARMUP_S, agent_beside_runtime
from benchmarks.common import REPO, write_result
from benchmarks.e2e_overhead import BenchError, run_loadgen, scrape_counter, scrape_series
from moescope.procfs import task_cpu_by_name

ByThread = dict[str, float]
BAR_MS_PER_REQUEST = 0.5  # the agent's CPU per request at the reference load (issue 15; e2e_overhead's bar)


def _pct(before: ByThread, after: ByThread, seconds: float) -> ByThread:
    return {name: 100.0 * (cpu_s - before.get(name, 0.0)) / seconds for name, cpu_s in after.items()}


STEPS_METRIC = "moescope_steps_total"
WORK_METRIC = "moescope_agent_work_cpu_seconds_total"
SOLO_CONCURRENCY = 1  # --per-step's second window: requests alone, more steps each


def steps_counted(metrics_port: int) -> float:
    """The agent's moescope_steps_total, every series summed (one per producer pid)."""
    return scrape_counter(metrics_port, STEPS_METRIC)


def work_cpu_s(metrics_port: int) -> ByThread:
    """The agent's CPU seconds by part ("main nvtx", "policy signals", ...) from its /metrics."""
    out: ByThread = {}
    for labels, seconds in scrape_series(metrics_port, WORK_METRIC).items():
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[f"{named.get('thread', '?')} {named.get('part', '?')}"] = seconds
    return out


def _window(runtime: Any, proc: Any, metrics_port: int | None, *, duration_s: float,
            concurrency: int, parts: bool = False) -> dict[str, Any]:
    """Every thread's % of a core over one loaded window, its requests/s and (with a port) steps/s,
    and with ``parts`` each part's % of a core."""
    steps0 = steps_counted(metrics_port) if metrics_port is not None else math.nan
    parts0 = work_cpu_s(metrics_port) if parts and metrics_port is not None else {}
    before, t0 = task_cpu_by_name(proc.pid, precise=True), time.monotonic()
    load = run_loadgen(runtime.port, duration_s=duration_s, concurrency=concurrency, out=None)
    seconds = time.monotonic() - t0
    loaded = _pct(before, task_cpu_by_name(proc.pid, precise=True), seconds)
    steps = steps_counted(metrics_port) if metrics_port is not None else math.nan
    if int(load["failures"]):
        raise BenchError(f"the load generator saw {load['failures']} failed requests")
    window = {"pct_of_core": loaded, "throughput_rps": float(load["throughput_rps"]),
              "requests_per_s": float(load["requests"]) / seconds, "steps_per_s": (steps - steps0) / seconds}
    if parts and metrics_port is not None:
        window["parts_pct_of_core"] = _pct(parts0, work_cpu_s(metrics_port), seconds)
    return window


def one_run(*, idle_s: float, duration_s: float, per_step: bool = False, parts: bool = False) -> dict[str, Any]:
    with agent_beside_runtime(REPO, name="agent-threads") as (runtime, proc, metrics_port):
        port = metrics_port if per_step or parts else None
        parts0 = work_cpu_s(port) if parts and port is not None else {}
        before, t0 = task_cpu_by_name(proc.pid, precise=True), time.monotonic()
        time.sleep(idle_s)
        idle_window_s = time.monotonic() - t0
        idle = _pct(before, task_cpu_by_name(proc.pid, precise=True), idle_window_s)
        idle_parts = _pct(parts0, work_cpu_s(port), idle_window_s) if parts and port is not None else {}
        run_loadgen(runtime.port, duration_s=WARMUP_S, concurrency=CONCURRENCY, out=None)
        batched = _window(runtime, proc, port, duration_s=duration_s, concurrency=CONCURRENCY, parts=parts)
        solo = (_window(runtime, proc, port, duration_s=duration_s, concurrency=SOLO_CONCURRENCY, parts=parts)
                if per_step else None)
    run = {"idle_pct_of_core": idle, "loaded_pct_of_core": batched["pct_of_core"],
           "throughput_rps": batched["throughput_rps"]}
    if parts:
        run["idle_parts_pct_of_core"] = idle_parts
        run["loaded_parts_pct_of_core"] = batched["parts_pct_of_core"]
    if solo is not None:
        run["windows"] = {"batched": batched, "solo": solo}
    return run


def split_per_step(idle: float, windows: list[dict[str, Any]], thread: str | None,
                   key: str = "pct_of_core") -> tuple[float, float]:
    """(µs per step, µs per request) of one thread (None: the whole agent; with ``key`` =
    "parts_pct_of_core", one part) from two loaded windows: loaded % of a core less idle % = step
    cost x steps/s + request cost x requests/s. NaN where the two windows' step-to-request mixes
    are too alike to tell the two apart."""
    def above_idle(w: dict[str, Any]) -> float:  # CPU µs a second above idle
        pct = w[key].get(thread, 0.0) if thread is not None else sum(w[key].values())
        return 1e4 * (pct - idle)

    (s1, r1, y1), (s2, r2, y2) = ((w["steps_per_s"], w["requests_per_s"], above_idle(w)) for w in windows)
    det = s1 * r2 - s2 * r1
    if not abs(det) > 0.05 * max(s1 * r2, s2 * r1, 1e-9):
        return math.nan, math.nan
    return (y1 * r2 - y2 * r1) / det, (s1 * y2 - s2 * y1) / det


def _medians(runs: list[dict[str, Any]], key: str) -> ByThread:
    names = sorted({name for run in runs for name in run[key]})
    return {name: statistics.median(run[key].get(name, 0.0) for run in runs) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs, each with a fresh runtime and agent (default 3)")
    parser.add_argument("--idle-s", type=float, default=10.0, help="the idle window per run (default 10)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="the loaded window per run (default 15)")
    parser.add_argument("--per-step", action="store_true",
                        help="a second loaded window with one client; the loaded CPU split per step and per request")
    parser.add_argument("--parts", action="store_true",
                        help="the main loop's and the policy thread's CPU by part, from the agent's /metrics")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.idle_s <= 0 or args.duration_s <= 0:
        print("agent_threads: error: --runs, --idle-s and --duration-s must be positive", file=sys.stderr)
        return 2
    runs = []
    try:
        for i in range(args.runs):
            run = one_run(idle_s=args.idle_s, duration_s=args.duration_s, per_step=args.per_step,
                          parts=args.parts)
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
    split: dict[str, dict[str, float]] = {}
    if args.per_step:
        # per run, then the median of each figure over the runs
        threads: list[str | None] = [*sorted(loaded, key=lambda n: -loaded[n]), None]
        for thread in threads:
            solved = [split_per_step(sum(run["idle_pct_of_core"].values()) if thread is None
                                     else run["idle_pct_of_core"].get(thread, 0.0),
                                     [run["windows"]["batched"], run["windows"]["solo"]], thread) for run in runs]
            split[thread or "whole agent"] = {"us_per_step": statistics.median(p[0] for p in solved),
                                              "us_per_request": statistics.median(p[1] for p in solved)}
        w = [run["windows"] for run in runs]
        print(f"agent_threads: per step and per request (loaded CPU above idle; batched window "
              f"{statistics.median(x['batched']['steps_per_s'] for x in w):.1f} steps/s, "
              f"{statistics.median(x['batched']['requests_per_s'] for x in w):.1f} requests/s; one client "
              f"{statistics.median(x['solo']['steps_per_s'] for x in w):.1f} steps/s, "
              f"{statistics.median(x['solo']['requests_per_s'] for x in w):.1f} requests/s):")
        for label, costs in split.items():
            print(f"  {label:<16} {costs['us_per_step']:8.1f} µs a step {costs['us_per_request']:8.1f} µs a request")
    parts_out: dict[str, dict[str, float]] = {}
    if args.parts:
        idle_p, loaded_p = _medians(runs, "idle_parts_pct_of_core"), _medians(runs, "loaded_parts_pct_of_core")
        print(f"agent_threads: CPU by part (moescope_agent_work_cpu_seconds), medians of {args.runs} runs:")
        header = f"  {'part':<28} {'idle':>8} {'loaded':>8} {'µs/request':>11}"
        print(header + (f" {'µs/step*':>9} {'µs/req*':>9}" if args.per_step else ""))
        for name in sorted(loaded_p, key=lambda n: -loaded_p[n]):
            row = {"idle_ms_per_s": 10.0 * idle_p.get(name, 0.0), "loaded_ms_per_s": 10.0 * loaded_p[name],
                   "loaded_us_per_request": 1e4 * loaded_p[name] / rps if rps > 0 else math.nan}
            line = (f"  {name:<28} {row['idle_ms_per_s']:8.2f} {row['loaded_ms_per_s']:8.2f} "
                    f"{row['loaded_us_per_request']:11.1f}")
            if args.per_step:
                solved = [split_per_step(run["idle_parts_pct_of_core"].get(name, 0.0),
                                         [run["windows"]["batched"], run["windows"]["solo"]], name,
                                         key="parts_pct_of_core") for run in runs]
                row["us_per_step"] = statistics.median(p[0] for p in solved)
                row["us_per_request"] = statistics.median(p[1] for p in solved)
                line += f" {row['us_per_step']:9.1f} {row['us_per_request']:9.1f}"
            parts_out[name] = row
            print(line)
        if args.per_step:
            print("  (* loaded CPU above idle, solved per step and per request as for the threads)")
    path = write_result("agent_threads", {
        "runs": runs, "idle_s": args.idle_s, "duration_s": args.duration_s, "throughput_rps": rps,
        "idle_pct_of_core": idle, "loaded_pct_of_core": loaded, "loaded_ms_per_request": per_request,
        "agent_idle_pct_of_core": idle_all, "agent_loaded_pct_of_core": loaded_all,
        "agent_loaded_ms_per_request": all_per_request, "bar_ms_per_request": BAR_MS_PER_REQUEST,
        "bar_met": 0 < all_per_request <= BAR_MS_PER_REQUEST, "per_step_split": split, "parts": parts_out,
    })
    print(f"agent_threads: -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
