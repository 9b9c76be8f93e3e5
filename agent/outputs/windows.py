"""The sliding windows over joined events: the policy's signals and the live view's panels.

Both read the same windows (request latency, step latency, expert-load latency, routing health
per layer, rates, the latest device samples), so what the policy acts on and what an operator sees
are one set of numbers. Quantiles are ``moescope.latency`` nearest-rank, as everywhere else.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from moescope.agent import state as st
from moescope.agent.join import (
    JoinEvent,
    NetSignalSeen,
    RequestJoined,
    RuntimeSeen,
    StepSeen,
    TelemetrySeen,
    expert_precisions,
    precision_text,
)
from moescope.agent.outputs.values import float_or_none, int_or_none
from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.policy.rules import Signals
from moescope.agent.routing_health import NAN, RoutingHealthWindow
from moescope.collectors.host import MemorySignal
from moescope.collectors.netsig import NetSignalWindow
from moescope.collectors.nvml import NvmlSample
from moescope.latency import SlidingQuantile

DEFAULT_WINDOW_NS = 10_000_000_000  # the policy's sliding windows (DESIGN.md: 10 s)


@dataclass(slots=True)
class EventRate:
    """Events per second over the last few seconds (for the live view)."""

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


class WindowsOutput:
    name = "windows"

    def __init__(self, *, window_ns: int = DEFAULT_WINDOW_NS, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.window_ns = window_ns
        self.clock = clock
        self._lock = threading.Lock()  # signals() / panels() run on the policy and publisher threads
        self._request_latency_ms = SlidingQuantile(duration_ns=window_ns)
        self._step_ms = SlidingQuantile(duration_ns=window_ns)
        self._load_ms = SlidingQuantile(duration_ns=window_ns)
        self._routing: RoutingHealthWindow | None = None
        self._request_rate = EventRate()
        self._error_rate = EventRate()
        self._step_rate = EventRate()
        self._errors_total = 0
        self._memory: MemorySignal | None = None
        self._nvml: NvmlSample | None = None
        self._layer_precision: dict[int, str] = {}
        self._runtime: RuntimeState | None = None
        self._net = NetSignalWindow(window_ns=window_ns)

    # ------------------------------------------------------------------ Output
    def export(self, batch: Sequence[JoinEvent]) -> None:
        now = self.clock()
        with self._lock:
            for event in batch:
                match event:
                    case RequestJoined(record=record):
                        self._request_latency_ms.add(record.end_ns, (record.end_ns - record.start_ns) / 1e6)
                        self._request_rate.add(now)
                        if not record.answered:
                            self._errors_total += 1
                            self._error_rate.add(now)
                    case StepSeen(step=b, experts_changed=changed):
                        step = b.step
                        self._step_ms.add(step.end_ns, step.duration_ns / 1e6)
                        self._step_rate.add(now)
                        for layer in step.layers:
                            for load in layer.loads:
                                self._load_ms.add(load.end_ns, load.duration_ns / 1e6)
                        if changed:
                            self._routing = None  # windows are per E: restart them
                        if b.num_experts > 0:
                            if self._routing is None:
                                self._routing = RoutingHealthWindow(
                                    duration_ns=self.window_ns, num_experts=b.num_experts
                                )
                            self._routing.add_table(step.end_ns, b.table)
                    case TelemetrySeen(sample=sample, memory=memory):
                        if isinstance(sample, NvmlSample):
                            self._nvml = sample
                        self._memory = memory
                    case RuntimeSeen(state=runtime, layer_precision=precision):
                        self._runtime = runtime
                        self._layer_precision = dict(precision)
                    case NetSignalSeen(record=record):
                        self._net.add(record)
                    case _:
                        pass

    def force_flush(self) -> None:
        return None

    def shutdown(self, deadline_ns: int) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ the policy's view
    def signals(self, t_s: float | None = None) -> Signals:
        """The windows now (NaN where there is no data)."""
        now = self.clock()
        with self._lock:
            gini: dict[int, float] = {}
            entropy_ratio: dict[int, float] = {}
            routing = self._routing
            if routing is not None:
                table = routing.table(now)  # every layer's window at once
                gini = dict(zip(table.layers.tolist(), table.gini.tolist(), strict=True))
                entropy_ratio = dict(zip(table.layers.tolist(), table.router_entropy_normalised.tolist(), strict=True))
            memory = self._memory
            net = self._net.rates(now)
            return Signals(
                t_s=now / 1e9 if t_s is None else t_s,
                step_p99_ms=self._step_ms.p99(now),
                device_memory_used_ratio=memory.ratio if memory is not None else NAN,
                expert_load_p99_ms=self._load_ms.p99(now),
                request_p99_ms=self._request_latency_ms.p99(now),
                listen_overflows_per_s=net.listen_overflows_per_s,
                tcp_retransmits_per_s=net.retransmits_per_s,
                tcp_resets_per_s=net.resets_per_s,
                expert_load_gini={k: v for k, v in gini.items() if not math.isnan(v)},
                router_entropy_ratio={k: v for k, v in entropy_ratio.items() if not math.isnan(v)},
            )

    def network_panel(self) -> st.Network:
        """The live view's network line: the same rates the policy reads."""
        with self._lock:
            net = self._net.rates(self.clock())
        if math.isnan(net.retransmits_per_s):
            return st.Network(window_s=net.window_s)
        return st.Network(
            window_s=net.window_s,
            listen_overflows_per_s=net.listen_overflows_per_s,
            retransmits_per_s=net.retransmits_per_s,
            resets_per_s=net.resets_per_s,
            listen_overflows_total=net.listen_overflows_total,
        )

    def layer_gini(self, now_ns: int) -> dict[int, float]:
        """Expert-load Gini per layer over the window (the metrics output's windowed gauge)."""
        with self._lock:
            routing = self._routing
            if routing is None:
                return {}
            table = routing.table(now_ns)
            return dict(zip(table.layers.tolist(), table.gini.tolist(), strict=True))

    def memory_source(self) -> str | None:
        """Where the latest memory signal came from ("nvml", "cgroup", "budget", "rss"), or None."""
        memory = self._memory
        return None if memory is None else str(memory.source)

    def layer_precision(self) -> dict[int, str]:
        with self._lock:
            return dict(self._layer_precision)

    # ------------------------------------------------------------------ the live view's panels
    def panels(self) -> tuple[st.Requests, st.Moe, st.Devices]:
        """Requests, MoE and devices panels of the live-state snapshot."""
        now = self.clock()
        window_s = self.window_ns / 1e9
        with self._lock:
            lat = self._request_latency_ms
            requests = st.Requests(
                window_s=window_s,
                rate_per_s=self._request_rate.rate(now),
                latency_p50_ms=float_or_none(lat.quantile(0.50, now)),
                latency_p95_ms=float_or_none(lat.quantile(0.95, now)),
                latency_p99_ms=float_or_none(lat.quantile(0.99, now)),
                errors_total=self._errors_total,
                errors_per_s=self._error_rate.rate(now),
            )
            layers = []
            routing = self._routing
            if routing is not None:
                table = routing.table(now)
                for i, layer in enumerate(table.layers.tolist()):
                    tokens = table.tokens[i].astype(np.float64).tolist()
                    share_bins, per_bin = st.bin_expert_shares(tokens)
                    layers.append(
                        st.MoeLayer(
                            layer=layer,
                            num_experts=routing.num_experts,
                            experts_per_bin=per_bin,
                            expert_token_share=share_bins,
                            hot_experts=st.hottest_experts(tokens),
                            tokens_total=int(table.tokens_total[i]),
                            entropy_bits=float_or_none(float(table.router_entropy_bits[i])),
                            gini=float_or_none(float(table.gini[i])),
                            capacity_drops=int(table.dropped_total[i]),
                            precision=self._layer_precision.get(layer),
                        )
                    )
            moe = st.Moe(window_s=window_s, layers=layers)
            devices = st.Devices()
            if self._nvml is not None:
                for gpu in self._nvml.gpus:
                    devices.gpus.append(
                        st.Gpu(
                            index=gpu.index,
                            name=gpu.name if isinstance(gpu.name, str) else None,
                            memory_used_bytes=int_or_none(gpu.memory_used_bytes),
                            memory_total_bytes=int_or_none(gpu.memory_total_bytes),
                            utilization_pct=float_or_none(gpu.utilization_gpu_percent),
                            nvlinks=[
                                st.NvLink(
                                    link=lk.link,
                                    tx_bytes_per_s=float_or_none(lk.tx_bytes_per_s),
                                    rx_bytes_per_s=float_or_none(lk.rx_bytes_per_s),
                                )
                                for lk in gpu.nvlinks
                            ],
                        )
                    )
            memory = self._memory
            if memory is not None:
                devices = st.Devices(
                    gpus=devices.gpus,
                    host_budget=st.HostBudget(
                        source=f"{memory.source}: {memory.scope}",
                        used_bytes=memory.used_bytes,
                        total_bytes=memory.total_bytes,
                    ),
                )
            runtime = self._runtime
        if runtime is not None:
            moe, devices = with_runtime_state(moe, devices, runtime)
        return requests, moe, devices


