"""request_bytes (the agent's spans -> OTLP protobuf natively) against the SDK's encoder.

The reference is ``encode_spans`` (opentelemetry-exporter-otlp-proto-common): the native bytes must
parse into the same ExportTraceServiceRequest (compared as protobuf's deterministic serialization,
so NaN payloads compare bitwise). Spans the native encoder does not take go to the SDK's span
encoder; the agent's own spans must not (they are the fast path).
"""

from __future__ import annotations

import logging
import math

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from otlp_receiver import HttpOtlpReceiver
from test_otlp_json_direct import ATTRS, _spans

from moescope.agent.export import ExportFlags, SpanEvent, SpanFactory, SpanLink, otlp_proto, resolve_export_config
from moescope.agent.export.otlp_proto import NativeGrpcSpanExporter, NativeHttpSpanExporter, request_bytes
from moescope.agent.export.processor import _as_encoding
from moescope.agent.export.setup import build_otlp_exporter
from moescope.agent.export.spans import shared_attributes

T0 = 1_750_000_000_000_000_000
CTX = SpanContext(trace_id=0xABCDEF0123456789ABCDEF0123456789, span_id=0x0123456789ABCDEF, is_remote=False,
                  trace_flags=TraceFlags(1))


def _canonical(request: ExportTraceServiceRequest) -> bytes:
    return request.SerializeToString(deterministic=True)


def _same_as_sdk(spans: list[ReadableSpan]) -> None:
    ours = ExportTraceServiceRequest.FromString(request_bytes(spans))
    assert _canonical(ours) == _canonical(encode_spans(spans))


