"""spans_to_line (SDK spans -> OTLP/JSON directly) against the protobuf route it replaces.

The reference is the SDK's own encoder (``encode_spans``) printed by ``google.protobuf.json_format``
(``request_to_line``): the direct mapping must give the same text, byte for byte, and that text
must parse back (``json_format``) into the very protobuf request the SDK encodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from moescope.agent.export import SpanEvent, SpanFactory, SpanLink, otlp_json
from moescope.agent.export.otlp_json import line_to_request, request_to_line, spans_to_bytes, spans_to_line
from moescope.agent.export.spans import SharedAttributes, shared_attributes


@pytest.fixture(params=["python", "native"], autouse=True)
def encoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test here runs with the Python span encoder and with the native one (which hands
    what it does not take back to Python, such as the SDK's own spans with BoundedAttributes):
    both must give the protobuf route's text."""
    if request.param == "native":
        assert otlp_json._native is not None, "agent/export/_otlp_span not built (pip install -e .)"
        monkeypatch.setattr(otlp_json, "encode_spans_text", otlp_json._spans_native)
    else:
        monkeypatch.setattr(otlp_json, "encode_spans_text", otlp_json._spans_python)
    yield request.param

ATTRS = {
    "s": "text", "empty_s": "", "utf8": "grüße ✓", "b": True, "f_b": False, "i": 42, "zero": 0, "neg": -(1 << 63),
    "big": (1 << 63) - 1, "f": 0.25, "f_int": 2.0, "f_zero": 0.0, "nan": float("nan"), "inf": float("inf"),
    "ninf": float("-inf"), "strs": ["a", "", "ü"], "ints": [1, -2, 0], "floats": [0.5, 1.0], "bools": [True, False],
    "empty": [],
    # arrays of floats: written in one join when every element is finite, else element by element
    "floats_special": [1.5, float("nan"), -0.0, float("inf"), float("-inf")], "floats_overflow": [1.7e308, 1.7e308],
    "f_neg_zero": -0.0, "f_tiny": 5e-324, "ints_edge": [-(1 << 63), (1 << 63) - 1], "ünï": "ascii key? no",
}


