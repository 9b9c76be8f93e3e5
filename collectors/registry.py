"""Collector registry and supervisor, node_exporter style.

Each periodic collector module registers a factory at import (`register(...)`). A `Supervisor`
builds the enabled collectors from one `CollectorConfig` (a factory that raises SourceUnavailable
is left out with one log line), runs each on its own thread at its own period, times every
collection, records its duration and success, and hands each sample to a sink. One collector that
fails, or hangs inside a driver call, never stops the others. The agent's daemon drives it; the
exporter turns `stats()` into per-collector self-metrics.

`python -m moescope.collectors.registry --pid N` runs every registered collector for a few seconds and
prints samples, the memory signal and the collectors' stats.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from moescope.errors import SourceUnavailable, UsageError

if TYPE_CHECKING:
    from moescope.collectors.host import MemorySignal

log = logging.getLogger("moescope.collectors")

# Modules whose import registers the built-in collectors.
BUILTIN_MODULES = ("moescope.collectors.nvml", "moescope.collectors.host")


@runtime_checkable
class Collector(Protocol):
    name: str
    period_s: float

    def collect(self) -> object: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    """Everything a factory may need; each factory takes what it uses."""

    target_pid: int | None = None
    period_s: float = 0.2
    budget_bytes: int | None = None
    nvml_library: str | None = None
    proc_root: Path = Path("/proc")
    rootfs: Path = Path("/")


Factory = Callable[[CollectorConfig], Collector]


@dataclass(frozen=True, slots=True)
class CollectorSpec:
    name: str
    factory: Factory
    default_enabled: bool
    # Lower first when choosing whose memory signal the policy reads (nvml before host).
    memory_signal_priority: int


_REGISTRY: dict[str, CollectorSpec] = {}


def register(name: str, factory: Factory, *, default_enabled: bool = True, memory_signal_priority: int = 100) -> None:
    """Called once by each collector module at import."""
    if name in _REGISTRY and _REGISTRY[name].factory is not factory:
        raise ValueError(f"collector {name!r} registered twice")
    _REGISTRY[name] = CollectorSpec(name, factory, default_enabled, memory_signal_priority)


def registered() -> dict[str, CollectorSpec]:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return dict(_REGISTRY)


@dataclass(slots=True)
class CollectorStats:
    """Self-metrics of one collector (exported as moescope_collector_* by the exporter)."""

    name: str
    period_s: float
    collections_total: int = 0
    failures_total: int = 0
    overruns_total: int = 0  # periods skipped because a collection ran past its next due time
    sink_errors_total: int = 0
    last_duration_ns: int = 0
    duration_ns_total: int = 0
    last_success: bool = False
    last_error: str | None = None
    last_success_monotonic_ns: int | None = None
    in_progress_since_monotonic_ns: int | None = None  # set while a collection is running

    def stalled(self, now_monotonic_ns: int, *, periods: float = 10.0) -> bool:
        """True while one collection has been running for more than `periods` periods."""
        started = self.in_progress_since_monotonic_ns
        return started is not None and now_monotonic_ns - started > periods * self.period_s * 1e9


Sink = Callable[[str, object], None]


class Supervisor:
    def __init__(
        self,
        collectors: Iterable[Collector],
        *,
        sink: Sink | None = None,
        priorities: dict[str, int] | None = None,
    ) -> None:
        self._collectors = {c.name: c for c in collectors}
        self._sink = sink
        self._priorities = dict(priorities or {})
        self._lock = threading.Lock()
        self._stats = {name: CollectorStats(name, c.period_s) for name, c in self._collectors.items()}
        self._latest: dict[str, object] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error_logged: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}  # collectors left out at build, with the reason

    @classmethod
    def from_registry(
        cls, config: CollectorConfig, *, enabled: Collection[str] | None = None, sink: Sink | None = None
    ) -> Supervisor:
        specs = registered()
        if enabled is not None:
            unknown = sorted(set(enabled) - set(specs))
            if unknown:
                raise UsageError(f"unknown collector(s): {', '.join(unknown)} (known: {', '.join(sorted(specs))})")
        collectors: list[Collector] = []
        unavailable: dict[str, str] = {}
        for spec in sorted(specs.values(), key=lambda s: s.memory_signal_priority):
            wanted = spec.name in enabled if enabled is not None else spec.default_enabled
            if not wanted:
                continue
            try:
                collectors.append(spec.factory(config))
            except SourceUnavailable as exc:
                unavailable[spec.name] = str(exc)
                log.info("collector %s off: %s", spec.name, exc)
        sup = cls(collectors, sink=sink, priorities={s.name: s.memory_signal_priority for s in specs.values()})
        sup.unavailable = unavailable
        return sup

    def set_sink(self, sink: Sink | None) -> None:
        """Where samples go; set before start()."""
        self._sink = sink

    @property
    def names(self) -> list[str]:
        return list(self._collectors)

    def collect_once(self, name: str) -> object | None:
        """Run one collection of `name` now, timed and recorded; None when it failed."""
        collector = self._collectors[name]
        stats = self._stats[name]
        start = time.monotonic_ns()
        with self._lock:
            stats.in_progress_since_monotonic_ns = start
        sample: object | None = None
        error: str | None = None
        try:
            sample = collector.collect()
        except Exception as exc:  # one collector's bug or driver failure must not stop the others
            error = f"{type(exc).__name__}: {exc}"
        end = time.monotonic_ns()
        with self._lock:
            stats.in_progress_since_monotonic_ns = None
            stats.collections_total += 1
            stats.last_duration_ns = end - start
            stats.duration_ns_total += end - start
            stats.last_success = error is None
            stats.last_error = error
            if error is None:
                stats.last_success_monotonic_ns = end
                self._latest[name] = sample
            else:
                stats.failures_total += 1
        if error is not None:
            if self._error_logged.get(name) != error:
                # Log each distinct error once; the failure counter tells how often it repeats.
                self._error_logged[name] = error
                log.warning("collector %s failed: %s", name, error)
            return None
        self._error_logged.pop(name, None)
        if self._sink is not None:
            try:
                self._sink(name, sample)
            except Exception as exc:  # a sink error is counted, never kills the collector loop
                with self._lock:
                    stats.sink_errors_total += 1
                log.debug("sink failed for %s: %s", name, exc)
        return sample

    def _loop(self, name: str) -> None:
        period_ns = int(self._collectors[name].period_s * 1e9)
        next_due = time.monotonic_ns()
        while not self._stop.is_set():
            self.collect_once(name)
            next_due += period_ns
            now = time.monotonic_ns()
            if now > next_due:
                missed = (now - next_due) // period_ns + 1
                with self._lock:
                    self._stats[name].overruns_total += int(missed)
                next_due += missed * period_ns
            self._stop.wait((next_due - now) / 1e9)

    def start(self) -> None:
        if self._threads:
            return
        self._stop.clear()
        for name in self._collectors:
            thread = threading.Thread(target=self._loop, args=(name,), name=f"collector-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, *, timeout_s: float = 2.0) -> list[str]:
        """Stop every loop and close every collector within one shared deadline.

        Returns the names of collectors whose thread did not finish in time (stuck in a call).
        """
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        stuck: list[str] = []
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                stuck.append(thread.name.removeprefix("collector-"))
        self._threads = []
        for name, collector in self._collectors.items():
            if name in stuck:
                continue  # closing under a running collect() could crash inside the driver
            try:
                collector.close()
            except Exception as exc:  # close errors are reported, the others still close
                log.warning("collector %s close failed: %s", name, exc)
        return stuck

    def stats(self) -> list[CollectorStats]:
        with self._lock:
            return [replace(s) for s in self._stats.values()]

    def latest(self, name: str) -> object | None:
        with self._lock:
            return self._latest.get(name)

    def memory_signal(self) -> MemorySignal | None:
        """The signal of the highest-priority collector that has one (nvml before host)."""
        from moescope.collectors.host import MemorySignal  # moescope.collectors.host registers itself through this module
        with self._lock:
            # A collector whose last collection failed has no current signal (its sample is stale).
            fresh = {n: s for n, s in self._latest.items() if self._stats[n].last_success}
            items = sorted(fresh.items(), key=lambda kv: self._priorities.get(kv[0], 100))
        for _, sample in items:
            getter = getattr(sample, "memory_signal", None)
            signal = getter() if callable(getter) else None
            if isinstance(signal, MemorySignal):
                return signal
        return None


@dataclass(frozen=True, slots=True)
class TelemetryRecord:
    """One collector's sample, as the daemon's sinks receive it."""

    collector: str
    sample: object


class SupervisorSource:
    """Adapter to moescope.agent.daemon's Source protocol: the supervisor's threads queue samples (bounded,
    drops counted), the daemon's poll() hands them to its sinks on the daemon thread."""

    name = "telemetry"

    def __init__(self, supervisor: Supervisor, *, emit: Callable[[object], None], max_pending: int = 1024) -> None:
        self.supervisor = supervisor
        self._emit = emit
        self._pending: deque[TelemetryRecord] = deque()
        self._max_pending = max_pending
        self._pending_lock = threading.Lock()
        self.dropped_samples = 0
        self.emitted = 0
        supervisor.set_sink(self._enqueue)
        supervisor.start()

    def _enqueue(self, name: str, sample: object) -> None:
        with self._pending_lock:
            if len(self._pending) >= self._max_pending:
                self.dropped_samples += 1  # the daemon is not polling: keep the newest, count the loss
                self._pending.popleft()
            self._pending.append(TelemetryRecord(name, sample))

    def poll(self, now_ns: int) -> int:
        with self._pending_lock:
            batch = list(self._pending)
            self._pending.clear()
        for record in batch:
            self._emit(record)
        self.emitted += len(batch)
        return len(batch)

    def stats(self) -> dict[str, int]:
        out = {"samples_emitted": self.emitted, "samples_dropped_queue_full": self.dropped_samples}
        for s in self.supervisor.stats():
            out[f"{s.name}_collections"] = s.collections_total
            out[f"{s.name}_failures"] = s.failures_total
            out[f"{s.name}_overruns"] = s.overruns_total
        return out

    def close(self) -> None:
        self.supervisor.stop()
        self.poll(0)  # flush what was collected before the stop


