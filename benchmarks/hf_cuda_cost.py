"""Cost of `moescope.instrument()` on CUDA at a production shape: a random-weight transformers
Qwen3-MoE with Qwen3-30B-A3B's shape (48 MoE layers, 128 experts, top-8, width 2048, expert width 768,
32 query / 4 KV heads of 128, vocab 151936; 30.5 B parameters, 61 GB in bf16), plain vs instrumented.

    python -m benchmarks.hf_cuda_cost [--pairs 5] [--forwards 8] [--layers 48] [--json-out PATH]

Two steps, each timed over whole forwards with the device synchronised before and after (wall time:
what a served step costs; moescope's instrumentation keeps its counts on the device and copies
them once per step, so its cost is host time and that one copy):
  decode:  64 sequences x 1 token (a decode batch; no KV cache, so attention is over the one token);
  prefill: 1 sequence x 2048 tokens.
A (plain) and B (instrumented with the defaults, moescope's NVTX injection library attached with no
agent: what a served process pays between attaches) alternate AB, BA, ...; each run is the median
of its forwards; the ratio is median(B) / median(A) and each pair's B/A gives the spread.
Needs a CUDA GPU with ~70 GB free (`--layers` fewer for a smaller one; the per-layer cost is what
scales). Writes bench-results/hf_cuda_cost.json (or --json-out).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Metrics, alternate_ab, write_result
from benchmarks.hf_instrument_cost import run_instrumented

# Qwen3-30B-A3B's published config, less its weights
PRODUCTION = {"hidden": 2048, "experts": 128, "top_k": 8, "vocab": 151936, "moe_intermediate_size": 768,
              "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
STEPS = {"decode": (64, 1), "prefill": (1, 2048)}


def _progress(step: str, line: str) -> None:
    print(f"{step}: {line}", flush=True)


def build_model(layers: int, device: str) -> Any:
    import torch

    from moescope.hf.tiny import tiny_config

    config = tiny_config("qwen3_moe", layers=layers, max_positions=4096, **PRODUCTION)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import moescope

    device = args.device
    t0 = time.perf_counter()
    model = build_model(args.layers, device)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, {params / 1e9:.2f} B parameters, built in {build_s:.1f} s; "
          f"{torch.cuda.memory_allocated() / 2**30 if device.startswith('cuda') else 0:.1f} GiB on the GPU", flush=True)
    results: dict[str, Any] = {}
    nvtx_state = ""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for step in args.step or list(STEPS):
        batch, tokens = STEPS[step]
        ids = torch.randint(0, PRODUCTION["vocab"], (batch, tokens), device=device,
                            generator=torch.Generator(device=device).manual_seed(0))

        def timed() -> Metrics:
            wall: list[float] = []
            with torch.no_grad():
                for _ in range(args.forwards):
                    sync()
                    start = time.perf_counter_ns()
                    model(input_ids=ids, use_cache=False)
                    sync()
                    wall.append((time.perf_counter_ns() - start) / 1e3)
            return {"forward_us": statistics.median(wall)}

        def instrumented() -> Metrics:
            nonlocal nvtx_state
            metrics, nvtx_state = run_instrumented(model, timed, who="hf_cuda_cost")
            return metrics

        with torch.no_grad():  # warm-up: allocations, kernel choice, the instrumented path's first copy
            for _ in range(2):
                model(input_ids=ids, use_cache=False)
            warm = moescope.instrument(model)
            model(input_ids=ids, use_cache=False)
            warm.close()
        sync()
        result = alternate_ab(run_a=timed, run_b=instrumented, pairs=args.pairs,
                              progress=functools.partial(_progress, step))
        pair_ratios = sorted(b["forward_us"] / a["forward_us"] for a, b in zip(result.a, result.b, strict=True))
        results[step] = {
            "batch": batch, "tokens": tokens,
            "plain_forward_us_median": result.median("a", "forward_us"),
            "instrumented_forward_us_median": result.median("b", "forward_us"),
            "added_us_per_forward": result.delta("forward_us"),
            "added_us_per_layer": result.delta("forward_us") / args.layers,
            "ratio": result.ratio("forward_us"),
            "pair_ratio": {"median": statistics.median(pair_ratios), "min": pair_ratios[0], "max": pair_ratios[-1]},
            "runs": result.to_dict(),
        }
        print(f"{step}: plain {results[step]['plain_forward_us_median'] / 1e3:.2f} ms, instrumented "
              f"{results[step]['instrumented_forward_us_median'] / 1e3:.2f} ms, ratio {results[step]['ratio']:.4f} "
              f"(pairs {pair_ratios[0]:.4f}..{pair_ratios[-1]:.4f})", flush=True)
    return {"device": torch.cuda.get_device_name() if device.startswith("cuda") else device, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "layers": args.layers,
            "parameters": params, "shape": PRODUCTION, "build_s": build_s, "forwards_per_run": args.forwards,
            "pairs": args.pairs, "nvtx": nvtx_state, "steps": results}


def profile(args: argparse.Namespace) -> None:
    """Where an instrumented forward's time goes, plain vs instrumented: per forward, the host's
    enqueue time (until the forward returns) and the whole time (device synchronised), the step
    end's share (moescope's reductions, its one copy, the NVTX emission), the synchronising calls,
    and torch.profiler's device-kernel total and top host-side operators."""
    import statistics as stats
    import warnings

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import moescope
    from moescope.hf import emit

    step_end_ns: list[int] = []
    original_post = emit.Instrumentation._step_post

    def timed_post(self: Any) -> None:
        start = time.perf_counter_ns()
        try:
            original_post(self)
        finally:
            step_end_ns.append(time.perf_counter_ns() - start)

    emit.Instrumentation._step_post = timed_post  # type: ignore[method-assign]  # before instrument() binds it
    model = build_model(args.layers, args.device)
    for step in args.step or ["decode"]:
        batch, tokens = STEPS[step]
        ids = torch.randint(0, PRODUCTION["vocab"], (batch, tokens), device=args.device)
        for arm in ("plain", "instrumented", "plain", "instrumented"):
            ins = moescope.instrument(model) if arm == "instrumented" else None
            with torch.no_grad():
                for _ in range(3):
                    model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
                step_end_ns.clear()
                enqueue, whole = [], []
                for _ in range(args.forwards):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter_ns()
                    model(input_ids=ids, use_cache=False)
                    t1 = time.perf_counter_ns()
                    torch.cuda.synchronize()
                    enqueue.append((t1 - t0) / 1e6)
                    whole.append((time.perf_counter_ns() - t0) / 1e6)
                ends = [n / 1e6 for n in step_end_ns]
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        model(input_ids=ids, use_cache=False)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
                torch.cuda.synchronize()
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    model(input_ids=ids, use_cache=False)
                    torch.cuda.synchronize()
            averages = prof.key_averages()
            device_us = sum(e.self_device_time_total for e in averages)
            kernels = sum(e.count for e in averages if e.self_device_time_total > 0)
            print(f"== {step} {arm}: enqueue {stats.median(enqueue):.2f} ms, whole {stats.median(whole):.2f} ms, "
                  f"step end {stats.median(ends) if ends else 0:.2f} ms, syncs {syncs}, device kernels "
                  f"{device_us / 1e3:.2f} ms over {kernels} launches", flush=True)
            if arm == "instrumented" and len(prof.key_averages()) and not getattr(profile, "shown", False):
                profile.shown = True  # type: ignore[attr-defined]
                print(averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
            if ins is not None:
                ins.close()
    emit.Instrumentation._step_post = original_post  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers (default 48, the production shape)")
    parser.add_argument("--pairs", type=int, default=5, help="A/B pairs per step (default 5)")
    parser.add_argument("--forwards", type=int, default=8, help="forwards per run (default 8)")
    parser.add_argument("--step", action="append", choices=tuple(STEPS), help="default: both")
    parser.add_argument("--json-out", default=None, help="also write the result here")
    parser.add_argument("--profile", action="store_true",
                        help="instead: cProfile one plain and one instrumented forward, and count their syncs")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("hf_cuda_cost: no CUDA device (this benchmark is for a GPU machine)", file=sys.stderr)
        return 2
    if args.profile:
        profile(args)
        return 0
    payload = measure(args)
    path = write_result("hf_cuda_cost", payload)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
