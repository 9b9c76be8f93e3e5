"""Traces from joined events: one trace per request, rooted at the kernel-timed SERVER span.

Structure (docs/traces-and-metrics.md "Trace structure"): the server span has a ``queue wait``
child (first byte → first step). The *first request of a batch whose record arrives* owns the
step's full subtree (step → layer → router / expert.load / expert.ffn); every other request of that
batch gets a ``moe.step`` stub under its own server span, same timing and step attributes,
``moe.step.shared = true``, and a span link to the owner's step. (Owner = first completed, not
oldest: a request's record arrives only when it completes, and spans are exported as soon as they
end, so the owner cannot wait for older batch-mates.) A step no request claimed before it left the
buffer by retention becomes its own trace (``moe.step.unjoined = true``); one pushed out early by
the buffer bound is dropped and counted by the join.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from opentelemetry.trace import SpanContext, SpanKind
from opentelemetry.util.types import AttributeValue

from moescope.agent.export.spans import SpanEvent, SpanFactory, SpanLink
from moescope.agent.join import (
    BufferedStep,
    JoinEvent,
    RequestJoined,
    RuntimeSeen,
    StepRetired,
    TelemetrySeen,
)
from moescope.agent.routing_health import step_health
from moescope.collectors.host import MemorySignal
from moescope.collectors.moe_convention import LayerEvent, StepEvent
from moescope.probes.ingress.loader import IngressRecord

MAX_ARRAY_EXPERTS = 256  # above this, per-expert arrays become top-16 id/token lists on spans
TOP_EXPERTS_ON_SPANS = 16

# How much of the forward pass becomes spans: "layer" (default) puts the router, expert loads and
# FFNs of a layer into array attributes of its moe.layer span; "expert" gives each its own span.
SPAN_DETAILS = ("layer", "expert")
DEFAULT_SPAN_DETAIL = "layer"

Attributes = dict[str, AttributeValue]


class TraceOutput:
    """Builds spans through a ``SpanFactory`` (the export pipeline batches and ships them)."""

    name = "traces"

    def __init__(self, spans: SpanFactory, *, epoch_offset_ns: int, span_detail: str = DEFAULT_SPAN_DETAIL) -> None:
        if span_detail not in SPAN_DETAILS:
            raise ValueError(f"span_detail must be one of {SPAN_DETAILS}, got {span_detail!r}")
        self.spans = spans
        self.span_detail = span_detail
        # Sources stamp CLOCK_MONOTONIC; OTLP wants ns since the Unix epoch: span times are shifted by this.
        self.epoch_offset_ns = epoch_offset_ns
        self._owners: dict[int, SpanContext] = {}  # step seq -> the owner's step span
        self._memory: MemorySignal | None = None
        self._layer_precision: dict[int, str] = {}
        self._counts: dict[str, int] = dict.fromkeys(("spans", "stub_spans", "owner_subtrees"), 0)

    # ------------------------------------------------------------------ Output
    def export(self, batch: Sequence[JoinEvent]) -> None:
        for event in batch:
            match event:
                case RequestJoined():
                    self._request_trace(event)
                case StepRetired(step=b, evicted=evicted):
                    owner = self._owners.pop(b.seq, None)
                    if owner is None and not b.claims and not evicted:
                        self._step_tree(b, parent=None, extra={"moe.step.unjoined": True})
                case TelemetrySeen(memory=memory):
                    self._memory = memory
                case RuntimeSeen(layer_precision=precision):
                    self._layer_precision = dict(precision)
                case _:
                    pass

    def force_flush(self) -> None:
        return None  # spans leave as they end; the export pipeline flushes (agent/export/setup.py)

    def shutdown(self, deadline_ns: int) -> None:
        self._owners.clear()

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    # ------------------------------------------------------------------ requests
    def _request_trace(self, event: RequestJoined) -> None:
        record: IngressRecord = event.record
        spans = self.spans
        attrs: Attributes = {
            "network.transport": "tcp",
            "network.protocol.name": "http",
            "network.peer.address": record.peer_addr,
            "network.peer.port": record.peer_port or None,
            "http.request.size": record.bytes_in,
            "http.response.size": record.bytes_out,
            "moe.request.key": record.fd,
            "moe.connection.generation": record.generation,
            "process.pid": record.tgid,
            "thread.id": record.tid,
            "moe.request.steps": len(event.steps),
            "moe.request.time_to_first_byte_ms": (record.first_response_ns - record.start_ns) / 1e6
            if record.first_response_ns
            else None,
        }
        off = self.epoch_offset_ns
        server = spans.start(
            "http.server.request", start_ns=record.start_ns + off, kind=SpanKind.SERVER, attributes=attrs
        )
        parent = server.get_span_context()
        n = 1
        if event.steps:
            spans.record(
                "queue wait",
                start_ns=record.start_ns + off,
                end_ns=max(record.start_ns, event.steps[0].step.start_ns) + off,
                parent=parent,
            )
            n += 1
        for b, first in zip(event.steps, event.first_claims, strict=True):
            owner = self._owners.get(b.seq)
            if owner is None and first:
                self._owners[b.seq] = self._step_tree(b, parent=parent, extra={})
                self._counts["owner_subtrees"] += 1
            elif owner is not None:
                spans.record(
                    "moe.step",
                    start_ns=b.step.start_ns + off,
                    end_ns=b.step.end_ns + off,
                    parent=parent,
                    attributes={**self._step_attributes(b.step), "moe.step.shared": True},
                    links=[SpanLink(owner, {"moe.link": "step.owner"})],
                )
                self._counts["stub_spans"] += 1
                n += 1
            if b.claims >= b.batch_size:
                self._owners.pop(b.seq, None)  # every request of the batch has its span now
        error = None if record.answered else "connection closed before a response was written"
        spans.end(server, end_ns=record.end_ns + off, error=error)
        self._counts["spans"] += n

    # ------------------------------------------------------------------ steps
    def _step_attributes(self, step: StepEvent) -> Attributes:
        return {
            "moe.step.tokens": step.tokens,
            "moe.step.batch_size": len(set(step.requests)),
            "moe.step.requests": sorted(set(step.requests)),
            "moe.step.layers": len(step.layers),
            "process.pid": step.pid,
            "thread.id": step.tid,
        }

    def _health_attributes(self, b: BufferedStep) -> tuple[Attributes, dict[int, Attributes]]:
        num_experts = b.num_experts
        healths = b.healths
        per_layer: dict[int, Attributes] = {}
        for routing, h in zip(b.routings, healths, strict=True):
            attrs: Attributes = {
                "moe.layer.experts": num_experts,
                "moe.router.entropy_bits": h.router_entropy_bits,
                "moe.router.entropy_normalized": h.router_entropy_normalised,
                "moe.expert_load.gini": h.load.gini,
                "moe.expert_load.entropy_bits": h.load.entropy_bits,
                "moe.expert_load.entropy_normalized": h.load.entropy_normalised,
                "moe.expert_load.max_share": h.load.max_share,
                "moe.expert_load.cv": h.load.cv,
                "moe.tokens.routed": h.load.tokens,
                "moe.tokens.dropped": h.load.dropped,
                "moe.tokens.drop_fraction": h.load.drop_fraction,
            }
            tokens = routing.tokens_per_expert
            if num_experts <= MAX_ARRAY_EXPERTS:
                attrs["moe.expert.tokens"] = [int(x) for x in tokens]
                attrs["moe.expert.dropped"] = [int(x) for x in routing.dropped_per_expert]
            else:
                top = _top_experts(tokens)
                attrs["moe.expert.top_ids"] = top
                attrs["moe.expert.top_tokens"] = [int(tokens[i]) for i in top]
            per_layer[routing.layer] = attrs
        step_attrs: Attributes = {}
        if healths:
            s = step_health(healths)
            step_attrs = {
                "moe.router.entropy_bits": s.router_entropy_bits,
                "moe.router.entropy_normalized": s.router_entropy_normalised,
                "moe.expert_load.gini": s.gini,
                "moe.expert_load.gini_max": s.gini_max,
                "moe.expert_load.max_share": s.max_share,
                "moe.tokens.dropped": s.dropped,
                "moe.tokens.drop_fraction": s.drop_fraction,
            }
        return step_attrs, per_layer

    def _device_events(self, step: StepEvent) -> list[SpanEvent]:
        memory = self._memory
        if memory is None:
            return []
        return [
            SpanEvent(
                "moe.device.sample",
                step.start_ns + self.epoch_offset_ns,
                {
                    "moe.device": memory.scope,
                    "moe.device.memory.source": str(memory.source),
                    "moe.device.memory.used_bytes": memory.used_bytes,
                    "moe.device.memory.total_bytes": memory.total_bytes,
                    "moe.device.memory.used_ratio": memory.ratio,
                },
            )
        ]

    def _step_tree(self, b: BufferedStep, *, parent: SpanContext | None, extra: Attributes) -> SpanContext:
        spans = self.spans
        step = b.step
        step_attrs, per_layer = self._health_attributes(b)
        off = self.epoch_offset_ns
        span = spans.start(
            "moe.step",
            start_ns=step.start_ns + off,
            parent=parent,
            attributes={**self._step_attributes(step), **step_attrs, **extra},
        )
        ctx = span.get_span_context()
        n = 1
        for layer in step.layers:
            n += self._layer(layer, parent=ctx, attrs=per_layer.get(layer.layer, {}))
        spans.end(span, end_ns=step.end_ns + off, events=self._device_events(step))
        self._counts["spans"] += n
        return ctx

    def _layer(self, layer: LayerEvent, *, parent: SpanContext, attrs: Attributes) -> int:
        spans = self.spans
        off = self.epoch_offset_ns
        if self.span_detail == "layer":
            spans.record(
                "moe.layer", start_ns=layer.start_ns + off, end_ns=layer.end_ns + off, parent=parent,
                attributes={"moe.layer": layer.layer, **attrs, **self._folded_layer_attributes(layer)},
            )
            return 1
        span = spans.start(
            "moe.layer", start_ns=layer.start_ns + off, parent=parent,
            attributes={"moe.layer": layer.layer, **attrs},
        )
        ctx = span.get_span_context()
        n = 1
        if layer.router is not None:
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
                    "moe.tokens.routed": sum(r.tokens.values()),
                    "moe.tokens.dropped": sum(r.dropped.values()),
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
            return {"moe.layer.experts.time_us": [float(x) for x in time_us]}
        top = _top_experts(time_us)
        return {"moe.layer.experts.slowest_ids": [int(i) for i in top],
                "moe.layer.experts.slowest_time_us": [float(time_us[i]) for i in top]}

    def _folded_layer_attributes(self, layer: LayerEvent) -> Attributes:
        """--span-detail layer: what the router, expert-load and FFN child spans would carry, as
        attributes of the layer span (one span per layer instead of 2 + experts run + loads)."""
        attrs: Attributes = {"moe.precision": self._layer_precision.get(layer.layer)}
        if layer.router is not None:
            attrs["moe.layer.router.duration_ms"] = (layer.router.end_ns - layer.router.start_ns) / 1e6
        if layer.ffns:
            attrs["moe.layer.ffn.experts"] = [f.expert for f in layer.ffns]
            attrs["moe.layer.ffn.tokens"] = [f.tokens for f in layer.ffns]
            attrs["moe.layer.ffn.duration_ms"] = [(f.end_ns - f.start_ns) / 1e6 for f in layer.ffns]
        if layer.experts is not None:  # moe/v2: all experts of the layer in one range
            attrs["moe.layer.experts.duration_ms"] = layer.experts.duration_ns / 1e6
            attrs["moe.layer.experts.tokens"] = layer.experts.tokens
            attrs.update(self._experts_time_attributes(layer))
        if layer.loads:
            attrs["moe.layer.load.experts"] = [load.expert for load in layer.loads]
            attrs["moe.layer.load.bytes"] = [load.bytes_moved for load in layer.loads]
            attrs["moe.layer.load.duration_ms"] = [(load.end_ns - load.start_ns) / 1e6 for load in layer.loads]
        return attrs


def _top_experts(values: np.ndarray) -> list[int]:
    """The TOP_EXPERTS_ON_SPANS experts with the largest values, largest first, ties by expert id."""
    return [int(i) for i in np.argsort(-np.asarray(values, dtype=np.float64), kind="stable")[:TOP_EXPERTS_ON_SPANS]]
