"""The record pipeline: typed records in, one join, outputs behind one interface.

    sources ── typed records ──▶ RequestJoin (agent/join.py) ──▶ WindowsOutput  (policy signals, live view)
    (daemon.emit → sink)                                     ├─▶ MetricsOutput  (/metrics)
                                                             ├─▶ TraceOutput    (OTLP / file)
                                                             └─▶ ... add_output(any Output)

``Pipeline`` only assembles them, in that order (the metrics output reads the windows' Gini, so the
windows see each step first), and forwards the reads the agent needs. The join rule, the trace
structure and the metric definitions live in the modules named above.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from opentelemetry.util.types import AttributeValue

from moescope import procfs
from moescope.agent import state as st
from moescope.agent.export.spans import SpanFactory
from moescope.agent.join import (
    DEFAULT_MAX_BUFFERED_LAYERS,
    DEFAULT_MAX_BUFFERED_STEPS,
    DEFAULT_STEP_RETENTION_NS,
    DRAIN_ALL_NS,
    Output,
    RequestJoin,
)
from moescope.agent.metrics import Metrics
from moescope.agent.outputs import (
    DEFAULT_LAYER_SPANS_PER_S,
    DEFAULT_SPAN_DETAIL,
    DEFAULT_WINDOW_NS,
    SPAN_DETAILS,
    MetricsOutput,
    TraceOutput,
    WindowsOutput,
)
from moescope.agent.outputs.windows import SIGNALS_REUSE_NS
from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.policy.rules import RuleSpec, Signals
from moescope.collectors.moe_convention import StepEvent
from moescope.collectors.registry import TelemetryRecord
from moescope.probes.ingress.loader import IngressRecord

__all__ = ["SPAN_DETAILS", "DEFAULT_SPAN_DETAIL", "Pipeline", "resource_attributes"]


class Pipeline:
    """The join and its outputs, assembled for `agent start` (and for tests and benchmarks)."""

    def __init__(
        self,
        *,
        spans: SpanFactory | None,
        metrics: Metrics | None = None,
        num_experts: int | None = None,
        window_ns: int = DEFAULT_WINDOW_NS,
        step_retention_ns: int = DEFAULT_STEP_RETENTION_NS,
        max_buffered_steps: int = DEFAULT_MAX_BUFFERED_STEPS,
        max_buffered_layers: int = DEFAULT_MAX_BUFFERED_LAYERS,
        clock: Callable[[], int] = time.monotonic_ns,
        epoch_offset_ns: int | None = None,
        defer_requests: bool = False,
        span_detail: str = DEFAULT_SPAN_DETAIL,
        layer_spans_per_s: float = DEFAULT_LAYER_SPANS_PER_S,
    ) -> None:
        if span_detail not in SPAN_DETAILS:
            raise ValueError(f"span_detail must be one of {SPAN_DETAILS}, got {span_detail!r}")
        # Sources stamp CLOCK_MONOTONIC; OTLP wants ns since the Unix epoch: span times are shifted by this.
        self.epoch_offset_ns = time.time_ns() - time.monotonic_ns() if epoch_offset_ns is None else epoch_offset_ns
        self.join = RequestJoin(
            num_experts=num_experts,
            step_retention_ns=step_retention_ns,
            max_buffered_steps=max_buffered_steps,
            max_buffered_layers=max_buffered_layers,
            clock=clock,
            defer_requests=defer_requests,
        )
        self.windows = WindowsOutput(window_ns=window_ns, clock=clock)
        self.join.add_output(self.windows)
        self.metrics_output = MetricsOutput(metrics, windows=self.windows) if metrics is not None else None
        if self.metrics_output is not None:
            self.join.add_output(self.metrics_output)
        self.traces = (
            TraceOutput(spans, epoch_offset_ns=self.epoch_offset_ns, span_detail=span_detail,
                        layer_spans_per_s=layer_spans_per_s)
            if spans is not None
            else None
        )
        if self.traces is not None:
            self.join.add_output(self.traces)

    # ------------------------------------------------------------------ inputs (the join's)
    def add_output(self, output: Output) -> None:
        """Register one more output: it sees every joined event from now on."""
        self.join.add_output(output)

    def sink(self, record: object) -> None:
        """The daemon's record sink."""
        self.join.sink(record)

    def on_request(self, record: IngressRecord) -> None:
        self.join.on_request(record)

    def on_steps(self, steps: Iterable[StepEvent]) -> None:
        self.join.on_steps(steps)

    def on_telemetry(self, record: TelemetryRecord) -> None:
        self.join.on_telemetry(record)

    def on_runtime_state(self, state: RuntimeState) -> None:
        self.join.on_runtime_state(state)

    def drain_requests(self, now_ns: int) -> None:
        self.join.drain_requests(now_ns)

    def expire(self, *, flush: bool = False) -> None:
        self.join.expire(flush=flush)

    # ------------------------------------------------------------------ reads (the outputs')
    def signals(self, t_s: float | None = None, *, wanted: Collection[str] | None = None,
                overrides: Mapping[str, object] | None = None, reuse_ns: int = 0) -> Signals:
        return self.windows.signals(t_s, wanted=wanted, overrides=overrides, reuse_ns=reuse_ns)

    def panels(self) -> tuple[st.Requests, st.Moe, st.Devices]:
        return self.windows.panels()

    def memory_source(self) -> str | None:
        return self.windows.memory_source()

    def flush_metrics(self) -> None:
        if self.metrics_output is not None:
            self.metrics_output.force_flush()

    def stats(self) -> dict[str, int]:
        out = self.join.stats()
        for output in self.join.outputs:
            out.update(output.stats())
        out.setdefault("spans", 0)
        out.setdefault("step_links", 0)
        out.setdefault("owner_subtrees", 0)
        return out

    def shutdown(self, deadline_ns: int | None = None, *, between: Callable[[], object] | None = None) -> None:
        """Every buffered step out (unclaimed ones as their own traces), then each output's shutdown.
        ``between`` runs between chunks of the flush (``RequestJoin.expire``): the trace export's
        drain, so that a run's held steps do not overflow its queue at exit."""
        self.join.expire(flush=True, between=between)
        deadline = DRAIN_ALL_NS if deadline_ns is None else deadline_ns
        for output in self.join.outputs:
            output.shutdown(deadline)


