"""The policy's runtime poll at production shapes: CPU per `stats` poll on the agent's side and on
the runtime's, whole stats against narrowed stats (`fields` + `placement_since`,
docs/control-protocol.md), A/B alternating on one runtime per shape.

The policy reads the runtime's stats every sample period (200 ms): queue depths for the queue
rule, and the placement (precision, residency) for spans and the live view. The whole reply grows
with layers x experts (~400 KB at Qwen3-30B-A3B's 48 x 128, ~950 KB at DeepSeek-V3's 58 x 256),
and at five polls a second building and reading it was a fifth of a core on each side. A run:
the reference runtime started at the shape (a thin model: d_model 16, the per-layer tables are
what matters here), a few requests so the counters are not all zero, then `--polls` polls of
`RuntimeStatsSignals` + `RuntimeStatsSource` (what the agent runs, with routing off as beside NVTX)
timed by the agent's thread CPU and the runtime's process CPU, alternating whole / narrowed; then
one narrowed run with requests going (busy queues: the agent's side and the reply's size; the
runtime's CPU is its serving then). A third arm, `page`, reads the runtime's stats page between
calls (moescope/stats_page.py: one `pread`, no call), idle and under load.

    .venv/bin/python -m benchmarks.stats_poll [--shapes reference,qwen3-30b-a3b,deepseek-v3] [--pairs 3]

Writes bench-results/stats_poll.json. Bar: narrowed, each side <= 2 ms a poll at every shape, idle
and (the agent's side) under load: 1 % of a core at 5 polls/s. Exit status 0 met, 1 missed, 2 bad
options, 4 a runtime did not come up.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, write_result
from benchmarks.e2e_overhead import cpu_s, stop_group
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.stats_source import NARROW_FIELDS, RuntimeStatsSignals, RuntimeStatsSource, queue_floor_for
from moescope.examples.moe_runtime.launch import LaunchError, launch, runtime_argv

SHAPES: dict[str, tuple[int, int, int]] = {  # layers, experts, top-k
    "reference": (4, 16, 2),
    "qwen3-30b-a3b": (48, 128, 8),
    "deepseek-v3": (58, 256, 8),
}
BAR_MS_PER_POLL = 2.0
# page: narrowed stats once, then the runtime's stats page (moescope/stats_page.py) between calls
MODES = ("whole", "narrowed", "page")


def poll_cost(socket_path: Path, runtime_pid: int, *, mode: str, polls: int) -> dict[str, float]:
    # the queues the default rules can act on, as `agent start` reads them
    signals = RuntimeStatsSignals(socket_path, timeout_s=30.0, use_page=mode == "page",
                                  queue_floor=queue_floor_for(load_policy().rules))
    signals.with_routing = False  # as the agent runs it beside NVTX
    if mode == "whole":
        signals.narrowed = False  # (as against a runtime that does not take narrowed stats)
    source = RuntimeStatsSource(signals, emit=lambda _state: None)
    try:
        for _ in range(3):  # connect, first placement read
            signals()
            source.poll(0)
        rt0, own0 = cpu_s(runtime_pid), time.thread_time()
        for _ in range(polls):
            signals()
            source.poll(0)
        own, rt = time.thread_time() - own0, cpu_s(runtime_pid) - rt0
        if signals.poll_errors:
            raise RuntimeError(f"{signals.poll_errors} failed polls")
        if (mode != "whole") != bool(signals.narrowed):
            raise RuntimeError(f"{mode}: the poller read narrowed={signals.narrowed}")
        if (mode == "page") != (signals.page_periods >= polls - 1):  # (a refresh may fall in the run)
            raise RuntimeError(f"{mode}: {signals.page_periods} of {polls} polls read the stats page")
        if mode == "page":
            assert signals.page is not None
            return {"agent_ms_per_poll": 1000.0 * own / polls, "runtime_ms_per_poll": 1000.0 * rt / polls,
                    "reply_bytes": float(signals.page.size)}
        assert signals._conn is not None  # noqa: SLF001 - the reply's size, once, on the poller's connection
        held = signals.last_state.placement_version if signals.last_state is not None else None
        reply = signals._conn.call("stats", {"fields": list(NARROW_FIELDS), "placement_since": held}) \
            if mode == "narrowed" else signals._conn.call("stats")  # noqa: SLF001
        return {"agent_ms_per_poll": 1000.0 * own / polls, "runtime_ms_per_poll": 1000.0 * rt / polls,
                "reply_bytes": float(len(json.dumps(reply)))}
    finally:
        signals.close()


class Load:
    """Requests one after another on a thread while it runs: the runtime's queues are busy (non-zero
    queue depths), as a poller sees them under load."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            warm(self.port, prompts=("keep the experts busy",), max_tokens=16)
            self.requests += 1

    def __enter__(self) -> Load:
        self._thread.start()
        time.sleep(1.0)  # the first step has run
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(600)


