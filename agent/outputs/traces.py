"""Traces from joined events: one trace per request, rooted at the kernel-timed SERVER span.

Structure (docs/traces-and-metrics.md "Trace structure"): a request that steps carried gets one
child span per phase of its breakdown (agent/request_phases.py: ``receive``, ``queue wait``,
``prefill``, ``decode``, ``response write``; zero-length ones too, so every such request has all
five) and the ``gen_ai.*`` / ``moe.request.*`` breakdown attributes on its server span.

The *first request of a batch whose record arrives* owns the step's full subtree (step → layer →
router / expert.load / expert.ffn), under its own server span. Every other request of that batch
reaches the step through a span link (``moe.link = step.owner``) on its ``prefill`` or ``decode``
phase span, whichever phase the step ran in: at most ``MAX_STEP_LINKS`` per phase span (the slowest
steps, in time order; ``moe.phase.steps_unlinked`` counts the rest). So a request's trace costs
O(1) spans however many tokens it generated; until 2026-12-04 each (request, step) pair was a
``moe.step`` stub span, O(output tokens) spans per request (docs/traces-and-metrics.md). (Owner =
first completed, not oldest: a request's record arrives only when it completes, and spans are
exported as soon as they end, so the owner cannot wait for older batch-mates.) A step no request
claimed before it left the buffer by retention becomes its own trace (``moe.step.unjoined =
true``); one pushed out early by the buffer bound is dropped and counted by the join.

Sampling under load (``LayerSampler``): every step gets its ``moe.step`` span (with the step's
routing-health aggregates); its layer subtree is kept for a slow step always, then as a budget of
layer spans per second allows. A step whose subtree was left out says so
(``moe.step.layers_sampled_out = true``) and is counted (``layer_subtrees_sampled_out``), apart from
export drops. Metrics and the policy see every step whatever is sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add, mul
from typing import Any

import numpy as np
from opentelemetry.trace import SpanContext, SpanKind
from opentelemetry.util.types import AttributeValue

from moescope.agent.export.otlp_json import COLUMN_SPANS, PLAIN_SPANS, event_text
from moescope.agent.export.spans import (
    SharedAttributes,
    SpanEvent,
    SpanFactory,
    SpanLink,
    shared_attributes,
    span_attributes,
)
from moescope.agent.join import (
    BufferedStep,
    JoinEvent,
    NetSignalSeen,
    RequestJoined,
    RuntimeSeen,
    StepRetired,
    StepSeen,
    TelemetrySeen,
    TreeDropped,
)
from moescope.agent.request_phases import RequestBreakdown
from moescope.agent.routing_health import LayerTable, StepsTable
from moescope.collectors.host import MemorySignal
from moescope.collectors.moe_convention import ROUTER_RANGE, FfnColumns, LayerColumns, LayerEvent, StepEvent
from moescope.collectors.netsig import NetEventIndex, span_event_fields
from moescope.latency import SlidingQuantile
from moescope.probes.ingress.loader import IngressRecord
from moescope.probes.netsig.loader import reset_reason_name

# Above this, per-expert arrays on spans become top-16 id/value lists: at E = 256 four 256-long arrays
# per layer span made each cost ~0.5 ms to build and encode (benchmarks/step_path.py).
MAX_ARRAY_EXPERTS = 64
TOP_EXPERTS_ON_SPANS = 16

# How much of the forward pass becomes spans: "layer" (default) puts the router, expert loads and
# FFNs of a layer into array attributes of its moe.layer span; "expert" gives each its own span.
SPAN_DETAILS = ("layer", "expert")
DEFAULT_SPAN_DETAIL = "layer"
# Layer spans per second kept on average (token bucket, burst of one second's worth), slow steps on
# top: 100 is every step of the reference model (L=4) up to 25 steps/s and half of them at its
# loaded ~50, or ~1.7 DeepSeek-V3 steps/s (L=58) besides the ~2/s slow ones; a kept layer span
# costs ~90-110 µs of agent CPU at E=256 (~12-15 at the reference's E=16), so at 200 DeepSeek-V3
# steps/s traces stay near 4-5 % of a core with the step spans, and at the reference load the
# layer subtrees are ~10 % of the agent instead of ~20 (docs/traces-and-metrics.md, "Sampling").
DEFAULT_LAYER_SPANS_PER_S = 100.0
SLOW_STEP_QUANTILE = 0.99  # a step at or above the window's p99 duration is "slow": always kept
SLOW_STEP_MIN_SAMPLES = 100  # ... once the window holds this many steps (before: the budget alone)
SLOW_STEP_WINDOW_NS = 10_000_000_000
# A phase span links to at most this many of the steps it ran in that another request's trace owns
# (the slowest, in time order): a long generation's decode stays one span with a bounded link list.
MAX_STEP_LINKS = 16
_STEP_LINK_ATTRIBUTES = shared_attributes({"moe.link": "step.owner"})  # a link to a step's owner span


@dataclass(slots=True)
class _Owner:
    """A step's owner span, and the one link to it that every batch-mate's phase span carries (the
    same object: its text is written once; agent/export/spans.py)."""

    link: SpanLink


class LayerSampler:
    """Which steps keep their layer subtree in traces (docs/traces-and-metrics.md, "Sampling").

    Per step, in the order steps complete: (1) a slow step (duration at or above the p99 of the last
    10 s of steps and above their median, once 100 are in) is kept; (2) otherwise it is kept if a
    token bucket of layer spans (``layer_spans_per_s`` per second, holding at most one second's
    worth) has room for its layers, which it then spends; (3) otherwise its subtree is sampled
    out. Time is the steps' own clock (their end), so the decision does not depend on when the
    agent gets to them.
    ``layer_spans_per_s = inf`` keeps every subtree; ``0`` keeps only slow ones.
    """

    def __init__(self, *, layer_spans_per_s: float = DEFAULT_LAYER_SPANS_PER_S) -> None:
        if math.isnan(layer_spans_per_s) or layer_spans_per_s < 0:
            raise ValueError(f"layer_spans_per_s must be >= 0, got {layer_spans_per_s}")
        self.rate = layer_spans_per_s
        self._tokens = layer_spans_per_s  # a full bucket at start
        self._last_ns: int | None = None
        self._durations = SlidingQuantile(duration_ns=SLOW_STEP_WINDOW_NS, max_samples=20_000)
        self.kept_slow = 0
        self.kept_budget = 0
        self.sampled_out = 0

    def keep(self, *, end_ns: int, duration_ns: int, layers: int) -> bool:
        durations = self._durations
        slow = (len(durations) >= SLOW_STEP_MIN_SAMPLES and duration_ns >= durations.quantile(SLOW_STEP_QUANTILE)
                and duration_ns > durations.quantile(0.5))  # with equal durations no step is "slow"
        durations.add(end_ns, float(duration_ns))
        if math.isinf(self.rate):
            self.kept_budget += 1
            return True
        if self._last_ns is not None and end_ns > self._last_ns:
            self._tokens = min(self.rate, self._tokens + self.rate * (end_ns - self._last_ns) / 1e9)
        self._last_ns = end_ns if self._last_ns is None else max(self._last_ns, end_ns)
        if slow:
            self.kept_slow += 1
            return True
        if layers <= self._tokens:
            self._tokens -= layers
            self.kept_budget += 1
            return True
        self.sampled_out += 1
        return False

Attributes = dict[str, AttributeValue]
# A step table as Python lists: its layers, its health columns (_HEALTH_COLUMNS order), and per
# layer either its per-expert tokens and dropped (E <= MAX_ARRAY_EXPERTS) or its top experts' ids
# and tokens.
_HealthLists = tuple[list[int], list[list[Any]], list[list[Any]], list[list[Any]]]
_HEALTH_COLUMNS = ("router_entropy_bits", "router_entropy_normalised", "gini", "entropy_bits", "entropy_normalised",
                   "max_share", "cv", "tokens_total", "dropped_total", "drop_fraction")
# ... and the layer span's attribute for each, in that order (after moe.layer.experts), as
# _layer_health_attributes writes them; then the two per-expert arrays, or the top experts' lists
_HEALTH_KEYS = ("moe.router.entropy_bits", "moe.router.entropy_normalized", "moe.expert_load.gini",
                "moe.expert_load.entropy_bits", "moe.expert_load.entropy_normalized", "moe.expert_load.max_share",
                "moe.expert_load.cv", "moe.tokens.routed", "moe.tokens.dropped", "moe.tokens.drop_fraction")
_EXPERT_ARRAY_KEYS = ("moe.expert.tokens", "moe.expert.dropped")
_TOP_EXPERT_KEYS = ("moe.expert.top_ids", "moe.expert.top_tokens")
NAN = float("nan")

# The span under the server span for each phase (agent/request_phases.py PHASES order).
PHASE_SPAN_NAMES = {"receive": "receive", "queue": "queue wait", "prefill": "prefill", "decode": "decode",
                    "write": "response write"}
GEN_AI_OPERATION = "text_completion"  # what the reference runtimes serve (POST /v1/completions)


# The server span's attributes in order (server_attributes: the kernel record's, then the
# breakdown's; the phases in agent/request_phases.py PHASES order).
_SERVER_KEYS = ("network.transport", "network.protocol.name", "network.peer.address", "network.peer.port",
                "http.request.size", "http.response.size", "moe.request.key", "moe.connection.generation",
                "process.pid", "thread.id", "moe.request.steps", "moe.request.time_to_first_byte_ms")
_BREAKDOWN_KEYS = ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model",
                   "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                   *(f"moe.request.phase.{phase}_ms" for phase in ("receive", "queue", "prefill", "decode", "write")),
                   "moe.request.expert_load_ms", "moe.request.routing_ms", "moe.request.ttft_ms",
                   "moe.request.ttft_source", "moe.request.tpot_ms", "moe.request.output_tokens_reported")
_SERVER_BREAKDOWN_KEYS = _SERVER_KEYS + _BREAKDOWN_KEYS
_UNLINKED_KEYS = ("moe.phase.steps_unlinked",)
_SERVER_KIND = SpanKind.SERVER.value
_INTERNAL_KIND = SpanKind.INTERNAL.value


def server_attributes(event: RequestJoined) -> tuple[tuple[str, ...], list[Any]]:
    """The server span's attribute keys and values, in order (``_SERVER_KEYS``, then with a breakdown
    ``_BREAKDOWN_KEYS``: the LLM-serving attributes of docs/traces-and-metrics.md "Where the time
    goes", GenAI semantic conventions where they fit, ``moe.request.*`` for the rest, durations in
    ms). A None value is an attribute the span leaves out. Both ways of making the span take these:
    a dict of them, or the text written from them (``TraceOutput._request_texts``)."""
    record = event.record
    values: list[Any] = [
        "tcp", "http", record.peer_addr, record.peer_port or None, record.bytes_in, record.bytes_out, record.fd,
        record.generation, record.tgid, record.tid, len(event.steps),
        (record.first_response_ns - record.start_ns) / 1e6 if record.first_response_ns else None,
    ]
    b = event.breakdown
    if b is None:
        return _SERVER_KEYS, values
    values += [GEN_AI_OPERATION, b.model, b.model, b.input_tokens if b.tokens_reported else None, b.output_tokens,
               b.receive_ns / 1e6, b.queue_ns / 1e6, b.prefill_ns / 1e6, b.decode_ns / 1e6, b.write_ns / 1e6,
               b.expert_load_ns / 1e6, b.routing_ns / 1e6, b.ttft_ns / 1e6, b.ttft_source,
               b.tpot_ns / 1e6 if b.tpot_ns is not None else None, b.tokens_reported]
    return _SERVER_BREAKDOWN_KEYS, values


class TraceOutput:
    """Builds spans through a ``SpanFactory`` (the export pipeline batches and ships them)."""

    name = "traces"

    def __init__(
        self, spans: SpanFactory, *, epoch_offset_ns: int, span_detail: str = DEFAULT_SPAN_DETAIL,
        layer_spans_per_s: float = DEFAULT_LAYER_SPANS_PER_S,
    ) -> None:
        if span_detail not in SPAN_DETAILS:
            raise ValueError(f"span_detail must be one of {SPAN_DETAILS}, got {span_detail!r}")
        self.spans = spans
        self.span_detail = span_detail
        self.sampler = LayerSampler(layer_spans_per_s=layer_spans_per_s)
        # step seq -> the step span's routing-health attributes of a step whose subtree is sampled
        # out (decided at StepSeen; a step not in it keeps its subtree), taken then: the join lets
        # its layer tree and table go at once. Held until the step retires (up to the join's
        # retention: ~20k steps at production rates), so as their values (STEP_HEALTH_KEYS' order)
        # where the keys are those: a tuple is a quarter of a 7-key dict.
        self._sampled_health: dict[int, Attributes | tuple[AttributeValue, ...]] = {}
        # Sources stamp CLOCK_MONOTONIC; OTLP wants ns since the Unix epoch: span times are shifted by this.
        self.epoch_offset_ns = epoch_offset_ns
        self._owners: dict[int, _Owner] = {}  # step seq -> the link to its owner's step span
        self._memory: MemorySignal | None = None
        self._memory_attributes: tuple[MemorySignal, SharedAttributes] | None = None  # its device event's
        self._layer_precision: dict[int, str] = {}
        self._net_events = NetEventIndex()  # retransmits/resets by connection, for the server spans
        self._counts: dict[str, int] = dict.fromkeys(("spans", "step_links", "owner_subtrees"), 0)
        # the latest join StepsTable and its steps' step-span attributes, computed for all at once
        self._group_health: tuple[StepsTable, list[Attributes]] | None = None
        self._group_lists: tuple[StepsTable, _HealthLists] | None = None  # ... and its table as lists

    # ------------------------------------------------------------------ Output
    def export(self, batch: Sequence[JoinEvent]) -> None:
        # the batch's spans reach the export queue together (SpanFactory.hold)
        holding = self.spans.hold()
        try:
            self._export_events(batch)
        finally:
            if holding:
                self.spans.release()

    def _export_events(self, batch: Sequence[JoinEvent]) -> None:
        for event in batch:
            match event:
                case StepSeen(step=b):
                    step = b.step
                    if not self.sampler.keep(end_ns=step.end_ns, duration_ns=step.duration_ns, layers=b.layer_count):
                        self._sample_out(b)
                case TreeDropped(step=b):  # a kept subtree the join could not hold any longer
                    if b.seq not in self._sampled_health:  # (counted by the join: step_trees_dropped_overflow)
                        self._sample_out(b)
                case RequestJoined():
                    self._request_trace(event)
                case StepRetired(step=b, evicted=evicted):
                    owner = self._owners.pop(b.seq, None)
                    if owner is None and not b.claims and not evicted:
                        self._step_tree(b, parent=None, extra={"moe.step.unjoined": True})
                    self._sampled_health.pop(b.seq, None)
                case TelemetrySeen(memory=memory):
                    self._memory = memory
                case RuntimeSeen(layer_precision=precision):
                    self._layer_precision = dict(precision)
                case NetSignalSeen(record=net) if net.events:
                    self._net_events.add(net.events)
                case _:
                    pass

    def _sample_out(self, b: BufferedStep) -> None:
        """The step's span will carry no layer subtree: its health is taken now, while its table is
        there (the join lets the tree go after this)."""
        health = self._sampled_step_health(b)
        self._sampled_health[b.seq] = tuple(health.values()) if tuple(health) == STEP_HEALTH_KEYS else health

    def force_flush(self) -> None:
        return None  # spans leave as they end; the export pipeline flushes (agent/export/setup.py)

    def shutdown(self, deadline_ns: int) -> None:
        self._owners.clear()
        self._sampled_health.clear()

    def layer_tree_needed(self, b: BufferedStep) -> bool:
        """The join asks after StepSeen: a step whose subtree is sampled out needs no layer tree."""
        return b.seq not in self._sampled_health

    def stats(self) -> dict[str, int]:
        return {**self._counts, "layer_subtrees_kept_slow": self.sampler.kept_slow,
                "layer_subtrees_kept_budget": self.sampler.kept_budget,
                "layer_subtrees_sampled_out": self.sampler.sampled_out}

    # ------------------------------------------------------------------ requests
    def _request_trace(self, event: RequestJoined) -> None:
        record: IngressRecord = event.record
        spans = self.spans
        keys, values = server_attributes(event)
        nets = self._net_events.for_request(peer_addr=record.peer_addr, peer_port=record.peer_port,
                                            start_ns=record.start_ns, end_ns=record.end_ns)
        # as text where the factory takes it; a server span with events or an error status as an object
        if PLAIN_SPANS is not None and record.answered and not nets and spans.takes_encoded(None):
            texts = self._request_texts(event, keys, values)
            if texts is not None:
                self._counts["spans"] += texts
                return
        attrs: Attributes = dict(zip(keys, values, strict=True))  # (a None left out by the factory)
        phases = event.breakdown
        off = self.epoch_offset_ns
        error = None if record.answered else "connection closed before a response was written"
        net_events = []
        for net in nets:
            name, net_attrs = span_event_fields(net, reset_reasons=reset_reason_name)
            net_events.append(SpanEvent(name, net.ts_ns + off, net_attrs))
        # the server span whole in one call (all of it is known now), before its children: one
        # finished span, not a live one ended after them
        parent = spans.record("http.server.request", start_ns=record.start_ns + off, end_ns=record.end_ns + off,
                              kind=SpanKind.SERVER, attributes=attrs, events=net_events, error=error)
        links = self._step_owners(event, parent)
        n = 1
        if phases is not None:
            n += spans.record_siblings(parent, self._phase_children(phases, links))
        self._counts["spans"] += n

    def _step_owners(self, event: RequestJoined,
                     parent: SpanContext) -> list[tuple[BufferedStep, SpanLink | None]]:
        """Per step of the request (oldest first), the link to its owner's span in another trace
        (None where this trace holds the step: its owner subtree, made here under ``parent``; or where
        none is left of it)."""
        links: list[tuple[BufferedStep, SpanLink | None]] = []
        for b, first in zip(event.steps, event.first_claims, strict=True):
            owner = self._owners.get(b.seq)
            if owner is None and first:
                context = self._step_tree(b, parent=parent, extra={})
                self._owners[b.seq] = _Owner(SpanLink(context, _STEP_LINK_ATTRIBUTES))
                self._counts["owner_subtrees"] += 1
                links.append((b, None))
            else:
                links.append((b, owner.link if owner is not None else None))
            if b.claims >= b.batch_size:
                self._owners.pop(b.seq, None)  # every request of the batch has reached the step now
        return links

    def _phase_children(self, phases: RequestBreakdown, links: list[tuple[BufferedStep, SpanLink | None]],
                        ) -> list[tuple[str, int, int, Attributes | None, tuple[SpanLink, ...]]]:
        """The phase spans under the server span: (name, start, end, attributes, links). The phases
        tile [start, end] in order: each child starts where the previous one ended; prefill and
        decode link to the steps they ran in that other traces own."""
        at = phases.start_ns + self.epoch_offset_ns
        cut = phases.prefill_steps
        children: list[tuple[str, int, int, Attributes | None, tuple[SpanLink, ...]]] = []
        for phase, ns in phases.phase_ns().items():
            span_links: tuple[SpanLink, ...] = ()
            attributes: Attributes | None = None
            if phase == "prefill" or phase == "decode":
                span_links, unlinked = _step_links(links[:cut] if phase == "prefill" else links[cut:])
                self._counts["step_links"] += len(span_links)
                if unlinked:
                    attributes = {"moe.phase.steps_unlinked": unlinked}
            children.append((PHASE_SPAN_NAMES[phase], at, at + ns, attributes, span_links))
            at += ns
        return children

    def _request_texts(self, event: RequestJoined, keys: tuple[str, ...], values: list[Any]) -> int | None:
        """The request's trace with its server and phase spans written as OTLP/JSON text from their
        parts (otlp_span.c ``plain_spans``; its step subtrees as ever): the server span's attributes
        as ``server_attributes`` gives them, no dict, no span objects, no encoding later. The text is
        what the spans the factory makes would encode to (tests/export/test_plain_spans.py). Returns
        the spans made; None where the server span has a value the writer does not take (nothing
        made: the caller makes the spans the usual way)."""
        record: IngressRecord = event.record
        off = self.epoch_offset_ns
        start_ns, end_ns = record.start_ns + off, record.end_ns + off
        phases = event.breakdown
        spans = self.spans
        assert PLAIN_SPANS is not None
        parent = spans.root_context()
        try:
            server = PLAIN_SPANS(parent, None, [(parent.span_id, "http.server.request", _SERVER_KIND, start_ns,
                                                 max(end_ns, start_ns), keys, values, (), ())])
        except ValueError:
            return None
        spans.hand_on_encoded(server)  # (before its children, as record() has it)
        links = self._step_owners(event, parent)
        if phases is None:
            return 1
        children = self._phase_children(phases, links)
        items: list[tuple[int, str, int, int, int, tuple[str, ...], tuple[Any, ...], tuple[Any, ...], tuple[()]]] = []
        for span_id, (name, start, end, attributes, span_links) in zip(
                spans.child_span_ids(len(children)), children, strict=True):
            made = spans.encoded_links(span_links) if span_links else ()
            if made is None:
                break
            unlinked = attributes.get("moe.phase.steps_unlinked") if attributes else None
            items.append((span_id, name, _INTERNAL_KIND, start, max(end, start), _UNLINKED_KEYS, (unlinked,), made, ()))
        else:
            try:
                spans.hand_on_encoded(PLAIN_SPANS(parent, parent, items))
                return 1 + len(items)
            except ValueError:
                pass
        return 1 + spans.record_siblings(parent, children)  # (new span ids: nothing else differs)

    # ------------------------------------------------------------------ steps
    def _step_attributes(self, b: BufferedStep) -> Attributes:
        step = b.step
        return {
            "moe.step.tokens": step.tokens,
            "moe.step.batch_size": len(set(step.requests)),
            "moe.step.requests": sorted(set(step.requests)),
            "moe.step.layers": b.layer_count,
            "process.pid": step.pid,
            "thread.id": step.tid,
        }

    def _health_lists(self, b: BufferedStep) -> _HealthLists:
        """The step's table as Python lists (``_table_lists``): a step still in its join group takes
        its rows of the group's lists, made once for the whole group (a quiet round of the
        reference model is one group of ~100 steps: one pass instead of ~13 small ones a step)."""
        group = b.group
        if group is None:
            return _table_lists(b.table)
        cached = self._group_lists
        if cached is None or cached[0] is not group:
            cached = self._group_lists = (group, _group_lists(group))
        layers, columns, first, second = cached[1]
        r = group.rows_per_step
        part = slice(b.group_index * r, (b.group_index + 1) * r)
        return layers, [column[part] for column in columns], first[part], second[part]

    def _layer_health_attributes(self, b: BufferedStep) -> dict[int, Attributes]:
        num_experts = b.num_experts
        per_layer: dict[int, Attributes] = {}
        # whole columns to Python at once (per-element numpy scalars cost ~10x)
        layers, health, first, second = self._health_lists(b)
        columns = zip(layers, *health, strict=True)
        # per-expert arrays, or the top experts of every layer (from one call over the [L, E] table)
        first_key, second_key = _EXPERT_ARRAY_KEYS if num_experts <= MAX_ARRAY_EXPERTS else _TOP_EXPERT_KEYS
        # each layer's attributes as a span stores them (a NaN left out, arrays as tuples, an empty
        # one left out): the layer spans take them without another cleaning pass
        for (layer, h_r, h_rn, gini, h, hn, share, cv, routed, dropped, drop_fraction), one, two in zip(
                columns, first, second, strict=True):
            attrs = {
                "moe.layer.experts": num_experts,
                "moe.router.entropy_bits": h_r,
                "moe.router.entropy_normalized": h_rn,
                "moe.expert_load.gini": gini,
                "moe.expert_load.entropy_bits": h,
                "moe.expert_load.entropy_normalized": hn,
                "moe.expert_load.max_share": share,
                "moe.expert_load.cv": cv,
                "moe.tokens.routed": routed,
                "moe.tokens.dropped": dropped,
                "moe.tokens.drop_fraction": drop_fraction,
            }
            if not (h_r == h_r and h_rn == h_rn and gini == gini and h == h and hn == hn and share == share
                    and cv == cv and drop_fraction == drop_fraction):
                attrs = {key: value for key, value in attrs.items() if value == value}
            if one:
                attrs[first_key] = tuple(one)
            if two:
                attrs[second_key] = tuple(two)
            per_layer[layer] = attrs
        return per_layer

    @staticmethod
    def _step_health_attributes(b: BufferedStep) -> Attributes:
        return step_health_attributes(b.table)

    def _sampled_step_health(self, b: BufferedStep) -> Attributes:
        """The step span's health attributes, for a run of the join's grouped steps all at once."""
        group = b.group
        if group is None:
            return self._step_health_attributes(b)
        cached = self._group_health
        if cached is None or cached[0] is not group:
            cached = self._group_health = (group, steps_health_attributes(group))
        return cached[1][b.group_index]  # (_step_tree copies what it takes from _sampled_health)

    def _device_events(self, step: StepEvent) -> tuple[SpanEvent, ...]:
        memory = self._memory
        if memory is None:
            return ()
        held = self._memory_attributes
        if held is None or held[0] is not memory:  # one attribute set per memory sample, shared
            held = self._memory_attributes = (memory, shared_attributes({
                "moe.device": memory.scope,
                "moe.device.memory.source": str(memory.source),
                "moe.device.memory.used_bytes": memory.used_bytes,
                "moe.device.memory.total_bytes": memory.total_bytes,
                "moe.device.memory.used_ratio": memory.ratio,
            }))
        return (SpanEvent("moe.device.sample", step.start_ns + self.epoch_offset_ns, held[1]),)

    def _step_tree(self, b: BufferedStep, *, parent: SpanContext | None, extra: Attributes) -> SpanContext:
        spans = self.spans
        step = b.step
        sampled = self._sampled_health.get(b.seq)
        with_layers = sampled is None
        if sampled is None:  # (a step still in its join group: the group's health, made for all its steps at once)
            step_attrs = dict(self._sampled_step_health(b))
        elif isinstance(sampled, tuple):
            step_attrs = dict(zip(STEP_HEALTH_KEYS, sampled, strict=True))
        else:
            step_attrs = dict(sampled)
        if not with_layers and b.layer_count:
            step_attrs["moe.step.layers_sampled_out"] = True
        device_by_layer: dict[int, float] = {}
        device_us = step.device_time_us  # moe.step.device: the layers' expert device time, layer order
        if device_us is not None and b.layer_count and len(device_us) == b.layer_count:
            step_attrs["moe.step.device_time_us"] = float(device_us.sum())
            if with_layers:
                columns = step.columns
                order = sorted(columns.layer.tolist() if columns is not None
                               else [layer.layer for layer in step.layers])
                device_by_layer = dict(zip(order, device_us.tolist(), strict=True))
        off = self.epoch_offset_ns
        attributes = {**self._step_attributes(b), **step_attrs, **extra}
        events = self._device_events(step)
        ctx = self._step_text(step, parent, attributes, events)
        if ctx is None:
            ctx = spans.record("moe.step", start_ns=step.start_ns + off, end_ns=step.end_ns + off, parent=parent,
                               attributes=attributes, events=events)
        n = 1
        if with_layers:
            if self.span_detail == "layer":
                parts = self._layer_parts(step, device_by_layer)
                made = self._encoded_layers(b, ctx, parts)
                if made is None:  # as spans: the attribute dicts, the span objects, encoded later
                    per_layer = self._layer_health_attributes(b)
                    children: list[tuple[int, int, Attributes]] = []
                    for start, end, index, extra in parts:
                        attrs = self._layer_head(index, per_layer, {})
                        if extra:
                            attrs.update(extra)
                        children.append((start, end, attrs))
                    made = spans.record_children("moe.layer", parent=ctx, children=children)
                n += made
            else:
                per_layer = self._layer_health_attributes(b)
                for layer in step.layers:
                    attrs = self._layer_head(layer.layer, per_layer, device_by_layer)
                    n += self._layer(layer, parent=ctx, attrs=attrs)
        self._counts["spans"] += n
        return ctx

    def _step_text(self, step: StepEvent, parent: SpanContext | None, attributes: Attributes,
                   events: tuple[SpanEvent, ...]) -> SpanContext | None:
        """The step span handed on as its OTLP/JSON text (otlp_span.c ``plain_spans``: from its
        attribute dict, with no span object and no encoding later) where the factory takes text;
        returns its context (its layers' parent, its batch-mates' link). None: not here, or a value
        the writer does not take (nothing made: the caller records the span)."""
        spans = self.spans
        if PLAIN_SPANS is None or not spans.takes_encoded(parent):
            return None
        # its events (the device-memory sample, one a step) as their text, from their shared
        # attribute sets: no SDK Event made and read back through its properties
        parts = spans.shared_event_parts(events)
        made: tuple[Any, ...] | None
        if parts is not None:
            made = tuple([event_text(name, t, attributes, attributes.dropped) for name, t, attributes in parts])
        else:
            made = spans.encoded_events(events)
            if made is None:
                return None
        ctx, named = spans.child_context(parent)
        start = step.start_ns + self.epoch_offset_ns
        try:
            texts = PLAIN_SPANS(ctx, named, [(ctx.span_id, "moe.step", _INTERNAL_KIND, start,
                                              max(step.end_ns + self.epoch_offset_ns, start), None, attributes, (),
                                              made)])
        except ValueError:
            return None
        spans.hand_on_encoded(texts)
        return ctx

    @staticmethod
    def _layer_head(index: int, per_layer: dict[int, Attributes], device_by_layer: dict[int, float]) -> Attributes:
        """A layer span's first attributes: ``moe.layer``, its routing health, its device time (one
        dict per span, in the attribute order the span has always had)."""
        attrs: Attributes = {"moe.layer": index}
        health = per_layer.get(index)
        if health is not None:
            attrs.update(health)
        device = device_by_layer.get(index)
        if device is not None:
            attrs["moe.experts.device_time_us"] = device
        return attrs

    def _layer_parts(self, step: StepEvent,
                     device_by_layer: dict[int, float]) -> list[tuple[int, int, int, Attributes]]:
        """--span-detail layer: each layer span's (start, end, layer index, attributes after its
        routing health). A layer span's attributes are ``moe.layer``, its routing health
        (``_layer_health_attributes``), then these, as a span stores them: its device time, what the
        router, expert-load and FFN child spans would carry (``_fold_layer_attributes``). A step
        from the whole-batch parser is read from its columns, with no LayerEvent made; the
        attributes are the same as from its objects (tests/export/test_trace_children.py)."""
        columns = step.columns
        if columns is not None:
            return self._column_parts(columns, device_by_layer)
        off = self.epoch_offset_ns
        layers = step.layers
        out: list[tuple[int, int, int, Attributes]] = []
        for layer, times in zip(layers, _experts_time_by_position(layers), strict=True):
            index = layer.layer
            extra: Attributes = {}
            device = device_by_layer.get(index)
            if device is not None:
                extra["moe.experts.device_time_us"] = device  # (NaN: left out by the cleaning below)
            self._fold_layer_attributes(layer, extra, times)
            if extra:
                # moe/v2's layers (no per-expert FFN or load ranges) add only scalars and the
                # expert times' one-type lists: _as_stored leaves them as span_attributes would
                # (tests/export/test_trace_children.py); v1's lists may mix None in: cleaned
                extra = _as_stored(extra) if not (layer.ffns or layer.loads) else span_attributes(extra)
            out.append((layer.start_ns + off, layer.end_ns + off, index, extra))
        return out

    def _column_parts(self, c: LayerColumns,
                      device_by_layer: dict[int, float]) -> list[tuple[int, int, int, Attributes]]:
        """``_layer_parts`` of a columnar step: what ``_fold_layer_attributes`` adds for each layer
        LayerColumns.materialize() would make, read from the arrays."""
        off = self.epoch_offset_ns
        precision_of = self._layer_precision
        times: list[Attributes | None] = (
            _experts_time_of(c.experts_time_us) if c.experts_time_us is not None else [None] * len(c))
        ffns = _ffn_lists(c.ffns) if c.ffns is not None else {}
        out: list[tuple[int, int, int, Attributes]] = []
        for i, (index, start, end, kind, r_start, r_end, has_x, x_start, x_end, x_tokens) in enumerate(zip(
                c.layer.tolist(), c.start_ns.tolist(), c.end_ns.tolist(), c.router_kind.tolist(),
                c.router_start_ns.tolist(), c.router_end_ns.tolist(), c.has_experts.tolist(),
                c.experts_start_ns.tolist(), c.experts_end_ns.tolist(), c.experts_tokens.tolist(), strict=True)):
            extra: Attributes = {}
            device = device_by_layer.get(index)
            if device is not None:
                extra["moe.experts.device_time_us"] = device
            precision = precision_of.get(index)
            if precision is not None:
                extra["moe.precision"] = precision
            if kind == ROUTER_RANGE:  # (step vectors: no moe.router range, no duration)
                extra["moe.layer.router.duration_ms"] = (r_end - r_start) / 1e6
            ffn = ffns.get(i)
            if ffn is not None:
                extra["moe.layer.ffn.experts"], extra["moe.layer.ffn.tokens"], extra["moe.layer.ffn.duration_ms"] = ffn
            if has_x:
                extra["moe.layer.experts.duration_ms"] = (x_end - x_start) / 1e6
                extra["moe.layer.experts.tokens"] = x_tokens
                layer_times = times[i]
                if layer_times:
                    extra.update(layer_times)
            out.append((start + off, end + off, index, _as_stored(extra)))
        return out

    def _encoded_layers(self, b: BufferedStep, parent: SpanContext,
                        parts: list[tuple[int, int, int, Attributes]]) -> int | None:
        """The step's layer spans written as OTLP/JSON text straight from its table's lists and
        ``parts`` (agent/export/otlp_span.c ``column_spans``): no routing-health dicts, no span
        objects, no encoding later; the text is what their spans would encode to
        (tests/export/test_column_spans.py). Only where the span factory can hand such spans on
        (``SpanFactory.takes_encoded``: OTLP-JSON export); None: not here, or a value the writer
        does not take (the caller builds them as spans)."""
        spans = self.spans
        if COLUMN_SPANS is None or not parts or not spans.takes_encoded(parent):
            return None
        layers, health, first, second = self._health_lists(b)
        row_of = {layer: row for row, layer in enumerate(layers)}  # (a repeated layer: its last row, as per_layer)
        keys = _EXPERT_ARRAY_KEYS if b.num_experts <= MAX_ARRAY_EXPERTS else _TOP_EXPERT_KEYS
        ids = spans.child_span_ids(len(parts))
        try:
            texts = COLUMN_SPANS(
                parent, "moe.layer", ids, [part[0] for part in parts], [part[1] for part in parts],
                [part[2] for part in parts], "moe.layer", [row_of.get(part[2], -1) for part in parts],
                "moe.layer.experts", b.num_experts, _HEALTH_KEYS, health, keys[0], first, keys[1], second,
                [part[3] for part in parts])
        except ValueError:
            return None
        spans.hand_on_encoded(texts)
        return len(texts)

    def _layer(self, layer: LayerEvent, *, parent: SpanContext, attrs: Attributes) -> int:
        """--span-detail expert: the layer span (``attrs``: its attributes, ``moe.layer`` first)
        with a child span per router, experts run, expert load and FFN."""
        spans = self.spans
        off = self.epoch_offset_ns
        span = spans.start("moe.layer", start_ns=layer.start_ns + off, parent=parent, attributes=attrs)
        ctx = span.get_span_context()
        n = 1
        if layer.router is not None and layer.router.timed:  # (compact v2.2: no moe.router range was sent)
            r = layer.router
            spans.record(
                "moe.router",
                start_ns=r.start_ns + off,
                end_ns=r.end_ns + off,
                parent=ctx,
                attributes={
                    "moe.layer": layer.layer,
                    "moe.router.entropy_bits": r.entropy_bits,
                    "moe.router.entropy_normalized": attrs.get("moe.router.entropy_normalized"),
                    "moe.tokens.routed": r.routed(),
                    "moe.tokens.dropped": r.over_capacity(),
                },
            )
            n += 1
        if layer.experts is not None:
            spans.record(
                "moe.experts",
                start_ns=layer.experts.start_ns + off,
                end_ns=layer.experts.end_ns + off,
                parent=ctx,
                attributes={
                    "moe.layer": layer.layer,
                    "moe.experts.tokens": layer.experts.tokens,
                    "moe.precision": self._layer_precision.get(layer.layer),
                    **self._experts_time_attributes(layer),
                },
            )
            n += 1
        for load in layer.loads:
            spans.record(
                "moe.expert.load",
                start_ns=load.start_ns + off,
                end_ns=load.end_ns + off,
                parent=ctx,
                attributes={
                    "moe.layer": layer.layer,
                    "moe.expert": load.expert,
                    "moe.expert.load.bytes": load.bytes_moved,
                },
            )
            n += 1
        for ffn in layer.ffns:
            spans.record(
                "moe.expert.ffn",
                start_ns=ffn.start_ns + off,
                end_ns=ffn.end_ns + off,
                parent=ctx,
                attributes={
                    "moe.layer": layer.layer,
                    "moe.expert": ffn.expert,
                    "moe.expert.ffn.tokens": ffn.tokens,
                    "moe.precision": self._layer_precision.get(layer.layer),
                },
            )
            n += 1
        spans.end(span, end_ns=layer.end_ns + off)
        return n

    @staticmethod
    def _experts_time_attributes(layer: LayerEvent) -> Attributes:
        """moe.experts.time (v2): each expert's compute µs, as an array up to MAX_ARRAY_EXPERTS
        experts, else the slowest 16 as id/µs lists (as the token arrays)."""
        experts = layer.experts
        if experts is None or experts.time_us is None:
            return {}
        time_us = experts.time_us
        if len(time_us) <= MAX_ARRAY_EXPERTS:
            return {"moe.layer.experts.time_us": time_us.astype(np.float64).tolist()}
        top = _top_experts(time_us)
        return {"moe.layer.experts.slowest_ids": top,
                "moe.layer.experts.slowest_time_us": time_us[top].astype(np.float64).tolist()}

    def _fold_layer_attributes(self, layer: LayerEvent, attrs: Attributes, times: Attributes | None) -> None:
        """--span-detail layer: what the router, expert-load and FFN child spans would carry, added
        to the layer span's ``attrs`` (one span per layer instead of 2 + experts run + loads);
        ``times``: the layer's ``_experts_time_attributes``."""
        precision = self._layer_precision.get(layer.layer)
        if precision is not None:  # None is left out of a span anyway
            attrs["moe.precision"] = precision
        router = layer.router
        if router is not None and router.timed:
            attrs["moe.layer.router.duration_ms"] = (router.end_ns - router.start_ns) / 1e6
        ffns = layer.ffns
        if ffns:
            attrs["moe.layer.ffn.experts"] = [f.expert for f in ffns]
            attrs["moe.layer.ffn.tokens"] = [f.tokens for f in ffns]
            attrs["moe.layer.ffn.duration_ms"] = [(f.end_ns - f.start_ns) / 1e6 for f in ffns]
        experts = layer.experts
        if experts is not None:  # moe/v2: all experts of the layer in one range
            attrs["moe.layer.experts.duration_ms"] = (experts.end_ns - experts.start_ns) / 1e6
            attrs["moe.layer.experts.tokens"] = experts.tokens
            if times:
                attrs.update(times)
        loads = layer.loads
        if loads:
            attrs["moe.layer.load.experts"] = [load.expert for load in loads]
            attrs["moe.layer.load.bytes"] = [load.bytes_moved for load in loads]
            attrs["moe.layer.load.duration_ms"] = [(load.end_ns - load.start_ns) / 1e6 for load in loads]


