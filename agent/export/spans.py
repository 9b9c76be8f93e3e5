"""Spans from recorded timestamps: the pipeline knows when things happened, after they happened.

``SpanFactory`` wraps an SDK tracer so the pipeline can build spans with explicit start/end times
(ns since the Unix epoch), explicit parents (a ``SpanContext``, never the ambient context: the
agent's own thread state must not leak into a target's trace) and span links. Attribute values are
converted to what OTLP carries: numpy scalars/arrays become Python values, ``None`` and NaN are
left out (an undefined ratio is an absent attribute, not a misleading number).

Cost: the pipeline makes ~30-70 spans per request, so span creation is a hot path. On the agent's
own tracer (an SDK tracer with the ALWAYS_ON sampler and no attribute-length limit) the factory
builds the finished ``ReadableSpan`` itself and hands it to the tracer's span processor: the same
span the SDK would export (ids from the tracer's id generator, trace flags and trace state as the
SDK sets them, the span limits applied with the SDK's own ``BoundedAttributes``/``BoundedList`` when
they are exceeded, list attributes as tuples), without the SDK's per-span ``Context``, lock,
attribute re-validation and ``on_start`` call. Other tracers (another sampler, value-length limits,
a non-SDK tracer) take the SDK's ``start_span`` path. tests/export/test_spans_direct.py checks that both
paths export identical spans.
"""

from __future__ import annotations

import logging
import math
import random
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from threading import get_ident
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import (
    DEFAULT_TRACE_STATE,
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

log = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


_PLAIN_ITEMS = frozenset((int, float, str, bool))  # element types of an array kept as it is
_SCALARS = frozenset((float, int, str, bool, type(None)))  # values that need no conversion


def _clean(attributes: Mapping[str, Any], *, tuples: bool) -> dict[str, Any]:
    """``clean_attributes``, with arrays as tuples (``tuples``: as the SDK stores them) or lists."""
    if set(map(type, attributes.values())) <= _SCALARS:
        # scalars only (most spans): leave out None and NaN, the one value not equal to itself
        return {key: value for key, value in attributes.items() if value is not None and value == value}
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        t = type(value)
        if t is float:  # the common cases first: no conversion
            if value == value:  # not NaN
                out[key] = value
        elif t is int or t is str or t is bool:
            out[key] = value
        elif t is list or t is tuple:
            if not value:
                continue  # an empty array is left out
            kinds = set(map(type, value))  # one C-level pass decides the homogeneous cases
            if len(kinds) == 1 and kinds <= _PLAIN_ITEMS:
                out[key] = (value if t is tuple else tuple(value)) if tuples else list(value)  # a copy
                continue
            converted = _convert(value)
            if converted is not None:
                out[key] = tuple(converted) if tuples and type(converted) is list else converted
        elif value is not None:
            converted = _convert(value)
            if converted is not None:
                out[key] = tuple(converted) if tuples and type(converted) is list else converted
    return out


class SharedAttributes(dict[str, Any]):
    """Attributes cleaned once (as the SDK stores them) and carried by many spans or links as the
    same object (the links to a step's owner span, agent/outputs/traces.py, share one). The factory
    passes it through uncleaned and uncopied, and the OTLP-JSON encoder writes its text once per
    object (agent/export/otlp_json.py). Never mutated after ``shared_attributes`` made it (a span
    given late attributes copies it first)."""

    __slots__ = ()


class SharedLink(Link):
    """An SDK Link the factory made once for a SpanLink whose attributes are a shared set, and hands
    to every span given that SpanLink (the batch-mates' links to a step's owner span): immutable, so
    the OTLP-JSON encoder writes its text once."""


class SharedBoundedAttributes(BoundedAttributes):
    """The immutable BoundedAttributes the factory made once for a shared attribute set, on every
    event or link given that set (a step span's device-memory event: one per memory sample, not
    one per step): never changed, so the OTLP-JSON encoder writes its text once."""


def shared_attributes(attributes: Mapping[str, Any]) -> SharedAttributes:
    """``attributes`` cleaned as a span stores them, in one object to share between spans."""
    return SharedAttributes(span_attributes(attributes))


def clean_attributes(attributes: Mapping[str, Any] | None) -> dict[str, AttributeValue]:
    """OTLP-representable attributes: numpy to Python, homogeneous sequences, no None/NaN."""
    if not attributes:
        return {}
    return _clean(attributes, tuples=False)


def span_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """``clean_attributes`` as the SDK stores them: sequences as tuples, only non-empty str keys."""
    if not attributes:
        return {}
    if type(attributes) is SharedAttributes:
        return attributes  # cleaned when it was made, shared as it is
    out = _clean(attributes, tuples=True)
    if "" in out or not set(map(type, out)) <= {str}:
        log.warning("span attributes with an empty or non-string key are left out")
        out = {k: v for k, v in out.items() if type(k) is str and k}
    return out


def _event_input(attributes: Mapping[str, Any]) -> Mapping[str, Any]:
    """An event's attributes as add_event takes them: cleaned, a shared set as it is (cleaned once)."""
    return attributes if type(attributes) is SharedAttributes else clean_attributes(attributes)


def _convert(value: Any) -> AttributeValue | None:
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):  # numpy scalar or array
        value = value.tolist()
    if isinstance(value, bool | str | int):
        return value
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, list | tuple):
        items = list(value)
        if not items:
            return None
        kinds = set(map(type, items))  # one C-level pass decides the common homogeneous cases
        if len(kinds) == 1 and (int in kinds or bool in kinds or str in kinds or float in kinds):
            return items
        if all(isinstance(v, bool) for v in items):
            return items
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            return items
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in items):
            return [float(v) for v in items]  # OTLP arrays are homogeneous
        return [str(v) for v in items]
    return str(value)


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpanLink:
    context: SpanContext
    attributes: Mapping[str, Any] = field(default_factory=dict)


