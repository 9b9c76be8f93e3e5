"""A moe/v2.1 producer of `moe.step.requests` vectors through the PyPI `nvtx` package (what an outside
runtime writes), for tests/nvtx/test_nvtx_step_requests.py. Writes what it sent as JSON (the truth).

    python step_requests_producer.py --log FILE [--steps N] [--layers L] [--experts E] [--seed S]

Each step: `moe.step` (payload: tokens), sometimes `moe.request` marks, one `moe.step.requests`
int64 vector [keys | input tokens | output tokens] (some steps repeat a marked key in it), then
L layers of moe.layer / moe.router / moe.routing / moe.experts. After the good steps come hostile
ones, one case each, which must be counted and leave their step's timing intact:
a vector of 7 elements, a float vector, negative token counts, and a second vector in one step.

Prints "ready" once the NVTX domain exists (the ring file is there), waits for "go" on stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import nvtx

HOSTILE = ("length 7", "float vector", "negative tokens", "two vectors")


def step(domain: Any, *, tokens: int, marks: list[int], vectors: list[np.ndarray], layers: int, experts: int,
         rng: np.random.Generator) -> None:
    domain.push_range(message="moe.step", payload=tokens)
    for key in marks:
        domain.mark(message="moe.request", payload=key)
    for vector in vectors:
        domain.mark(message="moe.step.requests", payload=vector)
    for layer in range(layers):
        routing = np.zeros(2 * experts, dtype=np.int32)
        routing[:experts] = rng.multinomial(2 * tokens, np.full(experts, 1.0 / experts))
        domain.push_range(message="moe.layer", category=layer + 1, payload=experts)
        domain.push_range(message="moe.router", category=layer + 1, payload=1.5)
        domain.mark(message="moe.routing", category=layer + 1, payload=routing)
        domain.pop_range()
        domain.push_range(message="moe.experts", category=layer + 1, payload=2 * tokens)
        domain.pop_range()
        domain.pop_range()
    domain.pop_range()


def run(*, steps: int, layers: int, experts: int, seed: int) -> dict[str, Any]:
    domain = nvtx.get_domain("moe")
    rng = np.random.default_rng(seed)
    sent: list[dict[str, Any]] = []
    for s in range(steps):
        batch = int(rng.integers(1, 6))
        keys = [int(k) for k in rng.choice(np.arange(100, 200), size=batch, replace=False)]
        prefill = s % 3 == 0
        n_in = [int(rng.integers(5, 400)) if prefill else 0 for _ in keys]
        n_out = [1 if i % 4 else int(rng.integers(0, 3)) for i in range(batch)]  # 0: a non-final chunk, 2: speculative
        marks = [keys[0], 7000 + s] if s % 2 else []  # a key marked and in the vector, and one marked only
        vector = np.array(keys + n_in + n_out, dtype=np.int64)
        step(domain, tokens=sum(n_in) + batch, marks=marks, vectors=[vector], layers=layers, experts=experts, rng=rng)
        sent.append({"marks": marks, "keys": keys, "input": n_in, "output": n_out})
    hostile = {
        "length 7": [np.arange(1, 8, dtype=np.int64)],
        "float vector": [np.array([101.0, 5.0, 1.0])],
        "negative tokens": [np.array([101, -5, 1], dtype=np.int64)],
        "two vectors": [np.array([101, 5, 1], dtype=np.int64), np.array([102, 6, 1], dtype=np.int64)],
    }
    for case in HOSTILE:
        step(domain, tokens=8, marks=[555], vectors=hostile[case], layers=layers, experts=experts, rng=rng)
    return {"steps": sent, "hostile": list(HOSTILE)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args(argv)
    nvtx.mark(message="ready")  # the first NVTX call (default domain): the ring file exists from here
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    result = run(steps=args.steps, layers=args.layers, experts=args.experts, seed=args.seed)
    with open(args.log, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