def _as_stored(attrs: Attributes) -> Attributes:
    """A layer span's attributes as ``span_attributes`` leaves them, for the values the layer
    builder makes (Python scalars, None, and lists of one type): None and a NaN scalar left out, an
    empty list left out, the others as tuples."""
    out: Attributes = {}
    for key, value in attrs.items():
        if type(value) is list:
            if value:
                out[key] = tuple(value)
        elif value is not None and value == value:  # not NaN
            out[key] = value
    return out


def _ffn_lists(ffns: FfnColumns) -> dict[int, tuple[list[int], list[int], list[float]]]:
    """A columnar step's moe.expert.ffn ranges by layer position: (experts, tokens, durations in ms),
    in the columns' order, as ``_fold_layer_attributes`` lists them."""
    out: dict[int, tuple[list[int], list[int], list[float]]] = {}
    for i, expert, tokens, duration in zip(ffns.layer.tolist(), ffns.expert.tolist(), ffns.tokens.tolist(),
                                           ((ffns.end_ns - ffns.start_ns) / 1e6).tolist(), strict=True):
        lists = out.get(i)
        if lists is None:
            lists = out[i] = ([], [], [])
        lists[0].append(expert)
        lists[1].append(tokens)
        lists[2].append(duration)
    return out


def _step_links(steps: Sequence[tuple[BufferedStep, SpanLink | None]]) -> tuple[tuple[SpanLink, ...], int]:
    """A phase span's links to its steps that other traces own, and how many of those were left out:
    past MAX_STEP_LINKS the slowest are kept, in time order (``steps``: oldest first)."""
    linked = [(b, link) for b, link in steps if link is not None]
    if len(linked) <= MAX_STEP_LINKS:
        return tuple(link for _, link in linked), 0
    slowest = sorted(range(len(linked)), key=lambda i: linked[i][0].step.duration_ns, reverse=True)[:MAX_STEP_LINKS]
    return tuple(linked[i][1] for i in sorted(slowest)), len(linked) - MAX_STEP_LINKS