def resource_attributes(pids: Iterable[int]) -> dict[str, AttributeValue]:
    """OTel resource for the traced serving process(es) and this host."""
    pids = list(pids)
    attrs: dict[str, AttributeValue] = {
        "service.name": os.environ.get("OTEL_SERVICE_NAME", "moe-serving"),
        "host.name": socket.gethostname(),
        "telemetry.sdk.name": "opentelemetry",
    }
    if pids:
        pid = pids[0]
        attrs["process.pid"] = pid
        comm = procfs.read_comm(pid)
        if comm is not None:
            attrs["process.executable.name"] = comm
            cmdline = procfs.read_cmdline(pid)
            if cmdline is not None:
                attrs["process.command_line"] = " ".join(cmdline).strip()[:512]
    return attrs


class RuntimeStatsReader(Protocol):
    """What PolicySignals reads of the runtime's stats (agent/policy/stats_source.py
    RuntimeStatsSignals; a Protocol, so a stand-in is taken too)."""

    with_routing: bool
    clock: Callable[[], float]

    def read_values(self, now_s: float) -> dict[str, Any]: ...


class PolicySignals:
    """The policy loop's source (agent/observe.py ``Observers.policy_signals``): the pipeline's
    windows, plus the runtime's queue depths from its stats page or socket (and its own routing and
    memory view where NVTX is off or nothing better reports memory): the fields the policy's rules
    read (the others are left NaN / empty). Compiled with the hot path: it runs five times a second
    for the agent's whole life, and as interpreted glue it was ~3 % of the agent's CPU at the
    reference load (docs/benchmarks.md "The policy's wake-up compiled; the stats page read in one
    native call").

    ``own(wanted)`` gives the fields the agent computes itself (the kernel requests' p99);
    ``pace(policy_signal=...)`` is told each period whether the host sampler carries the policy's
    memory signal (the runtime's own accounting and NVML do otherwise); ``nvtx`` is the agent's list
    of NVTX collectors, read each period (empty: NVTX is off)."""

    def __init__(self, pipeline: Pipeline, stats: RuntimeStatsReader | None, *,
                 rules: Callable[[], Sequence[RuleSpec] | None],
                 own: Callable[[frozenset[str] | None], dict[str, Any]],
                 pace: Callable[..., None], nvtx: Sequence[object]) -> None:
        self.pipeline = pipeline
        self.stats = stats
        self.rules = rules
        self.own = own
        self.pace = pace
        self.nvtx = nvtx  # the NVTX collectors (added to as targets come; none: NVTX is off)
        self._wanted: tuple[object, frozenset[str]] | None = None  # (the rules, the fields they read)

    def wanted(self) -> frozenset[str] | None:
        """The Signals fields the enabled rules read (None: no policy, every one)."""
        rules = self.rules()
        if rules is None:
            return None
        held = self._wanted
        if held is None or held[0] is not rules:  # (the engine's tuple, made once per config)
            held = self._wanted = (rules, frozenset(spec.signal for spec in rules))
        return held[1]

    def __call__(self) -> Signals:
        wanted = self.wanted()
        changes: dict[str, Any] = self.own(wanted)
        pipeline = self.pipeline
        stats = self.stats
        if stats is None:
            self.pace(policy_signal=pipeline.memory_source() != "nvml")
            return pipeline.signals(wanted=wanted, overrides=changes, reuse_ns=SIGNALS_REUSE_NS)
        # The runtime's own routing view is only the fallback where NVTX is off: skip computing it.
        nvtx = len(self.nvtx) > 0
        stats.with_routing = not nvtx
        theirs = stats.read_values(stats.clock())  # (its fields: no snapshot of its own to unpack)
        changes["expert_queue_tokens"] = theirs.get("expert_queue_tokens", {})  # (a new dict every period: not copied)
        if not nvtx:  # no NVTX: routing and memory as the runtime reports them
            changes["expert_load_gini"] = dict(theirs.get("expert_load_gini", {}))
            changes["router_entropy_ratio"] = dict(theirs.get("router_entropy_ratio", {}))
        # Without a GPU the runtime's own device-pool accounting is the device memory signal; host
        # RSS / cgroup stays in the TUI and metrics. NVML or an explicit --memory-budget-bytes win.
        source = pipeline.memory_source()
        memory = theirs.get("device_memory_used_ratio", math.nan)
        runtime_memory = source != "nvml" and source != "budget" and not math.isnan(memory)
        if runtime_memory:
            changes["device_memory_used_ratio"] = memory
        self.pace(policy_signal=not runtime_memory and source != "nvml")
        return pipeline.signals(wanted=wanted, overrides=changes, reuse_ns=SIGNALS_REUSE_NS)