def _provider(
    resource: Resource, exporter: InMemorySpanExporter, *, limits: SpanLimits | None = None
) -> TracerProvider:
    provider = TracerProvider(resource=resource, span_limits=limits or SpanLimits())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _spans() -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    res_a = Resource.create({"service.name": "svc", "process.pid": 7, "host.tags": ["x", "y"]})
    res_a2 = Resource.create({"service.name": "svc", "process.pid": 7, "host.tags": ["x", "y"]})  # equal, not identical
    res_b = Resource({"service.name": "other"}, schema_url="https://opentelemetry.io/schemas/1.21.0")
    p1 = _provider(res_a, exporter, limits=SpanLimits(max_span_attributes=4, max_links=1, max_events=1))
    p2 = _provider(res_b, exporter)
    p3 = _provider(res_a2, exporter)
    f1 = SpanFactory(p1.get_tracer("moescope", "1.2.3"))
    f2 = SpanFactory(p2.get_tracer("other-scope", schema_url="https://example.test/schema"))
    f3 = SpanFactory(p3.get_tracer("moescope", "1.2.3"))
    t0 = 1_750_000_000_000_000_000
    root = f2.record("root", start_ns=t0, end_ns=t0 + 900, kind=SpanKind.SERVER, attributes=ATTRS,
                     events=[SpanEvent("ev", t0 + 5, {"k": 1}), SpanEvent("", t0 + 6)])
    remote = SpanContext(trace_id=0x0102030405060708090A0B0C0D0E0F10, span_id=0x1112131415161718, is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", "v1"), ("b", "2")]))
    f1.record(
        "child",
        start_ns=t0 + 10,
        end_ns=t0 + 20,
        parent=root,
        attributes={"a": 1, "b": 2, "c": 3, "d": 4, "e": 5},
        links=[SpanLink(remote, {"moe.link": "x"}), SpanLink(root)],
        error="boom",
        events=[SpanEvent("one", t0 + 11), SpanEvent("two", t0 + 12)],
    )
    f3.record("under-remote", start_ns=t0 + 30, end_ns=t0 + 40, parent=remote, kind=SpanKind.CLIENT)
    # The SDK API directly: a span with trace state inherited, OK status, a link without attributes.
    tracer = p2.get_tracer("other-scope", schema_url="https://example.test/schema")
    span = tracer.start_span("direct", context=set_span_in_context(NonRecordingSpan(remote)), kind=SpanKind.PRODUCER,
                             links=[Link(remote)], start_time=t0 + 50)
    span.set_status(Status(StatusCode.OK))
    span.end(end_time=t0 + 60)
    consumer = tracer.start_span("", kind=SpanKind.CONSUMER, start_time=t0 + 70)
    consumer.end(end_time=t0 + 70)
    return list(exporter.get_finished_spans())


def test_same_text_as_protobuf_route() -> None:
    spans = _spans()
    assert len(spans) == 5
    line = spans_to_line(spans)
    assert line == request_to_line(encode_spans(spans))
    # both batches of one span and the empty batch
    for span in spans:
        assert spans_to_line([span]) == request_to_line(encode_spans([span]))
        # the file exporter's line: one resource and scope (schema URLs on both here and there)
        assert spans_to_bytes([span]) == (spans_to_line([span]) + "\n").encode()
    assert spans_to_line([]) == request_to_line(encode_spans([])) == "{}"
    assert spans_to_bytes(spans) == (line + "\n").encode() and spans_to_bytes([]) == b"{}\n"


def test_parses_back_into_the_sdk_encoding() -> None:
    spans = _spans()
    line = spans_to_line(spans)
    assert line_to_request(line) == encode_spans(spans)
    data = json.loads(line)
    # grouping: equal resources merge (2 resources), scopes within them (moescope, other-scope)
    assert len(data["resourceSpans"]) == 2
    assert [len(rs["scopeSpans"]) for rs in data["resourceSpans"]] == [1, 1]
    names = [[s.get("name", "") for ss in rs["scopeSpans"] for s in ss["spans"]] for rs in data["resourceSpans"]]
    assert names == [["root", "direct", ""], ["child", "under-remote"]]
    child = data["resourceSpans"][1]["scopeSpans"][0]["spans"][0]
    assert child["droppedAttributesCount"] == 1 and child["droppedLinksCount"] == 1 and child["droppedEventsCount"] == 1
    # the SDK keeps the newest link (root's, local: flags say "not remote")
    assert (
        len(child["links"]) == 1
        and child["links"][0]["traceId"] == child["traceId"]
        and child["links"][0]["flags"] == 0x100
    )
    under = data["resourceSpans"][1]["scopeSpans"][0]["spans"][1]
    assert under["parentSpanId"] == "1112131415161718" and under["flags"] == 0x300
    assert under["traceState"] == "vendor=v1,b=2"
    direct = data["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    assert direct["links"] == [
        {"traceId": "0102030405060708090a0b0c0d0e0f10", "spanId": "1112131415161718", "flags": 0x300}
    ]
    assert direct["status"] == {"code": 1} and direct["kind"] == 4


def test_unencodable_attribute_is_left_out_like_the_sdk() -> None:
    exporter = InMemorySpanExporter()
    provider = _provider(Resource.create({}), exporter)
    tracer = provider.get_tracer("t")
    span = tracer.start_span("s", attributes={"ok": 1, "huge": 1 << 70, "huge_list": [1, 1 << 64], "bad": "\ud800"},
                             start_time=1)
    span.end(end_time=2)
    spans = list(exporter.get_finished_spans())
    out = json.loads(spans_to_line(spans))
    attrs = out["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    assert [a["key"] for a in attrs] == ["ok"]
    assert spans_to_line(spans) == request_to_line(encode_spans(spans))


def test_spans_of_one_shape_with_values_the_template_cannot_write() -> None:
    """Spans with the same keys and value types share one encoding template; a value it cannot write
    as is (NaN, an infinity, an int outside int64, a string that is not UTF-8, a '%' in a key or a
    value) must still give the protobuf route's text, span by span."""
    exporter = InMemorySpanExporter()
    provider = _provider(Resource.create({}), exporter)
    factory = SpanFactory(provider.get_tracer("t"))
    shape = [
        {"f": 0.5, "g": 1e-7, "i": 3, "s": "a", "b": True, "ints": [1, 2], "floats": [0.25, 3.0], "50%d": 1.5},
        {"f": float("nan"), "g": 2.0, "i": 4, "s": "%s%d%r", "b": False, "ints": [3], "floats": [1.0], "50%d": 2.5},
        {"f": 1.0, "g": float("-inf"), "i": 5, "s": "b", "b": True, "ints": [4], "floats": [2.0], "50%d": 3.5},
        {"f": 1.0, "g": 2.0, "i": 1 << 63, "s": "c", "b": True, "ints": [5], "floats": [2.0], "50%d": 4.5},
        {"f": 1.0, "g": 2.0, "i": 6, "s": "\ud800", "b": True, "ints": [1 << 64], "floats": [2.0], "50%d": 5.5},
        {"f": 1.7e308, "g": 1.7e308, "i": -(1 << 63), "s": "ü", "b": False, "ints": [6], "floats": [float("inf")],
         "50%d": -0.0},
    ]
    for i, attrs in enumerate(shape):
        factory.record(f"s{i}", start_ns=10 + i, end_ns=20 + i, attributes=attrs)
    spans = list(exporter.get_finished_spans())
    assert len(spans) == len(shape)
    for span in spans:  # one at a time: each through the template the first one made
        assert spans_to_line([span]) == request_to_line(encode_spans([span]))
    assert spans_to_line(spans) == request_to_line(encode_spans(spans))
    attrs = json.loads(spans_to_line(spans[:1]))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    assert [a["key"] for a in attrs] == list(shape[0])


def test_the_factorys_spans_of_two_tracers_are_grouped() -> None:
    # ReadableSpans the factory made on two tracers (two resources, two scopes; one equal to the
    # first resource, not the same object): grouped as the protobuf route groups them
    exporter = InMemorySpanExporter()

    def tracer(resource: Resource, name: str) -> trace_api.Tracer:
        provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider.get_tracer(name)

    factories = [SpanFactory(tracer(resource, name))
                 for resource, name in ((Resource({"service.name": "a"}), "x"), (Resource({"service.name": "b"}), "x"),
                                        (Resource({"service.name": "a"}), "y"))]
    for i in range(6):
        factories[i % 3].record(f"s{i}", start_ns=1 + i, end_ns=2 + i)
    spans = list(exporter.get_finished_spans())
    assert {type(span) for span in spans} == {ReadableSpan} and all(f.direct for f in factories)
    assert spans_to_line(spans) == request_to_line(encode_spans(spans))
    assert spans_to_bytes(spans) == (spans_to_line(spans) + "\n").encode()
    assert spans_to_bytes(spans[::3]) == (spans_to_line(spans[::3]) + "\n").encode()  # one tracer's


HOSTILE_ASCII = "".join(chr(c) for c in range(128))  # every control character, quote, backslash and DEL


def test_the_native_encoder_takes_the_agents_spans_itself(encoder: str) -> None:
    """What the agent's spans are made of — ASCII strings with every escape, ints at the int64
    edges, floats of every kind, arrays, a shared attribute set, links, remote and local parents,
    error statuses — is written by the native encoder itself (no span handed back) and equals the
    protobuf route, events and links written through their Python callbacks; a span it does not
    take (events past the SDK's limit, trace state, non-ASCII text, an int past int64, a
    ReadableSpan subclass) goes to Python and still equals it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}), sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    factory = SpanFactory(provider.get_tracer("moescope", "1"))
    assert factory.direct  # the agent's own tracer: the factory builds the finished spans
    remote = SpanContext(trace_id=(1 << 128) - 1, span_id=(1 << 64) - 1, is_remote=True, trace_flags=TraceFlags(1))
    shared = shared_attributes({"moe.step.requests": [3, 1], "moe.step.shared": True})
    link_attrs = shared_attributes({"moe.link": "step.owner"})
    mine = {
        "esc": HOSTILE_ASCII, HOSTILE_ASCII: 1, "": "empty key",
        "i": [-(1 << 63), (1 << 63) - 1, 0, -1, 9, 10, -10, 99, 100, 1234567890, -(10 ** 18)],
        "f": [0.1, 1e16, 1e-5, 5e-324, 1.7976931348623157e308, -0.0, 2.0], "nan": float("nan"),
        "inf": float("inf"), "ninf": float("-inf"), "b": [True, False], "mixed": [1, "a", 2.5, True],
        "nested": [[1, 2], ["x"]], "none_in": [None, 1], "empty": [], "t": (1, 2),
    }
    root = factory.record("root " + HOSTILE_ASCII, start_ns=1, end_ns=2, kind=SpanKind.SERVER, attributes=mine)
    factory.record("", start_ns=0, end_ns=0, parent=remote, kind=SpanKind.CLIENT)
    factory.record("err", start_ns=3, end_ns=4, parent=root, error="bad \"thing\"\n")
    for _ in range(2):
        factory.record("stub", start_ns=5, end_ns=6, parent=root, attributes=shared,
                       links=[SpanLink(root, link_attrs), SpanLink(remote, {"k": [1.5]})])
    factory.record("events", start_ns=1, end_ns=2, events=[SpanEvent("e", 1, {"a": 1})])
    factory.record("device events", start_ns=1, end_ns=2, attributes=shared,  # as a step span's sample
                   events=[SpanEvent("moe.device.sample", 7, {"moe.device": HOSTILE_ASCII, "r": 0.5}),
                           SpanEvent("", 0, {}), SpanEvent("ü", 9, {"x": "grüße", "i": [1, 2]})])
    native_ok = list(exporter.get_finished_spans())
    factory.record("many events", start_ns=1, end_ns=2,  # past the SDK's 128: a BoundedList that dropped some
                   events=[SpanEvent(f"e{i}", i, {"i": i}) for i in range(130)])
    factory.record("ü name", start_ns=1, end_ns=2)
    factory.record("big", start_ns=1, end_ns=2, attributes={"x": 1 << 64, "y": "ok"})
    factory.record("utf8 value", start_ns=1, end_ns=2, attributes={"x": "grüße"})
    factory.record("state", start_ns=1, end_ns=2, parent=SpanContext(
        trace_id=5, span_id=6, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")])))
    spans = list(exporter.get_finished_spans())

    class Renamed(ReadableSpan):  # a subclass may override what the native encoder reads directly
        @property
        def name(self) -> str:
            return "renamed"

    spans.append(Renamed(name="sub", context=native_ok[0].context, resource=native_ok[0].resource,
                         start_time=1, end_time=2, instrumentation_scope=native_ok[0].instrumentation_scope))
    assert spans_to_line(spans) == request_to_line(encode_spans(spans))
    assert spans_to_bytes(spans) == (spans_to_line(spans) + "\n").encode()  # (one resource and scope)
    for span in spans:
        assert spans_to_line([span]) == request_to_line(encode_spans([span])), span.name
    if encoder == "native":
        handed_back: list[str] = []

        def fallback(span: ReadableSpan) -> str:
            handed_back.append(span.name)
            return otlp_json._span(span)

        assert otlp_json._native is not None
        text = otlp_json._native.encode(spans, fallback, otlp_json._link, otlp_json._event, SharedAttributes,
                                        ReadableSpan)
        assert text == otlp_json._spans_python(spans)
        assert handed_back == [s.name for s in spans[len(native_ok):]]