def _experts_time_by_position(layers: Sequence[LayerEvent]) -> list[Attributes | None]:
    """``TraceOutput._experts_time_attributes`` of each layer (None: no expert times), the slowest
    experts of every layer wider than MAX_ARRAY_EXPERTS found in one call per width."""
    return _experts_time_of([None if layer.experts is None else layer.experts.time_us for layer in layers])


def _experts_time_of(per_layer: Sequence[np.ndarray | None]) -> list[Attributes | None]:
    """``_experts_time_by_position`` from each layer's moe.experts.time vector (None: none)."""
    out: list[Attributes | None] = [None] * len(per_layer)
    wide: dict[int, list[tuple[int, np.ndarray]]] = {}  # E -> (position, times) of layers with E times
    for position, time_us in enumerate(per_layer):
        if time_us is None:
            continue
        if len(time_us) <= MAX_ARRAY_EXPERTS:  # (float32 to Python floats: the same doubles astype gives)
            out[position] = {"moe.layer.experts.time_us": (
                time_us.tolist() if time_us.dtype.kind == "f" else time_us.astype(np.float64).tolist())}
        else:
            wide.setdefault(len(time_us), []).append((position, time_us))
    for group in wide.values():
        matrix = np.stack([time_us for _, time_us in group]).astype(np.float64, copy=False)
        ids, slowest = top_experts_by_row(matrix)
        for (position, _), top, values in zip(group, ids, slowest, strict=True):
            out[position] = {"moe.layer.experts.slowest_ids": top, "moe.layer.experts.slowest_time_us": values}
    return out


