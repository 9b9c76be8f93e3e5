"""The agent's own CPU at the reference load, A/B between two checkouts of the agent, on one runtime.

e2e_overhead compares the runtime with and without the agent; this compares two agents beside
the same runtime (this checkout's), so a change to the agent is measured apart from the VM's
drift in the runtime's own speed. Each run: a fresh reference runtime (NVTX injection on, rings
on tmpfs), `agent start --pid` from tree A or B with e2e_overhead's arguments (every probe, traces
to OTLP-JSON files, /metrics, policy in --dry-run), then the agent's CPU over `--idle-s` with no
load and over `--duration-s` of the load generator (balanced, 8 clients) after a 3 s warm-up.
Runs alternate A/B, B/A, ...; medians and pair ratios.

    sudo .venv/bin/python -m benchmarks.agent_ab --baseline-tree /tmp/base [--tree .] [--pairs 4]

With `--otlp` both agents export OTLP/gRPC (the Jaeger route) to tests/otlp_receiver.py's receiver,
in a process of its own, instead of writing OTLP-JSON files. `--b-args '...'` gives B more `agent
start` arguments: with both trees the same checkout, what one setting costs. Each run also reads
every agent thread's time on a CPU over the loaded window (schedstat, ns): `thread_ms_per_s_main`,
`thread_ms_per_s_policy`, ... in the JSON and the printed medians, and the agent's CPU over its
runtime's in the same window (`agent_share_of_runtime_cpu_pct`, with pair ratios): per request the
agent's CPU moves with the VM's speed between runs (pair ratios of 0.92-1.29 for one change on
2026-12-06), its share of the runtime's less (0.96-1.06 for the same runs). And the pages the agent
faulted in a second over the window (`agent_minor_faults_per_s`): a count where a few % of CPU is
not resolved (agent/allocator.py's periodic trim).

A baseline tree: `git archive REV | tar -x -C /tmp/base`, with every native library copied in
(agent/native/libmoescope_health.so, collectors/nvtx_inject/libmoescope_nvtx.so, moescope/hf/libmoescope_hf.so
and the extension modules agent/export/_otlp_span*.so and moescope/_page_busy*.so: without the last two
the baseline writes spans and reads the stats page in Python, ~3.5 ms/s more on the main thread).
The hot path's mypyc build (build/compiled/) belongs to one tree: compare two trees with
MOESCOPE_COMPILED=0 in the environment (both pure Python) unless the baseline has its own build. To
give it one (both arms compiled, as the agent runs): `git worktree add /work/base REV`, the native
libraries copied in as above, then in it `PYTHONPATH=/work/base /path/to/.venv/bin/python
scripts/compile_hot.py` (~3.5 min; without PYTHONPATH the script finds this checkout's sources
through the editable install and says they are up to date). Writes
bench-results/agent_ab.json. Exit status: 0 done, 2 bad options, 4 a run could not be carried out
(the runtime or an agent did not come up, or a request failed).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.agent_cpu import Receiver
from benchmarks.common import REPO, Metrics, alternate_ab, write_result
from benchmarks.e2e_overhead import (
    START_TIMEOUT_S,
    BenchError,
    Runtime,
    agent_cpu_now,
    agent_cpu_since,
    agent_start_args,
    cpu_s,
    free_port,
    minor_faults,
    run_loadgen,
    start_runtime,
    stop_group,
)
from moescope.examples.moe_runtime.launch import LaunchError, LineReader
from moescope.procfs import task_cpu_by_name

CONCURRENCY = 8
WARMUP_S = 3.0
SETTLE_S = 2.0  # after the agent's last start-up note, before the idle window


def agent_argv(tree: Path, *args: str) -> list[str]:
    """`agent ...` with `moescope` and its folders imported from `tree` (step_path.pin_tree)."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
            f"from benchmarks.step_path import pin_tree; pin_tree(Path({str(tree)!r})); "
            "from moescope.agent.cli import entry; sys.argv[0] = 'agent'; entry()")
    return [sys.executable, "-c", code, *args]


class Beside(NamedTuple):
    """What agent_beside_runtime yields: the runtime, the agent's process and its /metrics port."""

    runtime: Runtime
    proc: subprocess.Popen[str]
    metrics_port: int