def _factory_spans() -> list[ReadableSpan]:
    """The agent's kinds of spans, from its factory: a server span with an error and an event, a
    phase span linking to a step owner (a shared link, twice), a step span with shared attributes
    and an event, layer spans with arrays, a remote parent."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.create({"service.name": "moe", "process.pid": 3}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    factory = SpanFactory(provider.get_tracer("moescope", "9.9"))
    assert factory.direct
    server = factory.start("http.server.request", start_ns=T0, kind=SpanKind.SERVER,
                           attributes={"network.peer.port": 4242, "http.request.size": 73, "ok": True})
    parent = server.get_span_context()
    step = factory.record("moe.step", start_ns=T0 + 10, end_ns=T0 + 90, parent=parent,
                          attributes=shared_attributes({"moe.step.tokens": 116, "moe.step.requests": (7, 8)}),
                          events=[SpanEvent("moe.device.sample", T0 + 10, shared_attributes({"used": 0.5}))])
    factory.record_children("moe.layer", parent=step, children=[
        (T0 + 11 + i, T0 + 20 + i, {"moe.layer": i, "moe.expert.tokens": (9, 32, 0, 5), "moe.expert_load.gini": 0.43,
                                     "moe.layer.experts.time_us": (572.301025390625, 0.0, -1.5), "empty": (),
                                     "moe.precision": "fp16"})
        for i in range(4)])
    link = SpanLink(step, shared_attributes({"moe.link": "step owner"}))
    for name in ("prefill", "decode"):
        factory.record(name, start_ns=T0 + 20, end_ns=T0 + 80, parent=parent, links=[link, link])
    remote = SpanContext(trace_id=7, span_id=9, is_remote=True, trace_flags=TraceFlags(1))
    factory.record("under-remote", start_ns=T0 + 1, end_ns=T0 + 2, parent=remote, kind=SpanKind.CLIENT)
    factory.end(server, end_ns=T0 + 100, events=[SpanEvent("tcp.retransmit", T0 + 50, {"n": 1})],
                error="connection closed before a response was written")
    return list(exporter.get_finished_spans())


def _readable(**fields: object) -> ReadableSpan:
    values: dict[str, object] = {"name": "raw", "context": CTX, "parent": None, "kind": SpanKind.INTERNAL,
                                 "attributes": {}, "start_time": T0, "end_time": T0 + 5, "status": Status()}
    values.update(fields)
    return ReadableSpan(**values)  # type: ignore[arg-type]


def test_the_native_encoder_is_built() -> None:
    # (without it request_bytes is the SDK's encoder and every comparison here is with itself)
    assert otlp_proto.available(), "agent/export/_otlp_span not built (pip install -e .)"


def test_the_sdks_request_for_the_json_encoders_corpus() -> None:
    # two resources (one equal, not identical), schema URLs, trace state, dropped attributes,
    # links and events, BoundedAttributes, OK and ERROR statuses, an empty name
    spans = _spans()
    _same_as_sdk(spans)
    for span in spans:
        _same_as_sdk([span])
    assert request_bytes([]) == b"" and _canonical(encode_spans([])) == b""


def test_the_sdks_request_for_the_agents_spans_taken_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    spans = _factory_spans()
    assert len(spans) == 9

    def not_here(span: ReadableSpan) -> bytes:
        raise AssertionError(f"{span.name} went to the SDK's encoder")

    monkeypatch.setattr(otlp_proto, "_span_message", not_here)  # the agent's spans never take that path
    _same_as_sdk(spans)
    for span in spans:
        _same_as_sdk([span])
    layer = ExportTraceServiceRequest.FromString(request_bytes(spans[1:2])).resource_spans[0].scope_spans[0].spans[0]
    assert layer.name == "moe.layer" and [kv.key for kv in layer.attributes][:2] == ["moe.layer", "moe.expert.tokens"]


@pytest.mark.parametrize("attributes", [
    ATTRS,  # every scalar kind and edge, NaN and infinities, arrays of each, an empty one
    {"too_big": 1 << 63, "kept": 1},  # the SDK leaves the key out (and logs): so must the bytes
    {"nested": ((1, 2), ("a",), ()), "none_inside": (None, 1)},
    {"kvlist": {"a": 1}, "bytes": b"\x00\xff"},
    {"surrogate": "\ud800", "after": 2},
    {"numpy_like": type("F", (float,), {})(1.5)},
    {"": "empty key", "ü": "ünïcode value"},
])
def test_values_the_native_encoder_does_not_take_give_the_sdks_bytes(
        attributes: dict[str, object], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.CRITICAL):  # (the SDK logs what it leaves out)
        _same_as_sdk([_readable(attributes=attributes)])


@pytest.mark.parametrize("fields", [
    {"name": "nön-ascii ✓"},
    {"kind": SpanKind.CONSUMER, "status": Status(StatusCode.ERROR, "ünïcode message")},
    {"status": Status(StatusCode.OK)},
    {"start_time": 0, "end_time": None},
    {"parent": SpanContext(trace_id=1, span_id=0, is_remote=True, trace_flags=TraceFlags(0))},
    {"events": (Event("e", {"k": (1.5, math.inf)}, timestamp=T0),)},
    {"links": (Link(CTX, {"a": 1}), Link(SpanContext(3, 4, True)))},
])
def test_span_fields_give_the_sdks_bytes(fields: dict[str, object]) -> None:
    _same_as_sdk([_readable(**fields)])


def test_a_span_the_sdk_cannot_encode_fails_the_same_way() -> None:
    span = _readable(name="bad \udc80")  # a lone surrogate: no UTF-8 for the name
    with pytest.raises(UnicodeEncodeError):
        encode_spans([span])
    with pytest.raises(UnicodeEncodeError):
        request_bytes([span])


def test_the_grpc_exporter_encodes_natively_and_falls_back_to_the_sdk(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    config = resolve_export_config(ExportFlags(endpoint="http://localhost:4317"), env={})
    assert config.otlp is not None and config.otlp.protocol == "grpc"
    exporter = build_otlp_exporter(config.otlp)
    try:
        assert isinstance(exporter, NativeGrpcSpanExporter) and _as_encoding(exporter) is not None
        spans = _factory_spans()
        encoded = exporter.encode(spans)  # (the processor's encode_queued; the receiver test sends)
        assert encoded.spans == 9 and _canonical(encoded.request) == _canonical(encode_spans(spans))
        assert exporter._translate_data(encoded) is encoded.request and exporter._count_data(encoded) == 9
        assert _canonical(exporter._translate_data(spans)) == _canonical(encode_spans(spans))

        def broken(spans: object) -> bytes:
            raise ValueError("broken encoder")

        monkeypatch.setattr(otlp_proto, "request_bytes", broken)
        monkeypatch.setattr(NativeGrpcSpanExporter, "_failed_logged", False)
        with caplog.at_level(logging.WARNING):
            assert _canonical(exporter._translate_data(spans)) == _canonical(encode_spans(spans))
            exporter._translate_data(spans)
        assert caplog.text.count("the native encoder failed (ValueError: broken encoder)") == 1
    finally:
        exporter.shutdown()


def _http_exporter(endpoint: str, **kwargs: object) -> NativeHttpSpanExporter:
    config = resolve_export_config(ExportFlags(endpoint=endpoint.removesuffix("/v1/traces"), protocol="http/protobuf"),
                                   env={})
    assert config.otlp is not None
    exporter = build_otlp_exporter(config.otlp)
    assert isinstance(exporter, NativeHttpSpanExporter) and _as_encoding(exporter) is not None
    for name, value in kwargs.items():
        setattr(exporter, name, value)
    return exporter


def test_the_http_exporter_sends_the_native_body_and_falls_back_to_the_sdk(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    spans = _factory_spans()
    with HttpOtlpReceiver() as rx:
        exporter = _http_exporter(rx.endpoint)
        try:
            def no_sdk(spans: object) -> object:
                raise AssertionError("the SDK's encoder was called")

            with monkeypatch.context() as patch:
                patch.setattr(otlp_proto, "encode_spans", no_sdk)
                encoded = exporter.encode(spans)  # natively
            assert encoded.spans == 9 and encoded.body == request_bytes(spans)
            assert exporter.export_encoded(encoded) is SpanExportResult.SUCCESS
            assert exporter.export(spans) is SpanExportResult.SUCCESS

            def broken(spans: object) -> bytes:
                raise ValueError("broken encoder")

            monkeypatch.setattr(otlp_proto, "request_bytes", broken)
            monkeypatch.setattr(NativeHttpSpanExporter, "_failed_logged", False)
            with caplog.at_level(logging.WARNING):
                assert exporter.export(spans) is SpanExportResult.SUCCESS  # the SDK's encoder's body
                assert exporter.encode(spans).body == encode_spans(spans).SerializePartialToString()
            assert caplog.text.count("the native encoder failed (ValueError: broken encoder)") == 1
        finally:
            exporter.shutdown()
        received = rx.requests
    assert len(received) == 3
    assert all(_canonical(request) == _canonical(encode_spans(spans)) for request in received)


def test_the_http_exporter_fails_as_the_sdks_does(caplog: pytest.LogCaptureFixture) -> None:
    """A refused request, a body over max_request_size, a batch no encoder takes and a shut-down
    exporter are failures (never raised); only the first reaches the receiver."""
    spans = _factory_spans()
    with HttpOtlpReceiver() as rx:
        exporter = _http_exporter(rx.endpoint)
        try:
            exporter._client._timeout = 0.5  # (the SDK retries 503 with backoff until its timeout)
            rx.set_unavailable(True)
            assert exporter.export(spans) is SpanExportResult.FAILURE
            assert rx.refused >= 1
            rx.set_unavailable(False)
            body = exporter.encode(spans)
            exporter._max_request_size = len(body.body) - 1
            with caplog.at_level(logging.WARNING):
                assert exporter.export_encoded(body) is SpanExportResult.FAILURE
            assert "over the exporter's max_request_size" in caplog.text
            exporter._max_request_size = len(body.body)
            assert exporter.export_encoded(body) is SpanExportResult.SUCCESS  # the limit is inclusive
            with pytest.raises(UnicodeEncodeError):
                exporter.encode([_readable(name="bad \udc80")])
            assert exporter.export([_readable(name="bad \udc80")]) is SpanExportResult.FAILURE
        finally:
            exporter.shutdown()
        assert exporter.export_encoded(body) is SpanExportResult.FAILURE
        assert exporter.export(spans) is SpanExportResult.FAILURE
        received = rx.requests
    assert len(received) == 1 and _canonical(received[0]) == _canonical(encode_spans(spans))
