"""Cost of the NVTX instrumentation on the forward pass, measured A/B.

    python -m moescope.examples.moe_runtime.overhead [--rounds 7] [--iters 40] [--json-out FILE]

Variants, run alternately round by round (medians reported; the machine is shared and noisy):
  off        instrumentation disabled (--no-nvtx): the no-op methods are still called
  default    what the server uses: the `moe` NVTX domain, i.e. no-op when no tool is attached
  python_path NvtxInstrumentation over a do-nothing Python domain: the producer-side Python
             path (attribute updates, payload conversion, calls) with nothing behind it
  tool       (only when NVTX_INJECTION64_PATH is set) the real domain with the injected tool
Workloads: a decode step of 8 requests and a prefill step of 8 x 32 tokens (default model size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from typing import Any

import nvtx
import torch

from moescope.examples.moe_runtime.model import SequenceState
from moescope.examples.moe_runtime.runtime import Runtime, RuntimeOptions
from moescope.moe_nvtx import (
    DOMAIN_NAME,
    Instrumentation,
    NvtxInstrumentation,
    make_instrumentation,
)


def _time_step(rt: Runtime, ins: Instrumentation, *, prompts: list[list[int]], decode: bool, iters: int) -> float:
    rt.model.ins = ins
    total_ns = 0
    for _ in range(iters):
        seqs = [SequenceState() for _ in prompts]
        if decode:
            rt.model.forward(seqs, prompts)
            inputs = [[65] for _ in prompts]
        else:
            inputs = prompts
        t0 = time.perf_counter_ns()
        rt.model.forward(seqs, inputs)
        total_ns += time.perf_counter_ns() - t0
    return total_ns / iters / 1000.0


class NullDomain:
    """Accepts every call the instrumentation makes and does nothing."""

    calls = 0

    def get_registered_string(self, string: str) -> str:
        return string

    def get_event_attributes(self, message: Any = None, color: Any = None, category: Any = None,
                             payload: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(message=message, category=category, payload=payload)

    def push_range(self, attributes: Any = None) -> None:
        pass

    def pop_range(self) -> None:
        pass

    def mark(self, attributes: Any = None) -> None:
        pass


class CountingDomain(NullDomain):
    def push_range(self, attributes: Any = None) -> None:
        self.calls += 1

    def pop_range(self) -> None:
        self.calls += 1

    def mark(self, attributes: Any = None) -> None:
        self.calls += 1


def count_calls(rt: Runtime, prompts: list[list[int]]) -> int:
    """NVTX calls (push + pop + mark) in one prefill step, counted by a counting domain."""
    domain = CountingDomain()
    rt.model.ins = NvtxInstrumentation(domain=domain)
    rt.model.forward([SequenceState() for _ in prompts], prompts)
    return domain.calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moescope.examples.moe_runtime.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    rt = Runtime(RuntimeOptions(nvtx=False))
    variants: dict[str, Instrumentation] = {
        "off": Instrumentation(),
        "default": make_instrumentation(enabled=True),
        "python_path": NvtxInstrumentation(domain=NullDomain()),
    }
    if os.environ.get("NVTX_INJECTION64_PATH"):
        variants["tool"] = NvtxInstrumentation(domain=nvtx.get_domain(DOMAIN_NAME))
    prompts = [[256, *range(70 + i, 101 + i)] for i in range(8)]  # 8 x 32 tokens
    calls = count_calls(rt, prompts)
    results: dict[str, dict[str, list[float]]] = {name: {"decode_us": [], "prefill_us": []} for name in variants}
    for _name, ins in variants.items():  # warm-up
        _time_step(rt, ins, prompts=prompts, decode=True, iters=3)
    for _ in range(args.rounds):
        for name, ins in variants.items():
            results[name]["decode_us"].append(_time_step(rt, ins, prompts=prompts, decode=True, iters=args.iters))
            results[name]["prefill_us"].append(
                _time_step(rt, ins, prompts=prompts, decode=False, iters=args.iters // 4 or 1)
            )
    medians = {name: {k: round(statistics.median(v), 2) for k, v in r.items()} for name, r in results.items()}
    off = medians["off"]
    summary = {
        "benchmark": "moe_runtime.nvtx_overhead",
        "default_instrumentation_class": type(variants["default"]).__name__,
        "nvtx_calls_per_prefill_step": calls,
        "median_us": medians,
        "ratio_vs_off": {name: {k: round(m[k] / off[k], 4) for k in m} for name, m in medians.items()},
        "rounds": args.rounds, "iters": args.iters, "threads": args.threads,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
