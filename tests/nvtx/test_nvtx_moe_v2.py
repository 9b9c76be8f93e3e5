"""moe/v2 end to end on real producers: the reference runtime's instrumentation sends routing
vectors through the real `nvtx` package and injection library; the parser's steps equal what was
sent, and a v1 producer of the same routing gives the agent identical metrics."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nvtx_helpers import HERE, Producer, kill_group, nonzero, parse_producer, producer_env

from moescope.agent.metrics import Metrics
from moescope.agent.pipeline import Pipeline
from moescope.collectors import moe_convention
from moescope.collectors.moe_convention import StepEvent

V2_PRODUCER = HERE / "moe_v2_producer.py"
LAYERS, EXPERTS, STEPS = 4, 64, 6


def _start(tmp_path: Path, ring_dir: Path, *args: str) -> tuple[Producer, subprocess.Popen[str]]:
    log_path = tmp_path / f"v2-producer-{len(list(tmp_path.glob('v2-producer-*')))}.json"
    env = producer_env(ring_dir, pythonpath=True)
    proc = subprocess.Popen(
        [sys.executable, str(V2_PRODUCER), "--log", str(log_path), "--layers", str(LAYERS), "--experts",
         str(EXPERTS), "--steps", str(STEPS), *args],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    return Producer(proc=proc, log_path=log_path, ring_dir=ring_dir), proc


@pytest.fixture
def run_producer(tmp_path: Path, ring_dir: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def run(*args: str) -> tuple[list[StepEvent], dict[str, Any], dict[str, int], dict[str, int]]:
        producer, proc = _start(tmp_path, ring_dir, *args)
        started.append(proc)
        # small batches: parents and children land in different ones
        steps, stats, collector = parse_producer(producer, batch_records=61)
        return steps, producer.log(), stats, collector.stats()

    try:
        yield run
    finally:
        for proc in started:
            kill_group(proc)


@pytest.mark.parametrize("routing", ["layer", "step"])
def test_v2_steps_equal_what_the_producer_sent(run_producer: Any, routing: str) -> None:
    steps, truth, stats, cstats = run_producer("--convention", "v2", "--routing", routing)
    assert cstats["dropped_ring_full"] == 0
    assert len(steps) == len(truth["steps"]) == STEPS
    for got, want in zip(steps, truth["steps"], strict=True):
        assert want["t0"] <= got.start_ns < got.end_ns <= want["t1"]
        assert got.tokens == want["tokens"] and got.requests == want["requests"]
        assert [layer.layer for layer in got.layers] == list(range(LAYERS))
        for layer, wl in zip(got.layers, want["layers"], strict=True):
            assert layer.num_experts == EXPERTS
            router = layer.router
            assert router is not None and router.entropy_bits == wl["entropy"]
            assert router.tokens_by_expert() == nonzero(wl["demand"])
            assert router.dropped_by_expert() == nonzero(wl["dropped"])
            assert router.vector is None and router.counts is not None  # checked, kept as one array
            assert not router.tokens and not router.dropped  # no per-expert dicts made for v2
            experts = layer.experts
            assert experts is not None and experts.tokens == wl["computed"]
            assert router.end_ns <= experts.start_ns < experts.end_ns <= layer.end_ns
            assert experts.time_us is not None
            np.testing.assert_array_equal(experts.time_us, np.asarray(wl["time_us"], dtype=np.float32))
            assert {e.expert: e.bytes_moved for e in layer.loads} == {int(k): v for k, v in wl["loads"].items()}
            assert all(experts.start_ns <= ld.start_ns < ld.end_ns <= experts.end_ns for ld in layer.loads)
            assert layer.ffns == []  # v2 default: no range per expert
    vectors = STEPS * LAYERS if routing == "layer" else STEPS  # per layer, or one per step
    assert stats["routing_vectors"] == vectors and stats["experts_ranges"] == STEPS * LAYERS
    assert stats["malformed_vectors"] == stats["misplaced"] == stats["orphans"] == stats["unknown_names"] == 0
    # O(layers) events per step: step, request, and per layer layer/router/experts/time (+ routing) (+ loads)
    loads = sum(len(wl["loads"]) for s in truth["steps"] for wl in s["layers"])
    assert cstats["records_received"] == STEPS * (2 + 1 + LAYERS * (2 + 2 + 2 + 1)) + vectors + 2 * loads


def test_compact_steps_carry_routing_and_entropy_in_step_vectors(run_producer: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_convention, "COLUMN_MIN_LAYERS", 1)  # this test's 4 layers as columns too
    steps, truth, stats, cstats = run_producer("--convention", "v2", "--routing", "compact")
    assert cstats["dropped_ring_full"] == 0
    assert len(steps) == len(truth["steps"]) == STEPS
    # small batches: a step in one batch holds its layers as columns, a split one as objects; alike
    assert 0 < stats["steps_layer_columns"] < STEPS
    for got, want in zip(steps, truth["steps"], strict=True):
        assert got.tokens == want["tokens"] and got.requests == want["requests"]
        assert got.layer_count == LAYERS and [layer.layer for layer in got.layers] == list(range(LAYERS))
        for layer, wl in zip(got.layers, want["layers"], strict=True):
            router = layer.router
            assert router is not None and not router.timed and router.start_ns == router.end_ns == layer.start_ns
            assert router.entropy_bits == wl["entropy"]
            assert router.tokens_by_expert() == nonzero(wl["demand"])
            assert router.dropped_by_expert() == nonzero(wl["dropped"])
            assert layer.experts is None and layer.num_experts == EXPERTS
    assert stats["routing_vectors"] == STEPS and stats["routers"] == stats["experts_ranges"] == 0
    assert stats["malformed_vectors"] == stats["misplaced"] == stats["orphans"] == stats["unknown_names"] == 0
    # O(1) vectors and 2 events per layer: step, request, layers, routing, entropy
    assert cstats["records_received"] == STEPS * (2 + 1 + 2 * LAYERS + 2)


def test_malformed_v2_vectors_are_counted_and_the_steps_kept(run_producer: Any) -> None:
    steps, _truth, stats, cstats = run_producer("--convention", "v2", "--hostile")
    assert cstats["dropped_ring_full"] == 0
    assert len(steps) == 4 and all(len(s.layers) == 1 for s in steps)  # every step and its timing kept
    routers = [s.layers[0].router for s in steps]
    assert all(r is not None for r in routers)
    # float and short routing vectors, and a step vector of the wrong length: counted, left out
    assert stats["malformed_vectors"] == 3
    assert [r.has_routing for r in routers if r is not None] == [False, False, True, False]
    assert stats["misplaced"] == stats["orphans"] == 0


def _metrics_of(steps: list[StepEvent]) -> dict[str, float]:
    metrics = Metrics()
    pipeline = Pipeline(spans=None, metrics=metrics)
    pipeline.on_steps(steps)
    metrics.refresh()
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        if not family.name.startswith(("moescope_expert", "moescope_router", "moescope_step_router",
                                       "moescope_step_expert_load", "moescope_experts")):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created") or "duration" in sample.name:
                continue  # when the series was made, and how long things took: not routing
            key = sample.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
            out[key] = sample.value
    return out


@pytest.mark.parametrize("column_min_layers", [1, moe_convention.COLUMN_MIN_LAYERS])
def test_v1_and_v2_give_identical_metrics_for_the_same_routing(run_producer: Any, monkeypatch: pytest.MonkeyPatch,
                                                               column_min_layers: int) -> None:
    """(column_min_layers 1: the v2 steps that fit one batch reach the join as LayerColumns; v1 never does)"""
    monkeypatch.setattr(moe_convention, "COLUMN_MIN_LAYERS", column_min_layers)
    v2_steps, v2_truth, _, v2_stats = run_producer("--convention", "v2", "--seed", "11")
    v1_steps, v1_truth, v1_parser, v1_stats = run_producer("--convention", "v1", "--seed", "11")
    per_step, step_truth, _, step_stats = run_producer("--convention", "v2", "--routing", "step", "--seed", "11")
    compact, compact_truth, _, compact_stats = run_producer("--convention", "v2", "--routing", "compact",
                                                            "--seed", "11")
    assert v2_stats["dropped_ring_full"] == v1_stats["dropped_ring_full"] == step_stats["dropped_ring_full"] == 0
    assert compact_stats["dropped_ring_full"] == 0
    assert [s["layers"] for s in v1_truth["steps"]] == [s["layers"] for s in v2_truth["steps"]]  # same routing sent
    assert [s["layers"] for s in step_truth["steps"]] == [s["layers"] for s in v2_truth["steps"]]
    assert v1_parser["routing_vectors"] == 0 and v1_parser["expert_marks"] > STEPS * LAYERS  # v1 really was v1
    for a, b in zip(v1_steps, v2_steps, strict=True):
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert la.router is not None and lb.router is not None
            assert (la.router.tokens_by_expert(), la.router.dropped_by_expert(), la.router.entropy_bits) == (
                lb.router.tokens_by_expert(), lb.router.dropped_by_expert(), lb.router.entropy_bits)
    v1_metrics, v2_metrics = _metrics_of(v1_steps), _metrics_of(v2_steps)
    assert any(k.startswith("moescope_expert_tokens_total") for k in v1_metrics)
    assert v1_metrics == v2_metrics == _metrics_of(per_step)
    # the compact form (no router or experts ranges) gives the same routing numbers too
    assert [[{k: wl[k] for k in ("layer", "entropy", "demand", "dropped")} for wl in s["layers"]]
            for s in v2_truth["steps"]] == [s["layers"] for s in compact_truth["steps"]]
    def routing_only(metrics: dict[str, float]) -> dict[str, float]:  # compact sends no expert-load ranges
        return {k: v for k, v in metrics.items() if not k.startswith("moescope_expert_load_bytes")}

    assert routing_only(v2_metrics) == routing_only(_metrics_of(compact))
    # and they are the numbers that were sent: per-expert token counters summed over the steps
    sent = np.sum([np.asarray(wl["demand"]) for s in v2_truth["steps"] for wl in s["layers"] if wl["layer"] == 0],
                  axis=0)
    counted = sum(v for k, v in v2_metrics.items() if k.startswith("moescope_expert_tokens_total") and "layer=0" in k)
    assert counted == int(sent.sum())
