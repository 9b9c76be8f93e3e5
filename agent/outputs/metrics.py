"""Prometheus families from joined events (the families themselves are declared in agent/metrics.py).

Per-step metrics that need no per-step precision are held here and written by ``force_flush`` (a
refresh hook: the daemon's publish tick and every scrape): per-expert token counters summed,
routing-health gauges at their latest value. Writing ~80 labelled series per step was a fifth of
the agent's CPU under load.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from moescope.agent.join import BufferedStep, JoinEvent, RequestJoined, StepSeen, TelemetrySeen
from moescope.agent.metrics import Metrics
from moescope.agent.outputs.values import finite
from moescope.agent.outputs.windows import WindowsOutput
from moescope.agent.routing_health import LayerHealth, step_health
from moescope.collectors.host import HostSample
from moescope.collectors.nvml import NvmlSample

WINDOW_GAUGE_PERIOD_NS = 1_000_000_000  # the windowed Gini sums the whole window per layer


class MetricsOutput:
    name = "metrics"

    def __init__(self, metrics: Metrics, *, windows: WindowsOutput | None = None) -> None:
        self.metrics = metrics
        self.windows = windows  # for the windowed gauges (moescope_expert_load_gini_window)
        self._lock = threading.Lock()  # export on the daemon thread, force_flush on a scrape's
        self._pending_tokens: dict[int, dict[int, int]] = {}
        self._pending_dropped: dict[int, dict[int, int]] = {}
        self._latest_layer_health: dict[int, LayerHealth] = {}
        self._latest_step_health: list[LayerHealth] | None = None
        self._window_gauges_ns = 0
        metrics.add_refresh_hook(self.force_flush)

    # ------------------------------------------------------------------ Output
    def export(self, batch: Sequence[JoinEvent]) -> None:
        for event in batch:
            match event:
                case RequestJoined():
                    self._request(event)
                case StepSeen(step=b):
                    self._step(b)
                case TelemetrySeen(sample=sample):
                    self._telemetry(sample)
                case _:
                    pass

    def force_flush(self) -> None:
        """Write the per-step metrics kept since the last flush into the registry (any thread)."""
        m = self.metrics
        with self._lock:
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

    def shutdown(self, deadline_ns: int) -> None:
        self.force_flush()

    def stats(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ events
    def _request(self, event: RequestJoined) -> None:
        m = self.metrics
        record = event.record
        m.observe("moescope_request_duration_seconds", (record.end_ns - record.start_ns) / 1e9)
        m.inc("moescope_requests")
        m.inc("moescope_request_received_bytes", record.bytes_in)
        m.inc("moescope_response_sent_bytes", record.bytes_out)
        if event.steps:
            wait_s = max(0, event.steps[0].step.start_ns - record.start_ns) / 1e9
            m.observe("moescope_request_queue_wait_seconds", wait_s)

    def _step(self, b: BufferedStep) -> None:
        m = self.metrics
        step = b.step
        m.inc("moescope_steps")
        if step.tokens is not None and step.tokens > 0:  # a counter cannot go down: bad payloads are skipped
            m.inc("moescope_step_tokens", step.tokens)
        m.observe("moescope_step_duration_seconds", step.duration_ns / 1e9)
        for layer in step.layers:
            for load in layer.loads:
                m.observe("moescope_expert_load_duration_seconds", load.duration_ns / 1e9)
                if load.bytes_moved is not None and load.bytes_moved > 0:
                    m.inc("moescope_expert_load_bytes", load.bytes_moved)
        with self._lock:
            for layer in step.layers:
                router = layer.router
                if router is None:
                    continue
                for pending, counts in ((self._pending_tokens, router.tokens), (self._pending_dropped, router.dropped)):
                    acc = pending.setdefault(layer.layer, {})
                    for expert, n in counts.items():
                        acc[expert] = acc.get(expert, 0) + n
            for h in b.healths:
                self._latest_layer_health[h.layer] = h
            if b.healths:
                self._latest_step_health = b.healths
        if b.num_experts:
            m.set("moescope_experts", b.num_experts)
        windows = self.windows
        if windows is not None and step.end_ns - self._window_gauges_ns >= WINDOW_GAUGE_PERIOD_NS:
            self._window_gauges_ns = now = step.end_ns
            for layer_index, gini in windows.layer_gini(now).items():
                m.set("moescope_expert_load_gini_window", gini, layer=str(layer_index))

    def _telemetry(self, sample: object) -> None:
        m = self.metrics
        if isinstance(sample, NvmlSample):
            for gpu in sample.gpus:
                dev = str(gpu.index)
                for name, value in (
                    ("moescope_device_memory_used_bytes", gpu.memory_used_bytes),
                    ("moescope_device_memory_total_bytes", gpu.memory_total_bytes),
                    ("moescope_pcie_transmit_bytes_per_second", gpu.pcie_tx_bytes_per_s),
                    ("moescope_pcie_receive_bytes_per_second", gpu.pcie_rx_bytes_per_s),
                    ("moescope_target_memory_bytes", gpu.target_memory_used_bytes),
                ):
                    if finite(value):
                        m.set(name, float(value), device=dev)
                for link in gpu.nvlinks:
                    if finite(link.tx_total_bytes):
                        m.set_counter_total(
                            "moescope_nvlink_transmit_bytes",
                            float(link.tx_total_bytes),
                            device=dev,
                            link=str(link.link),
                        )
                    if finite(link.rx_total_bytes):
                        m.set_counter_total(
                            "moescope_nvlink_receive_bytes", float(link.rx_total_bytes), device=dev, link=str(link.link)
                        )
        elif isinstance(sample, HostSample):
            signal = sample.memory_signal()
            if signal is not None:
                m.set("moescope_device_memory_used_bytes", float(signal.used_bytes), device="host")
                m.set("moescope_device_memory_total_bytes", float(signal.total_bytes), device="host")
            if sample.rss_bytes is not None and finite(sample.rss_bytes):
                m.set("moescope_target_memory_bytes", float(sample.rss_bytes), device="host")
