"""Spans from recorded timestamps: the pipeline knows when things happened, after they happened.

``SpanFactory`` wraps an SDK tracer so the pipeline can build spans with explicit start/end times
(ns since the Unix epoch), explicit parents (a ``SpanContext``, never the ambient context: the
agent's own thread state must not leak into a target's trace) and span links. Attribute values are
converted to what OTLP carries: numpy scalars/arrays become Python values, ``None`` and NaN are
left out (an undefined ratio is an absent attribute, not a misleading number).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


def clean_attributes(attributes: Mapping[str, Any] | None) -> dict[str, AttributeValue]:
    """OTLP-representable attributes: numpy to Python, homogeneous sequences, no None/NaN."""
    out: dict[str, AttributeValue] = {}
    for key, value in (attributes or {}).items():
        converted = _convert(value)
        if converted is not None:
            out[key] = converted
    return out


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


def _context_for(parent: SpanContext | None) -> Context:
    # An empty Context makes a new root; never inherit whatever span is current in this thread.
    if parent is None:
        return Context()
    return trace.set_span_in_context(NonRecordingSpan(parent), Context())


class SpanFactory:
    """Build spans with explicit timing, parents and links on a given tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

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
        return self.tracer.start_span(
            name,
            context=_context_for(parent),
            kind=kind,
            attributes=clean_attributes(attributes),
            links=[Link(link.context, clean_attributes(link.attributes)) for link in links],
            start_time=int(start_ns),
        )

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
            span.add_event(event.name, clean_attributes(event.attributes), timestamp=int(event.time_ns))
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
        span = self.start(name, start_ns=start_ns, parent=parent, kind=kind, attributes=attributes, links=links)
        return self.end(span, end_ns=end_ns, events=events, error=error)