def with_runtime_state(moe: st.Moe, devices: st.Devices, runtime: RuntimeState) -> tuple[st.Moe, st.Devices]:
    """Precision and residency per layer, and the runtime's device pool, from its control-socket stats."""
    layers = []
    for layer in moe.layers:
        base, precisions = expert_precisions(runtime, layer.layer)
        tiers = [runtime.tier.get((layer.layer, e)) for e in range(runtime.experts)]
        layers.append(
            replace(
                layer,
                precision=precision_text(base, precisions),
                expert_precision={str(e): p for e, p in enumerate(precisions) if p != base},
                resident_device=sum(1 for t in tiers if t == "device"),
                resident_host=sum(1 for t in tiers if t == "host"),
            )
        )
    if not devices.gpus:
        pools = [(name, m) for name, m in runtime.memory.items() if m.get("budget_bytes")]
        if pools:
            name, pool = max(pools, key=lambda kv: kv[1].get("used_ratio", 0.0))
            devices = replace(
                devices,
                host_budget=st.HostBudget(
                    source=f"runtime pool {name} (policy signal)",
                    used_bytes=int(pool.get("used_bytes", 0)),
                    total_bytes=int(pool.get("budget_bytes", 0)),
                ),
            )
    return replace(moe, layers=layers), devices
