"""A tiny transformers MoE model run under `moescope.instrument()`, for tests/hf/test_hf_nvtx.py.
Writes what the model's own router outputs say (output_router_logits=True, read apart from
moescope's hooks) as JSON: the truth the agent's parse is compared with.

    python hf_producer.py --arch qwen3_moe --log FILE [--routing step|layer] [--decode-steps N] [--live] [--full]

NVTX_INJECTION64_PATH is not set by the test: instrument() arranges it before the first NVTX call.
Prints "ready" once instrumented (the ring file exists), waits for "go" on stdin.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

import moescope
from moescope.hf.tiny import tiny_model

BATCH, PROMPT = 2, 6
REQUEST_KEYS = (41, 42)


def layer_truth(logits: torch.Tensor, *, top_k: int) -> dict[str, Any]:
    """Per-expert assignments and mean softmax entropy (bits) of one layer's router logits, float64."""
    s = logits.detach().double()
    chosen = s.topk(top_k, dim=-1).indices  # softmax is monotone: top-k of the logits is top-k of the probabilities
    counts = torch.bincount(chosen.reshape(-1), minlength=s.shape[-1])
    p = torch.softmax(s, dim=-1)
    entropy_bits = float((-(p * torch.log(p)).sum(-1) / math.log(2.0)).mean())
    return {"counts": counts.tolist(), "entropy_bits": entropy_bits, "tokens": int(s.shape[0])}


def run(*, arch: str, routing: str, decode_steps: int, live: bool, full: bool) -> dict[str, Any]:
    model: Any = tiny_model(arch)  # a transformers model: its attributes are not typed
    ins = moescope.instrument(model, routing=routing, defer=not live, compact=not full)
    assert ins.active, ins.describe()
    top_k = int(model.config.num_experts_per_tok)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(2)
    torch.manual_seed(1)
    ids = torch.randint(0, int(model.config.vocab_size), (BATCH, PROMPT))
    steps: list[dict[str, Any]] = []
    past = None
    with torch.no_grad():
        for _ in range(1 + decode_steps):
            ins.set_request_keys(REQUEST_KEYS)
            t0 = time.monotonic_ns()
            out = model(input_ids=ids, past_key_values=past, use_cache=True, output_router_logits=True)
            t1 = time.monotonic_ns()
            past = out.past_key_values
            steps.append({"t0": t0, "t1": t1, "tokens": int(ids.numel()),
                          "layers": [layer_truth(x, top_k=top_k) for x in out.router_logits]})
            ids = out.logits[:, -1:].argmax(-1)
    result = {"arch": arch, "top_k": top_k, "compact": ins.compact, "experts": [b.num_experts for b in ins.blocks],
              "nvtx": ins.nvtx_state, "stats": ins.stats(), "steps": steps}
    ins.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--routing", choices=("step", "layer"), default="step")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--live", action="store_true", help="live per-layer ranges (defer=False)")
    p.add_argument("--full", action="store_true", help="moe.router and moe.experts per layer (compact=False)")
    args = p.parse_args(argv)
    result = run(arch=args.arch, routing=args.routing, decode_steps=args.decode_steps, live=args.live, full=args.full)
    with open(args.log, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
