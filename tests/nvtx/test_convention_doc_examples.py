"""The producer examples in docs/nvtx-convention.md ("Examples for adopters") work as published.

Python: each example is executed, unchanged, in a real process with the real `nvtx` package and the
injection library, around stand-ins for the model's parts (router, top-k, experts) that draw
their numbers from numpy; the agent's parser must read back exactly those numbers. An example
that no longer runs, or that sends something the parser reads differently, fails here.

C: the doc's snippets need NVIDIA's headers, which are not in this tree, so doc_c_producer.c makes
the same calls with nvtx_abi.h's names (the schemas as the doc registers them: a dynamic schema of
a UINT64 length and the values indexed by it, which the `nvtx` package never sends); the test
checks the doc still shows that form, and the parser reads the C producer's steps exactly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from abi_harness import build_c_harness
from nvtx_helpers import REPO, Producer, kill_group, nonzero, parse_producer, producer_env

from moescope.collectors.moe_convention import StepEvent
from moescope.collectors.nvtx import injection_library_path

DOC = REPO / "docs" / "nvtx-convention.md"
LAYERS, EXPERTS, STEPS = 3, 8, 4

# The stand-ins each example calls, and the loop that drives it; what they drew is the truth the
# parsed steps are held to. `{example}` is the doc's code, run as it is printed.
HARNESS = '''
import json, sys
from types import SimpleNamespace
import numpy as np

rng = np.random.default_rng(11)
num_layers, num_experts = {layers}, {experts}
truth = {{"steps": []}}
current = []  # the step being made: its layers' numbers, in order

def router(layer, x):
    entropy = float(rng.uniform(0.5, 3.0))
    current.append({{"entropy": entropy}})
    return rng.standard_normal(num_experts), entropy

def select(logits):
    top_k = rng.integers(0, 20, num_experts)
    over = np.minimum(rng.integers(0, 3, num_experts), top_k)
    current[-1].update(demand=top_k.tolist(), dropped=over.tolist(), computed=int(top_k.sum()))
    return top_k, over

def fused_experts(x, top_k):
    return x

def run_layer(layer, x):
    raise AssertionError("the tool is attached: the example must take its instrumented path")

def layer_fn(i):
    def run(x):
        top_k = rng.integers(0, 20, num_experts)
        over = np.minimum(rng.integers(0, 3, num_experts), top_k)
        entropy = float(np.float32(rng.uniform(0.5, 3.0)))
        current.append({{"entropy": entropy, "demand": top_k.tolist(), "dropped": over.tolist()}})
        return x
    return run

layers = [layer_fn(i) for i in range(num_layers)]

def step_router_stats():
    routing = np.concatenate([np.concatenate((np.asarray(l["demand"]), np.asarray(l["dropped"])))
                              for l in current]).astype(np.int32)
    return routing, np.asarray([l["entropy"] for l in current], dtype=np.float32)

def forward(batch, x=None):
    if x is not None:
        raise AssertionError("the tool is attached: the example must take its instrumented path")
    for layer in range(num_layers):
        moe_layer(layer, None, num_experts)

{example}

print("ready", flush=True)
sys.stdin.readline()
for s in range(__STEPS__):
    current.clear()
    if "{mode}" == "per-layer":
        batch = [SimpleNamespace(key=7000 + 10 * s + r, new_tokens=[0] * (1 + r), prompt_tokens_this_step=5 * r)
                 for r in range(2 + s % 2)]
        step(batch)
        truth["steps"].append({{"tokens": sum(len(r.new_tokens) for r in batch),
                                "requests": {{r.key: [r.prompt_tokens_this_step, 1] for r in batch}},
                                "layers": list(current)}})
    else:
        step(SimpleNamespace(tokens=16 + s), None)
        truth["steps"].append({{"tokens": 16 + s, "layers": list(current)}})
json.dump(truth, open(sys.argv[1], "w"))
'''


def _examples() -> dict[str, str]:
    """The doc's Python examples: the per-layer form (the section's blocks before the compact form's
    heading) and the compact form (its block)."""
    text = DOC.read_text()
    section = text.split("## Examples for adopters", 1)[1]
    per_layer, compact = section.split("### The compact form", 1)
    blocks = {mode: re.findall(r"```python\n(.*?)```", part, flags=re.S)
              for mode, part in (("per-layer", per_layer), ("compact", compact))}
    assert len(blocks["per-layer"]) == 2 and len(blocks["compact"]) == 1, "the doc's examples moved"
    return {mode: "\n".join(found) for mode, found in blocks.items()}


def _run(tmp_path: Path, ring_dir: Path, mode: str) -> tuple[list[StepEvent], dict, dict[str, int], dict[str, int]]:
    script = tmp_path / f"example_{mode}.py"
    script.write_text(HARNESS.format(layers=LAYERS, experts=EXPERTS, mode=mode, example=_examples()[mode])
                      .replace("__STEPS__", str(STEPS)))
    log_path = tmp_path / f"example_{mode}.json"
    proc = subprocess.Popen([sys.executable, str(script), str(log_path)], env=producer_env(ring_dir),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        steps, stats, collector = parse_producer(Producer(proc=proc, log_path=log_path, ring_dir=ring_dir))
        return steps, json.loads(log_path.read_text()), stats, collector.stats()
    finally:
        kill_group(proc)


@pytest.mark.parametrize("mode", ["per-layer", "compact"])
def test_the_docs_python_examples_are_read_back_exactly(tmp_path: Path, ring_dir: Path, mode: str) -> None:
    steps, truth, stats, cstats = _run(tmp_path, ring_dir, mode)
    assert cstats["dropped_ring_full"] == 0
    assert stats["malformed_vectors"] == stats["misplaced"] == stats["orphans"] == stats["unknown_names"] == 0
    assert len(steps) == len(truth["steps"]) == STEPS
    for got, want in zip(steps, truth["steps"], strict=True):
        assert got.tokens == want["tokens"]
        if mode == "per-layer":
            assert got.request_tokens == {int(k): tuple(v) for k, v in want["requests"].items()}
        assert [layer.layer for layer in got.layers] == list(range(LAYERS))
        for layer, wl in zip(got.layers, want["layers"], strict=True):
            assert layer.num_experts == EXPERTS
            router = layer.router
            assert router is not None
            assert router.entropy_bits == wl["entropy"]  # as sent, bit for bit
            assert router.tokens_by_expert() == nonzero(wl["demand"])
            assert router.dropped_by_expert() == nonzero(wl["dropped"])
            if mode == "per-layer":
                assert layer.experts is not None and layer.experts.tokens == wl["computed"]
                assert router.end_ns <= layer.experts.start_ns < layer.experts.end_ns <= layer.end_ns
            else:
                assert layer.experts is None  # the compact form has no experts range
    assert stats["routing_vectors"] == (STEPS * LAYERS if mode == "per-layer" else STEPS)
    # what the truth holds is numpy's own draw, not something the parser could have made up
    assert sum(np.sum(wl["demand"]) for s in truth["steps"] for wl in s["layers"]) > 0


# What doc_c_producer.c mirrors of the doc's C examples: if one of these leaves the doc, the mirror
# (and this test) must follow it.
C_EXAMPLE_FORMS = (
    '{NVTX_PAYLOAD_ENTRY_FLAG_UNUSED, NVTX_PAYLOAD_ENTRY_TYPE_UINT64, "length"}',
    '{NVTX_PAYLOAD_ENTRY_FLAG_ARRAY_LENGTH_INDEX, NVTX_PAYLOAD_ENTRY_TYPE_INT32, "values",',
    "NVTX_PAYLOAD_ENTRY_TYPE_INT64, \"values\", NULL, 0}",
    "NVTX_PAYLOAD_ENTRY_TYPE_FLOAT32, \"values\", NULL, 0}",
    "schema.type = NVTX_PAYLOAD_SCHEMA_TYPE_DYNAMIC;",
    "NVTX_PAYLOAD_SCHEMA_ATTR_FIELD_TYPE | NVTX_PAYLOAD_SCHEMA_ATTR_FIELD_ENTRIES |",
    "{vector_schema, sizeof(uint64_t) + 2 * E * sizeof(int32_t), buf}",
    "{int64_vector_schema, sizeof(uint64_t) + 3 * R * sizeof(int64_t), buf}",
    "a.payloadType = NVTX_PAYLOAD_TYPE_EXT;",
    "a.reserved0 = 1;",
)


def _c_truth(steps: int) -> list[dict]:
    """doc_c_producer.c's numbers, computed here with numpy from the formulas in its header."""
    layer, expert = np.arange(LAYERS)[:, None], np.arange(EXPERTS)[None, :]
    out = []
    for s in range(2 * steps):
        tokens = (7 * s + 3 * layer + 5 * expert) % 11
        over = np.minimum((s + layer + expert) % 3, tokens)
        requests = {5000 + 10 * s + r: (4 * r, 1) for r in range(2 + s % 2)} if s < steps else None
        out.append({"tokens": 16 + s, "requests": requests, "demand": tokens, "dropped": over,
                    "entropy": 0.5 + 0.25 * np.arange(LAYERS) + 0.125 * s})
    return out


