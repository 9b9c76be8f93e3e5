"""Bad input reaching the pipeline is counted and left out, never raised into the collector's sink."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.export.store import TraceStore
from moescope.agent.metrics import Metrics
from moescope.agent.pipeline import Pipeline

from .scenario import NUM_LAYERS, FakeClock, build_step, record


def test_marks_outside_a_configured_expert_count_are_counted_not_raised(tmp_path: Path) -> None:
    """``--num-experts 4`` but the runtime marks experts up to 11, and payloads that went negative:
    each bad layer is counted and its health left out; the steps still join and export."""
    rng = np.random.default_rng(5)
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={}))
    metrics = Metrics()
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, metrics=metrics, num_experts=4, clock=clock, epoch_offset_ns=0,
                        span_detail="expert")
    first = build_step(rng, pid=1, tid=1, start_ms=10, end_ms=20, keys=[3], tokens=40, load_layer=0)
    second = build_step(rng, pid=1, tid=1, start_ms=30, end_ms=40, keys=[3], tokens=40, load_layer=1)
    for layer in (*first.layers, *second.layers):
        layer.num_experts = None  # a moe/v0 producer: E comes from --num-experts (the payload would win)
    second.tokens = -5  # an int64 payload gone wrong
    second.layers[1].loads[0].bytes_moved = -1
    clock.now_ns = second.end_ns
    pipeline.on_steps([first, second])  # one batch: a bad first step must not lose the second
    rec = record(pid=1, tid=1, fd=3, generation=1, seq=1, peer=("127.0.0.1", 9), start_ms=0, end_ms=50,
                 bytes_in=10, bytes_out=20)
    pipeline.on_request(rec)
    pipeline.expire(flush=True)
    tracing.shutdown(timeout_s=30)

    stats = pipeline.stats()
    assert stats["steps"] == 2 and stats["requests_joined"] == 1 and stats["steps_joined"] == 2
    assert stats["layers_bad_routing"] == 2 * NUM_LAYERS  # every layer routes to experts >= 4
    assert metrics.get("moescope_steps") == 2
    assert metrics.get("moescope_step_tokens") == 40  # the negative payload is not counted
    assert metrics.get("moescope_expert_load_bytes") == first.layers[0].loads[0].bytes_moved
    store = TraceStore.load(tmp_path / "traces")
    spans = [s for t in store.trace_ids() for s in store.spans(t)]
    assert len(spans) == stats["spans"]
    layers = [s for s in spans if s.name == "moe.layer"]
    assert len(layers) == 2 * NUM_LAYERS
    assert all(set(s.attributes) == {"moe.layer"} for s in layers)  # no health from bad marks
    assert len([s for s in spans if s.name == "moe.router"]) == 2 * NUM_LAYERS
