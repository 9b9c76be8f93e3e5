"""The agent's cost to the serving process, on one runtime: the runtime's CPU per request with the
agent attached and without it, alternated window by window on the same process.

e2e_overhead starts a fresh runtime per run, and a fresh reference runtime's own CPU per request
spreads by about +-10 % from one process to the next (allocator, thread placement, batching
state), so its five rounds cannot resolve the 1 % bar on host CPU per request. Here one runtime
serves every window: A = no agent, B = `agent start --pid` with e2e_overhead's arguments (every
probe, traces to OTLP-JSON files, /metrics, policy in --dry-run). Windows alternate A B, B A, ...
so drift hits both sides equally; each pair gives one ratio B/A, and the result is the median of
those ratios (and the ratio of the medians).

The runtime starts with the NVTX injection variable set (`agent nvtx-env`) in both arms, as in
e2e_overhead's off arm: B - A is what attaching the agent costs the runtime (ring writes, the
kernel probes' time in its syscalls, the policy's `stats` calls, contention for the two cores),
not what the injection library's idle path costs (that is e2e_overhead's off vs bare). Between
windows the agent is stopped with SIGINT (it detaches from the NVTX ring, the producer goes back
to its idle path) and the runtime is left `--settle-s` seconds before the next window.

    sudo .venv/bin/python -m benchmarks.host_ab [--pairs 8] [--duration-s 15] [--concurrency 8]

Writes bench-results/host_ab.json. Exit status: 0 the bar met (median pair ratio <= 1.01), 1 missed
(numbers still written), 2 bad options, 3 not root, 4 a run could not be carried out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ABResult, Metrics, write_result
from benchmarks.e2e_overhead import (
    Agent,
    BenchError,
    cpu_s,
    run_loadgen,
    start_agent,
    start_runtime,
    stop_agent,
    stop_group,
)

BAR_HOST_CPU_RATIO = 1.01


def window(runtime: Any, *, agent: Agent | None, duration_s: float, concurrency: int) -> Metrics:
    """One measured window of closed-loop load: the runtime's CPU per request (and the agent's)."""
    rt0 = cpu_s(runtime.proc.pid)
    agent0 = cpu_s(agent.proc.pid) if agent is not None else 0.0
    t0 = time.monotonic()
    load = run_loadgen(runtime.port, duration_s=duration_s, concurrency=concurrency, out=None)
    window_s = time.monotonic() - t0
    rt = cpu_s(runtime.proc.pid) - rt0
    if int(load["failures"]):
        raise BenchError(f"the load generator saw {load['failures']} failed requests")
    ok = max(1, int(load["requests"]))
    metrics: Metrics = {
        "runtime_cpu_ms_per_request": 1000.0 * rt / ok,
        "runtime_cpu_pct_of_core": 100.0 * rt / window_s,
        "throughput_rps": float(load["throughput_rps"]),
        "p99_ms": float(load["latency_ms"]["p99"]),
        "requests_per_step": float(load["requests"]) / max(1, int(load.get("server", {}).get("steps", 0))),
    }
    if agent is not None:
        spent = cpu_s(agent.proc.pid) - agent0
        metrics["agent_cpu_ms_per_request"] = 1000.0 * spent / ok
        metrics["agent_cpu_pct_of_core"] = 100.0 * spent / window_s
    return metrics


def measure(args: argparse.Namespace, workdir: Path) -> tuple[ABResult, list[float]]:
    runtime = start_runtime(workdir, inject=True, name="host-ab")
    result = ABResult()
    try:
        run_loadgen(runtime.port, duration_s=args.warmup_s, concurrency=args.concurrency, out=None)
        for index in range(args.pairs):
            for side in ("a", "b") if index % 2 == 0 else ("b", "a"):
                agent = start_agent(runtime, workdir, name=f"b{index}") if side == "b" else None
                try:
                    # the same short warm-up before both sides: the agent's first round, batching settling
                    run_loadgen(runtime.port, duration_s=args.settle_s, concurrency=args.concurrency, out=None)
                    metrics = window(runtime, agent=agent, duration_s=args.duration_s,
                                     concurrency=args.concurrency)
                finally:
                    if agent is not None:
                        stop_agent(agent)
                getattr(result, side).append(metrics)
                extra = (f", agent {metrics['agent_cpu_ms_per_request']:.2f} ms/request"
                         if side == "b" else "")
                print(f"host_ab: pair {index + 1}/{args.pairs} {'B (agent)' if side == 'b' else 'A (none) '}: "
                      f"{metrics['throughput_rps']:.1f} req/s, runtime {metrics['runtime_cpu_ms_per_request']:.2f} "
                      f"CPU ms/request{extra}", flush=True)
                time.sleep(args.settle_s)
    finally:
        stop_group(runtime.proc)
    ratios = [b["runtime_cpu_ms_per_request"] / a["runtime_cpu_ms_per_request"]
              for a, b in zip(result.a, result.b, strict=True)]
    return result, ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="A/B window pairs (default 8)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured load per window (default 15)")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="unmeasured load once, at the start")
    parser.add_argument("--settle-s", type=float, default=2.0,
                        help="unmeasured load before each window, and a pause after it (default 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop load generator clients")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.duration_s <= 0 or args.warmup_s < 0 or args.settle_s < 0 or args.concurrency < 1:
        print("host_ab: error: --pairs and --concurrency must be >= 1, --duration-s > 0, "
              "--warmup-s and --settle-s >= 0", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("host_ab: error: needs root (the agent loads eBPF programs)", file=sys.stderr)
        return 3
    try:
        with tempfile.TemporaryDirectory(prefix="moescope-host-ab-") as work, \
                tempfile.TemporaryDirectory(prefix="moescope-host-ab-rings-", dir="/dev/shm") as rings:
            workdir = Path(work)
            (workdir / "rings").symlink_to(rings)  # rings on tmpfs, as in e2e_overhead
            result, ratios = measure(args, workdir)
    except BenchError as exc:
        print(f"host_ab: error: {exc}", file=sys.stderr)
        return 4
    median_ratio = statistics.median(ratios)
    met = median_ratio <= BAR_HOST_CPU_RATIO
    summary: dict[str, Any] = result.to_dict()
    path = write_result("host_ab", {
        "pairs": args.pairs, "duration_s": args.duration_s, "concurrency": args.concurrency,
        "pair_ratios_runtime_cpu_ms_per_request": ratios,
        "median_pair_ratio_runtime_cpu_ms_per_request": median_ratio,
        "bar_runtime_cpu_ratio": BAR_HOST_CPU_RATIO, "bar_met": met, **summary,
    })
    print(f"host_ab: runtime CPU per request, pair ratios B/A: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"host_ab: median pair ratio {median_ratio:.3f}, ratio of medians "
          f"{result.ratio('runtime_cpu_ms_per_request'):.3f} (bar <= {BAR_HOST_CPU_RATIO}: "
          f"{'met' if met else 'missed'}); throughput B/A {result.ratio('throughput_rps'):.3f}; "
          f"agent {result.median('b', 'agent_cpu_ms_per_request'):.2f} CPU ms/request")
    print(f"host_ab: -> {path}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