def test_the_docs_c_example_is_read_back_exactly(tmp_path: Path, ring_dir: Path) -> None:
    doc = DOC.read_text().split("## Examples for adopters", 1)[1]
    c_blocks = "\n".join(re.findall(r"```c\n(.*?)```", doc, flags=re.S))
    missing = [form for form in C_EXAMPLE_FORMS if form not in c_blocks]
    assert not missing, f"the doc's C example changed; update tests/nvtx/doc_c_producer.c: {missing}"
    exe = build_c_harness("doc_c_producer", tmp_path)
    proc = subprocess.Popen([str(exe), str(injection_library_path()), str(LAYERS), str(EXPERTS), str(STEPS)],
                            env=producer_env(ring_dir, inject=False), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        steps, stats, collector = parse_producer(Producer(proc=proc, log_path=tmp_path / "unused", ring_dir=ring_dir))
    finally:
        kill_group(proc)
    cstats, schemas = collector.stats(), len(collector.strings.schemas)
    # the three schemas (registered before the attach: read from the ring, not counted as new)
    assert schemas == 3 and cstats["schemas_malformed_dropped"] == cstats["schemas_dropped"] == 0
    assert cstats["dropped_ring_full"] == 0 and cstats["ext_payloads_recorded"] == STEPS * (1 + LAYERS) + 2 * STEPS
    assert stats["malformed_vectors"] == stats["misplaced"] == stats["orphans"] == stats["unknown_names"] == 0
    truth = _c_truth(STEPS)
    assert len(steps) == len(truth) == 2 * STEPS
    for s, (got, want) in enumerate(zip(steps, truth, strict=True)):
        assert got.tokens == want["tokens"]
        assert got.request_tokens == want["requests"]
        assert [layer.layer for layer in got.layers] == list(range(LAYERS))
        for layer, demand, dropped, entropy in zip(got.layers, want["demand"], want["dropped"], want["entropy"],
                                                   strict=True):
            router = layer.router
            assert layer.num_experts == EXPERTS and router is not None
            assert router.entropy_bits == float(entropy)  # exact in float32 and float64 alike
            assert router.tokens_by_expert() == nonzero(demand.tolist())
            assert router.dropped_by_expert() == nonzero(dropped.tolist())
            if s < STEPS:
                assert layer.experts is not None and layer.experts.tokens == int(demand.sum())
            else:
                assert layer.experts is None
    assert stats["routing_vectors"] == STEPS * LAYERS + STEPS
