"""A step's layer spans (``--span-detail layer``) built from the parser's LayerColumns are the spans
its LayerEvent objects give: the same names, times, parents and attributes (keys, order, values and
their types), for steps mixing router ranges, step vectors and no router, fused-experts ranges with
and without per-expert times (as arrays up to 64 experts, as the slowest 16 above), per-expert FFN
ranges, per-layer device time, a precision from the runtime, and NaN health (a layer with no tokens).
The column builder skips the span cleaning (``SpanFactory.record_children``), so this is also the
check that what it makes is already as a span stores it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from test_spans_direct import CountingIds

from moescope.agent.export import SpanFactory
from moescope.agent.export.spans import span_attributes
from moescope.agent.join import BufferedStep, RequestJoin, RuntimeSeen
from moescope.agent.outputs.traces import TraceOutput
from moescope.collectors.moe_convention import (
    ROUTER_NONE,
    ROUTER_RANGE,
    ROUTER_STEP_VECTORS,
    FfnColumns,
    LayerColumns,
    StepEvent,
)

L = 9


def _columns(e: int, *, times: bool, ffns: bool, seed: int) -> LayerColumns:
    rng = np.random.default_rng(seed)
    start = np.arange(L, dtype=np.int64) * 1_000 + 10_000
    counts = rng.integers(0, 40, size=(L, 2 * e)).astype(np.int64)
    counts[3] = 0  # no tokens: NaN entropy, Gini and drop fraction in its health
    kinds = np.array([ROUTER_RANGE, ROUTER_STEP_VECTORS, ROUTER_NONE] * 3, dtype=np.int8)
    entropy = rng.random(L) * 3
    entropy[3] = np.nan
    has_experts = np.array([True, True, False] * 3)
    time_us: list[np.ndarray | None] | None = None
    if times:
        time_us = [rng.random(e) * 100 if i % 4 else None for i in range(L)]
        if e > 32:
            time_us[1] = np.full(e, 7.0)  # every expert tied: the slowest 16 by id
    ffn_columns = None
    if ffns:
        layer = np.array([0, 0, 2, 5, 5, 5], dtype=np.int64)  # positions; layers 1, 3, 4, ... have none
        ffn_start = start[layer] + np.arange(len(layer)) * 10 + 3
        ffn_columns = FfnColumns(layer=layer, expert=np.array([3, 1, 0, 7, 2, 5], dtype=np.int64),
                                 start_ns=ffn_start, end_ns=ffn_start + rng.integers(1, 9, len(layer)),
                                 tokens=np.array([4, 9, 1, 0, 3, 2], dtype=np.int64))
    return LayerColumns(
        layer=np.arange(L, dtype=np.int64) * 2, start_ns=start, end_ns=start + 900, num_experts=e,
        router_kind=kinds, router_start_ns=start + 5, router_end_ns=start + 5 + rng.integers(1, 400, L),
        entropy_bits=entropy, has_routing=np.ones(L, dtype=bool), counts=counts, has_experts=has_experts,
        experts_start_ns=start + 450, experts_end_ns=start + 450 + rng.integers(1, 400, L),
        experts_tokens=rng.integers(0, 500, L).astype(np.int64), experts_time_us=time_us, ffns=ffn_columns)


def _layer_spans(step: StepEvent, e: int) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.create({"service.name": "t"}),
                              id_generator=CountingIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    out = TraceOutput(SpanFactory(provider.get_tracer("moescope")), epoch_offset_ns=1_000_000)
    # (the trace output reads only the precision map of the runtime's view)
    out.export([RuntimeSeen(state=None, layer_precision={0: "fp16", 4: "fp32", 16: "fp16"})])  # type: ignore[arg-type]
    join = RequestJoin(clock=lambda: 0)
    b = BufferedStep(seq=1, step=step, num_experts=e, table=join._table(step, e), batch_size=1,
                     layer_count=step.layer_count)
    out._step_tree(b, parent=None, extra={})
    spans = list(exporter.get_finished_spans())
    assert [s.name for s in spans] == ["moe.step"] + ["moe.layer"] * L
    return spans


def _fields(span: ReadableSpan) -> dict[str, Any]:
    return {"name": span.name, "context": span.context, "parent": span.parent, "start": span.start_time,
            "end": span.end_time, "attributes": [(k, v, type(v)) for k, v in (span.attributes or {}).items()],
            "dropped": span.dropped_attributes}


@pytest.mark.parametrize("e", [16, 80])
@pytest.mark.parametrize(("times", "ffns"), [(True, True), (False, False), (True, False)])
def test_layer_spans_from_columns_are_the_object_paths(e: int, times: bool, ffns: bool) -> None:
    device = np.arange(L, dtype=np.float64) * 1.5
    device[2] = np.nan  # a NaN device time is left out of its layer span
    columnar = StepEvent(3, 3, 9_000, 30_000, 64, [7], None, None, device, columns=_columns(e, times=times,
                                                                                            ffns=ffns, seed=e))
    objects = StepEvent(3, 3, 9_000, 30_000, 64, [7], None,
                        _columns(e, times=times, ffns=ffns, seed=e).materialize(), device)
    a, b = _layer_spans(columnar, e), _layer_spans(objects, e)
    assert columnar.columns is not None and columnar._layers is None  # no LayerEvent was made for the spans
    assert [_fields(s) for s in a] == [_fields(s) for s in b]
    layers = a[1:]
    for span in layers:
        attrs = dict(span.attributes or {})
        assert span_attributes(attrs) == attrs  # already as stored
        assert all(v == v for v in attrs.values())  # no NaN scalar
    by_layer = {s.attributes["moe.layer"]: dict(s.attributes or {}) for s in layers}  # type: ignore[index]
    assert "moe.router.entropy_bits" not in by_layer[6] and "moe.tokens.routed" in by_layer[6]  # NaN left out
    assert "moe.experts.device_time_us" not in by_layer[4] and by_layer[2]["moe.experts.device_time_us"] == 1.5
    assert by_layer[0]["moe.precision"] == "fp16" and "moe.precision" not in by_layer[2]
    assert "moe.layer.router.duration_ms" in by_layer[0] and "moe.layer.router.duration_ms" not in by_layer[2]
    assert "moe.layer.experts.duration_ms" in by_layer[2] and "moe.layer.experts.duration_ms" not in by_layer[4]
    if ffns:
        assert by_layer[10]["moe.layer.ffn.experts"] == (7, 2, 5)
        assert "moe.layer.ffn.experts" not in by_layer[2]
    if times:
        key = "moe.layer.experts.time_us" if e <= 64 else "moe.layer.experts.slowest_ids"
        assert key in by_layer[2] and key not in by_layer[0]  # layer 0 (position 0) sent no times
        if e > 64:
            assert by_layer[2]["moe.layer.experts.slowest_ids"] == tuple(range(16))  # all tied: by id


def test_as_stored_is_span_attributes_for_what_the_layer_builder_adds() -> None:
    # the object path's layers without per-expert FFN or load ranges (moe/v2) take _as_stored instead
    # of the span cleaning: for the values they add (scalars, None, NaN, lists of one type, empty
    # lists) it must leave exactly what span_attributes leaves, in the same order and types
    from moescope.agent.outputs.traces import _as_stored

    rng = np.random.default_rng(3)
    pool: list[Any] = [None, float("nan"), 0.0, -2.5, 7, 0, True, "fp16", "", [], [1.5, float("nan"), 2.0],
                       [3, 1, 2], [0.25], ["a"]]
    for _ in range(300):
        keys = [f"k{i}" for i in rng.permutation(8)[: int(rng.integers(0, 8))]]
        extra = {key: pool[int(rng.integers(0, len(pool)))] for key in keys}
        got, want = _as_stored(extra), span_attributes(extra)
        assert list(got) == list(want)
        for key in want:
            g, w = got[key], want[key]
            assert type(g) is type(w) and (g == w or (isinstance(w, tuple) and repr(g) == repr(w))), key


def test_a_v2_layer_without_a_token_count_or_device_time_leaves_them_out() -> None:
    # objects from the per-event path: a fused-experts range with no token count and a NaN device
    # time: neither key on the layer span (as the span cleaning left them), the others all there
    columns = _columns(16, times=True, ffns=False, seed=5)
    layers = columns.materialize()
    for layer in layers:
        if layer.experts is not None:
            layer.experts.tokens = None
    device = np.full(L, np.nan)
    step = StepEvent(3, 3, 9_000, 30_000, 64, [7], None, layers, device)
    spans = _layer_spans(step, 16)[1:]
    for span in spans:
        attrs = dict(span.attributes or {})
        assert "moe.layer.experts.tokens" not in attrs and "moe.experts.device_time_us" not in attrs
        assert span_attributes(attrs) == attrs
    with_experts = [dict(s.attributes or {}) for s in spans if "moe.layer.experts.duration_ms" in (s.attributes or {})]
    assert with_experts and any("moe.layer.experts.time_us" in a for a in with_experts)
