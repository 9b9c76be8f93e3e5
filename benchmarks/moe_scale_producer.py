"""One expert-parallel rank's NVTX load for benchmarks/moe_scale.py, written from the outside of the
project: it follows docs/nvtx-convention.md (moe/v2, its v2.2 compact form, or moe/v1) and its
cost rules through the PyPI `nvtx` package alone and imports nothing of moescope (a producer an
adopter would write).

    python benchmarks/moe_scale_producer.py --layers 58 --experts 256 --top-k 8 --convention v2-compact \
        --steps-per-s 25 --duration-s 10 [--tokens 64] [--requests 8] [--seed 0] [--no-experts-time] \
        [--vectors set|held]

Conventions: v1 (per-expert marks), v2 (routing vector per layer), v2-step (one moe.step.routing
vector per step), v2-compact (moe/v2.2: moe.step.routing and moe.step.entropy per step, per layer
only its moe.layer range). Attributes: one object per (message, layer) made at start with its
category and constant payload; per step only changing payloads are set; calls go through the
package's module-level push_range/pop_range/mark (no keyword dict per call).

--vectors held (an experiment): each vector is a 0-d numpy array of dtype [("values", T, (n,))]
bound once to its attributes object, which the `nvtx` package then points at instead of copying
per set; the step's vectors are copied into it before the emission block (the runtime's
device-to-host copy would land there) and timed apart (vector_fill_cpu_us_per_step_median).
The package registers a static schema with one fixed-size-array field for it, which the agent's
payload decoder (collectors/nvtx.py SchemaTable.decode_array) must know to read the vectors.

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
from typing import Protocol

import numpy as np
import nvtx
from nvtx._lib.lib import DummyDomain

DOMAIN = "moe"
POOL_STEPS = 16
WAIT_FOR_EXIT_S = 300.0  # never outlive a harness that forgot us for longer than this


class Attributes(Protocol):
    """What the emitters set on an attributes object: nvtx's EventAttributes, or PlainAttributes."""

    category: int
    payload: object


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


PushFn = Callable[[Attributes, object], object]  # push(attrs, handle) and mark(attrs, handle)
PopFn = Callable[[object], object]  # pop(handle)


def nvtx_calls(domain: nvtx.Domain, tool: bool) -> tuple[PushFn, PopFn, PushFn, object]:
    """push(attrs, handle), pop(handle), mark(attrs, handle) and the handle they take.

    With a tool: the `nvtx` package's module-level functions (what its own `annotate` calls), which
    skip the empty keyword dict `Domain.push_range(attrs)` builds per call (docs/nvtx-convention.md,
    cost rules); where a package version lacks them, the Domain methods. With none: the
    DummyDomain's no-op methods, one call per event, so that arm measures the loop and the sets."""
    if tool:
        try:
            from nvtx._lib import mark as lib_mark
            from nvtx._lib import pop_range as lib_pop
            from nvtx._lib import push_range as lib_push
        except ImportError:
            lib_push = lib_pop = lib_mark = None
        handle = getattr(domain, "handle", None)
        if lib_push is not None and lib_pop is not None and lib_mark is not None and handle is not None:
            return lib_push, lib_pop, lib_mark, handle
        d_push, d_pop, d_mark = domain.push_range, domain.pop_range, domain.mark
        return (lambda a, _h: d_push(a)), (lambda _h: d_pop()), (lambda a, _h: d_mark(a)), None
    n_push, n_pop, n_mark = domain.push_range, domain.pop_range, domain.mark
    return (lambda _a, _h: n_push()), (lambda _h: n_pop()), (lambda _a, _h: n_mark()), None


class HeldVector:
    """A vector payload bound once to its attributes object (`--vectors held`): a 0-d numpy array of
    the structured dtype [("values", T, (n,))]. For a 0-d array the `nvtx` package keeps a pointer
    to the array's own bytes instead of copying them at each set (it copies every n-d array), so the
    runtime refills `values` in place (its device-to-host copy of the step's vectors lands there)
    and each event is a bare mark."""

    __slots__ = ("buffer", "values")

    def __init__(self, element: type[np.generic], length: int) -> None:
        self.buffer = np.zeros((), dtype=np.dtype([("values", element, (length,))]))
        self.values: np.ndarray = self.buffer["values"]  # a view: writes land in `buffer`


Emitter = Callable[[list[LayerStep], int], int]  # (step, first request key) -> NVTX calls made
Filler = Callable[[list[LayerStep]], None]  # held vectors: the step's vectors into their buffers


