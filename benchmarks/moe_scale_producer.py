"""One expert-parallel rank's NVTX load for benchmarks/moe_scale.py, written from the outside of the
project: it follows docs/nvtx-convention.md (moe/v2 or moe/v1) through the PyPI `nvtx` package
alone and imports nothing of moescope (a producer an adopter would write).

    python benchmarks/moe_scale_producer.py --layers 58 --experts 256 --top-k 8 --convention v2 \
        --steps-per-s 25 --duration-s 10 [--tokens 64] [--requests 8] [--seed 0] [--no-experts-time]

Protocol with the harness: prints one JSON line `{"ready": ..., "pid": ..., "tool": ...}` once the
domain and its strings are registered (the injection library has made its ring by then), waits for
a line on stdin, steps for --duration-s at --steps-per-s with absolute deadlines, prints one JSON
line of results, then waits for a line (or EOF) on stdin before exiting, so an agent attached to
it can drain its ring while it is still alive.

Routing: the k x tokens assignments of a step are spread over E experts by a seeded Zipf-like law
(weight 1/rank^s, ranks shuffled per layer so each layer has its own hot experts), capacity =
ceil(capacity_factor x k x tokens / E). A pool of steps is drawn before stepping; the emission
loop only reads it. Emission cost is the thread's CPU time (time.thread_time_ns) around the whole
emission block of a step, which holds nothing but the NVTX calls and the attribute sets they need.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import nvtx
from nvtx._lib.lib import DummyDomain

DOMAIN = "moe"
POOL_STEPS = 16
WAIT_FOR_EXIT_S = 300.0  # never outlive a harness that forgot us for longer than this
MESSAGES = ("moe.step", "moe.request", "moe.layer", "moe.router", "moe.routing", "moe.experts",
            "moe.experts.time", "moe.step.routing", "moe.expert.tokens", "moe.expert.dropped", "moe.expert.ffn")


class PlainAttributes:
    """Where attributes go with no NVTX tool (nvtx's DummyDomain hands out none)."""

    __slots__ = ("category", "payload")

    def __init__(self) -> None:
        self.category = 0
        self.payload: object = None


@dataclass(frozen=True)
class LayerStep:
    """One layer of one pooled step: what the router decided and what ran."""

    routing: np.ndarray  # int32[2E]: demand per expert, then over-capacity per expert
    experts_time_us: np.ndarray  # float32[E]
    processed_total: int
    tokens_marks: tuple[tuple[int, int], ...]  # (expert + 1, tokens) for demand > 0
    dropped_marks: tuple[tuple[int, int], ...]  # (expert + 1, tokens) for over capacity > 0
    ffn_ranges: tuple[tuple[int, int], ...]  # (expert + 1, tokens processed) for processed > 0


def draw_pool(*, layers: int, experts: int, top_k: int, tokens: int, zipf_s: float,
              capacity_factor: float, seed: int) -> tuple[list[list[LayerStep]], list[float]]:
    """POOL_STEPS steps of routing for every layer, and each layer's router entropy (bits)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1, dtype=np.float64) ** zipf_s
    probs = []
    entropies = []
    for _ in range(layers):
        p = rng.permutation(weights)
        p /= p.sum()
        probs.append(p)
        entropies.append(float(-(p * np.log2(p)).sum()))
    assignments = top_k * tokens
    capacity = math.ceil(capacity_factor * assignments / experts)
    pool: list[list[LayerStep]] = []
    for _ in range(POOL_STEPS):
        step = []
        for layer in range(layers):
            demand = rng.multinomial(assignments, probs[layer]).astype(np.int64)
            dropped = np.maximum(demand - capacity, 0)
            processed = demand - dropped
            time_us = (processed * 0.8).astype(np.float32)  # stand-in compute time: 0.8 us per token
            step.append(LayerStep(
                routing=np.concatenate((demand, dropped)).astype(np.int32),
                experts_time_us=time_us,
                processed_total=int(processed.sum()),
                tokens_marks=tuple((int(e) + 1, int(demand[e])) for e in np.flatnonzero(demand)),
                dropped_marks=tuple((int(e) + 1, int(dropped[e])) for e in np.flatnonzero(dropped)),
                ffn_ranges=tuple((int(e) + 1, int(processed[e])) for e in np.flatnonzero(processed)),
            ))
        pool.append(step)
    return pool, entropies


def make_emitter(*, convention: str, experts: int, tokens: int, request_keys: int, experts_time: bool,
                 entropies: list[float]) -> tuple[Callable[[list[LayerStep], int], int], bool]:
    """The per-step emission function (returns the NVTX calls it made) and whether a tool is attached."""
    domain = nvtx.get_domain(DOMAIN)
    tool = not isinstance(domain, DummyDomain)
    # Register every message once and reuse one attributes object per message (convention's cost rules).
    attrs = {m: domain.get_event_attributes(message=m) if tool else PlainAttributes() for m in MESSAGES}
    if tool:
        push, pop, mark = domain.push_range, domain.pop_range, domain.mark
    else:
        # No tool: nvtx's DummyDomain takes no attributes objects of ours; the adapters call its
        # no-op methods, so this arm measures the loop, the attribute sets and one call per event.
        def push(_attributes: object) -> None:
            domain.push_range()

        def mark(_attributes: object) -> None:
            domain.mark()

        pop = domain.pop_range
    a_step, a_req, a_layer, a_router = attrs["moe.step"], attrs["moe.request"], attrs["moe.layer"], attrs["moe.router"]
    a_routing, a_experts, a_time = attrs["moe.routing"], attrs["moe.experts"], attrs["moe.experts.time"]
    a_tok, a_drop, a_ffn = attrs["moe.expert.tokens"], attrs["moe.expert.dropped"], attrs["moe.expert.ffn"]
    a_step_routing = attrs["moe.step.routing"]
    # v2-step: the step's routing as one [L·2E] vector, as a runtime that bincounts the top-k
    # indices of every layer on the device and copies them once per step would hold it
    step_vectors: dict[int, np.ndarray] = {}
    cats = [(layer + 1, entropies[layer]) for layer in range(len(entropies))]

    def emit_v2(step: list[LayerStep], first_key: int) -> int:
        a_step.payload = tokens
        push(a_step)
        for key in range(first_key, first_key + request_keys):
            a_req.payload = key
            mark(a_req)
        for (cat, entropy), layer in zip(cats, step):
            a_layer.category = cat
            a_layer.payload = experts
            push(a_layer)
            a_router.category = cat
            a_router.payload = entropy
            push(a_router)
            a_routing.category = cat
            a_routing.payload = layer.routing
            mark(a_routing)
            pop()
            a_experts.category = cat
            a_experts.payload = layer.processed_total
            push(a_experts)
            if experts_time:
                a_time.category = cat
                a_time.payload = layer.experts_time_us
                mark(a_time)
            pop()
            pop()
        pop()
        return 2 + request_keys + len(step) * (7 if experts_time else 6)

    def emit_v2_step(step: list[LayerStep], first_key: int) -> int:
        vector = step_vectors.get(id(step))
        if vector is None:
            vector = step_vectors[id(step)] = np.concatenate([layer.routing for layer in step])
        a_step.payload = tokens
        push(a_step)
        for key in range(first_key, first_key + request_keys):
            a_req.payload = key
            mark(a_req)
        for (cat, entropy), layer in zip(cats, step):
            a_layer.category = cat
            a_layer.payload = experts
            push(a_layer)
            a_router.category = cat
            a_router.payload = entropy
            push(a_router)
            pop()
            a_experts.category = cat
            a_experts.payload = layer.processed_total
            push(a_experts)
            pop()
            pop()
        a_step_routing.payload = vector
        mark(a_step_routing)
        pop()
        return 3 + request_keys + len(step) * 6

    def emit_v1(step: list[LayerStep], first_key: int) -> int:
        a_step.payload = tokens
        push(a_step)
        for key in range(first_key, first_key + request_keys):
            a_req.payload = key
            mark(a_req)
        calls = 2 + request_keys
        for (cat, entropy), layer in zip(cats, step):
            a_layer.category = cat
            a_layer.payload = experts
            push(a_layer)
            a_router.category = cat
            a_router.payload = entropy
            push(a_router)
            for expert_cat, n in layer.tokens_marks:
                a_tok.category = expert_cat
                a_tok.payload = n
                mark(a_tok)
            for expert_cat, n in layer.dropped_marks:
                a_drop.category = expert_cat
                a_drop.payload = n
                mark(a_drop)
            pop()
            for expert_cat, n in layer.ffn_ranges:
                a_ffn.category = expert_cat
                a_ffn.payload = n
                push(a_ffn)
                pop()
            pop()
            calls += 4 + len(layer.tokens_marks) + len(layer.dropped_marks) + 2 * len(layer.ffn_ranges)
        pop()
        return calls

    emitters = {"v2": emit_v2, "v2-step": emit_v2_step, "v1": emit_v1}
    return emitters[convention], tool


def wait_line(timeout_s: float) -> None:
    """Return at a line on stdin, at EOF or after timeout_s."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if ready:
        sys.stdin.readline()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--convention", choices=("v1", "v2", "v2-step"), required=True,
                        help="v2-step: moe/v2 with the step's routing as one moe.step.routing vector")
    parser.add_argument("--steps-per-s", type=float, required=True)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per step (a decode batch)")
    parser.add_argument("--requests", type=int, default=8, help="moe.request marks per step")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="routing skew exponent")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-experts-time", dest="experts_time", action="store_false",
                        help="v2: leave out the optional moe.experts.time vector")
    args = parser.parse_args(argv)
    if min(args.layers, args.experts, args.top_k, args.tokens) < 1 or args.requests < 0 \
            or not args.steps_per_s > 0 or not args.duration_s > 0 or args.top_k > args.experts:
        print("moe_scale_producer: layers, experts, top-k, tokens >= 1, top-k <= experts, requests >= 0, "
              "steps-per-s and duration-s > 0", file=sys.stderr)
        return 2

    pool, entropies = draw_pool(layers=args.layers, experts=args.experts, top_k=args.top_k, tokens=args.tokens,
                                zipf_s=args.zipf_s, capacity_factor=args.capacity_factor, seed=args.seed)
    emit, tool = make_emitter(convention=args.convention, experts=args.experts, tokens=args.tokens,
                              request_keys=args.requests, experts_time=args.experts_time, entropies=entropies)
    print(json.dumps({"ready": True, "pid": os.getpid(), "tool": tool}), flush=True)
    wait_line(WAIT_FOR_EXIT_S)

    period_ns = int(1e9 / args.steps_per_s)
    total_steps = max(1, round(args.steps_per_s * args.duration_s))
    emission_cpu_ns: list[int] = []
    emission_wall_ns: list[int] = []
    calls = 0
    late = 0
    process_cpu0 = time.process_time_ns()
    start_ns = time.monotonic_ns()
    for index in range(total_steps):
        due_ns = start_ns + index * period_ns
        now_ns = time.monotonic_ns()
        if now_ns < due_ns:
            time.sleep((due_ns - now_ns) / 1e9)
        elif now_ns - due_ns > period_ns:
            late += 1  # more than a period behind its deadline (the host could not keep up)
        step = pool[index % POOL_STEPS]
        first_key = 1000 + (index * args.requests) % 4096
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        calls += emit(step, first_key)
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        emission_cpu_ns.append(c1 - c0)
        emission_wall_ns.append(w1 - w0)
    wall_s = (time.monotonic_ns() - start_ns) / 1e9
    process_cpu_s = (time.process_time_ns() - process_cpu0) / 1e9
    print(json.dumps({
        "pid": os.getpid(),
        "tool": tool,
        "steps_emitted": total_steps,
        "nvtx_calls": calls,
        "nvtx_calls_per_step": calls / total_steps,
        "emission_cpu_us_per_step_median": statistics.median(emission_cpu_ns) / 1e3,
        "emission_cpu_us_per_step_mean": statistics.fmean(emission_cpu_ns) / 1e3,
        "emission_wall_us_per_step_median": statistics.median(emission_wall_ns) / 1e3,
        "process_cpu_s": process_cpu_s,
        "wall_s": wall_s,
        "achieved_steps_per_s": total_steps / wall_s if wall_s else 0.0,
        "late_steps": late,
    }), flush=True)
    wait_line(WAIT_FOR_EXIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
