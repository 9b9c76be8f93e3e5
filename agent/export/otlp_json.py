"""OTLP-JSON lines: one ``ExportTraceServiceRequest`` per line, as the OTLP/JSON encoding defines it.

``google.protobuf.json_format`` does the message mapping (lowerCamelCase field names, int64 as
decimal strings); OTLP/JSON differs from the plain protobuf JSON mapping in one place we must fix
up: trace and span ids are hex strings, not base64. Enums are written as integers (also OTLP/JSON).
The result is what the OpenTelemetry Collector's file exporter writes and its otlpjsonfile receiver
reads, so a stored file can be replayed into any OTLP backend.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _map_ids(request: dict[str, Any], convert: Any) -> None:
    for resource_spans in request.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for key in _ID_FIELDS:
                    if span.get(key):
                        span[key] = convert(span[key])
                for link in span.get("links", ()):
                    for key in _ID_FIELDS:
                        if link.get(key):
                            link[key] = convert(link[key])


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def request_to_dict(request: ExportTraceServiceRequest) -> dict[str, Any]:
    out = json_format.MessageToDict(request, use_integers_for_enums=True)
    _map_ids(out, _b64_to_hex)
    return out


def request_to_line(request: ExportTraceServiceRequest) -> str:
    """One compact JSON line (no trailing newline)."""
    return json.dumps(request_to_dict(request), separators=(",", ":"), allow_nan=False)


def line_to_request(line: str) -> ExportTraceServiceRequest:
    """Parse one OTLP-JSON line; ``ValueError`` on anything that is not a valid request."""
    try:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        _map_ids(data, _hex_to_b64)
        return json_format.ParseDict(data, ExportTraceServiceRequest())
    except (json.JSONDecodeError, json_format.ParseError, TypeError, AttributeError) as exc:
        raise ValueError(str(exc)) from exc
