"""collectors/registry.py: registration, timing and success records, isolation of failing/hung collectors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pynvml
import pytest

from moescope.errors import UsageError
from moescope.collectors.host import HostSample, MemorySignal
from moescope.collectors.registry import CollectorConfig, Supervisor, SupervisorSource, TelemetryRecord, registered

from telemetry_helpers import Child, FakeNvml

WAIT_S = 30.0  # generous: only bounds waiting, never asserted as a duration


class Counting:
    """A healthy collector: returns its call number."""

    def __init__(self, name: str, period_s: float = 0.01) -> None:
        self.name, self.period_s, self.calls, self.closed = name, period_s, 0, False

    def collect(self) -> int:
        self.calls += 1
        return self.calls

    def close(self) -> None:
        self.closed = True


class Failing(Counting):
    def collect(self) -> int:
        self.calls += 1
        raise RuntimeError("driver said no")


class Hanging(Counting):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = threading.Event()
        self.entered = threading.Event()

    def collect(self) -> int:
        self.entered.set()
        self.release.wait(WAIT_S)
        return 0


class WithSignal(Counting):
    def __init__(self, name: str, signal: MemorySignal | None) -> None:
        super().__init__(name)
        self.signal = signal

    def collect(self) -> object:
        signal = self.signal

        class Sample:
            def memory_signal(self) -> MemorySignal | None:
                return signal

        return Sample()


def _wait_until(predicate: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_builtin_collectors_register_themselves() -> None:
    specs = registered()
    assert {"nvml", "host"} <= set(specs)
    assert specs["nvml"].memory_signal_priority < specs["host"].memory_signal_priority


def test_collect_once_records_duration_success_and_failure() -> None:
    sup = Supervisor([Counting("ok"), Failing("bad")])
    assert sup.collect_once("ok") == 1
    assert sup.collect_once("bad") is None
    stats = {s.name: s for s in sup.stats()}
    assert stats["ok"].collections_total == 1 and stats["ok"].last_success and stats["ok"].last_duration_ns > 0
    assert stats["ok"].last_success_monotonic_ns is not None
    assert stats["bad"].failures_total == 1 and not stats["bad"].last_success
    assert stats["bad"].last_error == "RuntimeError: driver said no"
    assert sup.latest("ok") == 1 and sup.latest("bad") is None


def test_failing_and_hung_collectors_do_not_stop_the_others() -> None:
    ok, bad, hung = Counting("ok"), Failing("bad"), Hanging("hung")
    received: list[tuple[str, object]] = []
    sup = Supervisor([ok, bad, hung], sink=lambda name, sample: received.append((name, sample)))
    sup.start()
    try:
        _wait_until(lambda: hung.entered.is_set() and ok.calls >= 20 and bad.calls >= 20, "20 collections each")
        stats = {s.name: s for s in sup.stats()}
        assert stats["bad"].failures_total == stats["bad"].collections_total >= 20
        assert stats["ok"].failures_total == 0 and stats["ok"].collections_total >= 20
        assert stats["hung"].collections_total == 0 and stats["hung"].in_progress_since_monotonic_ns is not None
        assert stats["hung"].stalled(time.monotonic_ns() + 10**10)  # 10 s on: > 10 periods of 10 ms
        assert {name for name, _ in received} == {"ok"}
    finally:
        stuck = sup.stop(timeout_s=0.2)
        hung.release.set()
    assert stuck == ["hung"]
    assert ok.closed and bad.closed and not hung.closed  # never closed under a running collect()


def test_sink_errors_are_counted_not_fatal() -> None:
    def sink(name: str, sample: object) -> None:
        raise ValueError("exporter down")

    ok = Counting("ok")
    sup = Supervisor([ok], sink=sink)
    for _ in range(3):
        assert sup.collect_once("ok") is not None
    (stats,) = sup.stats()
    assert stats.sink_errors_total == 3 and stats.failures_total == 0


def test_memory_signal_prefers_the_higher_priority_source() -> None:
    gpu = MemorySignal(9, 10, "nvml", "GPU 0")
    host = MemorySignal(1, 10, "rss", "host RAM")
    sup = Supervisor([WithSignal("host", host), WithSignal("nvml", None)], priorities={"nvml": 0, "host": 10})
    sup.collect_once("host")
    sup.collect_once("nvml")
    assert sup.memory_signal() == host  # the GPU collector has no signal (e.g. all GPUs lost)
    nvml = WithSignal("nvml", gpu)
    sup = Supervisor([WithSignal("host", host), nvml], priorities={"nvml": 0, "host": 10})
    sup.collect_once("host")
    sup.collect_once("nvml")
    assert sup.memory_signal() == gpu
    # The GPU collector starts failing (driver gone): its last sample is stale, the host signal rules.
    nvml.collect = Failing("x").collect  # type: ignore[method-assign]
    assert sup.collect_once("nvml") is None
    assert sup.memory_signal() == host


def test_from_registry_with_fake_gpus_and_without_driver(fake_nvml: FakeNvml, child: Child) -> None:
    fake_nvml.reset(1)
    fake_nvml.set_memory(0, total=100, reserved=0, used=97)
    sup = Supervisor.from_registry(CollectorConfig(target_pid=child.pid))
    try:
        assert sup.names == ["nvml", "host"] and sup.unavailable == {}
        for name in sup.names:
            sup.collect_once(name)
        signal = sup.memory_signal()
        assert signal is not None and signal.source == "nvml" and signal.ratio == 0.97
    finally:
        sup.stop()
    fake_nvml.set_init_result(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    sup = Supervisor.from_registry(CollectorConfig(target_pid=child.pid, budget_bytes=1 << 40))
    try:
        assert sup.names == ["host"] and "nvml" in sup.unavailable
        sample = sup.collect_once("host")
        assert isinstance(sample, HostSample)
        signal = sup.memory_signal()
        assert signal is not None and signal.source == "budget" and signal.total_bytes == 1 << 40
    finally:
        sup.stop()


def test_unknown_collector_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown collector"):
        Supervisor.from_registry(CollectorConfig(target_pid=1), enabled=["nvml", "gpu"])


def test_host_collector_needs_a_pid() -> None:
    sup = Supervisor.from_registry(CollectorConfig(target_pid=None, proc_root=Path("/proc")), enabled=["host"])
    assert sup.names == [] and sup.unavailable == {"host": "host memory needs a target pid"}


def test_daemon_source_adapter_delivers_in_order_and_counts_drops() -> None:
    ok = Counting("ok")
    sup = Supervisor([ok])
    received: list[object] = []
    source = SupervisorSource(sup, emit=received.append, max_pending=5)
    try:
        _wait_until(lambda: ok.calls >= 12, "12 collections")
    finally:
        source.close()  # stops the supervisor, then flushes
    assert ok.closed
    records = [r for r in received if isinstance(r, TelemetryRecord)]
    assert len(records) == 5 and all(r.collector == "ok" for r in records)
    values = [r.sample for r in records]
    assert values == list(range(ok.calls - 4, ok.calls + 1)), "the newest samples are kept, in order"
    stats = source.stats()
    assert stats["samples_dropped_queue_full"] == ok.calls - 5 and stats["samples_emitted"] == 5
    assert stats["ok_collections"] == ok.calls and stats["ok_failures"] == 0
