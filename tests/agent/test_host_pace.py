"""agent/observe.py: the host-memory sampler keeps the policy's 200 ms period only while it is the
policy's memory signal; where the runtime's device-pool accounting (or NVML) is, it feeds the live
view and /metrics alone and samples once a second while a live view reads, every 5 s while nobody
does, and it is back at 200 ms at the next evaluation that needs it."""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import replace
from typing import Any

from moescope.agent.daemon import Daemon
from moescope.agent.metrics import Metrics
from moescope.agent.observe import HOST_IDLE_PERIOD_S, HOST_VIEW_PERIOD_S, Observers
from moescope.agent.pipeline import Pipeline
from moescope.agent.policy.audit import AuditLog
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.engine import PolicyEngine
from moescope.collectors.host import HostCollector, HostSample, MemorySignal
from moescope.collectors.registry import DEFAULT_PERIOD_S, SampledSource, SampledSources, TelemetryRecord

CGROUP = MemorySignal(used_bytes=3 << 30, total_bytes=8 << 30, source="cgroup", scope="cgroup v2 /moe.slice")


def host_sample(signal: MemorySignal = CGROUP) -> HostSample:
    return HostSample(at_ns=time.time_ns(), pid=os.getpid(), alive=True, rss_bytes=1 << 30, cgroup=None,
                      cgroup_error="not read in this test", host_total_bytes=16 << 30, signal=signal)


class RuntimeView:
    """What RuntimeStatsSignals.read_values hands the agent: the runtime's own device-pool ratio (or NaN)."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.with_routing = False

    def clock(self) -> float:
        return time.monotonic()

    def read_values(self, now_s: float) -> dict[str, Any]:
        return {"device_memory_used_ratio": self.ratio}


def _observers(*, no_policy: bool = False, watched: bool = True) -> tuple[Observers, SampledSource]:
    metrics = Metrics()
    obs = Observers(args=argparse.Namespace(no_policy=no_policy, interval=1.0), daemon=Daemon(),
                    pipeline=Pipeline(spans=None, metrics=metrics),
                    tracing=None, metrics=metrics, metrics_server=None)  # type: ignore[arg-type]
    obs.live_view = watched  # (as --tui sets it; `agent top` reading the state file is the other way)
    host = SampledSource(HostCollector(os.getpid()), emit=lambda _r: None)
    obs.telemetry = SampledSources((host,))
    return obs, host


def test_the_runtime_memory_signal_slows_the_host_sampler_and_its_absence_restores_it() -> None:
    obs, host = _observers()
    obs.pipeline.sink(TelemetryRecord("host", host_sample()))  # host memory (cgroup) is what the pipeline has
    assert obs.pipeline.memory_source() == "cgroup" and host.period_s == DEFAULT_PERIOD_S
    runtime = RuntimeView(0.42)
    obs.stats_signals = runtime
    assert obs.policy_signals().device_memory_used_ratio == 0.42
    assert host.period_s == HOST_VIEW_PERIOD_S
    runtime.ratio = math.nan  # a runtime that stops reporting its pool: the host signal is the policy's again
    assert obs.policy_signals().device_memory_used_ratio == 3 / 8
    assert host.period_s == DEFAULT_PERIOD_S


def test_a_budget_keeps_the_host_sampler_at_the_policy_period() -> None:
    obs, host = _observers()
    budget = MemorySignal(used_bytes=1 << 30, total_bytes=4 << 30, source="budget", scope="pid RSS / budget")
    obs.pipeline.sink(TelemetryRecord("host", host_sample(budget)))
    obs.stats_signals = RuntimeView(0.9)
    assert obs.policy_signals().device_memory_used_ratio == 0.25  # the configured budget wins
    assert host.period_s == DEFAULT_PERIOD_S
    obs.stats_signals = None  # no control socket: the host signal is the policy's
    obs.policy_signals()
    assert host.period_s == DEFAULT_PERIOD_S


def test_the_host_sampler_follows_the_policy_s_configured_sample_period() -> None:
    obs, host = _observers()
    obs.pipeline.sink(TelemetryRecord("host", host_sample()))
    config = replace(load_policy(None), sample_period_ms=500)  # as `sample_period_ms = 500` in a policy file
    obs.policy = PolicyEngine(config, audit=AuditLog(), dry_run=True)
    obs.policy_signals()  # no control socket: the host signal is the policy's, at its period
    assert host.period_s == 0.5
    obs.stats_signals = RuntimeView(0.42)  # the runtime's pool takes over: the view's once a second
    obs.policy_signals()
    assert host.period_s == HOST_VIEW_PERIOD_S


def test_without_a_policy_the_host_sampler_feeds_the_view_once_a_second() -> None:
    obs, host = _observers(no_policy=True)
    obs._pace_host(policy_signal=False)  # what _attach_telemetry does under --no-policy
    assert host.period_s == HOST_VIEW_PERIOD_S


def test_while_nobody_watches_the_view_s_sampler_slows_to_its_idle_period() -> None:
    obs, host = _observers(watched=False)
    obs.pipeline.sink(TelemetryRecord("host", host_sample()))
    obs.stats_signals = RuntimeView(0.42)  # the runtime's pool is the policy's signal: the view's sampler
    obs.policy_signals()
    assert host.period_s == HOST_IDLE_PERIOD_S
    obs.live_view = True  # someone watches live: once a second from the next evaluation
    obs.policy_signals()
    assert host.period_s == HOST_VIEW_PERIOD_S
    obs.live_view = False
    obs.stats_signals = RuntimeView(math.nan)  # the host signal is the policy's again: its period, watched or not
    obs.policy_signals()
    assert host.period_s == DEFAULT_PERIOD_S


def test_without_a_policy_the_main_loop_s_rounds_pace_the_sampler() -> None:
    obs, host = _observers(no_policy=True, watched=False)
    obs._pace_rounds(0)
    assert host.period_s == HOST_IDLE_PERIOD_S
    obs.live_view = True
    obs._pace_rounds(0)
    assert host.period_s == HOST_VIEW_PERIOD_S
