"""collectors/registry.py: registration, the sampled-source adapter (timing, success, isolation of
failing and hung collectors, one stop deadline), memory-signal priority, and the generated flags."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest
from telemetry_helpers import Child, FakeNvml

from moescope.agent import start
from moescope.agent.daemon import Daemon
from moescope.collectors.host import HostSample, MemorySignal
from moescope.collectors.registry import (
    CollectorConfig,
    SampledSource,
    SourceHealth,
    StopGroup,
    TelemetryRecord,
    add_collector_alias,
    build_sampled_sources,
    check_names,
    enabled_collectors,
    flag_dest,
    memory_signal,
    registered,
    stop_all,
)
from moescope.errors import UsageError

WAIT_S = 30.0  # generous: only bounds waiting, never asserted as a duration
# stop_all's shared deadline: the healthy sources must be out before it even on a loaded 2-core
# machine; the hung one holds stop_all until it, so each run spends this much
STOP_DEADLINE_S = 2.0


class Counting:
    """A healthy collector: returns its call number."""

    def __init__(self, name: str, period_s: float = 0.01) -> None:
        self.name, self.period_s, self.calls, self.closed = name, period_s, 0, False

    def collect(self) -> object:
        self.calls += 1
        return self.calls

    def close(self) -> None:
        self.closed = True


class Failing(Counting):
    def collect(self) -> object:
        self.calls += 1
        raise RuntimeError("driver said no")


class Hanging(Counting):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = threading.Event()
        self.entered = threading.Event()

    def collect(self) -> object:
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


def _wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _thread_alive(name: str) -> bool:
    return any(t.name == f"collector-{name}" for t in threading.enumerate())


def test_builtin_sources_register_themselves() -> None:
    specs = registered()
    assert {name: spec.kind for name, spec in specs.items()} == {
        "nvml": "sampled", "host": "sampled", "ingress": "stream", "nvtx": "stream", "netsig": "stream",
    }
    assert specs["nvml"].memory_signal_priority < specs["host"].memory_signal_priority
    assert all(spec.help for spec in specs.values())
    # every source can be turned off: ingress too (--no-collector.ingress, where eBPF cannot be compiled)
    assert not any(spec.always_on for spec in specs.values()) and specs["ingress"].default_enabled


def test_collect_once_records_duration_success_and_failure() -> None:
    ok = SampledSource(Counting("ok"), emit=lambda _r: None)
    bad = SampledSource(Failing("bad"), emit=lambda _r: None)
    assert ok.health() == SourceHealth() and bad.health() == SourceHealth()  # not run yet
    assert ok.collect_once() == 1
    assert bad.collect_once() is None
    stats_ok, stats_bad = ok.collector_stats(), bad.collector_stats()
    assert stats_ok.collections_total == 1 and stats_ok.last_success and stats_ok.last_duration_ns > 0
    assert stats_ok.last_success_monotonic_ns is not None
    assert stats_bad.failures_total == 1 and not stats_bad.last_success
    assert stats_bad.last_error == "RuntimeError: driver said no"
    assert ok.latest() == 1 and bad.latest() is None
    assert ok.health() == SourceHealth(stats_ok.last_duration_ns, True, None)
    assert bad.health() == SourceHealth(stats_bad.last_duration_ns, False, "RuntimeError: driver said no")
    assert ok.stats()["collections"] == 1 and bad.stats()["failures"] == 1


def test_failing_and_hung_collectors_do_not_stop_the_others() -> None:
    ok, bad, hung = Counting("ok"), Failing("bad"), Hanging("hung")
    received: list[object] = []
    group = StopGroup()
    sources = [SampledSource(c, emit=received.append, stop_group=group) for c in (ok, bad, hung)]

    def poll_all() -> bool:  # as the daemon does; the first poll starts each thread
        for source in sources:
            source.poll(time.monotonic_ns())
        return hung.entered.is_set() and ok.calls >= 20 and bad.calls >= 20

    try:
        _wait_until(poll_all, "20 collections each")
        s_ok, s_bad, s_hung = (s.collector_stats() for s in sources)
        assert s_bad.failures_total == s_bad.collections_total >= 20
        assert s_ok.failures_total == 0 and s_ok.collections_total >= 20
        assert s_hung.collections_total == 0 and s_hung.in_progress_since_monotonic_ns is not None
        assert {r.collector for r in received if isinstance(r, TelemetryRecord)} == {"ok"}
        # 10 s on, the hung collection (10 ms period) is stalled: it reports failure, running that long
        later_ns = time.monotonic_ns() + 10**10
        health = sources[2].health(now_monotonic_ns=later_ns)
        assert health.last_success is False and health.last_duration_ns is not None
        assert health.last_duration_ns >= 10**10 and "running for" in (health.last_error or "")
        assert sources[0].health().last_success is True and sources[1].health().last_success is False
    finally:
        stuck = stop_all(sources, timeout_s=STOP_DEADLINE_S)
        hung.release.set()
    assert stuck == ["hung"]
    assert ok.closed and bad.closed and not hung.closed  # never closed under a running collect()


def test_closing_one_member_stops_its_whole_group() -> None:
    """The daemon closes sources one by one: the first close tells every member of the group to
    stop and fixes the one deadline the others then share."""
    hung, ok = Hanging("hung"), Counting("ok2")
    group = StopGroup(timeout_s=0.2)
    first = SampledSource(hung, emit=lambda _r: None, stop_group=group)
    second = SampledSource(ok, emit=lambda _r: None, stop_group=group)
    first.start()
    second.start()
    try:
        _wait_until(lambda: hung.entered.is_set() and ok.calls >= 3, "both running")
        first.close()
        assert first.stuck and not hung.closed
        _wait_until(lambda: not _thread_alive("ok2"), "the other member's thread to stop by itself")
        second.close()
        assert not second.stuck and ok.closed
    finally:
        hung.release.set()


def test_emit_errors_are_counted_not_fatal() -> None:
    def emit(record: object) -> None:
        raise ValueError("exporter down")

    source = SampledSource(Counting("ok"), emit=emit)
    try:
        for _ in range(3):
            assert source.collect_once() is not None
        assert source.poll(0) == 3  # the first poll hands over what was queued before it started the thread
        stats = source.stats()
        assert stats["emit_errors"] == 3 and stats["failures"] == 0 and stats["samples_emitted"] == 3
    finally:
        source.close()


def test_memory_signal_prefers_the_higher_priority_source() -> None:
    gpu = MemorySignal(9, 10, "nvml", "GPU 0")
    host = MemorySignal(1, 10, "rss", "host RAM")

    def sampled(collector: Counting, priority: int) -> SampledSource:
        return SampledSource(collector, emit=lambda _r: None, memory_signal_priority=priority)

    sources = [sampled(WithSignal("host", host), 10), sampled(WithSignal("nvml", None), 0)]
    for source in sources:
        source.collect_once()
    assert memory_signal(sources) == host  # the GPU collector has no signal (e.g. all GPUs lost)
    nvml = WithSignal("nvml", gpu)
    sources = [sampled(WithSignal("host", host), 10), sampled(nvml, 0)]
    for source in sources:
        source.collect_once()
    assert memory_signal(sources) == gpu
    # The GPU collector starts failing (driver gone): its last sample is stale, the host signal rules.
    nvml.collect = Failing("x").collect  # type: ignore[method-assign]  # the same collector starts failing
    assert sources[1].collect_once() is None
    assert memory_signal(sources) == host


def test_build_with_fake_gpus_and_without_driver(fake_nvml: FakeNvml, child: Child) -> None:
    fake_nvml.reset(1)
    fake_nvml.set_memory(0, total=100, reserved=0, used=97)
    built = build_sampled_sources(CollectorConfig(target_pid=child.pid), emit=lambda _r: None)
    try:
        assert built.names == ["nvml", "host"] and built.unavailable == {}
        for source in built.sources:
            source.collect_once()
        signal = memory_signal(built.sources)
        assert signal is not None and signal.source == "nvml" and signal.ratio == 0.97
    finally:
        assert built.close() == []
    fake_nvml.set_init_result(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    built = build_sampled_sources(CollectorConfig(target_pid=child.pid, budget_bytes=1 << 40), emit=lambda _r: None)
    try:
        assert built.names == ["host"] and "nvml" in built.unavailable
        sample = built.sources[0].collect_once()
        assert isinstance(sample, HostSample)
        signal = memory_signal(built.sources)
        assert signal is not None and signal.source == "budget" and signal.total_bytes == 1 << 40
    finally:
        built.close()


def test_unknown_collector_names_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"^unknown collector\(s\): gpu \(known: host, ingress, netsig, nvml, nvtx\)$"):
        build_sampled_sources(CollectorConfig(target_pid=1), emit=lambda _r: None, enabled=["nvml", "gpu"])
    with pytest.raises(UsageError, match="unknown collector"):
        check_names(["nvtx", "gpus"])
    with pytest.raises(UsageError, match="unknown collector"):
        add_collector_alias(argparse.ArgumentParser(), "--no-gpu", names=("gpu",), enabled=False, help="x")
    result = subprocess.run(
        [sys.executable, "-m", "moescope.collectors.registry", "--pid", "1", "--collectors", "nvml,gpu"],
        capture_output=True, text=True, timeout=WAIT_S,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "collectors: error: unknown collector(s): gpu (known: host, ingress, netsig, nvml, nvtx)"
    ]


def test_host_collector_needs_a_pid() -> None:
    built = build_sampled_sources(CollectorConfig(target_pid=None, proc_root=Path("/proc")), emit=lambda _r: None,
                                  enabled=["host"])
    assert built.names == [] and built.unavailable == {"host": "host memory needs a target pid"}


def test_queue_delivers_in_order_and_counts_drops() -> None:
    ok = Counting("ok")
    received: list[object] = []
    source = SampledSource(ok, emit=received.append, max_pending=5)
    source.start()
    try:
        _wait_until(lambda: ok.calls >= 12, "12 collections")
    finally:
        source.close()  # stops the thread, then flushes
    assert ok.closed
    records = [r for r in received if isinstance(r, TelemetryRecord)]
    assert len(records) == 5 and all(r.collector == "ok" for r in records)
    values = [r.sample for r in records]
    assert values == list(range(ok.calls - 4, ok.calls + 1)), "the newest samples are kept, in order"
    stats = source.stats()
    assert stats["samples_dropped_queue_full"] == ok.calls - 5 and stats["samples_emitted"] == 5
    assert stats["collections"] == ok.calls and stats["failures"] == 0


def test_a_sampled_source_runs_in_the_daemon() -> None:
    ok = Counting("ok")
    daemon = Daemon()
    received: list[object] = []
    daemon.add_sink(received.append)
    source = SampledSource(ok, emit=daemon.emit)
    daemon.add_source(source)
    try:
        _wait_until(lambda: daemon.tick() is None and len(received) >= 3, "three records through the daemon")
    finally:
        daemon.close()
    assert ok.closed and not _thread_alive("ok")
    assert [r.sample for r in received if isinstance(r, TelemetryRecord)] == list(range(1, len(received) + 1))
    assert daemon.stats()["ok"]["samples_emitted"] == len(received)


def test_registry_command_prints_samples_and_stats(child: Child) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moescope.collectors.registry", "--pid", str(child.pid), "--seconds", "0.5",
         "--collectors", "host", "--json", "--budget-bytes", str(1 << 40)],
        capture_output=True, text=True, timeout=WAIT_S,
    )
    assert result.returncode == 0, result.stderr
    *samples, summary_line = [json.loads(line) for line in result.stdout.splitlines()]
    assert samples and all(s["collector"] == "host" and s["sample"]["pid"] == child.pid for s in samples)
    assert set(summary_line) == {"memory_signal", "stats", "unavailable", "stuck"}
    assert summary_line["memory_signal"]["source"] == "budget" and summary_line["stuck"] == []
    (stats,) = summary_line["stats"]
    assert stats["name"] == "host" and stats["collections_total"] >= len(samples) and stats["failures_total"] == 0


# ---------------------------------------------------------------- flags


def _start_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent start")
    start.add_arguments(parser)
    return parser


def _enabled(*argv: str) -> set[str]:
    return enabled_collectors(_start_parser().parse_args(list(argv)))


def test_flags_are_generated_for_every_registered_source() -> None:
    parser = _start_parser()
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    help_text = " ".join(parser.format_help().split())
    specs = registered()
    for spec in specs.values():
        if spec.always_on:
            assert f"--collector.{spec.name}" not in options and f"--no-collector.{spec.name}" not in options
            continue
        on, off = options[f"--collector.{spec.name}"], options[f"--no-collector.{spec.name}"]
        assert on is off and on.dest == flag_dest(spec.name) == f"collector_{spec.name}"
        assert " ".join(spec.help.split()) in help_text
        assert spec.name not in _enabled(f"--no-collector.{spec.name}")
        assert spec.name in _enabled(f"--no-collector.{spec.name}", f"--collector.{spec.name}")  # the last wins
    assert "Always on" not in help_text and "--no-collector.ingress" in options
    assert _enabled() == {name for name, spec in specs.items() if spec.default_enabled or spec.always_on}


def test_no_nvtx_and_no_telemetry_are_aliases_with_one_meaning() -> None:
    parser = _start_parser()
    assert _enabled("--no-nvtx") == _enabled("--no-collector.nvtx") == {"ingress", "host", "nvml", "netsig"}
    assert _enabled("--no-telemetry") == _enabled("--no-collector.nvml", "--no-collector.host") == {
        "ingress", "nvtx", "netsig"}
    assert _enabled("--no-telemetry", "--collector.host") == {"ingress", "nvtx", "host", "netsig"}
    assert start.child_env(parser.parse_args(["--no-collector.nvtx"])) == {}
    assert start.child_env(parser.parse_args([])) != {}


def test_a_new_period_reaches_the_running_loop_and_a_bad_one_is_refused() -> None:
    ok = Counting("ok", period_s=0.01)
    source = SampledSource(ok, emit=lambda _r: None)
    with pytest.raises(ValueError, match="positive"):
        source.set_period(0.0)
    source.start()
    try:
        _wait_until(lambda: ok.calls >= 3, "three collections at 10 ms")
        source.set_period(600.0)
        # the wait already under way was computed with 10 ms: at most two more collections, then none
        _wait_until(lambda: source.stats()["collections"] == ok.calls, "the stats caught up")
        time.sleep(0.05)
        settled = ok.calls
        time.sleep(0.5)  # 50 periods of the old pace
        assert ok.calls == settled and source.period_s == 600.0
    finally:
        stop_all([source], timeout_s=STOP_DEADLINE_S)
