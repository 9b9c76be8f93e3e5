"""A step's layer spans written as OTLP/JSON text straight from its table's columns
(agent/export/otlp_span.c ``column_spans``, ``TraceOutput._encoded_layers``) are, byte for byte,
the text the same spans give when built as span objects and encoded: for columnar and object steps,
per-expert arrays (E <= 64) and top-expert lists (E > 64), NaN health, a layer with no routing row,
device times (NaN left out), precision, expert times, per-expert FFN and load ranges (a load of
unknown size: the cleaning's strings). Where a value is one the writer does not take (a non-ASCII
string) the spans are built the usual way, the same text again. The writer is used only when the
tracer's one processor exports OTLP/JSON text; and it refuses malformed columns with ValueError."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanContext, TraceFlags
from test_spans_direct import BatchTaking, CountingIds
from test_trace_children import _columns

from moescope.agent.export import SpanFactory
from moescope.agent.export.otlp_json import COLUMN_SPANS, spans_to_bytes
from moescope.agent.export.spans import EncodedSpan
from moescope.agent.join import BufferedStep, RequestJoin, RuntimeSeen
from moescope.agent.outputs.traces import TraceOutput
from moescope.collectors.moe_convention import ExpertLoadEvent, StepEvent

pytestmark = pytest.mark.skipif(COLUMN_SPANS is None, reason="the native encoder is not built")

L = 9  # test_trace_children._columns' layers
RESOURCE = Resource.create({"service.name": "t"})


def _step(e: int, *, columnar: bool, times: bool, ffns: bool, loads: bool = False, seed: int = 1) -> StepEvent:
    device = np.arange(L, dtype=np.float64) * 1.5 + 0.25
    device[2] = np.nan  # left out of its layer span
    columns = _columns(e, times=times, ffns=ffns, seed=seed)
    if columnar:
        return StepEvent(3, 3, 9_000, 30_000, 64, [7], None, None, device, columns=columns)
    layers = columns.materialize()
    layers[1].router = None  # a layer with no routing row: no health on its span
    if loads:
        layers[0].loads = [ExpertLoadEvent(3, 10_010, 10_020, None), ExpertLoadEvent(1, 10_030, 10_050, 4096)]
    return StepEvent(3, 3, 9_000, 30_000, 64, [7], None, layers, device)


def _spans(step: StepEvent, e: int, *, takes: bool, precision: dict[int, str] | None = None) -> list[Any]:
    batch = BatchTaking(takes_encoded_json=takes)
    provider = TracerProvider(sampler=ALWAYS_ON, resource=RESOURCE, id_generator=CountingIds())
    provider.add_span_processor(batch)
    factory = SpanFactory(provider.get_tracer("moescope"))
    out = TraceOutput(factory, epoch_offset_ns=1_000_000)
    out.export([RuntimeSeen(state=None, layer_precision=precision or {0: "fp16", 4: "fp32"})])  # type: ignore[arg-type]
    join = RequestJoin(clock=lambda: 0)
    b = BufferedStep(seq=1, step=step, num_experts=e, table=join._table(step, e), batch_size=1,
                     layer_count=step.layer_count)
    assert factory.hold()
    out._step_tree(b, parent=None, extra={})
    factory.release()
    return batch.spans


@pytest.mark.parametrize("e", [16, 80])
@pytest.mark.parametrize(("columnar", "times", "ffns", "loads"), [
    (True, True, True, False), (True, False, False, False), (True, True, False, False),
    (False, True, True, False), (False, False, False, True), (False, True, False, True),  # (loads: objects only)
])
def test_layer_spans_as_text_are_their_spans_encoded(e: int, columnar: bool, times: bool, ffns: bool,
                                                     loads: bool) -> None:
    written = _spans(_step(e, columnar=columnar, times=times, ffns=ffns, loads=loads, seed=e), e, takes=True)
    built = _spans(_step(e, columnar=columnar, times=times, ffns=ffns, loads=loads, seed=e), e, takes=False)
    assert [type(s) for s in written] == [EncodedSpan] * (L + 1)  # the step span (plain_spans), then its layers
    assert [type(s) for s in built] == [ReadableSpan] * (L + 1)
    assert spans_to_bytes(written) == spans_to_bytes(built)
    one_by_one = b",".join(spans_to_bytes([s])[:-1] for s in written)  # each alone: the same text too
    assert one_by_one == b",".join(spans_to_bytes([s])[:-1] for s in built)


def test_a_value_the_writer_does_not_take_builds_the_spans() -> None:
    # a non-ASCII precision: the native writer declines (ValueError inside), the spans are built
    # and encoded as before (the Python encoder writes that attribute)
    precision = {0: "fp16\u00e9", 4: "fp32"}
    written = _spans(_step(16, columnar=True, times=True, ffns=False), 16, takes=True, precision=precision)
    built = _spans(_step(16, columnar=True, times=True, ffns=False), 16, takes=False, precision=precision)
    assert [type(s) for s in written] == [EncodedSpan] + [ReadableSpan] * L  # (the step span: text all the same)
    # (the writer drew its span ids before declining; the spans built after it drew their own)
    assert _ids_in_order(spans_to_bytes(written)) == _ids_in_order(spans_to_bytes(built))


def _ids_in_order(line: bytes) -> bytes:
    """The line with each span id replaced by its order of first appearance."""
    seen: dict[bytes, bytes] = {}
    return re.sub(rb'"([0-9a-f]{16})"', lambda m: b'"#%d"' % int(seen.setdefault(m.group(1), b"%d" % len(seen))),
                  line)


def test_not_holding_or_not_json_builds_the_spans() -> None:
    batch = BatchTaking(takes_encoded_json=True)
    provider = TracerProvider(sampler=ALWAYS_ON, resource=RESOURCE, id_generator=CountingIds())
    provider.add_span_processor(batch)
    factory = SpanFactory(provider.get_tracer("moescope"))
    parent = SpanContext(5, 6, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    assert not factory.takes_encoded(parent)  # not holding
    assert factory.hold()
    assert factory.takes_encoded(parent)
    assert not factory.takes_encoded(SpanContext(0, 0, is_remote=False))  # an invalid parent
    factory.release()
    provider.add_span_processor(BatchTaking(takes_encoded_json=True))  # two processors: spans for both
    assert factory.hold()
    assert not factory.takes_encoded(parent)
    factory.release()
    other = TracerProvider(sampler=ALWAYS_ON, resource=RESOURCE)
    other.add_span_processor(BatchTaking(takes_encoded_json=False))
    other_factory = SpanFactory(other.get_tracer("moescope"))
    assert other_factory.hold() and not other_factory.takes_encoded(parent)
    other_factory.release()


def _args(**changes: Any) -> list[Any]:
    parent = SpanContext(7 << 64 | 9, 11, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    args: dict[str, Any] = dict(
        parent=parent, name="moe.layer", span_ids=[21, 22], starts=[100, 200], ends=[150, 250], heads=[0, 2],
        head_key="moe.layer", rows=[0, -1], head2_key="moe.layer.experts", head2=4, keys=("a", "b"),
        columns=[[1.5], [7]], first_key="t", first=[[1, 2, 3, 4]], second_key="d", second=[[]],
        extras=[{"x": 1.0}, {}])
    args.update(changes)
    return list(args.values())


def test_column_spans_writes_what_it_is_given() -> None:
    assert COLUMN_SPANS is not None
    texts = COLUMN_SPANS(*_args())
    assert texts[0] == (b'{"traceId":"00000000000000070000000000000009","spanId":"0000000000000015",'
                        b'"parentSpanId":"000000000000000b","name":"moe.layer","kind":1,'
                        b'"startTimeUnixNano":"100","endTimeUnixNano":"150","attributes":['
                        b'{"key":"moe.layer","value":{"intValue":"0"}},{"key":"moe.layer.experts","value":{"intValue":"4"}},'
                        b'{"key":"a","value":{"doubleValue":1.5}},{"key":"b","value":{"intValue":"7"}},'
                        b'{"key":"t","value":{"arrayValue":{"values":[{"intValue":"1"},{"intValue":"2"},'
                        b'{"intValue":"3"},{"intValue":"4"}]}}},{"key":"x","value":{"doubleValue":1.0}}],'
                        b'"status":{},"flags":256}')
    assert b'"attributes":[{"key":"moe.layer","value":{"intValue":"2"}}]' in texts[1]  # no row: the head alone


@pytest.mark.parametrize("changes", [
    {"starts": [100]},  # lists of different lengths
    {"columns": [[1.5]]},  # fewer columns than keys
    {"columns": [[1.5], [7, 8]]},  # a column longer than the rows
    {"rows": [0, 1]},  # a row past the table
    {"rows": [0, -2]},
    {"rows": [0, "1"]},
    {"extras": [{"x": None}, {}]},  # not as a span stores it
    {"extras": [{"x": float("nan")}, {}]},
    {"extras": [{"": 1}, {}]},
    {"extras": [{"x": object()}, {}]},
    {"extras": [{"x": "caf\u00e9"}, {}]},  # non-ASCII: the Python encoder's
    {"extras": [[("x", 1)], {}]},
    {"span_ids": [1 << 64, 22]},
    {"span_ids": [-1, 22]},
    {"starts": [1 << 63, 200]},
    {"heads": [1 << 64, 2]},
    {"first": [(1, object())]},
    {"parent": (1, 2)},
])
def test_column_spans_refuses_what_is_not_as_described(changes: dict[str, Any]) -> None:
    assert COLUMN_SPANS is not None
    with pytest.raises((ValueError, TypeError)):
        COLUMN_SPANS(*_args(**changes))


def test_the_agents_file_export_takes_layer_spans_as_text(tmp_path: Any) -> None:
    # the agent's own pipeline (build_tracing, OTLP-JSON files): its processor takes text, so a
    # kept step's layer spans go as text, and the file holds them as spans like any other
    from moescope.agent.export import build_tracing
    from moescope.agent.export.config import ExportConfig
    from moescope.agent.metrics import Metrics

    wanted: dict[str, Any] = dict(queue_spans=4096, batch_spans=512, schedule_delay_ms=500, shutdown_timeout_ms=10_000,
                                  traces_dir=tmp_path, file_max_bytes=1 << 24, files_keep=2, otlp=None)
    config = ExportConfig(**{k: v for k, v in wanted.items() if k in ExportConfig.__dataclass_fields__})
    tracing = build_tracing(config, resource_attributes={"service.name": "t"}, metrics=Metrics())
    try:
        assert tracing.processor.takes_encoded_json
        out = TraceOutput(tracing.factory, epoch_offset_ns=0)
        step = _step(16, columnar=True, times=True, ffns=False)
        join = RequestJoin(clock=lambda: 0)
        b = BufferedStep(seq=1, step=step, num_experts=16, table=join._table(step, 16), batch_size=1,
                         layer_count=step.layer_count)
        factory = tracing.factory
        assert factory.hold()
        out._step_tree(b, parent=None, extra={})
        held = list(factory._held or [])
        factory.release()
        assert [type(s) for s in held] == [EncodedSpan] * (L + 1)
        assert tracing.force_flush(10.0)
    finally:
        stats = tracing.shutdown(10.0)
    assert stats.exported == L + 1 and stats.dropped == 0
    import json
    lines = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    spans = [s for line in lines for r in line["resourceSpans"] for sc in r["scopeSpans"] for s in sc["spans"]]
    assert sorted(s["name"] for s in spans) == ["moe.layer"] * L + ["moe.step"]
    step_span = next(s for s in spans if s["name"] == "moe.step")
    assert all(s["parentSpanId"] == step_span["spanId"] for s in spans if s["name"] == "moe.layer")