# A step span's routing-health attributes, in the order step_health_attributes and
# steps_health_attributes make them.
STEP_HEALTH_KEYS = ("moe.router.entropy_bits", "moe.router.entropy_normalized", "moe.expert_load.gini",
                    "moe.expert_load.gini_max", "moe.expert_load.max_share", "moe.tokens.dropped",
                    "moe.tokens.drop_fraction")


def step_health_attributes(t: LayerTable) -> Attributes:
    """The step span's routing-health aggregates from a step's table: the values
    ``LayerTable.step_health()`` gives (token-weighted means over the layers with tokens and a
    value, added in layer order; maxima ignoring NaN), only for the fields the span carries (this
    runs for every step: under half of step_health's cost)."""
    if not len(t):
        return {}
    weights = t.tokens_total.tolist()
    every_layer_weighted = min(weights) > 0
    gini = t.gini.tolist()
    tokens = sum(weights)
    dropped = int(t.dropped_total.sum())
    return {
        "moe.router.entropy_bits": _weighted_mean(t.router_entropy_bits.tolist(), weights, every_layer_weighted),
        "moe.router.entropy_normalized": _weighted_mean(t.router_entropy_normalised.tolist(), weights,
                                                        every_layer_weighted),
        "moe.expert_load.gini": _weighted_mean(gini, weights, every_layer_weighted),
        "moe.expert_load.gini_max": _max_not_nan(gini),
        "moe.expert_load.max_share": _max_not_nan(t.max_share.tolist()),
        "moe.tokens.dropped": dropped,
        "moe.tokens.drop_fraction": dropped / tokens if tokens else NAN,
    }


