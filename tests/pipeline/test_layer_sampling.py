"""Layer subtrees in traces under load (agent/outputs/traces.py LayerSampler): slow steps always,
then a budget of layer spans per second; every step still gets its step span, every step counts in
metrics, and sampled-out subtrees are counted apart from export drops. Steps carry moe/v2 routing
rows (arrays) at DeepSeek-V3's shape, as the parser hands them over."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.export.store import TraceStore
from moescope.agent.metrics import Metrics
from moescope.agent.outputs import LayerSampler
from moescope.agent.pipeline import Pipeline
from moescope.collectors.moe_convention import LayerEvent, RouterEvent, StepEvent

LAYERS, EXPERTS, TOP_K, TOKENS = 58, 256, 8, 64
MS = 1_000_000
T0 = 10_000 * MS


def v2_step(
    rng: np.random.Generator, *, index: int, duration_ns: int, period_ns: int, layers: int = LAYERS
) -> StepEvent:
    start = T0 + index * period_ns
    step = StepEvent(pid=7, tid=7, start_ns=start, end_ns=start + duration_ns, tokens=TOKENS)
    span = duration_ns // (layers + 1)
    for layer in range(layers):
        t = start + layer * span
        tokens = np.bincount(rng.integers(0, EXPERTS, TOP_K * TOKENS), minlength=EXPERTS).astype(np.int64)
        router = RouterEvent(layer=layer, start_ns=t, end_ns=t + span // 4, entropy_bits=5.0,
                             counts=np.concatenate([tokens, np.zeros(EXPERTS, dtype=np.int64)]))
        step.layers.append(LayerEvent(layer=layer, start_ns=t, end_ns=t + span, router=router, num_experts=EXPERTS))
    return step


def run(tmp_path: Path, steps: list[StepEvent], *, layer_spans_per_s: float) -> tuple[Pipeline, Metrics, list]:
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path), queue_spans=1 << 18), env={}))
    metrics = Metrics()
    pipeline = Pipeline(spans=tracing.factory, metrics=metrics, epoch_offset_ns=0, clock=lambda: steps[-1].end_ns,
                        layer_spans_per_s=layer_spans_per_s)
    for step in steps:
        pipeline.on_steps([step])
    pipeline.shutdown()
    stats = tracing.shutdown(timeout_s=60)
    assert stats.dropped == 0 and stats.failed == 0
    store = TraceStore.load(tmp_path / "traces")
    return pipeline, metrics, [s for t in store.trace_ids() for s in store.spans(t)]


def test_over_budget_steps_keep_their_step_span_and_are_counted_as_sampled_out(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    # 200 steps/s for 2 s, one in 40 ten times slower; a budget of 580 layer spans/s = 10 steps/s
    steps = [v2_step(rng, index=i, duration_ns=(20 if i % 40 == 39 else 2) * MS, period_ns=5 * MS)
             for i in range(400)]
    pipeline, metrics, spans = run(tmp_path, steps, layer_spans_per_s=10 * LAYERS)
    stats = pipeline.stats()
    kept = stats["layer_subtrees_kept_slow"] + stats["layer_subtrees_kept_budget"]
    assert kept + stats["layer_subtrees_sampled_out"] == len(steps)
    # budget: one second's worth at start, then 10 steps/s over the ~2 s of steps; the slow steps
    # after the first 100 (the p99 needs them) are kept whatever the budget
    slow_after_warmup = sum(1 for i in range(100, 400) if i % 40 == 39)
    assert stats["layer_subtrees_kept_slow"] == slow_after_warmup
    assert 10 + 19 <= stats["layer_subtrees_kept_budget"] <= 10 + 21
    step_spans = [s for s in spans if s.name == "moe.step"]
    layer_spans = [s for s in spans if s.name == "moe.layer"]
    assert len(step_spans) == len(steps)  # every step has its span
    out = [s for s in step_spans if s.attributes.get("moe.step.layers_sampled_out")]
    assert len(out) == stats["layer_subtrees_sampled_out"]
    assert len(layer_spans) == kept * LAYERS
    parents_with_layers = {s.parent_span_id for s in layer_spans}
    assert not parents_with_layers & {s.span_id for s in out}  # a sampled-out step has no layer child
    # the step span keeps the step's routing health either way
    assert all("moe.expert_load.gini" in s.attributes for s in step_spans)
    # every step counts in metrics whatever was sampled
    assert metrics.get("moescope_steps") == len(steps)
    routed = sum(layer.router.routed() for s in steps for layer in s.layers if layer.router is not None)
    metrics.refresh()
    counted = sum(sample.value for family in metrics.registry.collect() for sample in family.samples
                  if sample.name == "moescope_expert_tokens_total")
    assert counted == routed  # top-N experts per layer plus "other": all tokens, whatever the labels


@pytest.mark.parametrize(("rate", "kept_all"), [(float("inf"), True), (0.0, False)])
def test_all_keeps_every_subtree_and_zero_only_slow_ones(tmp_path: Path, rate: float, kept_all: bool) -> None:
    rng = np.random.default_rng(4)
    steps = [v2_step(rng, index=i, duration_ns=(30 if i == 150 else 2) * MS, period_ns=5 * MS, layers=4)
             for i in range(160)]
    pipeline, _metrics, spans = run(tmp_path, steps, layer_spans_per_s=rate)
    stats = pipeline.stats()
    layer_spans = [s for s in spans if s.name == "moe.layer"]
    if kept_all:
        assert stats["layer_subtrees_sampled_out"] == 0 and len(layer_spans) == len(steps) * 4
    else:
        assert stats["layer_subtrees_kept_slow"] == 1 and stats["layer_subtrees_kept_budget"] == 0
        assert len(layer_spans) == 4  # the one slow step's


def test_sampler_rejects_a_negative_or_nan_budget() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="layer_spans_per_s"):
            LayerSampler(layer_spans_per_s=bad)


def test_a_sampled_out_step_lets_its_layer_tree_go_at_once_and_keeps_its_step_attributes(tmp_path: Path) -> None:
    """At production depth the step buffer is mostly layer trees waiting for their requests; a step
    whose subtree is sampled out needs none, so the join drops it at StepSeen (kept ones wait)."""
    rng = np.random.default_rng(5)
    steps = [v2_step(rng, index=i, duration_ns=2 * MS, period_ns=5 * MS) for i in range(120)]
    for i, step in enumerate(steps):
        step.requests.extend([1000 + i, 2000 + i])  # marked requests that no kernel record claims (yet)
    # the step spans' health when every subtree is kept (no tree is let go early): the reference
    _pipeline, _metrics, all_kept = run(tmp_path / "all", steps, layer_spans_per_s=float("inf"))
    expected_gini = {s.start_ns: s.attributes["moe.expert_load.gini"] for s in all_kept if s.name == "moe.step"}
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path / "sampled"),
                                                              queue_spans=1 << 18), env={}))
    pipeline = Pipeline(spans=tracing.factory, metrics=Metrics(), epoch_offset_ns=0, clock=lambda: steps[-1].end_ns,
                        layer_spans_per_s=10 * LAYERS)
    held = []
    for step in steps:
        pipeline.on_steps([step])
        b = pipeline.join._buffer[-1]
        held.append((b, bool(b.step.layers)))
    stats = pipeline.stats()
    traces = pipeline.traces
    assert traces is not None
    released = pipeline.join.stats()["step_trees_released_unread"]
    assert released == stats["layer_subtrees_sampled_out"] > 0
    for b, has_tree in held:
        kept = traces.layer_tree_needed(b)
        assert has_tree == kept  # sampled out: no tree left in the buffer; kept: waits for its requests
        assert b.layer_count == LAYERS
    assert pipeline.join._buffered_layers == (len(steps) - released) * LAYERS
    pipeline.shutdown()  # flush: every step retires unclaimed and gets its own trace
    assert tracing.shutdown(timeout_s=60).dropped == 0
    store = TraceStore.load(tmp_path / "sampled" / "traces")
    step_spans = [s for t in store.trace_ids() for s in store.spans(t) if s.name == "moe.step"]
    assert len(step_spans) == len(steps) == len(expected_gini)
    for span in step_spans:
        assert span.attributes["moe.step.layers"] == LAYERS
        # the health a sampled-out step's span carries was taken before its table went
        assert span.attributes["moe.expert_load.gini"] == pytest.approx(expected_gini[span.start_ns])


def test_the_steps_device_times_reach_the_step_and_layer_spans(tmp_path: Path) -> None:
    """moe.step.device (a runtime's CUDA-event times, one per layer in layer order) is on the step
    span as a total and on each layer span as its own; a vector of the wrong length is left out."""
    rng = np.random.default_rng(6)
    steps = [v2_step(rng, index=i, duration_ns=2 * MS, period_ns=5 * MS, layers=4) for i in range(3)]
    steps[0].device_time_us = np.array([10.0, 20.0, 30.0, 40.0], dtype=np.float32)
    steps[1].device_time_us = np.array([1.0, 2.0], dtype=np.float32)  # 2 values for 4 layers: left out
    _pipeline, _metrics, spans = run(tmp_path, steps, layer_spans_per_s=float("inf"))
    by_start = {s.start_ns: s for s in spans if s.name == "moe.step"}
    first, second, third = (by_start[s.start_ns] for s in steps)
    assert first.attributes["moe.step.device_time_us"] == pytest.approx(100.0)
    assert "moe.step.device_time_us" not in second.attributes
    assert "moe.step.device_time_us" not in third.attributes
    layers = {s.attributes["moe.layer"]: s for s in spans
              if s.name == "moe.layer" and s.parent_span_id == first.span_id}
    assert {k: v.attributes["moe.experts.device_time_us"] for k, v in layers.items()} == pytest.approx(
        {0: 10.0, 1: 20.0, 2: 30.0, 3: 40.0})
    assert not any("moe.experts.device_time_us" in s.attributes for s in spans
                   if s.name == "moe.layer" and s.parent_span_id != first.span_id)


@pytest.mark.parametrize("detail", ["layer", "expert"])
def test_a_compact_layer_has_no_router_span_or_router_time(tmp_path: Path, detail: str) -> None:
    """moe/v2.2 compact steps: the router was never timed (no moe.router range was sent), so its
    layer's span carries no router duration and --span-detail expert makes no moe.router span;
    the routing numbers from the step vectors are on the layer span all the same."""
    rng = np.random.default_rng(4)
    steps = [v2_step(rng, index=i, duration_ns=2 * MS, period_ns=5 * MS, layers=4) for i in range(3)]
    for step in steps:
        for layer in step.layers:
            r = layer.router
            assert r is not None
            layer.router = RouterEvent(layer=r.layer, start_ns=layer.start_ns, end_ns=layer.start_ns,
                                       entropy_bits=r.entropy_bits, counts=r.counts, timed=False)
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path), queue_spans=1 << 18), env={}))
    pipeline = Pipeline(spans=tracing.factory, metrics=Metrics(), epoch_offset_ns=0, clock=lambda: steps[-1].end_ns,
                        layer_spans_per_s=float("inf"), span_detail=detail)
    for step in steps:
        pipeline.on_steps([step])
    pipeline.shutdown()
    assert tracing.shutdown(timeout_s=60).dropped == 0
    store = TraceStore.load(tmp_path / "traces")
    spans = [s for t in store.trace_ids() for s in store.spans(t)]
    layer_spans = [s for s in spans if s.name == "moe.layer"]
    assert len(layer_spans) == 3 * 4
    assert not [s for s in spans if s.name == "moe.router"]
    assert all("moe.layer.router.duration_ms" not in s.attributes for s in layer_spans)
    assert all(s.attributes["moe.router.entropy_bits"] == 5.0 for s in layer_spans)
