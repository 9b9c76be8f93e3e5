"""A producer of moe/v2 (or v1) steps through the reference runtime's instrumentation, with seeded
routing, for tests/nvtx/test_nvtx_moe_v2.py. Writes what it sent as JSON (the truth).

    python moe_v2_producer.py --log FILE --convention v2 [--routing layer|step|compact] [--hostile]
                              --steps N --layers L --experts E --seed S

Prints "ready" once the NVTX domain exists (the ring file is there), waits for "go" on stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import numpy as np

from moescope.moe_nvtx import make_instrumentation


def routing(rng: np.random.Generator, *, experts: int, tokens: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Skewed top-k assignments over E experts, and what went over a capacity (as a router does)."""
    weights = 1.0 / np.arange(1, experts + 1) ** 1.1
    weights = rng.permutation(weights / weights.sum())
    demand = rng.multinomial(tokens * top_k, weights).astype(np.int64)
    capacity = int(1.25 * tokens * top_k / experts) + 1
    dropped = np.maximum(demand - capacity, 0)
    return demand, dropped


def run(*, convention: str, routing_place: str, steps: int, layers: int, experts: int, top_k: int,
        seed: int) -> dict[str, Any]:
    ins = make_instrumentation(enabled=True, convention=convention, routing_place=routing_place)
    assert ins.active, "NVTX tool not attached"
    rng = np.random.default_rng(seed)
    truth: list[dict[str, Any]] = []
    for s in range(steps):
        tokens = 32 + s
        t0 = time.monotonic_ns()
        ins.step_push(tokens)
        ins.request_mark(9000 + s)
        step: dict[str, Any] = {"tokens": tokens, "requests": [9000 + s], "layers": [],
                                "tid": threading.get_native_id()}
        for layer in range(layers):
            demand, dropped = routing(rng, experts=experts, tokens=tokens, top_k=top_k)
            entropy = float(rng.uniform(0.5, np.log2(experts)))
            ins.layer_push(layer, experts)
            ins.router_push(layer, entropy)
            ins.routing(layer, demand, dropped)
            ins.pop()
            computed = int((demand - dropped).sum())
            ins.experts_push(layer, computed)
            loads = {int(e): 4096 * (int(e) + 1) for e in np.flatnonzero(demand)[: 1 + (s + layer) % 2]}
            time_us = np.zeros(experts, dtype=np.float32)
            for e in np.flatnonzero(demand - dropped).tolist():
                if e in loads:
                    ins.load_push(e, loads[e])
                    ins.pop()
                if ins.expert_ranges:
                    ins.ffn_push(e, int(demand[e] - dropped[e]))
                    ins.pop()
                time_us[e] = float(rng.uniform(1.0, 50.0))
            if ins.expert_times:
                ins.experts_time_mark(layer, time_us)
            ins.experts_pop()
            ins.pop()
            step["layers"].append({
                "layer": layer, "entropy": entropy, "demand": demand.tolist(), "dropped": dropped.tolist(),
                "computed": computed, "loads": loads, "time_us": time_us.tolist(),
            })
        ins.step_pop()
        step["t0"], step["t1"] = t0, time.monotonic_ns()
        truth.append(step)
    return {"convention": convention, "steps": truth}


def run_compact(*, steps: int, layers: int, experts: int, top_k: int, seed: int) -> dict[str, Any]:
    """moe/v2.2's compact form straight through the `nvtx` package: per layer only push/pop
    moe.layer; the step carries every layer's routing (moe.step.routing) and router entropy
    (moe.step.entropy). Draws the same random numbers as run() so the routing is the same."""
    import nvtx

    d = nvtx.get_domain("moe")
    rng = np.random.default_rng(seed)
    truth: list[dict[str, Any]] = []
    for s in range(steps):
        tokens = 32 + s
        t0 = time.monotonic_ns()
        d.push_range(message="moe.step", payload=tokens)
        d.mark(message="moe.request", payload=9000 + s)
        step: dict[str, Any] = {"tokens": tokens, "requests": [9000 + s], "layers": [],
                                "tid": threading.get_native_id()}
        rows, entropies = [], []
        for layer in range(layers):
            demand, dropped = routing(rng, experts=experts, tokens=tokens, top_k=top_k)
            entropy = float(rng.uniform(0.5, np.log2(experts)))
            d.push_range(message="moe.layer", category=layer + 1, payload=experts)
            d.pop_range()
            rng.uniform(1.0, 50.0, size=int(np.count_nonzero(demand - dropped)))  # run()'s expert times
            rows.append(np.concatenate((demand, dropped)).astype(np.int32))
            entropies.append(entropy)
            step["layers"].append({"layer": layer, "entropy": entropy, "demand": demand.tolist(),
                                   "dropped": dropped.tolist()})
        d.mark(message="moe.step.routing", payload=np.concatenate(rows))
        d.mark(message="moe.step.entropy", payload=np.asarray(entropies, dtype=np.float64))
        d.pop_range()
        step["t0"], step["t1"] = t0, time.monotonic_ns()
        truth.append(step)
    return {"convention": "v2", "steps": truth}


def run_hostile(*, experts: int) -> dict[str, Any]:
    """moe/v2 vectors of the wrong type or length, one per case: each must be counted, the steps kept."""
    import nvtx

    d = nvtx.get_domain("moe")
    cases = {
        "float routing": np.ones(2 * experts, dtype=np.float32),
        "short routing": np.ones(2 * experts - 1, dtype=np.int32),
        "2-D routing": np.ones((2, experts), dtype=np.int32),  # sent flat by nvtx: right length, still fine
    }
    for vector in cases.values():
        d.push_range(message="moe.step", payload=8)
        d.push_range(message="moe.layer", category=1, payload=experts)
        d.push_range(message="moe.router", category=1, payload=1.0)
        d.mark(message="moe.routing", category=1, payload=vector)
        d.pop_range()
        d.pop_range()
        d.pop_range()
    d.push_range(message="moe.step", payload=8)  # a step vector that does not add up to its layers
    d.push_range(message="moe.layer", category=1, payload=experts)
    d.push_range(message="moe.router", category=1, payload=1.0)
    d.pop_range()
    d.pop_range()
    d.mark(message="moe.step.routing", payload=np.ones(3 * experts, dtype=np.int32))
    d.pop_range()
    return {"cases": list(cases) + ["step routing of the wrong length"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--log", required=True)
    p.add_argument("--convention", choices=("v1", "v2"), required=True)
    p.add_argument("--routing", choices=("layer", "step", "compact"), default="layer")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--hostile", action="store_true", help="send malformed v2 vectors instead")
    args = p.parse_args(argv)
    make_instrumentation(enabled=True)  # the first NVTX call: the ring file exists from here
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    if args.hostile:
        result = run_hostile(experts=args.experts)
    elif args.routing == "compact":
        result = run_compact(steps=args.steps, layers=args.layers, experts=args.experts, top_k=args.top_k,
                             seed=args.seed)
    else:
        result = run(convention=args.convention, routing_place=args.routing, steps=args.steps, layers=args.layers,
                     experts=args.experts, top_k=args.top_k, seed=args.seed)
    with open(args.log, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