def steps_health_attributes(t: StepsTable) -> list[Attributes]:
    """``step_health_attributes`` of every step of ``t`` (equal floats): as arrays over the steps
    whose layers all have tokens and values (products added left to right by a cumulative sum, as
    the per-step loop adds them); the per-step function for the others."""
    k, r = len(t), t.rows_per_step
    if not k or not r:
        return [step_health_attributes(t.step(i)) for i in range(k)]
    weights = t.per_step(t.tokens_total)
    columns = [t.per_step(c) for c in (t.router_entropy_bits, t.router_entropy_normalised, t.gini, t.max_share)]
    plain = np.asarray((weights > 0).all(axis=1))
    for column in columns:
        plain = plain & ~np.isnan(column).any(axis=1)
    total = weights.sum(axis=1)
    dropped = t.per_step(t.dropped_total).sum(axis=1)

    def mean(values: np.ndarray) -> list[float]:
        out: list[float] = (np.cumsum(values * weights, axis=1)[:, -1] / np.where(total > 0, total, 1)).tolist()
        return out

    entropy, entropy_norm, gini = mean(columns[0]), mean(columns[1]), mean(columns[2])
    gini_max, max_share = columns[2].max(axis=1).tolist(), columns[3].max(axis=1).tolist()
    out: list[Attributes] = []
    for i, (is_plain, tokens, lost) in enumerate(zip(plain.tolist(), total.tolist(), dropped.tolist(), strict=True)):
        if not is_plain:
            out.append(step_health_attributes(t.step(i)))
            continue
        out.append({
            "moe.router.entropy_bits": entropy[i], "moe.router.entropy_normalized": entropy_norm[i],
            "moe.expert_load.gini": gini[i], "moe.expert_load.gini_max": gini_max[i],
            "moe.expert_load.max_share": max_share[i], "moe.tokens.dropped": int(lost),
            "moe.tokens.drop_fraction": lost / tokens if tokens else NAN,
        })
    return out


