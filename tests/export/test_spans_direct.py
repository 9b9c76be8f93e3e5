"""SpanFactory's direct path (ReadableSpan built by the factory) against the SDK's start_span path.

Both factories run the same calls on tracers with the same deterministic id sequence; the spans
they export must be the same: every field, attribute values with their types, dropped counts under
tight limits, and the same OTLP-JSON text.
"""

from __future__ import annotations

import itertools
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags, TraceState
from sample_trace import emit_sample

from moescope.agent.export import SpanEvent, SpanFactory, SpanLink
from moescope.agent.export.otlp_json import request_to_line, spans_to_line
from moescope.agent.export.spans import SharedBoundedAttributes, SharedLink, shared_attributes

SHARED_LINK = shared_attributes({"moe.link": "step.owner"})


class BatchTaking(SpanProcessor):
    """A tracer's one processor that takes a batch (``on_end_sampled``, as the agent's does) and
    says whether its exporter writes OTLP/JSON text (the factory hands text on only then)."""

    def __init__(self, *, takes_encoded_json: bool) -> None:
        self.takes_encoded_json = takes_encoded_json
        self.spans: list[Any] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)

    def on_end_sampled(self, spans: list[Any]) -> None:
        self.spans.extend(spans)


class CountingIds(IdGenerator):
    """Deterministic ids, so two tracers fed the same calls give the same ids."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return (1 << 100) + next(self._next)


def _factory(
    *, direct: bool, limits: SpanLimits, ids: IdGenerator | None = None
) -> tuple[SpanFactory, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.create({"service.name": "t"}), span_limits=limits,
                              id_generator=ids or CountingIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    factory = SpanFactory(provider.get_tracer("moescope", "9.9"), direct=direct)
    assert factory.direct is direct
    return factory, exporter


def _workload(factory: SpanFactory) -> None:
    emit_sample(factory)
    remote = SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("k", "v")]))
    many = {f"a{i}": i for i in range(6)}
    span = factory.start("over-limits", start_ns=10, parent=remote, kind=SpanKind.CONSUMER, attributes=many,
                         links=[SpanLink(remote, {"x": 1, "y": 2, "z": 3}) for _ in range(4)])
    factory.end(span, end_ns=20, attributes={"a0": "again", "late": [1.5, 2]},
                events=[SpanEvent(f"e{i}", 11 + i, {"i": i, "j": [i], "k": "s"}) for i in range(5)], error="bad")
    ok = factory.start("ok-then-error", start_ns=30)
    ok.set_status(StatusCode.OK)
    ok.set_status(StatusCode.ERROR, "ignored after OK")
    ok.set_attribute("moe.x", 3)
    ok.update_name("renamed")
    ok.end(end_time=40)
    ok.end(end_time=50)  # ignored: already ended
    ok.set_attribute("after", 1)  # ignored: already ended
    factory.record("skewed", start_ns=100, end_ns=90, attributes={"n": None, "nan": float("nan"), "e": []})
    # shared attribute sets: one object on several spans and links, copied for a late change
    shared = shared_attributes({"moe.step.tokens": 8, "moe.step.requests": [3, 1], "nan": float("nan")})
    link = (SpanLink(remote, SHARED_LINK),)
    for i in range(2):
        factory.record(f"stub{i}", start_ns=200 + i, end_ns=210, attributes=shared, links=link)
    late = factory.start("stub-late", start_ns=220, attributes=shared, links=link)
    factory.end(late, end_ns=230, attributes={"moe.step.tokens": 9, "extra": 1.5})
    # record() without events or an error (the agent's phases and layers) takes a shorter
    # path to the finished span: the limits must bite there as in the SDK too
    factory.record("record-over-limits", start_ns=300, end_ns=310, parent=remote, kind=SpanKind.PRODUCER,
                   attributes=many, links=[SpanLink(remote, {"x": 1, "y": 2, "z": 3}) for _ in range(4)])
    # record() with events (a step span's device sample: a shared attribute set) takes the short path too
    memory = shared_attributes({"moe.device": "host", "used": 3, "ratio": 0.5, "nan": float("nan")})
    factory.record("record-events", start_ns=320, end_ns=330, parent=remote, attributes={"a": 1},
                   events=[SpanEvent("moe.device.sample", 321, memory), SpanEvent("plain", 322, {"i": [1, 2]})])
    factory.record("record-events-over-limits", start_ns=340, end_ns=350,
                   events=[SpanEvent(f"e{i}", 341 + i, memory if i % 2 else {"i": i, "j": 2, "k": 3})
                           for i in range(5)])
    # record_children (a step's layer spans): attributes already as stored; under a valid parent (one
    # trace), an invalid one (each child a root of its own), past the attribute limit, end before start
    parent = factory.record("layers-parent", start_ns=400, end_ns=490, parent=remote)
    stored = [(410 + i, 420 + i, {"moe.layer": i, "moe.expert.tokens": (i, 2), "h": 0.5, "s": "x", "b": True})
              for i in range(3)]
    assert factory.record_children("moe.layer", parent=parent, children=stored) == 3
    assert factory.record_children("moe.layer", parent=SpanContext(0, 0, False),
                                   children=[(440, 430, {"a": 1}), (450, 460, {})]) == 2
    # record_siblings (a request's phases), made while the factory holds its finished spans: names,
    # attributes to clean, links plain and shared, past the limits, an invalid parent, end before start
    holding = factory.hold()
    siblings = [
        ("receive", 500, 510, None, ()),
        ("prefill", 510, 505, {"moe.phase.steps_unlinked": 3, "n": None, "arr": [1, 2]},
         (SpanLink(remote, SHARED_LINK), SpanLink(remote, {"x": 1}))),
        ("decode", 520, 530, many, [SpanLink(remote, {"x": 1, "y": 2, "z": 3}) for _ in range(4)]),
    ]
    assert factory.record_siblings(parent, siblings) == 3
    assert factory.record_siblings(SpanContext(0, 0, False), siblings[:2]) == 2
    if holding:
        factory.release()


def _fields(span: ReadableSpan) -> dict[str, Any]:
    return {
        "name": span.name, "context": span.context, "parent": span.parent, "kind": span.kind,
        "start": span.start_time, "end": span.end_time,
        "attributes": [(k, v, type(v)) for k, v in (span.attributes or {}).items()],
        "dropped_attributes": span.dropped_attributes,
        "events": [(e.name, e.timestamp, dict(e.attributes or {}), e.dropped_attributes) for e in span.events],
        "dropped_events": span.dropped_events,
        "links": [(lk.context, dict(lk.attributes or {}), lk.dropped_attributes) for lk in span.links],
        "dropped_links": span.dropped_links,
        "status": (span.status.status_code, span.status.description),
        "resource": span.resource, "scope": span.instrumentation_scope,
    }


def test_direct_spans_equal_sdk_spans() -> None:
    for limits in (SpanLimits(), SpanLimits(max_span_attributes=4, max_events=3, max_links=2, max_event_attributes=2,
                                            max_link_attributes=2)):
        direct, direct_out = _factory(direct=True, limits=limits)
        sdk, sdk_out = _factory(direct=False, limits=limits)
        _workload(direct)
        _workload(sdk)
        a, b = list(direct_out.get_finished_spans()), list(sdk_out.get_finished_spans())
        assert len(a) == len(b) == 26
        assert [_fields(s) for s in a] == [_fields(s) for s in b]
        assert spans_to_line(a) == spans_to_line(b) == request_to_line(encode_spans(b))
    over = {s.name: s for s in a}["over-limits"]
    assert (over.dropped_attributes, over.dropped_events, over.dropped_links) == (4, 2, 2)  # the limits did bite
    recorded = {s.name: s for s in a}["record-over-limits"]
    assert (recorded.dropped_attributes, recorded.dropped_links) == (2, 2)


def test_shared_attributes_are_carried_as_one_object_and_never_changed() -> None:
    """A shared attribute set is the very object on every span given it (and a links tuple of shared
    set one SharedLink per SpanLink), encoded to the protobuf route's text each time; a span given late
    attributes takes a copy, so the others and the shared set keep theirs."""
    direct, out = _factory(direct=True, limits=SpanLimits())
    _workload(direct)
    spans = {s.name: s for s in out.get_finished_spans()}
    stub0, stub1, late = spans["stub0"], spans["stub1"], spans["stub-late"]
    assert stub0._attributes is stub1._attributes  # (the SDK's .attributes is a fresh read-only view)
    assert dict(stub0.attributes or {}) == {"moe.step.tokens": 8, "moe.step.requests": (3, 1)}  # cleaned once: no NaN
    assert stub0.links[0] is stub1.links[0] is late.links[0]  # one immutable SharedLink for the SpanLink
    assert type(stub0.links[0]) is SharedLink
    assert dict(late.attributes or {}) == {"moe.step.requests": (3, 1), "moe.step.tokens": 9, "extra": 1.5}
    assert late._attributes is not stub0._attributes and dict(stub1.attributes or {})["moe.step.tokens"] == 8
    for _ in range(2):  # the second pass is the encoder's cached text
        assert spans_to_line([stub0, stub1, late]) == request_to_line(encode_spans([stub0, stub1, late]))
    # events given one shared set carry one immutable SharedBoundedAttributes, cleaned once (no NaN)
    first = spans["record-events"].events[0].attributes
    again = [e.attributes for e in spans["record-events-over-limits"].events if e.name in ("e1", "e3")]
    assert type(first) is SharedBoundedAttributes and all(a is first for a in again)
    assert dict(first) == {"moe.device": "host", "used": 3, "ratio": 0.5}
    with_events = [spans["record-events"], spans["record-events-over-limits"]]
    for _ in range(2):
        assert spans_to_line(with_events) == request_to_line(encode_spans(with_events))


def test_a_shared_span_link_is_one_sdk_link_in_any_tuple() -> None:
    """The links to a step's owner span: one SpanLink object, in a different tuple on each request's
    phase span, becomes the same SharedLink every time (its text is written once); a link with
    plain attributes gets its own Link."""
    direct, out = _factory(direct=True, limits=SpanLimits())
    owner = direct.record("owner", start_ns=1, end_ns=2)
    to_owner = SpanLink(owner, SHARED_LINK)
    other = direct.record("other", start_ns=1, end_ns=2)
    for i in range(3):
        direct.record(f"phase{i}", start_ns=3, end_ns=4, links=(to_owner, SpanLink(other, {"i": i})))
    spans = {s.name: s for s in out.get_finished_spans()}
    firsts = [spans[f"phase{i}"].links[0] for i in range(3)]
    assert firsts[0] is firsts[1] is firsts[2] and type(firsts[0]) is SharedLink
    seconds = [spans[f"phase{i}"].links[1] for i in range(3)]
    assert len({id(link) for link in seconds}) == 3 and all(type(link) is not SharedLink for link in seconds)
    assert [dict(link.attributes or {}) for link in seconds] == [{"i": 0}, {"i": 1}, {"i": 2}]
    phases = [spans[f"phase{i}"] for i in range(3)]
    assert spans_to_line(phases) == request_to_line(encode_spans(phases))


def test_random_trace_id_flag_and_remote_parent_as_sdk() -> None:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    direct, out = _factory(direct=True, limits=SpanLimits(), ids=RandomIdGenerator())
    root = direct.record("root", start_ns=1, end_ns=2)
    child = direct.record("child", start_ns=1, end_ns=2, parent=root)
    remote = SpanContext(trace_id=5, span_id=6, is_remote=True, trace_flags=TraceFlags(1))
    under_remote = direct.record("under-remote", start_ns=1, end_ns=2, parent=remote)
    assert root.trace_flags == child.trace_flags == TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
    assert under_remote.trace_flags == TraceFlags(TraceFlags.SAMPLED)  # the remote parent's trace id is not ours
    assert under_remote.trace_id == 5 and not under_remote.is_remote
    invalid = SpanContext(trace_id=0, span_id=0, is_remote=False)
    orphan = direct.record("invalid-parent", start_ns=1, end_ns=2, parent=invalid)
    spans = {s.name: s for s in out.get_finished_spans()}
    assert spans["invalid-parent"].parent is None and orphan.trace_id != 0
    assert spans["child"].parent == root and spans["under-remote"].parent == remote


def test_sdk_path_kept_where_direct_would_differ() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # ParentBased sampler: the SDK decides
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert SpanFactory(provider.get_tracer("t")).direct is False
    limited = TracerProvider(sampler=ALWAYS_ON, span_limits=SpanLimits(max_span_attribute_length=8))
    assert SpanFactory(limited.get_tracer("t")).direct is False  # value truncation: the SDK does it
    assert SpanFactory(TracerProvider(sampler=ALWAYS_ON).get_tracer("t")).direct is True


def test_finished_span_sets_exactly_the_fields_the_sdk_constructor_sets() -> None:
    """The factory builds ReadableSpan objects without the SDK's keyword constructor (spans.py
    finished_span): the same type and the same instance fields, each the object given. An SDK that
    adds, renames or derives a field fails here."""
    from opentelemetry.sdk.util.instrumentation import InstrumentationInfo, InstrumentationScope
    from opentelemetry.trace import Link, Status

    from moescope.agent.export.spans import finished_span

    context = SpanContext(1 << 70, 7, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent = SpanContext(1 << 70, 3, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    args: dict[str, Any] = dict(
        name="moe.step", context=context, parent=parent, kind=SpanKind.SERVER, attributes={"a": 1},
        links=(Link(parent),), events=(), status=Status(StatusCode.ERROR, "boom"), start_time=10, end_time=20,
        resource=Resource.create({"service.name": "t"}), instrumentation_info=InstrumentationInfo("moescope"),
        instrumentation_scope=InstrumentationScope("moescope"),
    )
    sdk = ReadableSpan(**args)
    ours = finished_span(args["name"], context, parent, args["kind"], args["attributes"], args["links"],
                         args["events"], args["status"], 10, 20, args["resource"], args["instrumentation_info"],
                         args["instrumentation_scope"])
    assert type(ours) is ReadableSpan
    assert vars(ours).keys() == vars(sdk).keys()
    for key, value in vars(sdk).items():
        assert getattr(ours, key) is value or getattr(ours, key) == value, key
    assert spans_to_line([ours]) == spans_to_line([sdk])
