"""The span path reads SpanContext by item, the default trace state by identity, the tracer's config
directly and an ingress record's flags, instead of the SDK's and the record's interpreted properties
(each an interpreted call from compiled code): the same values, the properties still asked where a
subclass may override them, and the tracer's on/off state read at every span."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider, _TracerConfig
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import DEFAULT_TRACE_STATE, SpanContext, TraceFlags, TraceState

from moescope.agent.export import SpanFactory
from moescope.agent.export import spans as spans_module
from moescope.agent.export.otlp_json import PLAIN_SPANS
from moescope.agent.export.spans import _TUPLE_FIELDS, _trace_of, context_span_id, no_trace_state
from moescope.agent.join import record_answered
from moescope.probes.ingress.loader import F_NO_RESPONSE, IngressRecord

RANDOM = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)


class Renamed(SpanContext):
    """A SpanContext subclass whose properties do not read its items: the helpers must ask them."""

    @property
    def span_id(self) -> int:
        return 99

    @property
    def is_valid(self) -> bool:
        return False


def test_the_pinned_sdk_is_read_by_item() -> None:
    # the fast path is the one that runs with the SDK this project pins
    assert _TUPLE_FIELDS is True


def test_item_reads_equal_the_properties() -> None:
    state = TraceState([("vendor", "x")])
    for ctx in (SpanContext(7, 8, is_remote=False, trace_flags=RANDOM),
                SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(1), trace_state=state),
                SpanContext(0, 0, is_remote=False)):
        assert context_span_id(ctx) == ctx.span_id
        flags = TraceFlags(TraceFlags.SAMPLED | (ctx.trace_flags & TraceFlags.RANDOM_TRACE_ID))
        assert _trace_of(ctx) == (ctx.is_valid, ctx.trace_id, flags, ctx.trace_state)
    assert _trace_of(SpanContext(7, 8, is_remote=False, trace_flags=RANDOM))[2] is spans_module._SAMPLED_RANDOM


def test_a_subclass_is_asked_through_its_properties() -> None:
    ctx = Renamed(7, 8, is_remote=False)
    assert ctx[1] == 8 and context_span_id(ctx) == 99
    assert _trace_of(ctx)[0] is False


def test_trace_state_emptiness() -> None:
    assert no_trace_state(DEFAULT_TRACE_STATE)
    assert no_trace_state(TraceState())  # another empty one: asked for its length
    assert not no_trace_state(TraceState([("k", "v")]))


def _tracer() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("t"), exporter


def test_the_tracer_config_is_read_at_every_span() -> None:
    tracer, exporter = _tracer()
    factory = SpanFactory(tracer)
    assert factory.direct and factory._config_enabled
    factory.record("on", start_ns=1, end_ns=2)
    tracer._set_tracer_config(_TracerConfig(is_enabled=False))
    factory.record("off", start_ns=1, end_ns=2)
    assert not factory.takes_encoded(None)
    tracer._set_tracer_config(_TracerConfig(is_enabled=True))
    factory.record("on-again", start_ns=1, end_ns=2)
    assert [s.name for s in exporter.get_finished_spans()] == ["on", "on-again"]


def test_an_overridden_is_enabled_is_called() -> None:
    tracer, exporter = _tracer()
    calls = []

    def off() -> bool:
        calls.append(1)
        return False

    tracer.__class__ = type("OwnTracer", (type(tracer),), {"_is_enabled": lambda self: off()})
    factory = SpanFactory(tracer)
    assert not factory._config_enabled
    factory.record("never", start_ns=1, end_ns=2)
    assert calls and exporter.get_finished_spans() == ()


@pytest.mark.skipif(PLAIN_SPANS is None, reason="the native encoder is not built")
def test_the_native_encoder_takes_only_an_empty_default_trace_state() -> None:
    from moescope.agent.export import otlp_json

    native: Any = otlp_json._native
    plain_spans: Any = PLAIN_SPANS
    assert native is not None and plain_spans is not None
    with pytest.raises(ValueError, match="empty trace state"):
        native.set_empty_trace_state(TraceState([("k", "v")]))
    with pytest.raises(TypeError):
        native.set_empty_trace_state(5)
    native.set_empty_trace_state(DEFAULT_TRACE_STATE)  # (what the module registered: left as it was)
    with_state = SpanContext(5, 6, is_remote=False, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    with pytest.raises(ValueError):
        plain_spans(with_state, None, [(6, "s", 1, 1, 2, (), (), (), ())])
    plain = SpanContext(5, 6, is_remote=False, trace_flags=TraceFlags(1))
    assert plain_spans(plain, None, [(6, "s", 1, 1, 2, (), (), (), ())])


def _record(flags: int) -> IngressRecord:
    return IngressRecord(tgid=1, tid=1, fd=3, generation=1, seq=0, family=2, peer_addr="127.0.0.1", peer_port=1,
                         start_ns=1, first_response_ns=2, end_ns=3, bytes_in=1, bytes_out=1, flags=flags)


def test_record_answered_is_the_property() -> None:
    for flags in (0, F_NO_RESPONSE, F_NO_RESPONSE | 0x4, 0x4):
        assert record_answered(_record(flags)) is _record(flags).answered

    class Never(IngressRecord):
        @property
        def answered(self) -> bool:
            return False

    assert record_answered(Never(*_record(0))) is False


def test_shared_links_keep_the_sdk_link_fields() -> None:
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.trace import Link

    from moescope.agent.export.spans import _LINK_FIELDS, SharedBoundedAttributes, SharedLink, context_ids, link_fields

    assert _LINK_FIELDS is True  # the pinned SDK: SharedLink sets the fields itself
    ctx = SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(1))
    attrs = SharedBoundedAttributes(1, {"a": 1, "b": 2}, immutable=True, max_value_len=None)  # one dropped
    shared = SharedLink(ctx, attrs)
    assert (shared.context, shared.attributes, shared.dropped_attributes) == (ctx, attrs, 1)
    assert link_fields(shared) == (ctx, attrs, 1)
    plain = Link(ctx, BoundedAttributes(4, {"a": 1}, immutable=True, max_value_len=None))
    assert link_fields(plain) == (plain.context, plain.attributes, 0)
    assert context_ids(ctx) == (7, 8, True) == (ctx.trace_id, ctx.span_id, ctx.is_remote)
    assert context_ids(Renamed(7, 8, is_remote=False))[1] == 99