def make_emitter(*, convention: str, experts: int, tokens: int, request_keys: int, experts_time: bool,
                 entropies: list[float], held_vectors: bool = False) -> tuple[Emitter, Filler, bool]:
    """The per-step emission function, the held-vector filler (a no-op unless held_vectors) and
    whether a tool is attached."""
    domain = nvtx.get_domain(DOMAIN)
    tool = not isinstance(domain, DummyDomain)

    def attrs(message: str, *, category: int = 0, payload: object = None) -> Attributes:
        """One attributes object for `message` (convention's cost rules: register once, reuse)."""
        if tool:
            return domain.get_event_attributes(message=message, category=category or None, payload=payload)
        plain = PlainAttributes()
        plain.category, plain.payload = category, payload
        return plain

    def held(element: type[np.generic], length: int) -> HeldVector | None:
        return HeldVector(element, length) if held_vectors else None

    def vector_attrs(message: str, vector: HeldVector | None, *, category: int = 0) -> Attributes:
        return attrs(message, category=category, payload=None if vector is None else vector.buffer)

    push, pop, mark, handle = nvtx_calls(domain, tool)
    layers = len(entropies)
    # One attributes object per (message, layer), its category and constant payload (moe.layer's E)
    # set once here: per step only the payloads that change are set.
    held_routing = [held(np.int32, 2 * experts) for _ in range(layers)]
    held_time = [held(np.float32, experts) for _ in range(layers)]
    a_layer = [attrs("moe.layer", category=layer + 1, payload=experts) for layer in range(layers)]
    a_router = [attrs("moe.router", category=layer + 1) for layer in range(layers)]
    a_routing = [vector_attrs("moe.routing", held_routing[layer], category=layer + 1) for layer in range(layers)]
    a_experts = [attrs("moe.experts", category=layer + 1) for layer in range(layers)]
    a_time = [vector_attrs("moe.experts.time", held_time[layer], category=layer + 1) for layer in range(layers)]
    a_step, a_req = attrs("moe.step"), attrs("moe.request")
    a_tok, a_drop, a_ffn = attrs("moe.expert.tokens"), attrs("moe.expert.dropped"), attrs("moe.expert.ffn")
    # v2-step / v2-compact: the step's routing as one [L·2E] vector, as a runtime that bincounts the
    # top-k indices of every layer on the device and copies them once per step would hold it; the
    # step's router entropies as one float32[L] vector, copied with it
    held_step_routing, held_step_entropy = held(np.int32, layers * 2 * experts), held(np.float32, layers)
    a_step_routing = vector_attrs("moe.step.routing", held_step_routing)
    a_step_entropy = vector_attrs("moe.step.entropy", held_step_entropy)
    step_vectors: dict[int, np.ndarray] = {}
    entropy_vector = np.asarray(entropies, dtype=np.float32)
    per_layer = list(zip(a_layer, a_router, a_routing, a_experts, a_time, entropies, strict=True))
    set_vectors = not held_vectors

    def step_vector(step: list[LayerStep]) -> np.ndarray:
        vector = step_vectors.get(id(step))
        if vector is None:
            vector = step_vectors[id(step)] = np.concatenate([layer.routing for layer in step])
        return vector

    def fill(step: list[LayerStep]) -> None:
        if not held_vectors:
            return
        if convention == "v2":
            for layer, routing, times in zip(step, held_routing, held_time):
                assert routing is not None and times is not None
                routing.values[...] = layer.routing
                times.values[...] = layer.experts_time_us
        elif convention in ("v2-step", "v2-compact"):
            assert held_step_routing is not None and held_step_entropy is not None
            held_step_routing.values[...] = step_vector(step)
            held_step_entropy.values[...] = entropy_vector

    def open_step(first_key: int) -> None:
        a_step.payload = tokens
        push(a_step, handle)
        for key in range(first_key, first_key + request_keys):
            a_req.payload = key
            mark(a_req, handle)

    def emit_v2(step: list[LayerStep], first_key: int) -> int:
        open_step(first_key)
        for (lay, rtr, rtg, exp, tim, entropy), layer in zip(per_layer, step):
            push(lay, handle)
            rtr.payload = entropy
            push(rtr, handle)
            if set_vectors:
                rtg.payload = layer.routing
            mark(rtg, handle)
            pop(handle)
            exp.payload = layer.processed_total
            push(exp, handle)
            if experts_time:
                if set_vectors:
                    tim.payload = layer.experts_time_us
                mark(tim, handle)
            pop(handle)
            pop(handle)
        pop(handle)
        return 2 + request_keys + len(step) * (7 if experts_time else 6)

    def emit_v2_step(step: list[LayerStep], first_key: int) -> int:
        open_step(first_key)
        for (lay, rtr, _rtg, exp, _tim, entropy), layer in zip(per_layer, step):
            push(lay, handle)
            rtr.payload = entropy
            push(rtr, handle)
            pop(handle)
            exp.payload = layer.processed_total
            push(exp, handle)
            pop(handle)
            pop(handle)
        if set_vectors:
            a_step_routing.payload = step_vector(step)
        mark(a_step_routing, handle)
        pop(handle)
        return 3 + request_keys + len(step) * 6

    def emit_v2_compact(step: list[LayerStep], first_key: int) -> int:
        # moe/v2.2: with moe.step.routing and moe.step.entropy in the step, a layer is only its
        # moe.layer range (category and payload preset: no attribute set at all per layer)
        open_step(first_key)
        for lay, _layer in zip(a_layer, step):
            push(lay, handle)
            pop(handle)
        if set_vectors:
            a_step_routing.payload = step_vector(step)
            a_step_entropy.payload = entropy_vector
        mark(a_step_routing, handle)
        mark(a_step_entropy, handle)
        pop(handle)
        return 4 + request_keys + len(step) * 2

    def emit_v1(step: list[LayerStep], first_key: int) -> int:
        open_step(first_key)
        calls = 2 + request_keys
        for (lay, rtr, _rtg, _exp, _tim, entropy), layer in zip(per_layer, step):
            push(lay, handle)
            rtr.payload = entropy
            push(rtr, handle)
            for expert_cat, n in layer.tokens_marks:
                a_tok.category = expert_cat
                a_tok.payload = n
                mark(a_tok, handle)
            for expert_cat, n in layer.dropped_marks:
                a_drop.category = expert_cat
                a_drop.payload = n
                mark(a_drop, handle)
            pop(handle)
            for expert_cat, n in layer.ffn_ranges:
                a_ffn.category = expert_cat
                a_ffn.payload = n
                push(a_ffn, handle)
                pop(handle)
            pop(handle)
            calls += 4 + len(layer.tokens_marks) + len(layer.dropped_marks) + 2 * len(layer.ffn_ranges)
        pop(handle)
        return calls

    emitters = {"v2": emit_v2, "v2-step": emit_v2_step, "v2-compact": emit_v2_compact, "v1": emit_v1}
    return emitters[convention], fill, tool


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
    parser.add_argument("--convention", choices=("v1", "v2", "v2-step", "v2-compact"), required=True,
                        help="v2-step: moe/v2 with the step's routing as one moe.step.routing vector; "
                        "v2-compact: moe/v2.2, moe.step.routing + moe.step.entropy, per layer moe.layer only")
    parser.add_argument("--steps-per-s", type=float, required=True)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per step (a decode batch)")
    parser.add_argument("--requests", type=int, default=8, help="moe.request marks per step")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="routing skew exponent")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vectors", choices=("set", "held"), default="set",
                        help="set: a numpy array set as each vector payload per event (the nvtx package copies it); "
                        "held: each vector bound once as a 0-d structured array, refilled in place before the "
                        "emission block (the runtime's device-to-host copy) and marked")
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
    emit, fill, tool = make_emitter(convention=args.convention, experts=args.experts, tokens=args.tokens,
                                    request_keys=args.requests, experts_time=args.experts_time, entropies=entropies,
                                    held_vectors=args.vectors == "held")
    print(json.dumps({"ready": True, "pid": os.getpid(), "tool": tool}), flush=True)
    wait_line(WAIT_FOR_EXIT_S)

    period_ns = int(1e9 / args.steps_per_s)
    total_steps = max(1, round(args.steps_per_s * args.duration_s))
    emission_cpu_ns: list[int] = []
    fill_cpu_ns: list[int] = []
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
        f0 = time.thread_time_ns()
        fill(step)  # --vectors held: the step's vectors into their buffers, outside the emission block
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        fill_cpu_ns.append(c0 - f0)
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
        "vectors": args.vectors,
        "vector_fill_cpu_us_per_step_median": statistics.median(fill_cpu_ns) / 1e3,
        "process_cpu_s": process_cpu_s,
        "wall_s": wall_s,
        "achieved_steps_per_s": total_steps / wall_s if wall_s else 0.0,
        "late_steps": late,
    }), flush=True)
    wait_line(WAIT_FOR_EXIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