_EMPTY_CONTEXT = Context()
# shared event and link attribute sets kept with their immutable BoundedAttributes (the link marker, a
# device-memory set per memory sample)
_SHARED_BOUNDED_CACHE = 64
# single links with a shared attribute set kept with their SharedLink: the links to the steps whose
# batch-mates have not all reached them yet (a few seconds of steps)
_SINGLE_LINK_CACHE = 4096


def _context_for(parent: SpanContext | None) -> Context:
    # An empty Context makes a new root; never inherit whatever span is current in this thread.
    if parent is None:
        return _EMPTY_CONTEXT
    return trace.set_span_in_context(NonRecordingSpan(parent), Context())


_UNSET = Status(StatusCode.UNSET)  # immutable: one shared by every span until it sets its own
_NO_TRACE_STATE = DEFAULT_TRACE_STATE  # (SpanContext's default: a root span's)
_TRACE_ID_MAX, _SPAN_ID_MAX = 2**128 - 1, 2**64 - 1
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_NEW_READABLE_SPAN = ReadableSpan.__new__


def finished_span(
    name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind, attributes: Any,
    links: Sequence[Link], events: Sequence[Event], status: Status, start_ns: int, end_ns: int,
    resource: Resource, info: Any, scope: Any,
) -> ReadableSpan:
    """``ReadableSpan(name=..., ...)`` with every field given: the same object, its fields set
    directly. The SDK's keyword constructor was ~1.2 µs of a span's ~2 (the agent makes one object
    per span it exports); tests/export/test_spans_direct.py holds the two to the same fields, so an
    SDK that adds one fails there, not in the field."""
    span: ReadableSpan = _NEW_READABLE_SPAN(ReadableSpan)
    span._name = name
    span._context = context
    span._kind = kind
    span._instrumentation_info = info
    span._instrumentation_scope = scope
    span._parent = parent
    span._start_time = start_ns
    span._end_time = end_ns
    span._attributes = attributes
    span._events = events
    span._links = links
    span._resource = resource
    span._status = status
    return span


class EncodedSpan:
    """A finished span already written as its OTLP/JSON text (``_text``: what the native encoder
    writes for the ReadableSpan it stands for), with its tracer's resource and scope. The OTLP/JSON
    encoders append the text as it is (agent/export/otlp_span.c); the factory makes these only for
    a span processor whose exporter writes OTLP/JSON (``SpanFactory.takes_encoded``)."""

    def __init__(self, text: bytes, resource: Resource, scope: Any) -> None:
        self._text = text
        self._resource = resource
        self._instrumentation_scope = scope

    @property
    def resource(self) -> Resource:
        return self._resource

    @property
    def instrumentation_scope(self) -> Any:
        return self._instrumentation_scope