def _weighted_mean(values: list[float], weights: list[int], every_layer_weighted: bool) -> float:
    """``sum w v / sum w`` over the layers with w > 0 and v not NaN, the products added one by one
    from 0.0 in layer order (so the float is the same as the loop's in routing_health)."""
    if every_layer_weighted and not math.isnan(sum(values)):  # sum: only a NaN test (NaN in, NaN out)
        total = sum(weights)
        products = reduce(add, map(mul, values, weights), 0.0)  # C-level, strictly left to right
    else:
        kept = [(v, w) for v, w in zip(values, weights, strict=True) if w > 0 and v == v]
        total = sum([w for _, w in kept])
        products = reduce(add, [v * w for v, w in kept], 0.0)
    return products / total if total else NAN


def _max_not_nan(values: list[float]) -> float:
    if values and not math.isnan(sum(values)):
        return max(values)
    finite = [v for v in values if v == v]
    return max(finite) if finite else NAN


def _top_experts(values: np.ndarray) -> list[int]:
    """The TOP_EXPERTS_ON_SPANS experts with the largest values, largest first, ties by expert id."""
    v = np.asarray(values, dtype=np.float64)
    n = TOP_EXPERTS_ON_SPANS
    if v.size > 2 * n:
        # the n-th largest value bounds the candidates; every expert tied with it stays a candidate,
        # so ties still go by expert id (a full stable sort of E values per layer cost ~5x)
        cut = np.partition(v, v.size - n)[v.size - n]
        candidates = np.flatnonzero(v >= cut)
        order = candidates[np.argsort(-v[candidates], kind="stable")][:n]
    else:
        order = np.argsort(-v, kind="stable")[:n]
    return [int(i) for i in order.tolist()]