# ---------------------------------------------------------------- command line


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # N/A and paths print as text


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moescope.collectors.registry",
        description="Run every registered collector for a while; print samples, the memory signal and stats.",
    )
    parser.add_argument("--pid", type=int, required=True, help="target process")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--period-ms", type=int, default=200)
    parser.add_argument("--budget-bytes", type=int, default=None, help="memory budget for the host signal")
    parser.add_argument("--nvml-library", default=None, help="path to libnvidia-ml.so.1 (default: the loader's)")
    parser.add_argument("--collectors", default=None, help="comma-separated subset (default: all enabled)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="collectors: %(levelname)s: %(message)s")
    if args.period_ms <= 0 or args.seconds <= 0:
        print("collectors: error: --period-ms and --seconds must be positive", file=sys.stderr)
        return UsageError.exit_code
    config = CollectorConfig(
        target_pid=args.pid,
        period_s=args.period_ms / 1000,
        budget_bytes=args.budget_bytes,
        nvml_library=args.nvml_library,
    )

    def emit(name: str, sample: object) -> None:
        if args.json:
            print(json.dumps({"collector": name, "sample": _jsonable(sample)}), flush=True)
        else:
            print(f"{name}: {sample}", flush=True)

    try:
        enabled = args.collectors.split(",") if args.collectors else None
        supervisor = Supervisor.from_registry(config, enabled=enabled, sink=emit)
    except (UsageError, ValueError) as exc:
        print(f"collectors: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    supervisor.start()
    try:
        time.sleep(args.seconds)
    finally:
        stuck = supervisor.stop()
    signal = supervisor.memory_signal()
    stats = supervisor.stats()
    if args.json:
        print(json.dumps({"memory_signal": _jsonable(signal), "stats": _jsonable(stats),
                          "unavailable": supervisor.unavailable, "stuck": stuck}), flush=True)
    else:
        print(f"memory signal: {signal}")
        for s in stats:
            print(f"collector {s.name}: {s.collections_total} collections, {s.failures_total} failed, "
                  f"last {s.last_duration_ns / 1e6:.2f} ms, last error {s.last_error}")
    return 0 if signal is not None and not stuck else 1


if __name__ == "__main__":
    # Run main() from the importable module, whose registry the collector modules register into.
    from moescope.collectors.registry import main as _main

    sys.exit(_main())
