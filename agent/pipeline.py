"""The join: kernel-timed requests + NVTX MoE steps + device samples → traces, metrics, signals, state.

Inputs arrive on the daemon thread, in any interleaving:

- ``on_request(IngressRecord)`` when the kernel saw a request complete (probes/ingress);
- ``on_steps([StepEvent])`` when the NVTX collector completed ``moe.step`` ranges (collectors/nvtx
  → collectors/moe_convention);
- ``on_telemetry(TelemetryRecord)`` for every device/host sample (collectors/registry).

Join rule: a step served a request when the step's ``moe.request`` marks carry the request's key
(the connection's fd), the step ran in the same process (pid == tgid), and the step started inside
the request's kernel-timed interval [first byte read, last byte written]. Steps end before the
response that depends on them is written, but the daemon polls NVTX and ingress one after the other:
with ``defer_requests`` (the agent's setting) a request record waits for the first tick that started
after it ended, by when all its steps have been drained (``drain_requests``). Buffered steps are
kept for ``step_retention_ns`` and bounded in count.

Trace structure (docs/traces-and-metrics.md "Trace structure"): one trace per request rooted at the
kernel-timed SERVER span, with a ``queue wait`` child (first byte → first step). The *first request of
a batch whose record arrives* owns the step's full subtree (step → layer → router / expert.load /
expert.ffn); every other request of that batch gets a ``moe.step`` stub under its own server span,
same timing and step attributes, ``moe.step.shared = true``, and a span link to the owner's step.
(Owner = first completed, not oldest: a request's record arrives only when it completes, and spans
are exported as soon as they end, so the owner cannot wait for older batch-mates.) A step no request
claimed before it expires becomes its own trace (``moe.step.unjoined = true``), counted.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from opentelemetry.trace import SpanContext, SpanKind

from moescope.agent import state as st
from moescope.agent.export.spans import SpanEvent, SpanFactory, SpanLink
from moescope.agent.metrics import Metrics
from moescope.agent.policy.rules import Signals
from moescope.agent.routing_health import (
    NAN,
    LayerHealth,
    LayerRouting,
    RoutingHealthWindow,
    SlidingQuantile,
    layer_health,
    step_health,
)
from moescope.collectors.moe_convention import LayerEvent, StepEvent

log = logging.getLogger(__name__)

DEFAULT_WINDOW_NS = 10_000_000_000  # the policy's sliding windows (DESIGN.md: 10 s)
DEFAULT_STEP_RETENTION_NS = 120_000_000_000
DEFAULT_MAX_BUFFERED_STEPS = 20_000
MAX_ARRAY_EXPERTS = 256  # above this, per-expert arrays become top-16 id/token lists on spans


# How much of the forward pass becomes spans: "layer" (default) puts the router, expert loads and
# FFNs of a layer into array attributes of its moe.layer span; "expert" gives each its own span.
SPAN_DETAILS = ("layer", "expert")
DEFAULT_SPAN_DETAIL = "layer"


@dataclass(slots=True)
class _BufferedStep:
    step: StepEvent
    num_experts: int
    healths: list[LayerHealth]  # computed once per step: metrics, windows and spans all use these
    routings: list[LayerRouting]
    owner: SpanContext | None = None  # the owner's step span, once a request claimed it
    claims: int = 0


@dataclass(slots=True)
class _Rate:
    """Events per second over the last few seconds (for the TUI)."""

    window_ns: int = 5_000_000_000
    times: deque[int] = field(default_factory=deque)

    def add(self, t_ns: int) -> None:
        self.times.append(t_ns)
        self._prune(t_ns)  # here too: rate() is only called by a live view, which may be off

    def rate(self, now_ns: int) -> float:
        self._prune(now_ns)
        return len(self.times) / (self.window_ns / 1e9)

    def _prune(self, now_ns: int) -> None:
        while self.times and self.times[0] < now_ns - self.window_ns:
            self.times.popleft()


class Pipeline:
    """Joins the sources; owns the sliding windows the policy and the TUI read."""

    def __init__(
        self,
        *,
        spans: SpanFactory | None,
        metrics: Metrics | None = None,
        num_experts: int | None = None,
        window_ns: int = DEFAULT_WINDOW_NS,
        step_retention_ns: int = DEFAULT_STEP_RETENTION_NS,
        max_buffered_steps: int = DEFAULT_MAX_BUFFERED_STEPS,
        clock: Callable[[], int] = time.monotonic_ns,
        epoch_offset_ns: int | None = None,
        defer_requests: bool = False,
        span_detail: str = DEFAULT_SPAN_DETAIL,
    ) -> None:
        if span_detail not in SPAN_DETAILS:
            raise ValueError(f"span_detail must be one of {SPAN_DETAILS}, got {span_detail!r}")
        self.spans = spans
        self.span_detail = span_detail
        # sink() holds request records until drain_requests(now_ns) (a daemon tick hook) sees they ended
        # before the tick started: the steps of such a request were in the NVTX ring when it was drained.
        self.defer_requests = defer_requests
        self._deferred: list[Any] = []
        # Sources stamp CLOCK_MONOTONIC; OTLP wants ns since the Unix epoch: span times are shifted by this.
        self.epoch_offset_ns = time.time_ns() - time.monotonic_ns() if epoch_offset_ns is None else epoch_offset_ns
        self.metrics = metrics
        self.window_ns = window_ns
        self.step_retention_ns = step_retention_ns
        self.max_buffered_steps = max_buffered_steps
        self.clock = clock
        self._configured_experts = num_experts
        self._num_experts = num_experts or 0
        self._lock = threading.Lock()  # snapshot()/signals() may run on other threads
        # (pid, request key) -> buffered steps carrying that key, oldest first
        self._by_key: dict[tuple[int, int], deque[_BufferedStep]] = {}
        self._buffer: deque[_BufferedStep] = deque()
        self._request_latency_ms = SlidingQuantile(duration_ns=window_ns)
        self._step_ms = SlidingQuantile(duration_ns=window_ns)
        self._load_ms = SlidingQuantile(duration_ns=window_ns)
        self._routing: RoutingHealthWindow | None = None
        self._request_rate = _Rate()
        self._error_rate = _Rate()
        self._step_rate = _Rate()
        self._last_memory: Any = None  # moescope.collectors.host.MemorySignal
        self._last_nvml: Any = None  # moescope.collectors.nvml.NvmlSample
        self._layer_precision: dict[int, str] = {}
        self._window_gauges_ns = 0
        # Per-step metrics that need no per-step precision are kept here and written to the
        # registry by flush_metrics() (daemon tick and every scrape): per-expert token counters
        # summed, routing-health gauges at their latest value. Writing ~80 labelled series per step
        # was a fifth of the agent's CPU under load.
        self._metrics_lock = threading.Lock()
        self._pending_tokens: dict[int, dict[int, int]] = {}
        self._pending_dropped: dict[int, dict[int, int]] = {}
        self._latest_layer_health: dict[int, LayerHealth] = {}
        self._latest_step_health: Any = None
        if metrics is not None:
            metrics.add_refresh_hook(self.flush_metrics)
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "requests", "requests_unanswered", "requests_joined", "steps", "steps_joined",
                "steps_unjoined", "steps_evicted_overflow", "stub_spans", "owner_subtrees", "spans",
                "telemetry_samples", "experts_grown", "layers_bad_routing",
            ),
            0,
        )

    # ------------------------------------------------------------------ inputs
    def on_request(self, record: Any) -> None:
        """One kernel-timed request (moescope.probes.ingress.loader.IngressRecord)."""
        now = self.clock()
        with self._lock:
            self._counts["requests"] += 1
            latency_ms = (record.end_ns - record.start_ns) / 1e6
            self._request_latency_ms.add(record.end_ns, latency_ms)
            self._request_rate.add(now)
            if not record.answered:
                self._counts["requests_unanswered"] += 1
                self._error_rate.add(now)
            steps = self._claim_steps(record)
        if self.metrics is not None:
            self.metrics.observe("moescope_request_duration_seconds", latency_ms / 1e3)
            self.metrics.inc("moescope_requests")
            self.metrics.inc("moescope_request_received_bytes", record.bytes_in)
            self.metrics.inc("moescope_response_sent_bytes", record.bytes_out)
            if steps:
                wait_s = max(0, steps[0].step.start_ns - record.start_ns) / 1e9
                self.metrics.observe("moescope_request_queue_wait_seconds", wait_s)
        if self.spans is not None:
            self._emit_request_trace(record, steps)

    def on_steps(self, steps: Iterable[StepEvent]) -> None:
        """Completed ``moe.step`` trees from the convention parser."""
        for step in steps:
            self._on_step(step)
        self.expire()

    def on_telemetry(self, record: Any) -> None:
        """A moescope.collectors.registry.TelemetryRecord: NVML sample or host memory signal."""
        sample = record.sample
        with self._lock:
            self._counts["telemetry_samples"] += 1
            getter = getattr(sample, "memory_signal", None)
            signal = getter() if callable(getter) else None
            if hasattr(sample, "gpus"):
                self._last_nvml = sample
                if signal is not None:
                    self._last_memory = signal
            elif signal is not None and (self._last_memory is None or self._last_memory.source != "nvml"):
                self._last_memory = signal  # host/cgroup/budget: the signal where NVML has none
        if self.metrics is not None:
            self._telemetry_metrics(sample)

    def sink(self, record: Any) -> None:
        """The daemon's record sink: dispatch by type."""
        if hasattr(record, "first_response_ns"):
            if self.defer_requests:
                with self._lock:
                    self._deferred.append(record)
            else:
                self.on_request(record)
        elif hasattr(record, "collector") and hasattr(record, "sample"):
            self.on_telemetry(record)

    def drain_requests(self, now_ns: int) -> None:
        """Daemon tick hook: join the deferred requests that ended before this tick started.

        The daemon polls its sources one after another; a request can end (and its record be read)
        after the NVTX ring was drained in the same tick, while its steps, which ended before its
        response, wait in that ring. Every source of this tick was polled at or after ``now_ns``, so
        a request with ``end_ns < now_ns`` has all its steps buffered now; later ones wait a tick.
        """
        with self._lock:
            ready = [r for r in self._deferred if r.end_ns < now_ns]
            if not ready:
                return None
            self._deferred = [r for r in self._deferred if r.end_ns >= now_ns]
        for record in sorted(ready, key=lambda r: r.end_ns):
            self.on_request(record)
        return None

    # ------------------------------------------------------------------ steps
    def _experts_for(self, step: StepEvent) -> int:
        """E: the moe.layer payload (moe/v1) wins; else --num-experts; else the largest expert id seen."""
        reported = max((layer.num_experts or 0 for layer in step.layers), default=0)
        if reported:
            wanted = reported
        elif self._configured_experts:
            wanted = self._configured_experts
        else:
            seen = 0
            for layer in step.layers:
                router = layer.router
                if router is not None:
                    for expert in (*router.tokens, *router.dropped):
                        seen = max(seen, expert + 1)
                for ev in (*layer.loads, *layer.ffns):
                    seen = max(seen, ev.expert + 1)
            wanted = max(seen, self._num_experts)
        if wanted != self._num_experts:
            self._counts["experts_grown"] += 1
            self._num_experts = wanted
            self._routing = None  # windows are per E: restart them
        return self._num_experts

    def _on_step(self, step: StepEvent) -> None:
        with self._lock:
            self._counts["steps"] += 1
            num_experts = self._experts_for(step)
            self._step_ms.add(step.end_ns, step.duration_ns / 1e6)
            self._step_rate.add(self.clock())
            for layer in step.layers:
                for load in layer.loads:
                    self._load_ms.add(load.end_ns, load.duration_ns / 1e6)
            routings = self._routings(step, num_experts)
            if num_experts > 0:
                if self._routing is None:
                    self._routing = RoutingHealthWindow(duration_ns=self.window_ns, num_experts=num_experts)
                self._routing.add_step(step.end_ns, routings)
            buffered = _BufferedStep(step, num_experts, [layer_health(r) for r in routings], routings)
            self._buffer.append(buffered)
            for key in set(step.requests):
                self._by_key.setdefault((step.pid, key), deque()).append(buffered)
            while len(self._buffer) > self.max_buffered_steps:
                self._counts["steps_evicted_overflow"] += 1
                self._drop_oldest_locked()
        if self.metrics is not None:
            self._step_metrics(step, buffered.healths)

    def _routings(self, step: StepEvent, num_experts: int) -> list[LayerRouting]:
        out = []
        if num_experts <= 0:
            return out
        for layer in step.layers:
            router = layer.router
            if router is None:
                continue
            try:
                routing = LayerRouting.from_marks(
                    layer=layer.layer,
                    num_experts=num_experts,
                    tokens=router.tokens,
                    dropped=router.dropped,
                    router_entropy_bits=NAN if router.entropy_bits is None else router.entropy_bits,
                )
            except ValueError:
                # bad marks (expert id >= a configured E, negative count): this layer's health is left out, counted
                self._counts["layers_bad_routing"] += 1
                continue
            out.append(routing)
        return out

    def _claim_steps(self, record: Any) -> list[_BufferedStep]:
        """Buffered steps of this request (same pid, key == fd, started inside its interval)."""
        queue = self._by_key.get((record.tgid, record.fd))
        if not queue:
            return []
        mine = [b for b in queue if record.start_ns <= b.step.start_ns <= record.end_ns]
        mine.sort(key=lambda b: b.step.start_ns)  # arrival order is end order: two model threads can interleave
        if mine:
            self._counts["requests_joined"] += 1
        for b in mine:
            b.claims += 1
        # A later request on this fd starts after this one ended: older entries can go.
        while queue and queue[0].step.start_ns <= record.end_ns:
            queue.popleft()
        if not queue:
            del self._by_key[(record.tgid, record.fd)]
        return mine

    def _drop_oldest_locked(self) -> _BufferedStep:
        b = self._buffer.popleft()
        for key in set(b.step.requests):
            q = self._by_key.get((b.step.pid, key))
            if q and q[0] is b:
                q.popleft()
                if not q:
                    del self._by_key[(b.step.pid, key)]
        if b.claims:
            self._counts["steps_joined"] += 1
        else:
            self._counts["steps_unjoined"] += 1
        return b

    def expire(self, *, flush: bool = False) -> None:
        """Retire buffered steps past retention (all with ``flush``); unclaimed ones become traces."""
        if flush:
            self.drain_requests(2**63 - 1)  # the sources are closed: every request left is final
        now = self.clock()
        expired: list[_BufferedStep] = []
        with self._lock:
            while self._buffer and (flush or self._buffer[0].step.end_ns < now - self.step_retention_ns):
                expired.append(self._drop_oldest_locked())
        if self.spans is not None:
            for b in expired:
                if not b.claims:
                    self._emit_step_tree(b, parent=None, extra={"moe.step.unjoined": True})

    # ------------------------------------------------------------------ traces
    def _emit_request_trace(self, record: Any, steps: list[_BufferedStep]) -> None:
        spans = self.spans
        assert spans is not None
        attrs: dict[str, Any] = {
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
            "moe.request.steps": len(steps),
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
        if steps:
            spans.record(
                "queue wait",
                start_ns=record.start_ns + off,
                end_ns=max(record.start_ns, steps[0].step.start_ns) + off,
                parent=parent,
            )
            n += 1
        for b in steps:
            if b.owner is None:
                b.owner = self._emit_step_tree(b, parent=parent, extra={})
                self._counts["owner_subtrees"] += 1
            else:
                spans.record(
                    "moe.step",
                    start_ns=b.step.start_ns + off,
                    end_ns=b.step.end_ns + off,
                    parent=parent,
                    attributes={**self._step_attributes(b.step), "moe.step.shared": True},
                    links=[SpanLink(b.owner, {"moe.link": "step.owner"})],
                )
                self._counts["stub_spans"] += 1
                n += 1
            if b.claims >= len(set(b.step.requests)):
                # Every request of the batch has its span: only the step's header is needed until
                # it leaves the buffer, so let its layer tree go now (most of the agent's heap).
                b.step = replace(b.step, layers=[])
                b.routings, b.healths = [], []  # per-layer arrays: only an unclaimed step's tree uses them
        error = None if record.answered else "connection closed before a response was written"
        spans.end(server, end_ns=record.end_ns + off, error=error)
        self._counts["spans"] += n

    def _step_attributes(self, step: StepEvent) -> dict[str, Any]:
        return {
            "moe.step.tokens": step.tokens,
            "moe.step.batch_size": len(set(step.requests)),
            "moe.step.requests": sorted(set(step.requests)),
            "moe.step.layers": len(step.layers),
            "process.pid": step.pid,
            "thread.id": step.tid,
        }

    def _health_attributes(self, b: _BufferedStep) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        num_experts = b.num_experts
        healths = b.healths
        per_layer: dict[int, dict[str, Any]] = {}
        for routing, h in zip(b.routings, healths, strict=True):
            attrs: dict[str, Any] = {
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
                top = sorted(range(len(tokens)), key=lambda i: -int(tokens[i]))[:16]
                attrs["moe.expert.top_ids"] = top
                attrs["moe.expert.top_tokens"] = [int(tokens[i]) for i in top]
            per_layer[routing.layer] = attrs
        step_attrs: dict[str, Any] = {}
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
        memory = self._last_memory
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

    def _emit_step_tree(self, b: _BufferedStep, *, parent: SpanContext | None, extra: dict[str, Any]) -> SpanContext:
        spans = self.spans
        assert spans is not None
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
            n += self._emit_layer(layer, parent=ctx, attrs=per_layer.get(layer.layer, {}))
        spans.end(span, end_ns=step.end_ns + off, events=self._device_events(step))
        self._counts["spans"] += n
        return ctx

    def _emit_layer(self, layer: LayerEvent, *, parent: SpanContext, attrs: dict[str, Any]) -> int:
        spans = self.spans
        assert spans is not None
        off = self.epoch_offset_ns
        if self.span_detail == "layer":
            spans.record(
                "moe.layer", start_ns=layer.start_ns + off, end_ns=layer.end_ns + off, parent=parent,
                attributes={"moe.layer": layer.layer, **attrs, **self._folded_layer_attributes(layer)},
            )
            return 1
        span = spans.start(
            "moe.layer", start_ns=layer.start_ns + off, parent=parent, attributes={"moe.layer": layer.layer, **attrs}
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
        for load in layer.loads:
            spans.record(
                "moe.expert.load",
                start_ns=load.start_ns + off,
                end_ns=load.end_ns + off,
                parent=ctx,
                attributes={"moe.layer": layer.layer, "moe.expert": load.expert, "moe.expert.load.bytes": load.bytes_moved},
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

    def _folded_layer_attributes(self, layer: LayerEvent) -> dict[str, Any]:
        """--span-detail layer: what the router, expert-load and FFN child spans would carry, as
        attributes of the layer span (one span per layer instead of 2 + experts run + loads)."""
        attrs: dict[str, Any] = {"moe.precision": self._layer_precision.get(layer.layer)}
        if layer.router is not None:
            attrs["moe.layer.router.duration_ms"] = (layer.router.end_ns - layer.router.start_ns) / 1e6
        if layer.ffns:
            attrs["moe.layer.ffn.experts"] = [f.expert for f in layer.ffns]
            attrs["moe.layer.ffn.tokens"] = [f.tokens for f in layer.ffns]
            attrs["moe.layer.ffn.duration_ms"] = [(f.end_ns - f.start_ns) / 1e6 for f in layer.ffns]
        if layer.loads:
            attrs["moe.layer.load.experts"] = [load.expert for load in layer.loads]
            attrs["moe.layer.load.bytes"] = [load.bytes_moved for load in layer.loads]
            attrs["moe.layer.load.duration_ms"] = [(load.end_ns - load.start_ns) / 1e6 for load in layer.loads]
        return attrs

    # ------------------------------------------------------------------ metrics
    def _step_metrics(self, step: StepEvent, healths: list[LayerHealth]) -> None:
        m = self.metrics
        assert m is not None
        m.inc("moescope_steps")
        if step.tokens is not None and step.tokens > 0:  # a counter cannot go down: bad payloads are skipped
            m.inc("moescope_step_tokens", step.tokens)
        m.observe("moescope_step_duration_seconds", step.duration_ns / 1e9)
        for layer in step.layers:
            for load in layer.loads:
                m.observe("moescope_expert_load_duration_seconds", load.duration_ns / 1e9)
                if load.bytes_moved is not None and load.bytes_moved > 0:
                    m.inc("moescope_expert_load_bytes", load.bytes_moved)
        with self._metrics_lock:
            for layer in step.layers:
                router = layer.router
                if router is None:
                    continue
                for pending, counts in ((self._pending_tokens, router.tokens), (self._pending_dropped, router.dropped)):
                    acc = pending.setdefault(layer.layer, {})
                    for expert, n in counts.items():
                        acc[expert] = acc.get(expert, 0) + n
            for h in healths:
                self._latest_layer_health[h.layer] = h
            if healths:
                self._latest_step_health = healths
        num_experts = self._num_experts
        if num_experts:
            m.set("moescope_experts", num_experts)
        routing = self._routing
        # The windowed gauge sums the whole window per layer: once a second is plenty for a scrape.
        if routing is not None and step.end_ns - self._window_gauges_ns >= 1_000_000_000:
            self._window_gauges_ns = now = step.end_ns
            for layer in routing.layers():
                m.set("moescope_expert_load_gini_window", routing.layer_stats(layer, now).gini, layer=str(layer))

    def flush_metrics(self) -> None:
        """Write the per-step metrics kept since the last flush into the registry (any thread)."""
        m = self.metrics
        if m is None:
            return
        with self._metrics_lock:
            tokens, dropped = self._pending_tokens, self._pending_dropped
            healths = list(self._latest_layer_health.values())
            step_healths = self._latest_step_health
            self._pending_tokens, self._pending_dropped = {}, {}
            self._latest_layer_health, self._latest_step_health = {}, None
        for layer in sorted(tokens.keys() | dropped.keys()):
            m.record_expert_counts(layer=layer, tokens=tokens.get(layer, {}), dropped=dropped.get(layer))
        for h in healths:
            m.set_layer_health(h)
        if step_healths:
            m.set_step_health(step_health(step_healths))

    def _telemetry_metrics(self, sample: Any) -> None:
        m = self.metrics
        assert m is not None
        if hasattr(sample, "gpus"):
            for gpu in sample.gpus:
                dev = str(gpu.index)
                for name, value in (
                    ("moescope_device_memory_used_bytes", gpu.memory_used_bytes),
                    ("moescope_device_memory_total_bytes", gpu.memory_total_bytes),
                    ("moescope_pcie_transmit_bytes_per_second", gpu.pcie_tx_bytes_per_s),
                    ("moescope_pcie_receive_bytes_per_second", gpu.pcie_rx_bytes_per_s),
                ):
                    if _finite(value):
                        m.set(name, float(value), device=dev)
                for link in gpu.nvlinks:
                    if _finite(link.tx_total_bytes):
                        m.set_counter_total("moescope_nvlink_transmit_bytes", float(link.tx_total_bytes), device=dev, link=str(link.link))
                    if _finite(link.rx_total_bytes):
                        m.set_counter_total("moescope_nvlink_receive_bytes", float(link.rx_total_bytes), device=dev, link=str(link.link))
        else:
            getter = getattr(sample, "memory_signal", None)
            signal = getter() if callable(getter) else None
            if signal is not None:
                m.set("moescope_device_memory_used_bytes", float(signal.used_bytes), device="host")
                m.set("moescope_device_memory_total_bytes", float(signal.total_bytes), device="host")
            rss = getattr(sample, "rss_bytes", None)
            if _finite(rss):
                m.set("moescope_target_memory_bytes", float(rss), device="host")

    # ------------------------------------------------------------------ outputs
    def set_precision(self, layer_precision: dict[int, str]) -> None:
        """Per-layer precision as the runtime reports it (control-socket stats), for spans and the TUI."""
        with self._lock:
            self._layer_precision = dict(layer_precision)

    def signals(self, t_s: float | None = None) -> Signals:
        """The policy's view of the windows now (NaN where there is no data)."""
        now = self.clock()
        with self._lock:
            gini: dict[int, float] = {}
            entropy_ratio: dict[int, float] = {}
            routing = self._routing
            if routing is not None:
                for layer in routing.layers():
                    gini[layer] = routing.layer_stats(layer, now).gini
                    bits = routing.router_entropy_bits(layer, now)
                    e = routing.num_experts
                    entropy_ratio[layer] = bits / math.log2(e) if e > 1 and not math.isnan(bits) else NAN
            memory = self._last_memory
            return Signals(
                t_s=now / 1e9 if t_s is None else t_s,
                step_p99_ms=self._step_ms.p99(now),
                device_memory_used_ratio=memory.ratio if memory is not None else NAN,
                expert_load_p99_ms=self._load_ms.p99(now),
                request_p99_ms=self._request_latency_ms.p99(now),
                expert_load_gini={k: v for k, v in gini.items() if not math.isnan(v)},
                router_entropy_ratio={k: v for k, v in entropy_ratio.items() if not math.isnan(v)},
            )

    def memory_source(self) -> str | None:
        """Where the latest memory signal came from ("nvml", "cgroup", "budget", "rss"), or None."""
        memory = self._last_memory
        return None if memory is None else str(memory.source)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
            out["buffered_steps"] = len(self._buffer)
            return out

    def panels(self) -> tuple[st.Requests, st.Moe, st.Devices]:
        """Requests, MoE and devices panels of the TUI snapshot."""
        now = self.clock()
        window_s = self.window_ns / 1e9
        with self._lock:
            lat = self._request_latency_ms
            requests = st.Requests(
                window_s=window_s,
                rate_per_s=self._request_rate.rate(now),
                latency_p50_ms=_none(lat.quantile(0.50, now)),
                latency_p95_ms=_none(lat.quantile(0.95, now)),
                latency_p99_ms=_none(lat.quantile(0.99, now)),
                errors_total=self._counts["requests_unanswered"],
                errors_per_s=self._error_rate.rate(now),
            )
            layers = []
            routing = self._routing
            if routing is not None:
                for layer in routing.layers():
                    stats = routing.layer_stats(layer, now)
                    tokens = [float(x) for x in routing.layer_totals(layer, now)]
                    share_bins, per_bin = st.bin_expert_shares(tokens)
                    layers.append(
                        st.MoeLayer(
                            layer=layer,
                            num_experts=routing.num_experts,
                            experts_per_bin=per_bin,
                            expert_token_share=share_bins,
                            hot_experts=st.hottest_experts(tokens),
                            tokens_total=stats.tokens,
                            entropy_bits=_none(routing.router_entropy_bits(layer, now)),
                            gini=_none(stats.gini),
                            capacity_drops=stats.dropped,
                            precision=self._layer_precision.get(layer),
                        )
                    )
            moe = st.Moe(window_s=window_s, layers=layers)
            devices = st.Devices()
            if self._last_nvml is not None:
                for gpu in self._last_nvml.gpus:
                    devices.gpus.append(
                        st.Gpu(
                            index=gpu.index,
                            name=_none_str(gpu.name),
                            memory_used_bytes=_none_int(gpu.memory_used_bytes),
                            memory_total_bytes=_none_int(gpu.memory_total_bytes),
                            utilization_pct=_none(gpu.utilization_gpu_percent),
                            nvlinks=[
                                st.NvLink(link=lk.link, tx_bytes_per_s=_none(lk.tx_bytes_per_s), rx_bytes_per_s=_none(lk.rx_bytes_per_s))
                                for lk in gpu.nvlinks
                            ],
                        )
                    )
            memory = self._last_memory
            if memory is not None:
                devices = st.Devices(
                    gpus=devices.gpus,
                    host_budget=st.HostBudget(
                        source=f"{memory.source}: {memory.scope}", used_bytes=memory.used_bytes, total_bytes=memory.total_bytes
                    ),
                )
            return requests, moe, devices


def _finite(value: Any) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _none(value: Any) -> float | None:
    return float(value) if _finite(value) else None


def _none_int(value: Any) -> int | None:
    return int(value) if _finite(value) else None


def _none_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def resource_attributes(pids: Iterable[int]) -> dict[str, Any]:
    """OTel resource for the traced serving process(es) and this host."""
    pids = list(pids)
    attrs: dict[str, Any] = {
        "service.name": os.environ.get("OTEL_SERVICE_NAME", "moe-serving"),
        "host.name": socket.gethostname(),
        "telemetry.sdk.name": "opentelemetry",
    }
    if pids:
        pid = pids[0]
        attrs["process.pid"] = pid
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
                attrs["process.executable.name"] = f.read().strip()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                attrs["process.command_line"] = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:512]
        except OSError:
            pass
    return attrs