# A span handed on as text carries at most this many attributes; a span limit below it sends the
# spans the SDK's way (its BoundedAttributes drops and counts the oldest).
ENCODED_MAX_ATTRIBUTES = 64


class _DirectSpan(trace.Span):
    """A span the factory builds without the SDK's Span: becomes a ReadableSpan when it ends.

    The Span API behaves as the SDK's does: calls after ``end`` are ignored (with a warning), an
    OK status is final, UNSET never overrides.
    """

    def __init__(
        self,
        factory: SpanFactory,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any] | BoundedAttributes,
        links: Sequence[Link],
        start_ns: int,
    ) -> None:
        self._factory = factory
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes
        self._links = links
        self._events: list[Event] | BoundedList = []
        self._status = _UNSET
        self._start_ns = start_ns
        self._ended = False

    def _warn_ended(self, what: str) -> bool:
        if self._ended:
            log.warning("span %r already ended: %s ignored", self._name, what)
        return self._ended

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        self.set_attributes({key: value})

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._warn_ended("set_attributes"):
            return
        self._attributes = self._factory._merge(self._attributes, span_attributes(attributes))

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self._warn_ended("add_event"):
            return
        limits = self._factory._limits
        event = Event(name=name, attributes=self._factory._event_attributes(attributes), timestamp=timestamp)
        if isinstance(self._events, list) and limits.max_events is not None and len(self._events) >= limits.max_events:
            self._events = BoundedList.from_seq(limits.max_events, self._events)
        self._events.append(event)

    def update_name(self, name: str) -> None:
        if not self._warn_ended("update_name"):
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._warn_ended("set_status"):
            return
        if self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        attrs: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        attrs.update(attributes or {})
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._warn_ended("end"):
            return
        self._ended = True
        self._factory._finish(self, time.time_ns() if end_time is None else end_time)


class _RandomIds:
    """``RandomIdGenerator``'s ids, drawn the same way (``random.getrandbits``, drawn again while
    it gives the invalid id 0) from compiled code."""

    def generate_span_id(self) -> int:
        span_id = random.getrandbits(64)
        while span_id == 0:
            span_id = random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = random.getrandbits(128)
        while trace_id == 0:
            trace_id = random.getrandbits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True


