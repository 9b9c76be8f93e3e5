"""A request's server and phase spans and a step span written as OTLP/JSON text from their parts
(agent/export/otlp_span.c ``plain_spans``, ``TraceOutput._request_texts`` and ``_step_text``) are,
byte for byte, the text the same spans give when built as span objects and encoded: over the
pipeline's whole trace scenario (keep-alive, a batch of three sharing steps it owns and links to, an
unanswered request, an expired step, unjoined steps, fd reuse, step spans' device-memory events;
both span details), phase spans linking to many owner steps, requests with no breakdown, and a
retransmit event (that server span is built as an object). Where a value is one
the writer does not take (a non-ASCII model name) the spans are built the usual way. The writer
refuses malformed parts with ValueError."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanContext, TraceFlags
from phase_requests import ModelRequest, model_request
from test_spans_direct import BatchTaking, CountingIds

from moescope.agent.export import SpanFactory
from moescope.agent.export.otlp_json import PLAIN_SPANS, spans_to_bytes
from moescope.agent.export.spans import EncodedSpan, SpanLink, shared_attributes
from moescope.agent.join import NetSignalSeen, RequestJoined
from moescope.agent.outputs.traces import MAX_STEP_LINKS, TraceOutput
from moescope.agent.pipeline import Pipeline
from moescope.collectors.netsig import NetSignalRecord
from moescope.probes.netsig.loader import NetEvent
from tests.pipeline.scenario import EPOCH_OFFSET_NS, RETENTION_NS, FakeClock, feed, feed_linked_steps, main_scenario

pytestmark = pytest.mark.skipif(PLAIN_SPANS is None, reason="the native encoder is not built")

RESOURCE = Resource.create({"service.name": "t"})


def _factory(*, takes: bool) -> tuple[SpanFactory, BatchTaking]:
    batch = BatchTaking(takes_encoded_json=takes)
    provider = TracerProvider(sampler=ALWAYS_ON, resource=RESOURCE, id_generator=CountingIds())
    provider.add_span_processor(batch)
    return SpanFactory(provider.get_tracer("moescope")), batch


def _scenario_spans(*, takes: bool, detail: str) -> list[Any]:
    factory, batch = _factory(takes=takes)
    clock = FakeClock()
    pipeline = Pipeline(spans=factory, clock=clock, step_retention_ns=RETENTION_NS, epoch_offset_ns=EPOCH_OFFSET_NS,
                        span_detail=detail)
    feed(main_scenario(), pipeline, clock)
    return batch.spans


def _names(spans: list[Any]) -> list[str]:
    return [s.name if isinstance(s, ReadableSpan) else "<text>" for s in spans]


@pytest.mark.parametrize("detail", ["layer", "expert"])
def test_the_scenarios_request_spans_as_text_are_their_spans_encoded(detail: str) -> None:
    written = _scenario_spans(takes=True, detail=detail)
    built = _scenario_spans(takes=False, detail=detail)
    assert len(written) == len(built)
    assert spans_to_bytes(written) == spans_to_bytes(built)
    servers = [s for s in built if s.name == "http.server.request"]
    # every answered request's server span went as text; the unanswered one (an error status) did not
    texts = [w for w, b in zip(written, built, strict=True)
             if b.name == "http.server.request" and type(w) is EncodedSpan]
    assert len(servers) == 11 and len(texts) == 10
    phases = [w for w, b in zip(written, built, strict=True) if b.name in ("receive", "queue wait", "prefill", "decode",
                                                                           "response write")]
    assert phases and all(type(w) is EncodedSpan for w in phases)
    steps = [(w, b) for w, b in zip(written, built, strict=True) if b.name == "moe.step"]
    # every step span went as text, with its device-memory event (and the unjoined ones as roots)
    assert steps and all(type(w) is EncodedSpan for w, _ in steps) and all(b.events for _, b in steps)
    assert any(b.parent is None for _, b in steps) and any(b.parent is not None for _, b in steps)
    one_by_one = b",".join(spans_to_bytes([s])[:-1] for s in written)  # each alone: the same text too
    assert one_by_one == b",".join(spans_to_bytes([s])[:-1] for s in built)


def _linked_spans(*, takes: bool) -> list[Any]:
    """Two requests over MAX_STEP_LINKS + 4 steps: the first owns them, the second's prefill and
    decode link to them (the slowest MAX_STEP_LINKS of the decode steps; the rest counted)."""
    factory, batch = _factory(takes=takes)
    clock = FakeClock()
    feed_linked_steps(Pipeline(spans=factory, clock=clock, epoch_offset_ns=EPOCH_OFFSET_NS), clock, MAX_STEP_LINKS + 4)
    return batch.spans


def test_phase_spans_linking_owner_steps_as_text_are_their_spans_encoded() -> None:
    written, built = _linked_spans(takes=True), _linked_spans(takes=False)
    assert spans_to_bytes(written) == spans_to_bytes(built)
    decode = [(w, b) for w, b in zip(written, built, strict=True) if b.name == "decode"]
    assert len(decode) == 2 and all(type(w) is EncodedSpan for w, _ in decode)
    assert max(len(b.links) for _, b in decode) == MAX_STEP_LINKS
    assert any(b.attributes.get("moe.phase.steps_unlinked") for _, b in decode)


def _requests(model: str | None, *, retransmit: bool = False) -> list[RequestJoined]:
    out = []
    for i, shape in enumerate((ModelRequest(), ModelRequest(input_tokens=None, decode_steps=0),
                               ModelRequest(streamed=True, decode_steps=1))):
        rec, b = model_request(shape, start_ns=1_000_000_000 * (i + 1), fd=7 + i, model=model)
        out.append(RequestJoined(record=rec, steps=(), first_claims=(), breakdown=b))
    rec, _ = model_request(ModelRequest(), start_ns=9_000_000_000, fd=20)
    out.append(RequestJoined(record=rec._replace(peer_port=0, first_response_ns=0), steps=(), first_claims=()))
    return out


def _request_spans(events: list[Any], *, takes: bool) -> list[Any]:
    factory, batch = _factory(takes=takes)
    out = TraceOutput(factory, epoch_offset_ns=EPOCH_OFFSET_NS)
    out.export(events)
    return batch.spans


def test_requests_with_and_without_a_breakdown_as_text_are_their_spans_encoded() -> None:
    events = _requests("moe-tiny")
    written, built = _request_spans(events, takes=True), _request_spans(events, takes=False)
    assert spans_to_bytes(written) == spans_to_bytes(built)
    assert all(type(s) is EncodedSpan for s in written)
    assert [s.name for s in built].count("http.server.request") == 4 and len(built) == 3 * 6 + 1
    # (no input tokens reported, no TPOT, no first response, no peer port: left out, as the dict does)
    plain = next(s for s in built if s.name == "http.server.request" and s.attributes["moe.request.key"] == 20)
    assert "network.peer.port" not in plain.attributes and "moe.request.time_to_first_byte_ms" not in plain.attributes


def test_a_server_span_with_events_is_built_as_a_span() -> None:
    events = _requests("moe-tiny")
    first = events[0].record
    net = NetEvent(ts_ns=first.start_ns + 1000, kind="retransmit", detail=1, family=2, local_addr="127.0.0.1",
                   local_port=8000, remote_addr=first.peer_addr, remote_port=first.peer_port)
    batch: list[Any] = [NetSignalSeen(record=NetSignalRecord(at_ns=first.start_ns, events=(net,))), *events]
    written, built = _request_spans(batch, takes=True), _request_spans(batch, takes=False)
    assert spans_to_bytes(written) == spans_to_bytes(built)
    assert written[0].events  # the server span with its retransmit: that request's spans built
    assert [type(s) for s in written] == [ReadableSpan] * 6 + [EncodedSpan] * 13


def test_a_value_the_writer_does_not_take_builds_the_spans() -> None:
    events = _requests("mod\u00e8le")  # a non-ASCII model name: the Python encoder's
    written, built = _request_spans(events, takes=True), _request_spans(events, takes=False)
    # the three with that model: built as spans (their ids drawn twice); the fourth has no model
    assert [type(s) for s in written] == [ReadableSpan] * 18 + [EncodedSpan]
    assert _ids_in_order(spans_to_bytes(written)) == _ids_in_order(spans_to_bytes(built))


def _ids_in_order(line: bytes) -> bytes:
    """The line with each id replaced by its order of first appearance."""
    seen: dict[bytes, bytes] = {}
    return re.sub(rb'"([0-9a-f]{16}|[0-9a-f]{32})"',
                  lambda m: b'"#%d"' % int(seen.setdefault(m.group(1), b"%d" % len(seen))), line)


TRACE = SpanContext(7 << 64 | 9, 11, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def _item(**changes: Any) -> tuple[Any, ...]:
    item: dict[str, Any] = dict(span_id=21, name="decode", kind=0, start=100, end=150, keys=("a", "b", "c", "d"),
                                values=[1.5, None, float("nan"), "x"], links=(), events=())
    item.update(changes)
    return tuple(item.values())


def test_plain_spans_writes_what_it_is_given() -> None:
    assert PLAIN_SPANS is not None
    link = SpanLink(SpanContext(5, 6, is_remote=False), shared_attributes({"moe.link": "step.owner"}))
    factory, _ = _factory(takes=True)
    links = factory.encoded_links((link,))
    assert links is not None
    texts = PLAIN_SPANS(TRACE, TRACE, [_item(), _item(span_id=22, kind=1, keys=(), values=(), links=links,
                                                   start=0, name="")])
    assert texts[0] == (b'{"traceId":"00000000000000070000000000000009","spanId":"0000000000000015",'
                        b'"parentSpanId":"000000000000000b","name":"decode","kind":1,'
                        b'"startTimeUnixNano":"100","endTimeUnixNano":"150","attributes":['
                        b'{"key":"a","value":{"doubleValue":1.5}},{"key":"d","value":{"stringValue":"x"}}],'
                        b'"status":{},"flags":256}')
    assert texts[1] == (b'{"traceId":"00000000000000070000000000000009","spanId":"0000000000000016",'
                        b'"parentSpanId":"000000000000000b","kind":2,"endTimeUnixNano":"150",'
                        b'"links":[{"traceId":"00000000000000000000000000000005","spanId":"0000000000000006",'
                        b'"attributes":[{"key":"moe.link","value":{"stringValue":"step.owner"}}],"flags":256}],'
                        b'"status":{},"flags":256}')
    root = PLAIN_SPANS(TRACE, None, [_item(values=[None, None, None, None])])[0]
    assert b"parentSpanId" not in root and b"attributes" not in root
    # a dict (keys None), arrays of one type as they are, empty ones left out (as span_attributes does)
    text = PLAIN_SPANS(TRACE, TRACE, [_item(keys=None, values={"r": [3, 1], "e": (), "f": (0.5, float("nan")),
                                                                 "n": None, "b": True})])[0]
    assert (b'"attributes":[{"key":"r","value":{"arrayValue":{"values":[{"intValue":"3"},{"intValue":"1"}]}}},'
            b'{"key":"f","value":{"arrayValue":{"values":[{"doubleValue":0.5},{"doubleValue":"NaN"}]}}},'
            b'{"key":"b","value":{"boolValue":true}}],"status"') in text


@pytest.mark.parametrize(("parent", "item"), [
    (TRACE, _item(values=[1.5, None])),  # fewer values than keys
    (TRACE, _item(values=[(1, 2.5), None, None, None])),  # a mixed array: span_attributes converts it
    (TRACE, _item(values=[[None], None, None, None])),
    (TRACE, _item(values=[np.arange(3), None, None, None])),
    (TRACE, _item(keys=None, values={"a": np.float64(1.0)})),  # a dict's values likewise
    (TRACE, _item(keys=None, values={"": 1})),
    (TRACE, _item(keys=None, values=[("a", 1)])),  # keys None: a dict
    (TRACE, _item(events=[])),  # not a tuple
    (TRACE, _item(values=[np.int64(3), None, None, None])),  # a numpy scalar, likewise
    (TRACE, _item(values=[1 << 64, None, None, None])),  # past int64: the Python encoder leaves it out
    (TRACE, _item(values=["caf\u00e9", None, None, None])),  # non-ASCII: the Python encoder's
    (TRACE, _item(keys=("", "b", "c", "d"))),  # an empty key
    (TRACE, _item(keys=(1, "b", "c", "d"))),
    (TRACE, _item(name="d\u00e9code")),
    (TRACE, _item(name=None)),
    (TRACE, _item(kind=5)),
    (TRACE, _item(kind=-1)),
    (TRACE, _item(span_id=1 << 64)),
    (TRACE, _item(span_id=-1)),
    (TRACE, _item(start=1 << 63)),
    (TRACE, _item(end="150")),
    (TRACE, _item(links=[])),  # not a tuple
    (TRACE, _item()[:7]),  # seven parts
    (SpanContext(8 << 64, 11, is_remote=False), _item()),  # a parent in another trace
    ((1, 2), _item()),  # not a context
])
def test_plain_spans_refuses_what_is_not_as_described(parent: Any, item: Any) -> None:
    assert PLAIN_SPANS is not None
    with pytest.raises((ValueError, TypeError)):
        PLAIN_SPANS(TRACE, parent, [item])


def test_the_factory_takes_roots_as_text_only_while_holding_for_json() -> None:
    factory, _ = _factory(takes=True)
    assert not factory.takes_encoded(None)  # not holding
    assert factory.hold() and factory.takes_encoded(None)
    factory.release()
    other, _ = _factory(takes=False)
    assert other.hold() and not other.takes_encoded(None)
    other.release()