def warm(port: int, *, prompts: tuple[str, ...] = ("mixture of experts", "routing health"),
         max_tokens: int = 2) -> None:
    for prompt in prompts:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens}))
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()


def one_shape(shape: str, *, pairs: int, polls: int, workdir: Path) -> dict[str, Any]:
    layers, experts, top_k = SHAPES[shape]
    sock = workdir / f"{shape}.sock"
    argv = runtime_argv("--port", "0", "--no-nvtx", "--threads", "1", "--control-socket", str(sock),
                        "--layers", str(layers), "--experts", str(experts), "--top-k", str(top_k),
                        "--d-model", "16", "--d-ff", "32", "--n-heads", "2")
    launched = launch(argv, timeout_s=600, env=dict(os.environ), cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        warm(launched.banner.http_port)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for index in range(pairs):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                runs[mode].append(poll_cost(sock, launched.popen.pid, mode=mode, polls=polls))
        # under load: the agent's side and the reply (the runtime's CPU is mostly serving then)
        with Load(launched.banner.http_port):
            busy = {mode: poll_cost(sock, launched.popen.pid, mode=mode, polls=polls)
                    for mode in ("narrowed", "page")}
    finally:
        stop_group(launched.popen)
    out: dict[str, Any] = {"shape": shape, "layers": layers, "experts": experts, "runs": runs}
    for mode in MODES:
        for metric in ("agent_ms_per_poll", "runtime_ms_per_poll", "reply_bytes"):
            out[f"{mode}_{metric}"] = statistics.median(r[metric] for r in runs[mode])
    for mode, run in busy.items():
        out[f"{mode}_busy_agent_ms_per_poll"] = run["agent_ms_per_poll"]
        out[f"{mode}_busy_reply_bytes"] = run["reply_bytes"]
    worst = max(out["narrowed_agent_ms_per_poll"], out["narrowed_runtime_ms_per_poll"],
                out["narrowed_busy_agent_ms_per_poll"])
    out["bar_met"] = worst <= BAR_MS_PER_POLL
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--pairs", type=int, default=3, help="whole/narrowed pairs per shape (default 3)")
    parser.add_argument("--polls", type=int, default=50, help="timed polls per run (default 50)")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes or args.pairs < 1 or args.polls < 1:
        print(f"stats_poll: error: shapes must be of {', '.join(SHAPES)} (got {unknown or 'none'}); "
              "--pairs and --polls >= 1", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="mspoll-") as work:
        for shape in shapes:
            try:
                result = one_shape(shape, pairs=args.pairs, polls=args.polls, workdir=Path(work))
            except (LaunchError, RuntimeError) as exc:
                print(f"stats_poll: error: {shape}: {exc}", file=sys.stderr)
                return 4
            results.append(result)
            print(f"stats_poll: {shape} (L{result['layers']} E{result['experts']}): whole "
                  f"{result['whole_reply_bytes'] / 1e3:.0f} KB, agent {result['whole_agent_ms_per_poll']:.2f} / "
                  f"runtime {result['whole_runtime_ms_per_poll']:.2f} ms a poll; narrowed "
                  f"{result['narrowed_reply_bytes'] / 1e3:.0f} KB, agent {result['narrowed_agent_ms_per_poll']:.2f} / "
                  f"runtime {result['narrowed_runtime_ms_per_poll']:.2f} ms; under load "
                  f"{result['narrowed_busy_reply_bytes'] / 1e3:.0f} KB, agent "
                  f"{result['narrowed_busy_agent_ms_per_poll']:.2f} ms (bar {BAR_MS_PER_POLL} each: "
                  f"{'met' if result['bar_met'] else 'missed'}); "
                  f"stats page {result['page_reply_bytes'] / 1e3:.0f} KB, "
                  f"agent {result['page_agent_ms_per_poll']:.3f} / "
                  f"runtime {result['page_runtime_ms_per_poll']:.3f} ms, "
                  f"under load agent {result['page_busy_agent_ms_per_poll']:.3f} ms", flush=True)
    met = all(r["bar_met"] for r in results)
    path = write_result("stats_poll", {"pairs": args.pairs, "polls": args.polls, "bar_ms_per_poll": BAR_MS_PER_POLL,
                                       "bar_met": met, "shapes": results})
    print(f"stats_poll: -> {path}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
