"""Real transformers MoE models (tiny random-weight Mixtral, Qwen2-MoE, Qwen3-MoE) under
`moescope.instrument()`, through the real `nvtx` package and injection library: the per-layer
per-expert token counts and router entropies the agent's parser reads equal what the models' own
router outputs say (output_router_logits=True, computed apart from moescope's hooks)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nvtx_helpers import Producer, kill_group, parse_producer

from moescope.collectors.moe_convention import RouterEvent, StepEvent
from moescope.collectors.nvtx import INJECTION_ENV

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PRODUCER = HERE / "hf_producer.py"
DECODE_STEPS = 3


def per_expert(router: RouterEvent, experts: int) -> tuple[list[int], list[int]]:
    """(tokens routed, over capacity) per expert as the parser holds them: a v2 [2E] row, or v1 dicts."""
    counts = getattr(router, "counts", None)
    if counts is not None:
        return [int(n) for n in counts[:experts]], [int(n) for n in counts[experts:]]
    return ([router.tokens.get(e, 0) for e in range(experts)], [router.dropped.get(e, 0) for e in range(experts)])


def run_producer(tmp_path: Path, ring_dir: Path, *args: str) -> tuple[list[StepEvent], dict[str, Any], dict[str, int]]:
    log_path = tmp_path / "truth.json"
    env = {k: v for k, v in os.environ.items() if k != INJECTION_ENV}  # instrument() must arrange it
    env["MOESCOPE_NVTX_DIR"] = str(ring_dir)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, str(PRODUCER), "--log", str(log_path), "--decode-steps", str(DECODE_STEPS), *args],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        producer = Producer(proc=proc, log_path=log_path, ring_dir=ring_dir)
        steps, stats, collector = parse_producer(producer)
        assert collector.stats()["dropped_ring_full"] == 0
        return steps, producer.log(), stats
    finally:
        kill_group(proc)


@pytest.mark.parametrize("arch,routing,mode", [
    ("mixtral", "step", "compact"), ("qwen2_moe", "step", "compact"), ("qwen3_moe", "step", "compact"),
    ("mixtral", "step", "full"), ("qwen3_moe", "layer", "full"), ("qwen3_moe", "step", "live")])
def test_agent_counts_equal_the_models_own_router_outputs(tmp_path: Path, ring_dir: Path, arch: str,
                                                          routing: str, mode: str) -> None:
    """Deferred (the default: layers emitted after the step) in the compact form (the default:
    moe.step.routing + moe.step.entropy, per layer only moe.layer) and the full form (moe.router and
    moe.experts per layer), and live (defer=False) paths."""
    steps, truth, stats = run_producer(tmp_path, ring_dir, "--arch", arch, "--routing", routing,
                                       *({"live": ["--live"], "full": ["--full"]}.get(mode, [])))
    compact = mode == "compact"
    assert truth["compact"] == compact
    assert truth["nvtx"].startswith("active (NVTX_INJECTION64_PATH set by moescope.instrument()")
    assert truth["stats"]["hook_errors"] == truth["stats"]["layers_without_scores"] == 0
    top_k = truth["top_k"]
    assert len(steps) == len(truth["steps"]) == 1 + DECODE_STEPS
    for got, want in zip(steps, truth["steps"], strict=True):
        assert want["t0"] <= got.start_ns < got.end_ns <= want["t1"]
        assert got.tokens == want["tokens"] and got.requests == [41, 42]
        assert [layer.layer for layer in got.layers] == list(range(len(want["layers"])))
        for layer, wl in zip(got.layers, want["layers"], strict=True):
            assert layer.num_experts == len(wl["counts"]) == 8
            router = layer.router
            assert router is not None and router.entropy_bits is not None
            tokens, over_capacity = per_expert(router, 8)
            assert tokens == wl["counts"]
            assert sum(tokens) == top_k * want["tokens"] == top_k * wl["tokens"]
            assert over_capacity == [0] * 8
            assert math.isclose(router.entropy_bits, wl["entropy_bits"], abs_tol=1e-6)
            assert 0.0 < router.entropy_bits <= math.log2(8)
            assert router.routed() == top_k * want["tokens"]  # what the agent reports as routed
            if compact:  # no moe.router / moe.experts ranges: an untimed router, no experts span
                assert not router.timed and layer.experts is None
                continue
            assert router.timed
            assert layer.experts is not None and layer.experts.tokens == top_k * want["tokens"]
            assert layer.start_ns <= router.start_ns and layer.experts.end_ns <= layer.end_ns
    assert stats["malformed_vectors"] == stats["misplaced"] == stats["orphans"] == stats["unknown_names"] == 0
    assert stats["routing_vectors"] == (len(steps) if routing == "step" else sum(len(s.layers) for s in steps))