# |count| at most this keeps count * E + id exact in int64 and the counts exact as float64, so the
# combined key orders experts as _top_experts does
_EXACT_COUNT_MAX = 1 << 53


def _expert_lists(tokens: np.ndarray, dropped: np.ndarray) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per row of [rows, E] tables, the arrays a layer span carries: every expert's tokens and
    dropped where E <= MAX_ARRAY_EXPERTS, else the top experts' ids and tokens."""
    if tokens.shape[1] <= MAX_ARRAY_EXPERTS:
        return tokens.tolist(), dropped.tolist()
    return top_experts_by_row(tokens)


def _table_lists(t: LayerTable) -> _HealthLists:
    first, second = _expert_lists(t.tokens, t.dropped)
    return t.layers.tolist(), [getattr(t, name).tolist() for name in _HEALTH_COLUMNS], first, second


def _group_lists(g: StepsTable) -> _HealthLists:
    """``_table_lists`` of every step of a group at once, step after step (slice a step's rows)."""
    e = g.num_experts
    blocks = g.blocks.reshape(-1, 2 * e)  # [k R, 2E]: the steps' rows in order
    first, second = _expert_lists(blocks[:, :e], blocks[:, e:])
    return g.layers.tolist(), [getattr(g, name).tolist() for name in _HEALTH_COLUMNS], first, second