class SpanFactory:
    """Build spans with explicit timing, parents and links on a given tracer.

    ``direct=None`` (default) builds spans directly where the tracer allows it (see the module
    docstring); ``direct=False`` always goes through the SDK's ``start_span``.
    """

    def __init__(self, tracer: trace.Tracer, *, direct: bool | None = None) -> None:
        self.tracer = tracer
        self.direct = self._direct_possible(tracer) if direct is None else direct and self._direct_possible(tracer)
        if self.direct:
            assert isinstance(tracer, SdkTracer)
            self._limits = tracer._span_limits
            ids = tracer.id_generator
            # the SDK's default generator's draws made by compiled code (_RandomIds): its methods are
            # interpreted Python, ~11 calls a request; any other generator is called as it is
            self._ids: Any = _RandomIds() if type(ids) is RandomIdGenerator else ids
            self._processor = tracer.span_processor
            self._resource = tracer.resource
            self._scope = tracer._instrumentation_scope
            self._info = tracer.instrumentation_info
            self._root_flags = _SAMPLED_RANDOM if self._ids.is_trace_id_random() else _SAMPLED
        self._last: tuple[SpanContext | None, Context] = (None, _EMPTY_CONTEXT)  # one tuple: swapped atomically
        # hold(): the finished spans of the holding thread, handed on together by release()
        self._held: list[Any] | None = None  # (ReadableSpan, or EncodedSpan: hand_on_encoded)
        self._holder = 0  # that thread's ident
        # the last parent given, with its trace id, the flags and the trace state its children take
        self._parent_held: tuple[SpanContext | None, tuple[int, TraceFlags, TraceState]] = (
            None, (0, _SAMPLED, _NO_TRACE_STATE))
        # SpanContext's own constructor checks ids and fills defaults; where it makes the plain tuple
        # this SDK's does (checked once here), the direct path builds that tuple itself
        probe = SpanContext(1, 2, is_remote=False, trace_flags=_SAMPLED, trace_state=None)
        self._plain_contexts = (type(probe) is SpanContext and probe.trace_state is _NO_TRACE_STATE
                                and tuple(probe) == (1, 2, False, _SAMPLED, _NO_TRACE_STATE, True))
        # (id, limit) -> (a shared event or link attribute set, its immutable BoundedAttributes), the
        # set kept with it
        self._bounded: dict[tuple[int, int | None], tuple[SharedAttributes, SharedBoundedAttributes]] = {}
        # id -> (a SpanLink with a shared attribute set, its SharedLink), the SpanLink kept with it
        self._single_links: dict[int, tuple[SpanLink, SharedLink | None]] = {}

    @staticmethod
    def _direct_possible(tracer: trace.Tracer) -> bool:
        if not isinstance(tracer, SdkTracer) or tracer.sampler is not ALWAYS_ON:
            return False
        limits = getattr(tracer, "_span_limits", None)
        needed = ("_instrumentation_scope", "_is_enabled", "span_processor", "id_generator", "resource")
        if limits is None or not all(hasattr(tracer, name) for name in needed):
            return False  # an SDK whose internals differ: its own path
        # value-length limits truncate strings: the SDK's path does that
        return limits.max_span_attribute_length is None and limits.max_attribute_length is None

    def _context(self, parent: SpanContext | None) -> Context:
        # Children of one span arrive together (a layer's router/loads/FFNs): reuse its Context.
        if parent is None:
            return _EMPTY_CONTEXT
        last_parent, last_context = self._last
        if parent is last_parent:
            return last_context
        context = _context_for(parent)
        self._last = (parent, context)
        return context

    def start(
        self,
        name: str,
        *,
        start_ns: int,
        parent: SpanContext | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Iterable[SpanLink] = (),
    ) -> trace.Span:
        """Start a span at ``start_ns``; end it later with ``end(span, end_ns=...)``."""
        if self.direct and self.tracer._is_enabled():  # type: ignore[attr-defined]  # the SDK Tracer's, not the API's
            return self._start_direct(name, int(start_ns), parent, kind, attributes, links)
        return self.tracer.start_span(
            name,
            context=self._context(parent),
            kind=kind,
            attributes=clean_attributes(attributes),
            links=[Link(link.context, clean_attributes(link.attributes)) for link in links],
            start_time=int(start_ns),
        )

    # --- the direct path ---------------------------------------------------------------------
    def _start_direct(
        self,
        name: str,
        start_ns: int,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        links: Iterable[SpanLink],
    ) -> _DirectSpan:
        context, parent, attrs, span_links = self._direct_parts(parent, attributes, links)
        return _DirectSpan(self, name, context, parent, kind, attrs, span_links, start_ns)

    def _direct_parts(
        self, parent: SpanContext | None, attributes: Mapping[str, Any] | None, links: Iterable[SpanLink],
    ) -> tuple[SpanContext, SpanContext | None, dict[str, Any] | BoundedAttributes, Sequence[Link]]:
        """A new span's context, its parent (None when not valid), attributes and links."""
        # What Tracer.start_span does with the ALWAYS_ON sampler: the parent's trace (and trace
        # state, and random-trace-id flag) if it is valid, else a new trace.
        if parent is not None:
            held = self._parent_held  # a parent's children come together (a request's phases, a step's layers)
            if held[0] is parent:
                trace_id, flags, trace_state = held[1]
            elif parent.is_valid:
                trace_id = parent.trace_id
                flags = _SAMPLED_RANDOM if parent.trace_flags.random_trace_id else _SAMPLED
                trace_state = parent.trace_state
                self._parent_held = (parent, (trace_id, flags, trace_state))
            else:
                parent = None
        if parent is None:
            trace_id = self._ids.generate_trace_id()
            flags = self._root_flags
            trace_state = _NO_TRACE_STATE
        span_id = self._ids.generate_span_id()
        if self._plain_contexts and 0 < span_id <= _SPAN_ID_MAX and 0 < trace_id <= _TRACE_ID_MAX:
            # SpanContext(...) without its checks: the ids were just checked, the flags are ours
            context = tuple.__new__(SpanContext, (trace_id, span_id, False, flags, trace_state, True))
        else:
            context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=trace_state)
        attrs: dict[str, Any] | BoundedAttributes = span_attributes(attributes)
        limit = self._limits.max_span_attributes
        if limit is not None and len(attrs) > limit:
            attrs = BoundedAttributes(limit, attrs, immutable=False, max_value_len=None)  # drops the oldest, counted
        span_links: Sequence[Link] = ()
        if links:
            span_links = self._links(links)
        return context, parent, attrs, span_links

    def _links(self, links: Iterable[SpanLink]) -> Sequence[Link]:
        """The span's SDK links. A link whose attributes are a shared set (the links to a step's
        owner span) gets the same SharedLink object every time (immutable: its encoded text is kept
        too)."""
        valid: list[Link] = []
        for link in links:
            if type(link.attributes) is SharedAttributes:
                shared = self._shared_link(link)
                if shared is not None:
                    valid.append(shared)
                continue
            bounded = BoundedAttributes(self._limits.max_link_attributes, clean_attributes(link.attributes),
                                        max_value_len=None, immutable=True)
            if link.context and (link.context.is_valid or bounded or link.context.trace_state):
                valid.append(Link(link.context, bounded))
        max_links = self._limits.max_links
        if max_links is not None and len(valid) > max_links:
            return BoundedList.from_seq(max_links, valid)  # counts its drops per span
        return tuple(valid)

    def _shared_link(self, link: SpanLink) -> SharedLink | None:
        """The SDK link for a SpanLink with a shared attribute set, made once per SpanLink object
        (None: not a valid link)."""
        entry = self._single_links.get(id(link))
        if entry is not None and entry[0] is link:
            return entry[1]
        bounded = self._shared_bounded(link.attributes, self._limits.max_link_attributes)  # type: ignore[arg-type]
        made = None
        if link.context and (link.context.is_valid or bounded or link.context.trace_state):
            made = SharedLink(link.context, bounded)
        if len(self._single_links) >= _SINGLE_LINK_CACHE:
            self._single_links.clear()
        self._single_links[id(link)] = (link, made)  # the SpanLink kept: its id is not reused
        return made

    def _shared_bounded(self, shared: SharedAttributes, limit: int | None) -> SharedBoundedAttributes:
        """The immutable BoundedAttributes of a shared attribute set under a limit (an event's or a
        link's), made once per object."""
        key = (id(shared), limit)
        entry = self._bounded.get(key)
        if entry is not None and entry[0] is shared:
            return entry[1]
        bounded = SharedBoundedAttributes(limit, dict(shared), max_value_len=None, immutable=True)
        if len(self._bounded) >= _SHARED_BOUNDED_CACHE:
            self._bounded.clear()
        self._bounded[key] = (shared, bounded)
        return bounded

    def _events(self, events: Iterable[SpanEvent]) -> Sequence[Event]:
        """A finished span's SDK events, as add_event one by one would leave them (past the limit
        the oldest go, counted by the BoundedList)."""
        made = [Event(name=e.name, attributes=self._event_attributes(_event_input(e.attributes)),
                      timestamp=int(e.time_ns)) for e in events]
        limit = self._limits.max_events
        if limit is not None and len(made) > limit:
            return BoundedList.from_seq(limit, made)
        return tuple(made)

    def _event_attributes(self, attributes: Mapping[str, Any] | None) -> BoundedAttributes:
        """An event's attributes as the SDK stores them (``attributes`` already cleaned)."""
        limit = self._limits.max_event_attributes
        if type(attributes) is SharedAttributes:
            return self._shared_bounded(attributes, limit)
        return BoundedAttributes(limit, attributes, max_value_len=None, immutable=True)

    def _merge(
        self, attrs: dict[str, Any] | BoundedAttributes, late: dict[str, Any]
    ) -> dict[str, Any] | BoundedAttributes:
        """Late attributes as BoundedAttributes.__setitem__ adds them: a re-set key moves to the end."""
        limit = self._limits.max_span_attributes
        if type(attrs) is SharedAttributes:
            attrs = dict(attrs)  # other spans carry this object: this span's own copy takes the change
        for key, value in late.items():
            if isinstance(attrs, dict):
                if key in attrs:
                    del attrs[key]
                elif limit is not None and len(attrs) >= limit:
                    attrs = BoundedAttributes(limit, attrs, immutable=False, max_value_len=None)
                    attrs[key] = value
                    continue
                attrs[key] = value
            else:
                attrs[key] = value
        return attrs

    def _finish(self, span: _DirectSpan, end_ns: int) -> None:
        events = span._events
        self._finished(span._name, span._context, span._parent, span._kind, span._attributes, span._links,
                       tuple(events) if isinstance(events, list) else events, span._status, span._start_ns, end_ns)

    def _finished(
        self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
        attrs: dict[str, Any] | BoundedAttributes, links: Sequence[Link], events: Sequence[Event],
        status: Status, start_ns: int, end_ns: int,
    ) -> None:
        """The finished span, as Span.end makes it, handed to the tracer's span processor."""
        if isinstance(attrs, BoundedAttributes):
            attrs._immutable = True  # as Span.end does
        span = finished_span(name, context, parent, kind, attrs, links, events, status, start_ns, end_ns,
                             self._resource, self._info, self._scope)
        self._sink()(span)

    # --- holding finished spans --------------------------------------------------------------
    def hold(self) -> bool:
        """From now until ``release()``, the spans this thread finishes on the direct path are kept
        and handed to the span processor together (one call, one lock, where the provider's only
        processor takes a batch: BoundedBatchSpanProcessor.on_end_sampled) instead of one by one
        (~1 µs a span through the SDK's processor fan-out and the queue's lock). Other threads'
        spans go on at once. False (nothing to release) when not on the direct path or already
        holding."""
        if not self.direct or self._held is not None:
            return False
        self._holder = get_ident()
        self._held = []
        return True

    def _sink(self) -> Callable[[ReadableSpan], None]:
        """Where this thread's finished spans go now: the held list while it holds, else the processor."""
        held = self._held
        if held is not None and self._holder == get_ident():
            return held.append
        return self._processor.on_end

    def release(self) -> None:
        """Hand the held spans on, in the order they finished, and stop holding."""
        held, self._held = self._held, None
        if held:
            self._end_many(held)

    # --- spans handed on as text -------------------------------------------------------------
    def takes_encoded(self, parent: SpanContext | None) -> bool:
        """Whether spans under ``parent`` (None: root spans, ``root_context``) may be handed on now
        as their OTLP/JSON text (``hand_on_encoded``): on the direct path, while this thread holds
        (``hold``), with the tracer's one span processor taking a batch and exporting OTLP/JSON text
        (``BoundedBatchSpanProcessor.takes_encoded_json``), under a valid parent without trace state,
        and span limits that leave ENCODED_MAX_ATTRIBUTES attributes. Else the caller makes spans."""
        if self._held is None or self._holder != get_ident() or not self.direct:
            return False
        batch = self._batch_processor()
        if batch is None or not getattr(batch, "takes_encoded_json", False):
            return False
        limit = self._limits.max_span_attributes
        if parent is not None and not (parent.is_valid and not parent.trace_state):
            return False
        return self.tracer._is_enabled() and (limit is None or limit >= ENCODED_MAX_ATTRIBUTES)  # type: ignore[attr-defined]

    def root_context(self) -> SpanContext:
        """The context of a new root span, drawn as ``record`` draws it (its trace id, then its span
        id): for a root span handed on as text."""
        trace_id = self._ids.generate_trace_id()
        span_id = self._ids.generate_span_id()
        flags = self._root_flags
        if self._plain_contexts and 0 < span_id <= _SPAN_ID_MAX and 0 < trace_id <= _TRACE_ID_MAX:
            return tuple.__new__(SpanContext, (trace_id, span_id, False, flags, _NO_TRACE_STATE, True))
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=_NO_TRACE_STATE)

    def child_context(self, parent: SpanContext | None) -> tuple[SpanContext, SpanContext | None]:
        """A new span's context and the parent it names, drawn as ``record`` draws them (None or an
        invalid parent: a new root): for a span handed on as text."""
        if parent is None:
            return self.root_context(), None
        named, contexts = self._contexts_under(parent, 1)
        return contexts[0], named

    def encoded_events(self, events: Sequence[SpanEvent]) -> tuple[Event, ...] | None:
        """A span's SDK events as ``record`` makes them, for a span handed on as text; None where
        the events limit would drop some (the caller makes the span)."""
        made = self._events(events) if events else ()
        return made if type(made) is tuple else None

    def shared_event_parts(self, events: Sequence[SpanEvent]) -> list[tuple[str, int, BoundedAttributes]] | None:
        """A span's events as ``record`` would store them — name, time, attributes under the event
        attribute limit — without the SDK's Event objects, for a span written as text
        (otlp_json.event_text); None where an event's attributes are not a shared set or the events
        limit would drop some (the caller takes ``encoded_events``)."""
        limit = self._limits.max_events
        if limit is not None and len(events) > limit:
            return None
        parts: list[tuple[str, int, BoundedAttributes]] = []
        for event in events:
            attributes = event.attributes
            if type(attributes) is not SharedAttributes:
                return None
            parts.append((event.name, int(event.time_ns), self._event_attributes(attributes)))
        return parts

    def encoded_links(self, links: Sequence[SpanLink]) -> tuple[Link, ...] | None:
        """A span's SDK links as ``record`` makes them, for a span handed on as text; None where the
        links limit would drop some (the SDK's BoundedList counts them: the caller makes the span)."""
        made = self._links(links)
        return made if type(made) is tuple else None

    def child_span_ids(self, count: int) -> list[int]:
        """The span ids of ``count`` children of a valid parent, drawn as ``record_children`` draws
        them (one ``generate_span_id`` each, in order)."""
        new_span_id = self._ids.generate_span_id
        return [new_span_id() for _ in range(count)]

    def hand_on_encoded(self, texts: list[bytes]) -> None:
        """Finished spans, each as its OTLP/JSON text, handed on with this thread's held spans (only
        after ``takes_encoded`` said yes)."""
        held = self._held
        assert held is not None
        resource, scope = self._resource, self._scope
        held.extend([EncodedSpan(text, resource, scope) for text in texts])

    def _batch_processor(self) -> Any:
        """The tracer's one span processor where it takes a batch (``on_end_sampled``), else None."""
        processors = getattr(self._processor, "_span_processors", None)  # the SDK's fan-out, where it is one
        if processors is not None and len(processors) == 1 and getattr(processors[0], "on_end_sampled", None):
            return processors[0]
        return None

    def _end_many(self, spans: list[Any]) -> None:
        batch = self._batch_processor()
        if batch is not None:
            batch.on_end_sampled(spans)  # (the direct path's spans are all sampled: ALWAYS_ON)
            return
        on_end = self._processor.on_end
        for span in spans:
            on_end(span)

    @staticmethod
    def end(
        span: trace.Span,
        *,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        events: Iterable[SpanEvent] = (),
        error: str | None = None,
    ) -> SpanContext:
        """Add late attributes/events, set an error status if given, end at ``end_ns``."""
        if attributes:
            span.set_attributes(clean_attributes(attributes))
        for event in events:
            span.add_event(event.name, _event_input(event.attributes), timestamp=int(event.time_ns))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=int(end_ns))
        return span.get_span_context()

    def record(
        self,
        name: str,
        *,
        start_ns: int,
        end_ns: int,
        parent: SpanContext | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Iterable[SpanLink] = (),
        events: Iterable[SpanEvent] = (),
        error: str | None = None,
    ) -> SpanContext:
        """A complete span in one call; returns its context (to parent children or link to)."""
        if end_ns < start_ns:
            end_ns = start_ns  # clock skew between sources must not make a negative duration
        if self.direct and self.tracer._is_enabled():  # type: ignore[attr-defined]  # the SDK Tracer's, not the API's
            if error is None:
                # the agent's spans (phases, steps, layers): the finished span at once, no _DirectSpan
                context, parent, attrs, span_links = self._direct_parts(parent, attributes, links)
                made = self._events(events) if events else ()
                self._finished(name, context, parent, kind, attrs, span_links, made, _UNSET, int(start_ns), int(end_ns))
                return context
            # one-shot: straight to the finished span (what end() does, minus its checks on a fresh span)
            direct = self._start_direct(name, int(start_ns), parent, kind, attributes, links)
            for event in events:
                direct.add_event(event.name, _event_input(event.attributes), timestamp=int(event.time_ns))
            if error is not None:
                direct._status = Status(StatusCode.ERROR, error)
            direct._ended = True
            self._finish(direct, int(end_ns))
            return direct._context
        span = self.start(name, start_ns=start_ns, parent=parent, kind=kind, attributes=attributes, links=links)
        return self.end(span, end_ns=end_ns, events=events, error=error)

    def _contexts_under(self, parent: SpanContext, count: int) -> tuple[SpanContext | None, list[SpanContext]]:
        """The parent its children name (None where ``parent`` is not valid) and ``count`` new span
        contexts for them, as _direct_parts makes them: in the parent's trace with its trace state
        and flags, or each a new root where the parent is not valid."""
        valid = parent.is_valid
        if valid:
            flags = _SAMPLED_RANDOM if parent.trace_flags.random_trace_id else _SAMPLED
            trace_id, trace_state = parent.trace_id, parent.trace_state
        else:
            flags, trace_state, trace_id = self._root_flags, _NO_TRACE_STATE, 0
        new_span_id, new_trace_id, plain = self._ids.generate_span_id, self._ids.generate_trace_id, self._plain_contexts
        contexts: list[SpanContext] = []
        for _ in range(count):
            if not valid:
                trace_id = new_trace_id()
            span_id = new_span_id()
            if plain and 0 < span_id <= _SPAN_ID_MAX and 0 < trace_id <= _TRACE_ID_MAX:
                # SpanContext(...) without its checks: the ids were just checked, the flags are ours
                contexts.append(tuple.__new__(SpanContext, (trace_id, span_id, False, flags, trace_state, True)))
            else:
                contexts.append(SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags,
                                            trace_state=trace_state))
        return (parent if valid else None), contexts

    def record_siblings(self, parent: SpanContext,
                        children: Sequence[tuple[str, int, int, Mapping[str, Any] | None, Sequence[SpanLink]]]) -> int:
        """One INTERNAL span under ``parent`` per ``(name, start_ns, end_ns, attributes, links)``, each
        as ``record`` makes it without events or error (a request's phase spans); returns how many.
        Attributes are cleaned and links made as ``record`` does; the direct path resolves the parent
        once and builds each span without ``record``'s keyword handling."""
        if not (self.direct and self.tracer._is_enabled()):  # type: ignore[attr-defined]
            for name, start_ns, end_ns, attributes, links in children:
                self.record(name, start_ns=start_ns, end_ns=end_ns, parent=parent, attributes=attributes, links=links)
            return len(children)
        span_parent, contexts = self._contexts_under(parent, len(children))
        limit = self._limits.max_span_attributes
        finished = self._finished
        internal = SpanKind.INTERNAL
        for context, (name, start_ns, end_ns, attributes, links) in zip(contexts, children, strict=True):
            attrs: dict[str, Any] | BoundedAttributes = span_attributes(attributes) if attributes else {}
            if limit is not None and len(attrs) > limit:
                attrs = BoundedAttributes(limit, attrs, immutable=False, max_value_len=None)  # counted
            start_ns, end_ns = int(start_ns), int(end_ns)
            finished(name, context, span_parent, internal, attrs, self._links(links) if links else (), (), _UNSET,
                     start_ns, end_ns if end_ns >= start_ns else start_ns)
        return len(children)

    def record_children(self, name: str, *, parent: SpanContext,
                        children: Iterable[tuple[int, int, dict[str, Any]]]) -> int:
        """One INTERNAL span named ``name`` under ``parent`` per ``(start_ns, end_ns, attributes)``,
        each as ``record`` makes it without links, events or error (a step's layer spans); returns
        how many. ``attributes`` must already be as a span stores them (what ``span_attributes``
        returns unchanged: Python scalars, arrays as tuples of one type, non-empty str keys, no None
        and no NaN scalar; tests/export/test_trace_children.py holds the layer builder to that); each
        dict becomes its span's own. The direct path resolves the parent once and skips the
        per-span cleaning and keyword handling (~9 µs of a layer span's ~17 on this VM)."""
        if not (self.direct and self.tracer._is_enabled()):  # type: ignore[attr-defined]
            made = 0
            for start_ns, end_ns, attributes in children:
                self.record(name, start_ns=start_ns, end_ns=end_ns, parent=parent, attributes=attributes)
                made += 1
            return made
        children = list(children)
        span_parent, contexts = self._contexts_under(parent, len(children))
        limit = self._limits.max_span_attributes
        resource, info, scope = self._resource, self._info, self._scope
        on_end = self._sink()
        internal = SpanKind.INTERNAL
        made = 0
        for context, (start_ns, end_ns, attrs) in zip(contexts, children, strict=True):
            span_attrs: dict[str, Any] | BoundedAttributes = attrs
            if limit is not None and len(attrs) > limit:
                span_attrs = BoundedAttributes(limit, attrs, immutable=True, max_value_len=None)  # counted
            start_ns, end_ns = int(start_ns), int(end_ns)
            on_end(finished_span(name, context, span_parent, internal, span_attrs, (), (), _UNSET, start_ns,
                                 end_ns if end_ns >= start_ns else start_ns, resource, info, scope))
            made += 1
        return made
