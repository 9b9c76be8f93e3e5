"""OTLP-JSON lines: one ``ExportTraceServiceRequest`` per line, as the OTLP/JSON encoding defines it.

Writing: ``spans_to_line`` maps the SDK's finished spans straight to the OTLP/JSON object — the
same text, key order included, as encoding them to protobuf (the SDK's ``encode_spans``) and
printing that with ``google.protobuf.json_format`` (``request_to_line``), at a fraction of the CPU:
lowerCamelCase field names in field-number order, proto3 defaults (0, "", empty lists) left out,
int64/fixed64 as decimal strings, enums as integers, trace and span ids as hex (OTLP/JSON's one
departure from the protobuf JSON mapping, which would write base64), non-finite doubles as
"NaN"/"Infinity"/"-Infinity". Spans are grouped by resource, then by instrumentation scope, in
first-seen order, as the SDK's encoder groups them. An attribute the protobuf encoder could not
represent (an int outside int64, a string that is not valid UTF-8, an unsupported type) is left
out and logged, as the SDK's encoder does.

Reading: ``line_to_request`` parses a line back into the protobuf request.

The result is what the OpenTelemetry Collector's file exporter writes and its otlpjsonfile receiver
reads, so a stored file can be replayed into any OTLP backend.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan

from moescope.agent.export.spans import EncodedSpan, SharedAttributes, SharedBoundedAttributes, SharedLink

log = logging.getLogger(__name__)

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


# --- direct mapping from SDK spans ----------------------------------------------------------------
# The text is written piece by piece (strings escaped by json's own C encoder): building dicts for
# json.dumps cost twice as much, and the export thread runs this for every span.

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_FLAG_HAS_IS_REMOTE = 0x100  # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAG_IS_REMOTE = 0x200  # SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_quote = json.encoder.encode_basestring_ascii  # what json.dumps (ensure_ascii) writes for a str
_float_text = float.__repr__  # what json.dumps writes for a finite float
_CACHE_MAX = 4096
_key_prefixes: dict[str, str] = {}  # attribute key -> '{"key":"...","value":'
# Encoded resources and scopes by object (they live as long as the provider): id -> (object, text).
_object_cache: dict[int, tuple[Any, str]] = {}
# Encoded shared attribute sets (the links to a step's owner share one): id -> (object, text), the object kept
# with its text so that its id cannot be reused while cached; the export thread is the only writer.
_shared_texts: dict[int, tuple[Any, str]] = {}
_SHARED_MAX = 1024
_link_texts: dict[int, tuple[Any, str]] = {}  # SharedLinks' texts, the same way


class _Unencodable(ValueError):
    """A value protobuf's AnyValue cannot hold (the SDK's encoder drops such an attribute)."""


def _double(value: float) -> str:
    if math.isfinite(value):
        return _float_text(value)
    if math.isnan(value):
        return '"NaN"'
    return '"Infinity"' if value > 0 else '"-Infinity"'


def _string(value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Unencodable(f"string is not valid UTF-8: {exc}") from exc
    return _quote(value)


def _float_array(value: Sequence[float]) -> str | None:
    """An all-float array whose elements are finite, in one join; None if any is not (the general path)."""
    if math.isfinite(sum(value)):  # NaN or an infinity anywhere makes the sum non-finite; so can overflow
        return '{"arrayValue":{"values":[{"doubleValue":' + '},{"doubleValue":'.join(map(_float_text, value)) + "}]}}"
    return None


def _any_value(value: Any) -> str:
    """One AnyValue as OTLP/JSON text (what ``_encode_value`` + ``MessageToDict`` would give)."""
    t = type(value)
    if t is str:
        return '{"stringValue":' + _string(value) + "}"
    if t is int:
        if _INT64_MIN <= value <= _INT64_MAX:
            return '{"intValue":"' + str(value) + '"}'
        raise _Unencodable(f"integer {value} is outside int64")
    if t is float:
        return '{"doubleValue":' + _double(value) + "}"
    if t is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if t is tuple or t is list:
        if not value:
            return '{"arrayValue":{}}'
        kinds = set(map(type, value))
        if len(kinds) == 1:
            if int in kinds and _INT64_MIN <= min(value) and max(value) <= _INT64_MAX:
                # per-expert token counts: the common array, written in one join
                return '{"arrayValue":{"values":[{"intValue":"' + '"},{"intValue":"'.join(map(str, value)) + '"}]}}'
            if float in kinds:
                text = _float_array(value)
                if text is not None:
                    return text
        return '{"arrayValue":{"values":[' + ",".join([_any_value(v) for v in value]) + "]}}"
    # The general cases, in the SDK encoder's order (bool before int: bool is an int).
    if value is None:
        return "{}"
    if isinstance(value, bool):
        return _any_value(bool(value))
    if isinstance(value, str):
        return _any_value(str(value))
    if isinstance(value, int):
        return _any_value(int(value))
    if isinstance(value, float):
        return _any_value(float(value))
    if isinstance(value, bytes):
        return '{"bytesValue":"' + base64.b64encode(value).decode("ascii") + '"}'
    if isinstance(value, Sequence):
        return _any_value(list(value))
    if isinstance(value, Mapping):
        pairs = [_key_value(str(k), v) for k, v in value.items()]
        return '{"kvlistValue":{"values":[' + ",".join(pairs) + "]}}" if pairs else '{"kvlistValue":{}}'
    raise _Unencodable(f"invalid type {type(value).__name__} of value {value!r}")


def _key_prefix(key: str) -> str:
    prefix = _key_prefixes.get(key)
    if prefix is None:
        if type(key) is not str:
            raise _Unencodable(f"attribute key {key!r} is not a string")
        prefix = '{"key":' + _string(key) + ',"value":' if key else '{"value":'
        if len(_key_prefixes) >= _CACHE_MAX:
            _key_prefixes.clear()
        _key_prefixes[key] = prefix
    return prefix


def _key_value(key: str, value: Any) -> str:
    return _key_prefix(key) + _any_value(value) + "}"


@dataclass(frozen=True, slots=True)
class _Template:
    """The text of one attribute set shape (keys in order, each value's type) with a %-placeholder
    per value: ``%r`` for a float, ``"%d"`` for an int, ``%s`` for the rest (their AnyValue text)."""

    text: str
    floats: tuple[int, ...]  # positions of the float values (written only if all are finite)
    ints: tuple[int, ...]  # of the int values (only if all are within int64)
    others: tuple[int, ...]  # of the values written through _any_value


# Spans of one kind carry the same keys with the same value types (58 moe.layer spans a step):
# their text is one %-format of a template, one C-level call for the scalars instead of a
# concatenation per attribute. (keys, types) -> template; None: that shape takes the general path.
_templates: dict[tuple[tuple[Any, ...], tuple[type, ...]], _Template | None] = {}
_TEMPLATES_MAX = 256


def _template(keys: tuple[Any, ...], types: tuple[type, ...]) -> _Template | None:
    pieces: list[str] = []
    floats: list[int] = []
    ints: list[int] = []
    others: list[int] = []
    try:
        for position, (key, t) in enumerate(zip(keys, types, strict=True)):
            prefix = _key_prefix(key).replace("%", "%%")
            if t is float:
                pieces.append(prefix + '{"doubleValue":%r}}')
                floats.append(position)
            elif t is int:
                pieces.append(prefix + '{"intValue":"%d"}}')
                ints.append(position)
            else:
                pieces.append(prefix + "%s}")
                others.append(position)
    except _Unencodable:
        return None  # a key that is not a string: the general path leaves that attribute out
    return _Template("[" + ",".join(pieces) + "]", tuple(floats), tuple(ints), tuple(others))


def _templated(attributes: Mapping[str, Any]) -> str | None:
    """``_attributes`` through the shape's template; None where the general path must decide (a
    non-finite float, an int outside int64, a value _any_value cannot encode)."""
    values = tuple(attributes.values())
    shape = (tuple(attributes), tuple(map(type, values)))
    template = _templates.get(shape)
    if template is None:
        if shape in _templates:
            return None
        if len(_templates) >= _TEMPLATES_MAX:
            _templates.clear()
        template = _templates[shape] = _template(*shape)
        if template is None:
            return None
    if template.floats and not math.isfinite(sum([values[i] for i in template.floats])):
        return None  # NaN or an infinity among them (or a sum past the float range): element by element
    if template.ints:
        picked = [values[i] for i in template.ints]
        if min(picked) < _INT64_MIN or max(picked) > _INT64_MAX:
            return None
    if template.others:
        args = list(values)
        try:
            for i in template.others:
                args[i] = _any_value(args[i])
        except (_Unencodable, TypeError, ValueError):
            return None
        values = tuple(args)
    return template.text % values


def _attributes(attributes: Mapping[str, Any] | None) -> str:
    """``[...]`` of the encodable attributes, or "" when there are none (the field is left out).
    A ``SharedAttributes`` or ``SharedBoundedAttributes`` (never mutated; carried by many spans or
    events) is written once per object."""
    if not attributes:
        return ""
    if type(attributes) is SharedAttributes or type(attributes) is SharedBoundedAttributes:
        return _cached(attributes, _encode_attributes, cache=_shared_texts, limit=_SHARED_MAX)
    return _encode_attributes(attributes)


def _encode_attributes(attributes: Mapping[str, Any]) -> str:
    text = _templated(attributes)
    if text is not None:
        return text
    out = []
    for key, value in attributes.items():
        try:
            out.append(_key_value(key, value))
        except (_Unencodable, TypeError, ValueError) as exc:
            log.warning("OTLP encoding: attribute %r left out: %s", key, exc)
    return "[" + ",".join(out) + "]" if out else ""


_Text = TypeVar("_Text", str, bytes)


def _cached(obj: Any, encode: Callable[[Any], _Text], *, cache: dict[int, tuple[Any, _Text]],
            limit: int = 64) -> _Text:
    """encode(obj), kept by the object's identity (the object is kept with its text, so its id is
    not reused while cached): for objects that never change once made (otlp_proto keeps message
    bytes in a cache of its own the same way)."""
    entry = cache.get(id(obj))
    if entry is not None and entry[0] is obj:
        return entry[1]
    text = encode(obj)
    if len(cache) >= limit:
        cache.clear()
    cache[id(obj)] = (obj, text)
    return text


def _resource(resource: Any) -> str:
    attrs = _attributes(resource.attributes)
    return '{"attributes":' + attrs + "}" if attrs else "{}"


def _scope(scope: Any) -> str:
    parts = []
    if scope.name:
        parts.append('"name":' + _string(scope.name))
    if scope.version:
        parts.append('"version":' + _string(scope.version))
    attrs = _attributes(scope.attributes)
    if attrs:
        parts.append('"attributes":' + attrs)
    return "{" + ",".join(parts) + "}"


def _flags(context: Any) -> str:
    return str(
        _FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE if context is not None and context.is_remote else _FLAG_HAS_IS_REMOTE
    )


def _link(link: Any) -> str:
    """One span link's text (also the native encoder's callback for links). Links are immutable,
    so a SharedLink that many spans carry (the links to a step's owner, agent/export/spans.py) is written once."""
    if type(link) is not SharedLink:
        return _link_text(link)
    return _cached(link, _link_text, cache=_link_texts, limit=_SHARED_MAX)


def _link_text(link: Any) -> str:
    lc = link.context
    item = f'{{"traceId":"{lc.trace_id:032x}","spanId":"{lc.span_id:016x}"'
    link_attrs = _attributes(link.attributes)
    if link_attrs:
        item += ',"attributes":' + link_attrs
    if link.dropped_attributes:
        item += f',"droppedAttributesCount":{link.dropped_attributes}'
    return item + ',"flags":' + _flags(lc) + "}"


def _event(event: Any) -> str:
    """One span event's text (also the native encoder's callback for events); an event already
    written as its text (``event_text``: a span handed on from its parts) is that text."""
    if type(event) is str:
        return event
    return event_text(event.name, event.timestamp, event.attributes, event.dropped_attributes)


def event_text(name: str, timestamp: int | None, attributes: Mapping[str, Any] | None, dropped: int) -> str:
    """The text of an SDK event of this name, time, attributes (as the SDK stores them: a
    SharedBoundedAttributes' text is written once) and dropped count."""
    e = []
    if timestamp:
        e.append(f'"timeUnixNano":"{timestamp}"')
    if name:
        e.append('"name":' + _string(name))
    event_attrs = _attributes(attributes)
    if event_attrs:
        e.append('"attributes":' + event_attrs)
    if dropped:
        e.append(f'"droppedAttributesCount":{dropped}')
    return "{" + ",".join(e) + "}"


def _spans_python(spans: Sequence[ReadableSpan]) -> str:
    return ",".join([_span(s) for s in spans])


def _spans_native(spans: Sequence[ReadableSpan]) -> str:
    # the native encoder writes what it takes and hands every other span to _span (agent/export/otlp_span.c)
    assert _native is not None
    text: str = _native.encode(spans, _span, _link, _event, SharedAttributes, ReadableSpan)
    return text


_native: ModuleType | None
try:
    from moescope.agent.export import _otlp_span as _native
except ImportError:  # a source checkout without `pip install -e .`: the Python encoder alone
    _native = None
# Spans written as text from columns (agent/outputs/traces.py, a step's layer spans), and the type
# of such a span in a batch (the native encoder appends its text): both only with the native encoder.
COLUMN_SPANS: Callable[..., list[bytes]] | None = None
if _native is not None:
    _native.set_encoded_type(EncodedSpan)
    COLUMN_SPANS = _native.column_spans


def _plain_spans(trace: Any, parent: Any, items: list[Any]) -> list[bytes]:
    assert _native is not None
    texts: list[bytes] = _native.plain_spans(trace, parent, items, _link, _event)
    return texts


# Spans written as text from their parts (a request's server and phase spans, a step span):
# PLAIN_SPANS(trace, parent, items) -> their texts (otlp_span.c `plain_spans`; links and events
# written as the encoder writes them).
PLAIN_SPANS: Callable[[Any, Any, list[Any]], list[bytes]] | None = _plain_spans if _native is not None else None
# The spans of one scope as their comma-joined texts: native where built (the same text, ≈ 5x less
# CPU), Python otherwise; tests/export checks both against the protobuf route.
encode_spans_text = _spans_python if _native is None else _spans_native


def _span(span: ReadableSpan) -> str:
    ctx = span.context
    parts = [f'{{"traceId":"{ctx.trace_id:032x}","spanId":"{ctx.span_id:016x}"']
    trace_state = ctx.trace_state
    if trace_state:
        parts.append(',"traceState":' + _string(",".join([f"{k}={v}" for k, v in trace_state.items()])))
    parent = span.parent
    if parent is not None:
        parts.append(f',"parentSpanId":"{parent.span_id:016x}"')
    if span.name:
        parts.append(',"name":' + _string(span.name))
    parts.append(f',"kind":{span.kind.value + 1}')  # API INTERNAL=0.. -> OTLP SPAN_KIND_INTERNAL=1..
    if span.start_time:
        parts.append(f',"startTimeUnixNano":"{span.start_time}"')
    if span.end_time:
        parts.append(f',"endTimeUnixNano":"{span.end_time}"')
    own = getattr(span, "_attributes", None)  # the SDK's read gives a fresh proxy: the shared object is behind it
    attrs = _attributes(own if type(own) is SharedAttributes else span.attributes)
    if attrs:
        parts.append(',"attributes":' + attrs)
    if span.dropped_attributes:
        parts.append(f',"droppedAttributesCount":{span.dropped_attributes}')
    span_events = span.events  # a new tuple per read
    if span_events:
        parts.append(',"events":[' + ",".join([_event(event) for event in span_events]) + "]")
    if span.dropped_events:
        parts.append(f',"droppedEventsCount":{span.dropped_events}')
    span_links = span.links
    if span_links:
        parts.append(',"links":[' + ",".join([_link(link) for link in span_links]) + "]")
    if span.dropped_links:
        parts.append(f',"droppedLinksCount":{span.dropped_links}')
    status = span.status
    status_parts = []
    if status.description:
        status_parts.append('"message":' + _string(status.description))
    if status.status_code.value:
        status_parts.append(f'"code":{status.status_code.value}')
    parts.append(',"status":{' + ",".join(status_parts) + '},"flags":' + _flags(parent) + "}")
    return "".join(parts)


def spans_to_line(spans: Sequence[ReadableSpan]) -> str:
    """One compact OTLP-JSON line (no trailing newline) holding ``spans``.

    The same text as ``request_to_line(encode_spans(spans))`` (tests/export checks it, byte for
    byte) without building protobuf messages or dicts.
    """
    if not spans:
        return "{}"
    first = spans[0]
    resource, scope = first.resource, first.instrumentation_scope or None
    if _one_tracer(spans, resource, scope):
        # the agent's batches: one tracer, so one resource and scope object for every span
        return _request_text([(resource, [(scope, spans)])])
    # Group as the SDK's encoder does (by Resource, then scope; equality, not identity), comparing
    # each distinct object once: Resource.__hash__ serialises all its attributes.
    groups: list[tuple[Any, list[tuple[Any, list[ReadableSpan]]]]] = []
    by_resource: dict[int, list[tuple[Any, list[ReadableSpan]]]] = {}
    by_scope: dict[tuple[int, int], list[ReadableSpan]] = {}
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope or None
        scopes = by_resource.get(id(resource))
        if scopes is None:
            for other, other_scopes in groups:
                if other == resource:
                    scopes = other_scopes
                    break
            else:
                scopes = []
                groups.append((resource, scopes))
            by_resource[id(resource)] = scopes
        key = (id(scopes), id(scope))
        members = by_scope.get(key)
        if members is None:
            for other_scope, other_members in scopes:
                if other_scope == scope:
                    members = other_members
                    break
            else:
                members = []
                scopes.append((scope, members))
            by_scope[key] = members
        members.append(span)
    return _request_text(groups)


_FIELD_TYPES = frozenset((ReadableSpan, EncodedSpan))  # both keep their resource and scope in these fields
_RESOURCE_OF = operator.attrgetter("_resource")
_SCOPE_OF = operator.attrgetter("_instrumentation_scope")


def _one_tracer(spans: Sequence[ReadableSpan], resource: Any, scope: Any) -> bool:
    """Whether every span has ``resource`` and ``scope`` (the first span's: the objects, not equal
    ones), as the agent's batches from one tracer have. The factory's spans (exact ReadableSpans)
    are checked on their fields in C-driven passes: the properties cost ~1 µs a span."""
    if set(map(type, spans)) <= _FIELD_TYPES:
        resources, scopes = set(map(id, map(_RESOURCE_OF, spans))), set(map(id, map(_SCOPE_OF, spans)))
        return resources == {id(resource)} and scopes == {id(scope)}
    return all(s.resource is resource and (s.instrumentation_scope or None) is scope for s in spans)


# A trace file line's text is kept under this by cutting a batch into several lines (line_chunks):
# a line is one bytes object, and one of the mmap threshold or more (agent/allocator.py: 256 KiB)
# is a fresh mapping each time, every page of it faulted in as the encoder writes it (a batch of
# ~400 spans at the reference load is ~0.4 MB: page faults were ~3 % of the main loop). Under it
# the line comes from the heap, whose freed blocks the next batch reuses.
LINE_TARGET_BYTES = 192 << 10
SPAN_TEXT_GUESS_BYTES = 2048  # a span made the SDK way: its text's size is not known before encoding


def line_chunks(spans: Sequence[ReadableSpan], target_bytes: int = LINE_TARGET_BYTES) -> list[Sequence[ReadableSpan]]:
    """``spans`` cut, in order, into runs whose texts add up to at most ``target_bytes`` (a span
    already written as text counts its length; another SPAN_TEXT_GUESS_BYTES); a span bigger than
    that is a run of its own. One run (``spans`` itself) when it all fits."""
    runs: list[Sequence[ReadableSpan]] = []
    start = size = 0
    for i, span in enumerate(spans):
        n = len(span._text) if type(span) is EncodedSpan else SPAN_TEXT_GUESS_BYTES
        if size + n > target_bytes and i > start:
            runs.append(spans[start:i])
            start, size = i, 0
        size += n
    if not runs:
        return [spans]
    runs.append(spans[start:])
    return runs


def spans_to_bytes(spans: Sequence[ReadableSpan]) -> bytes:
    """``spans_to_line(spans)`` and a newline, as UTF-8 bytes (the file exporter's line). Spans of one
    resource and scope (the agent's batches) go through the native encoder as one buffer: the text is
    copied once into the bytes, where the str route copied it four times (str, join, newline, encode)."""
    if not spans:
        return b"{}\n"
    first = spans[0]
    resource, scope = first.resource, first.instrumentation_scope or None
    if _native is None or encode_spans_text is not _spans_native or not _one_tracer(spans, resource, scope):
        return (spans_to_line(spans) + "\n").encode("utf-8")
    parts = _request_parts([(resource, [(scope, spans)])])  # one group: one placeholder for its spans
    at = parts.index(spans)
    line: bytes = _native.encode(spans, _span, _link, _event, SharedAttributes, ReadableSpan,
                                 "".join(parts[:at]).encode("utf-8"),  # type: ignore[arg-type]  # (all str)
                                 ("".join(parts[at + 1:]) + "\n").encode("utf-8"))  # type: ignore[arg-type]
    return line


def _request_text(groups: Sequence[tuple[Any, Sequence[tuple[Any, Sequence[ReadableSpan]]]]]) -> str:
    # pieces joined once at the end: a batch's spans are ~0.5 MB of text, and each concatenation
    # around them copied all of it (a dozen copies a batch)
    return "".join([part if isinstance(part, str) else encode_spans_text(part) for part in _request_parts(groups)])


def _request_parts(
    groups: Sequence[tuple[Any, Sequence[tuple[Any, Sequence[ReadableSpan]]]]],
) -> list[str | Sequence[ReadableSpan]]:
    """The request's text in pieces, each scope's spans left as the sequence itself (the caller
    encodes it: joined into a str, or written around by the native encoder's bytes)."""
    parts: list[str | Sequence[ReadableSpan]] = ['{"resourceSpans":[']
    for r, (resource, scopes) in enumerate(groups):
        parts.append(',{"resource":' if r else '{"resource":')
        parts.append(_cached(resource, _resource, cache=_object_cache))
        parts.append(',"scopeSpans":[')
        for i, (scope, members) in enumerate(scopes):
            parts.append(',{"scope":' if i else '{"scope":')
            parts.append(_cached(scope, _scope, cache=_object_cache) if scope is not None else "{}")
            parts.append(',"spans":[')
            parts.append(members)
            parts.append("]")
            if scope is not None and scope.schema_url:
                parts.append(',"schemaUrl":' + _string(scope.schema_url))
            parts.append("}")
        parts.append("]")
        if resource.schema_url:
            parts.append(',"schemaUrl":' + _string(resource.schema_url))
        parts.append("}")
    parts.append("]}")
    return parts
