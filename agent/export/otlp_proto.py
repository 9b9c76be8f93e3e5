"""OTLP protobuf for the agent's spans, natively: what OTLP/gRPC export sends to a backend.

The SDK's encoder (opentelemetry-exporter-otlp-proto-common ``encode_spans``) builds a protobuf
object per span, per attribute and per array element in Python: ~68 µs a span for the agent's
spans on this VM (a layer span carries three arrays of E values), against ~3 µs for the same spans'
OTLP/JSON text from the native encoder (docs/benchmarks.md "OTLP/gRPC export"). ``request_bytes``
writes the ``ExportTraceServiceRequest`` wire bytes with that native encoder (``encode_pb`` in
agent/export/otlp_span.c) for the spans it takes — the factory's ReadableSpans: no trace state,
attributes in a plain dict of str, bool, int64, float, None or arrays of those — and with the SDK's
own span encoder for any other span; resources, scopes, links and events are encoded by the SDK's
functions too (links to a step's owner span, a SharedLink many spans carry, once per object).
tests/export/test_otlp_proto.py parses the bytes and compares the message with ``encode_spans``'s.

``NativeGrpcSpanExporter`` is the SDK's OTLP/gRPC exporter (its channel, TLS, headers, retries and
timeouts unchanged) with this encoding; without the native module it is the SDK's exporter.
``NativeHttpSpanExporter`` is the same for OTLP/HTTP (protobuf): the SDK's exporter (its session,
compression, headers, retries, timeout and request-size limit) sending these bytes as they are,
with no message object in between.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from opentelemetry.exporter.otlp.proto.common._internal import _encode_instrumentation_scope, _encode_resource
from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import (
    _encode_events,
    _encode_links,
    _encode_span,
)
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http._common import RequestPayloadTooLargeError, _is_request_too_large
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as OTLPHttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE

from moescope.agent.export.otlp_json import _cached as _cached_by_id
from moescope.agent.export.otlp_json import _one_tracer
from moescope.agent.export.spans import SharedAttributes, SharedLink

log = logging.getLogger(__name__)

_native: ModuleType | None
try:
    from moescope.agent.export import _otlp_span as _native
except ImportError:  # a source checkout without `pip install -e .`: the SDK's encoder alone
    _native = None

_CACHE_LIMIT = 4096  # objects whose message bytes are kept (resources, scopes, shared links)
_cache: dict[int, tuple[Any, bytes]] = {}


def available() -> bool:
    """Whether the native encoder is built (else ``request_bytes`` is the SDK's encoder's)."""
    return _native is not None


def _cached(obj: Any, encode: Callable[[Any], bytes]) -> bytes:
    """encode(obj) kept by identity in this module's cache (otlp_json's helper, bytes here)."""
    return _cached_by_id(obj, encode, cache=_cache, limit=_CACHE_LIMIT)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _span_message(span: ReadableSpan) -> bytes:
    return _encode_span(span).SerializeToString()


def _link(link: Any) -> bytes:
    if type(link) is SharedLink:
        return _cached(link, _link_message)
    return _link_message(link)


def _link_message(link: Any) -> bytes:
    return _encode_links([link])[0].SerializeToString()


def _event(event: Any) -> bytes:
    encoded = _encode_events([event])
    assert encoded is not None  # (one event in, one out)
    return encoded[0].SerializeToString()


def _resource(resource: Any) -> bytes:
    return _encode_resource(resource).SerializeToString()


def _scope(scope: Any) -> bytes:
    return _encode_instrumentation_scope(scope).SerializeToString()


def _groups(spans: Sequence[ReadableSpan]) -> list[tuple[Any, list[tuple[Any, list[ReadableSpan]]]]]:
    """The spans by resource, then scope, in first-seen order and by equality (as encode_spans's
    dicts group them)."""
    by_resource: dict[Any, dict[Any, list[ReadableSpan]]] = {}
    for span in spans:
        by_resource.setdefault(span.resource, {}).setdefault(span.instrumentation_scope or None, []).append(span)
    return [(resource, list(scopes.items())) for resource, scopes in by_resource.items()]


def request_bytes(spans: Sequence[ReadableSpan]) -> bytes:
    """The ExportTraceServiceRequest of ``spans``, serialized: the message ``encode_spans`` makes."""
    if _native is None:
        return encode_spans(spans).SerializeToString()
    if not spans:
        return b""
    first = spans[0]
    resource, scope = first.resource, first.instrumentation_scope or None
    # the agent's batches come from one tracer: grouped by identity without hashing each Resource
    groups = [(resource, [(scope, spans)])] if _one_tracer(spans, resource, scope) else _groups(spans)
    out = []
    for resource, scopes in groups:
        parts = [_field(1, _cached(resource, _resource))]
        for scope, members in scopes:
            scope_parts = [_field(1, _cached(scope, _scope) if scope is not None else b""),
                           _native.encode_pb(members, _span_message, _link, _event, SharedAttributes, ReadableSpan)]
            if scope is not None and scope.schema_url:
                scope_parts.append(_field(3, scope.schema_url.encode("utf-8")))
            parts.append(_field(2, b"".join(scope_parts)))
        if resource.schema_url:
            parts.append(_field(3, resource.schema_url.encode("utf-8")))
        out.append(_field(1, b"".join(parts)))
    return b"".join(out)


class EncodedRequest:
    """A batch's request made ahead of its export (``NativeGrpcSpanExporter.encode``)."""

    __slots__ = ("request", "spans")

    def __init__(self, request: ExportTraceServiceRequest, spans: int) -> None:
        self.request, self.spans = request, spans


class NativeGrpcSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC span exporter, its request encoded by ``request_bytes`` (parsed back into
    the request message by protobuf's C runtime, which the gRPC stub serializes again: ~1 µs a span
    each). An encoding error falls back to the SDK's encoder for that batch, logged once.

    An ``EncodingExporter`` (agent/export/processor.py): ``encode`` makes the request on the thread
    that made the spans, ``export_encoded`` sends it with the SDK's retries."""

    _failed_logged = False

    def encode(self, spans: Sequence[ReadableSpan]) -> EncodedRequest:
        return EncodedRequest(self._translate_data(spans), len(spans))

    def export_encoded(self, payload: EncodedRequest) -> SpanExportResult:
        return self._export(payload)  # type: ignore[arg-type]  # (_translate_data and _count_data take it)

    def _count_data(self, data: Sequence[ReadableSpan] | EncodedRequest) -> int:
        return data.spans if isinstance(data, EncodedRequest) else len(data)

    def _translate_data(self, data: Sequence[ReadableSpan] | EncodedRequest) -> ExportTraceServiceRequest:
        if isinstance(data, EncodedRequest):
            return data.request
        if _native is not None:
            try:
                return ExportTraceServiceRequest.FromString(request_bytes(data))
            except Exception as exc:  # noqa: BLE001 - the SDK's encoder is always there
                if not NativeGrpcSpanExporter._failed_logged:
                    NativeGrpcSpanExporter._failed_logged = True
                    log.warning("OTLP/gRPC: the native encoder failed (%s: %s); this batch and any other it "
                                "fails on go through the SDK's encoder (logged once)", type(exc).__name__, exc)
        return super()._translate_data(data)


class EncodedBody:
    """A batch's OTLP/HTTP request body made ahead of its export (``NativeHttpSpanExporter.encode``)."""

    __slots__ = ("body", "spans")

    def __init__(self, body: bytes, spans: int) -> None:
        self.body, self.spans = body, spans


class NativeHttpSpanExporter(OTLPHttpSpanExporter):
    """The SDK's OTLP/HTTP (protobuf) span exporter with its request body made by ``request_bytes``:
    sent as it is (the body is the serialized request). The sending is the SDK's client (session,
    compression, headers, retries with backoff, timeout); the request-size limit, the exporter's
    own metrics and the failure results are as the SDK's ``export`` has them (tests/export/
    test_otlp_proto.py holds them to it against the test receiver). An encoding error falls back to
    the SDK's encoder for that batch, logged once; one the SDK's encoder also fails on fails the
    batch, as the SDK's exporter does.

    An ``EncodingExporter`` (agent/export/processor.py): ``encode`` makes the body on the thread that
    made the spans, ``export_encoded`` sends it."""

    _failed_logged = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:  # (the SDK's check, before any encoding)
            return super().export(spans)
        try:
            payload = self.encode(spans)
        except Exception:  # noqa: BLE001 - the SDK's export fails the batch the same way, with its metrics
            return super().export(spans)
        return self.export_encoded(payload)

    def encode(self, spans: Sequence[ReadableSpan]) -> EncodedBody:
        """The request body; raises what the SDK's encoder raises on a batch neither encoder takes."""
        if _native is not None:
            try:
                return EncodedBody(request_bytes(spans), len(spans))
            except Exception as exc:  # noqa: BLE001 - the SDK's encoder is always there
                if not NativeHttpSpanExporter._failed_logged:
                    NativeHttpSpanExporter._failed_logged = True
                    log.warning("OTLP/HTTP: the native encoder failed (%s: %s); this batch and any other it "
                                "fails on go through the SDK's encoder (logged once)", type(exc).__name__, exc)
        return EncodedBody(encode_spans(spans).SerializePartialToString(), len(spans))

    def export_encoded(self, payload: EncodedBody) -> SpanExportResult:
        """Sends a body ``encode`` made: what the SDK's ``export`` does once it has serialized its
        request (a shut-down exporter, an oversize body and a failed send are failures)."""
        if self._shutdown:
            log.warning("OTLP/HTTP: the exporter is shut down; a batch of %d spans is not sent", payload.spans)
            return SpanExportResult.FAILURE
        body = payload.body
        with self._metrics.export_operation(payload.spans) as result:
            if _is_request_too_large(body, self._max_request_size):
                log.warning("OTLP/HTTP: a batch of %d spans is %d bytes, over the exporter's max_request_size "
                            "(%d bytes): not sent", payload.spans, len(body), self._max_request_size)
                result.error = RequestPayloadTooLargeError(
                    f"request of {len(body)} bytes over max_request_size {self._max_request_size}")
                return SpanExportResult.FAILURE
            sent = self._client.export(body)
            if not sent.success:
                result.error = sent.error
                if sent.status_code is not None:
                    result.error_attrs = {HTTP_RESPONSE_STATUS_CODE: sent.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