@contextmanager
def agent_beside_runtime(tree: Path, *, name: str, extra_args: tuple[str, ...] = ()) -> Iterator[Beside]:
    """A fresh reference runtime (NVTX injection on, rings on tmpfs) and `agent start --pid` from
    `tree` beside it with e2e_overhead's arguments (and `extra_args`), settled after its last
    start-up note; both stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix=f"moescope-{name}-") as work, \
            tempfile.TemporaryDirectory(prefix=f"moescope-{name}-rings-", dir="/dev/shm") as rings:
        workdir = Path(work)
        (workdir / "rings").symlink_to(rings)
        runtime = start_runtime(workdir, inject=True, name=name)
        state = workdir / "state"
        state.mkdir()
        metrics_port = free_port()
        proc = subprocess.Popen(
            agent_argv(tree, *agent_start_args(runtime, state, metrics_port), *extra_args),
            cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        err, out = LineReader(proc.stderr, keep_lines=None), LineReader(proc.stdout, keep_lines=None)
        try:
            try:
                err.wait_for("agent: policy", timeout_s=START_TIMEOUT_S)  # the last note: all attached
            except LaunchError as exc:
                raise BenchError(f"agent from {tree}: {exc}") from None
            time.sleep(SETTLE_S)
            yield Beside(runtime, proc, metrics_port)
        finally:
            stop_group(proc, sig=signal.SIGINT, timeout_s=60.0)
            err.join(10.0)
            out.join(10.0)
            stop_group(runtime.proc)


def one_run(tree: Path, *, idle_s: float, duration_s: float, extra_args: tuple[str, ...] = ()) -> Metrics:
    with agent_beside_runtime(tree, name="agent-ab", extra_args=extra_args) as (runtime, proc, _):
        cpu0, t0 = agent_cpu_now(proc.pid), time.monotonic()
        time.sleep(idle_s)
        idle = agent_cpu_since(cpu0, proc.pid) / (time.monotonic() - t0)
        run_loadgen(runtime.port, duration_s=WARMUP_S, concurrency=CONCURRENCY, out=None)
        cpu0, runtime0, t0 = agent_cpu_now(proc.pid), cpu_s(runtime.proc.pid), time.monotonic()
        threads0 = task_cpu_by_name(proc.pid, precise=True)
        faults0 = minor_faults(proc.pid)
        load = run_loadgen(runtime.port, duration_s=duration_s, concurrency=CONCURRENCY, out=None)
        window_s = time.monotonic() - t0
        faults = minor_faults(proc.pid) - faults0
        agent_s, runtime_s = agent_cpu_since(cpu0, proc.pid), cpu_s(runtime.proc.pid) - runtime0
        threads = {name: 1000.0 * (cpu - threads0.get(name, 0.0)) / window_s
                   for name, cpu in task_cpu_by_name(proc.pid, precise=True).items()}
    if int(load["failures"]):
        raise BenchError(f"the load generator saw {load['failures']} failed requests")
    ok = max(1, int(load["requests"]))
    return {
        "agent_idle_cpu_pct_of_core": 100.0 * idle,
        "agent_cpu_pct_of_core": 100.0 * agent_s / window_s,
        "agent_cpu_ms_per_request": 1000.0 * agent_s / ok,
        "runtime_cpu_ms_per_request": 1000.0 * runtime_s / ok,
        # the agent's CPU over its runtime's in the same window: steadier across runs than per request,
        # which moves with the VM's speed as much as with the agent (docs/benchmarks.md)
        "agent_share_of_runtime_cpu_pct": 100.0 * agent_s / runtime_s if runtime_s > 0 else float("nan"),
        "throughput_rps": float(load["throughput_rps"]),
        # loaded: pages the agent faulted in a second (malloc's heap grown again after a trim, fresh mmaps)
        "agent_minor_faults_per_s": faults / window_s,
        # loaded, per thread (moescope.procfs.name_thread's names), ms on a CPU a second (schedstat):
        # `thread_ms_per_s_main`, ...
        **{f"thread_ms_per_s_{name.removeprefix('ms-')}": ms for name, ms in threads.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="the agent's checkout for A")
    parser.add_argument("--tree", type=Path, default=REPO, help="the agent's checkout for B (default: this one)")
    parser.add_argument("--pairs", type=int, default=4, help="A/B pairs (default 4)")
    parser.add_argument("--idle-s", type=float, default=10.0, help="the idle window per run (default 10)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="the loaded window per run (default 15)")
    parser.add_argument("--otlp", action="store_true",
                        help="both agents export OTLP/gRPC to tests/otlp_receiver.py's receiver in its own process "
                             "(default: OTLP-JSON files, as e2e_overhead)")
    parser.add_argument("--b-args", default="", metavar="ARGS",
                        help="more `agent start` arguments for B only, one string (e.g. "
                             "'--trace-layer-spans-per-s 0' with --tree the same as --baseline-tree: "
                             "what a setting costs)")
    args = parser.parse_args(argv)
    trees = {"a": args.baseline_tree.resolve(), "b": args.tree.resolve()}
    for side, tree in trees.items():
        if not (tree / "moescope" / "__init__.py").is_file() or not (tree / "agent").is_dir():
            print(f"agent_ab: error: {side.upper()} tree {tree} is not a moescope checkout", file=sys.stderr)
            return 2
    if args.pairs < 1 or args.idle_s <= 0 or args.duration_s <= 0:
        print("agent_ab: error: --pairs, --idle-s and --duration-s must be positive", file=sys.stderr)
        return 2
    b_args = tuple(shlex.split(args.b_args))
    receiver = Receiver(REPO) if args.otlp else None
    extra = ("--otlp-endpoint", receiver.endpoint) if receiver is not None else ()
    try:
        result = alternate_ab(
            run_a=lambda: one_run(trees["a"], idle_s=args.idle_s, duration_s=args.duration_s, extra_args=extra),
            run_b=lambda: one_run(trees["b"], idle_s=args.idle_s, duration_s=args.duration_s,
                                  extra_args=extra + b_args),
            pairs=args.pairs, progress=lambda line: print(f"agent_ab: {line}", flush=True),
        )
    except BenchError as exc:
        print(f"agent_ab: error: {exc}", file=sys.stderr)
        return 4
    finally:
        if receiver is not None:
            receiver.close()
    summary: dict[str, Any] = result.to_dict()
    per_pair = [b["agent_cpu_ms_per_request"] / a["agent_cpu_ms_per_request"]
                for a, b in zip(result.a, result.b, strict=True)]
    summary["pair_ratios_agent_cpu_ms_per_request"] = per_pair
    per_pair_share = [b["agent_share_of_runtime_cpu_pct"] / a["agent_share_of_runtime_cpu_pct"]
                      for a, b in zip(result.a, result.b, strict=True)]
    summary["pair_ratios_agent_share_of_runtime_cpu"] = per_pair_share
    thread_metrics = sorted({key for run in (*result.a, *result.b) for key in run if key.startswith("thread_")})
    for run in (*result.a, *result.b):  # (a thread that came and went in one run reads 0 in the others)
        for key in thread_metrics:
            run.setdefault(key, 0.0)
    for metric in ("agent_idle_cpu_pct_of_core", "agent_cpu_pct_of_core", "agent_cpu_ms_per_request",
                   "runtime_cpu_ms_per_request", "agent_share_of_runtime_cpu_pct", "throughput_rps",
                   "agent_minor_faults_per_s", *thread_metrics):
        print(f"agent_ab: {metric}: A {result.median('a', metric):.2f}, B {result.median('b', metric):.2f} "
              f"(B/A {result.ratio(metric):.3f})")
    print(f"agent_ab: per request, pair ratios B/A: {', '.join(f'{r:.2f}' for r in per_pair)} "
          f"(median {statistics.median(per_pair):.3f}); the agent's share of its runtime's CPU, pair ratios "
          f"B/A: {', '.join(f'{r:.2f}' for r in per_pair_share)} (median {statistics.median(per_pair_share):.3f})")
    path = write_result("agent_ab", {"trees": {k: str(v) for k, v in trees.items()}, "pairs": args.pairs,
                                     "idle_s": args.idle_s, "duration_s": args.duration_s,
                                     "export": "otlp-grpc" if args.otlp else "otlp-json-files",
                                     "b_args": list(b_args), **summary})
    print(f"agent_ab: -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