def top_experts_by_row(counts: np.ndarray) -> tuple[list[list[int]], list[list[float]]]:
    """``_top_experts`` of every row of a [L, E] matrix, and those experts' values: per row the ids
    (largest first, ties by expert id) and their values, as Python lists (ints for integer counts).

    Integer counts (the routing table) take one partition over the whole matrix: each entry becomes
    the unique key ``count * E + (E - 1 - id)``, whose order is (count, then lower id first); the
    top keys give both the id and the count back (58 per-row partitions cost ~14x). Floats (expert
    times) take one partition and one small sort when no row has a NaN or a tie at its n-th largest
    value; anything else goes row by row."""
    m = np.asarray(counts)
    if m.ndim != 2:
        raise ValueError(f"top_experts_by_row wants a [layers, experts] matrix, got shape {m.shape}")
    rows, e = m.shape
    n = min(TOP_EXPERTS_ON_SPANS, e)
    if rows == 0 or n == 0:
        return [[] for _ in range(rows)], [[] for _ in range(rows)]
    limit = min(_EXACT_COUNT_MAX, (1 << 62) // e)
    if m.dtype.kind in "iu" and -limit <= int(m.min()) and int(m.max()) <= limit:
        keys = m.astype(np.int64) * e + np.arange(e - 1, -1, -1, dtype=np.int64)
        top = np.partition(keys, e - n, axis=1)[:, e - n:]
        top.sort(axis=1)
        top = top[:, ::-1]  # largest key first
        values, reversed_ids = np.divmod(top, e)  # floor division: exact for negative counts too
        return ((e - 1) - reversed_ids).tolist(), values.tolist()
    if m.dtype.kind == "f" and not np.isnan(m).any():
        # the n-th largest of each row bounds its candidates; with no value tied at that bound a row
        # has exactly n, in id order, and a stable sort of those n orders them as _top_experts does
        cut = np.partition(m, e - n, axis=1)[:, e - n:e - n + 1]
        candidates = m >= cut
        if bool((candidates.sum(axis=1) == n).all()):
            row_index, column_index = np.nonzero(candidates)  # row by row, ids ascending
            ids_matrix = column_index.reshape(rows, n)
            values_matrix = m[row_index, column_index].reshape(rows, n)
            order = np.argsort(-values_matrix, axis=1, kind="stable")
            return (np.take_along_axis(ids_matrix, order, axis=1).tolist(),
                    np.take_along_axis(values_matrix, order, axis=1).tolist())
    ids = [_top_experts(row) for row in m]  # NaN, ties at the bound, huge counts: row by row
    return ids, [row[top].tolist() for row, top in zip(m, ids, strict=True)]
