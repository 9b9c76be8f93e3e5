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

import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping

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
from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.policy.rules import Signals
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

    def shutdown(self, deadline_ns: int | None = None) -> None:
        """Every buffered step out (unclaimed ones as their own traces), then each output's shutdown."""
        self.join.expire(flush=True)
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
