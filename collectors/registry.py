"""Data sources and their registry, node_exporter style.

Every data source the agent runs is a `Source`: polled on the daemon thread, never blocking, it
emits typed records through the callable it was built with, counts every loss in `stats()` and
reports its last run in `health()` (the agent turns that into
`moescope_agent_collector_{duration_seconds,success}{collector}`).

Each collector module registers a `SourceSpec` at import. Two kinds:
  stream   drained in place on each poll (the ingress probe, the NVTX ring): the agent builds
           them, because only it has their inputs (the loaded eBPF object, the step parser)
  sampled  a blocking `Collector.collect()` (NVML, host memory), run by `SampledSource` on a
           thread of its own at its period: timed, failures and overruns counted, samples queued
           (bounded, drops counted) and handed to the daemon on its poll
The built-in modules are found by listing the `moescope.collectors` package (`registered()`), so a
new collector module registers itself by existing; the stream specs are registered here, which
keeps probes/ out of this module's imports. `add_collector_flags` makes `--collector.NAME` /
`--no-collector.NAME` from the registry and `enabled_collectors(args)` reads them back.

`python -m moescope.collectors.registry --pid N` runs every sampled collector for a few seconds and
prints samples, the memory signal and the collectors' stats.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import pkgutil
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from moescope.errors import SourceUnavailable, UsageError
from moescope.procfs import name_thread

if TYPE_CHECKING:
    from moescope.collectors.host import MemorySignal

log = logging.getLogger("moescope.collectors")

COLLECTORS_PACKAGE = "moescope.collectors"
SourceKind = Literal["stream", "sampled"]
Emit = Callable[[object], None]

DEFAULT_MAX_PENDING = 1024  # samples queued per sampled source between two daemon polls
DEFAULT_STOP_TIMEOUT_S = 2.0
DEFAULT_PERIOD_S = 0.2  # the policy's sample period (DESIGN: per-expert monitoring every 200 ms)
# A stream source whose buffer is this full when the quiet daemon peeks gets a round at once
# (Source.backlogged; agent/daemon.py): an eighth, as the NVTX ring's own early drain.
BACKLOG_FILL = 0.125
STALL_PERIODS = 10.0  # a collection running this many periods is reported as failing
_NAME = re.compile(r"[a-z][a-z0-9_]*")


# ---------------------------------------------------------------- the one source model


@dataclass(frozen=True, slots=True)
class SourceHealth:
    """A source's last run: how long it took and whether it worked (None: it has not run yet)."""

    last_duration_ns: int | None = None
    last_success: bool | None = None
    last_error: str | None = None


class Source(Protocol):
    """A producer of records, polled by the daemon (non-blocking)."""

    name: str

    def poll(self, now_ns: int) -> int | None:
        """Handle whatever is pending, emitting records; return how many events were handled (None
        counts as none)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters, including every drop (names say what was lost)."""
        ...

    def health(self) -> SourceHealth:
        """The last run's duration and success, for the per-collector self-metrics."""
        ...

    def close(self) -> None:
        """Flush what is pending and release kernel/OS resources."""
        ...

    # Optional: `backlogged() -> bool`, whether the source's buffer (a ring, a queue) is past
    # BACKLOG_FILL now. The daemon calls it between rounds while quiet (every 150 ms, rounds up to
    # 1 s apart) to bring the next round forward; it must be cheap and must not drain or emit.


def merge_health(healths: Iterable[SourceHealth]) -> SourceHealth:
    """One health for several sources of one name (an NVTX ring per target): the longest last
    run, and a success only when every one that ran succeeded (the first failure's error)."""
    durations: list[int] = []
    success: bool | None = None
    error: str | None = None
    for health in healths:
        if health.last_duration_ns is not None:
            durations.append(health.last_duration_ns)
        if health.last_success is False and success is not False:
            success, error = False, health.last_error
        elif health.last_success is True and success is None:
            success = True
    return SourceHealth(max(durations) if durations else None, success, error)


@runtime_checkable
class Collector(Protocol):
    """A blocking periodic collector; `SampledSource` runs it off the daemon thread."""

    name: str
    period_s: float

    def collect(self) -> object: ...

    def close(self) -> None: ...


@runtime_checkable
class HasMemorySignal(Protocol):
    """A sample that carries the memory signal the policy reads (NVML's and the host's)."""

    def memory_signal(self) -> MemorySignal | None: ...


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    """Everything a sampled collector's factory may need; each factory takes what it uses."""

    target_pid: int | None = None
    period_s: float = DEFAULT_PERIOD_S
    budget_bytes: int | None = None
    nvml_library: str | None = None
    proc_root: Path = Path("/proc")
    rootfs: Path = Path("/")


CollectorFactory = Callable[[CollectorConfig], Collector]


@dataclass(frozen=True, slots=True)
class TelemetryRecord:
    """One sampled collector's sample, as the daemon's sinks receive it."""

    collector: str
    sample: object


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One registered source: what its flags, its self-metrics and the build read."""

    name: str
    help: str
    kind: SourceKind
    default_enabled: bool = True
    # "sampled" only: builds the blocking collector; a stream source is built by the agent.
    factory: CollectorFactory | None = None
    # Lower first when choosing whose memory signal the policy reads (nvml before host).
    memory_signal_priority: int = 100
    always_on: bool = False  # the agent is built around it: listed, but no flag turns it off

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"collector name {self.name!r} must match {_NAME.pattern} (it becomes a flag)")
        if (self.kind == "sampled") != (self.factory is not None):
            raise ValueError(f"collector {self.name!r}: a sampled collector has a factory, a stream source none")


_REGISTRY: dict[str, SourceSpec] = {}
_DISCOVERY_ERRORS: dict[str, str] = {}
_discovered = False


def _add(spec: SourceSpec) -> None:
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"collector {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec


def register(
    name: str,
    factory: CollectorFactory,
    *,
    help: str = "",
    default_enabled: bool = True,
    memory_signal_priority: int = 100,
) -> None:
    """Called once by each sampled collector module at import."""
    _add(SourceSpec(name, help or f"the {name} collector", "sampled", default_enabled, factory, memory_signal_priority))


def register_stream(name: str, *, help: str, default_enabled: bool = True, always_on: bool = False) -> None:
    """A source the agent builds and drains itself; registered for its flags and self-metrics."""
    _add(SourceSpec(name, help, "stream", default_enabled, always_on=always_on))


register_stream("ingress", help="kernel-timed requests (eBPF syscall tracepoints; needs bcc and the "
                                "kernel's headers). Off: NVTX, telemetry and policy alone, steps traced "
                                "without their requests, for hosts where eBPF cannot be compiled")
register_stream("nvtx", help="the target's NVTX ranges (MoE steps, expert loads) from its injection ring")


def registered() -> dict[str, SourceSpec]:
    """Every registered source. The first call imports each module of the collectors package,
    which registers what it holds; a module that fails to import is logged and left out."""
    global _discovered
    if not _discovered:
        _discovered = True
        from moescope import collectors as package  # this module's own package, already imported

        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_") or info.name == "registry":
                continue
            module = f"{COLLECTORS_PACKAGE}.{info.name}"
            try:
                importlib.import_module(module)
            except Exception as exc:  # one broken module must not take the other collectors with it
                _DISCOVERY_ERRORS[module] = f"{type(exc).__name__}: {exc}"
                log.warning("collector module %s not loaded: %s", module, _DISCOVERY_ERRORS[module])
    return dict(_REGISTRY)


def discovery_errors() -> dict[str, str]:
    """Collector modules that failed to import, with the reason."""
    registered()
    return dict(_DISCOVERY_ERRORS)


def check_names(names: Iterable[str]) -> None:
    """UsageError (one line) for a name no source registered."""
    specs = registered()
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise UsageError(f"unknown collector(s): {', '.join(unknown)} (known: {', '.join(sorted(specs))})")


def sampled_names() -> list[str]:
    """The sampled collectors, in memory-signal priority order."""
    specs = [s for s in registered().values() if s.kind == "sampled"]
    return [s.name for s in sorted(specs, key=lambda s: s.memory_signal_priority)]


# ---------------------------------------------------------------- sampled sources


@dataclass(slots=True)
class CollectorStats:
    """Counters of one sampled collector (the registry command prints them)."""

    name: str
    period_s: float
    collections_total: int = 0
    failures_total: int = 0
    overruns_total: int = 0  # periods skipped because a collection ran past its next due time
    sink_errors_total: int = 0  # emit calls that raised, on the daemon thread
    last_duration_ns: int = 0
    duration_ns_total: int = 0
    last_success: bool = False
    last_error: str | None = None
    last_success_monotonic_ns: int | None = None
    in_progress_since_monotonic_ns: int | None = None  # set while a collection is running

    def stalled(self, now_monotonic_ns: int, *, periods: float = STALL_PERIODS) -> bool:
        """True while one collection has been running for more than `periods` periods."""
        started = self.in_progress_since_monotonic_ns
        return started is not None and now_monotonic_ns - started > periods * self.period_s * 1e9


class StopGroup:
    """One stop signal and one deadline for the sampled sources built together: closing them one
    after another (the daemon's close order) costs at most one timeout in all, however many hang."""

    def __init__(self, *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.stop_event = threading.Event()
        self._deadline_monotonic_s: float | None = None
        self._lock = threading.Lock()

    def begin(self, timeout_s: float | None = None) -> float:
        """Tell every member to stop (the first call only sets the deadline); the deadline, monotonic s."""
        with self._lock:
            if self._deadline_monotonic_s is None:
                wait_s = self.timeout_s if timeout_s is None else timeout_s
                self._deadline_monotonic_s = time.monotonic() + wait_s
                self.stop_event.set()
            return self._deadline_monotonic_s


class SampledSource:
    """A blocking `Collector` behind the Source interface: its own thread collects at its period
    (timed, failures and overruns counted, one distinct error logged once), a bounded queue keeps
    the newest samples (drops counted), and poll() emits them as TelemetryRecords on the daemon
    thread. The first poll starts the thread. close() never waits past its group's deadline: a
    collection stuck in a driver call is left running and its collector is not closed under it."""

    def __init__(
        self,
        collector: Collector,
        *,
        emit: Emit,
        max_pending: int = DEFAULT_MAX_PENDING,
        memory_signal_priority: int = 100,
        stop_group: StopGroup | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = collector.name
        self.collector = collector
        self.period_s = collector.period_s
        self.memory_signal_priority = memory_signal_priority
        self._emit = emit
        self._max_pending = max_pending
        self._group = stop_group if stop_group is not None else StopGroup()
        self._lock = threading.Lock()
        self._stats = CollectorStats(collector.name, collector.period_s)
        self._latest: object | None = None
        self._pending: deque[TelemetryRecord] = deque()
        self._dropped_queue_full = 0
        self._emitted = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error_logged: str | None = None
        self.stuck = False  # its thread was still inside collect() when close() gave up on it

    # -- collection (the source's own thread, or a caller that wants one now)

    def collect_once(self) -> object | None:
        """Run one collection now, timed, recorded and queued; None when it failed."""
        stats = self._stats
        start = time.monotonic_ns()
        with self._lock:
            stats.in_progress_since_monotonic_ns = start
        sample: object | None = None
        error: str | None = None
        try:
            sample = self.collector.collect()
        except Exception as exc:  # a collector's bug or driver failure must not stop the others
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
                self._latest = sample
                if len(self._pending) >= self._max_pending:
                    self._pending.popleft()  # the daemon is not polling: keep the newest, count the loss
                    self._dropped_queue_full += 1
                self._pending.append(TelemetryRecord(self.name, sample))
            else:
                stats.failures_total += 1
        if error is not None:
            if self._error_logged != error:
                # Each distinct error once; the failure counter tells how often it repeats.
                self._error_logged = error
                log.warning("collector %s failed: %s", self.name, error)
            return None
        self._error_logged = None
        return sample

    def set_period(self, period_s: float) -> None:
        """Sample every `period_s` from the next collection on (any thread: one attribute write
        the loop reads each round). The agent slows a source that feeds only the live view."""
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        if period_s != self.period_s:
            with self._lock:
                self.period_s = period_s
                self._stats.period_s = period_s

    def _loop(self) -> None:
        name_thread(f"ms-{self.name}")
        stop = self._group.stop_event
        next_due = time.monotonic_ns()
        while not stop.is_set():
            self.collect_once()
            period_ns = max(int(self.period_s * 1e9), 1)
            next_due += period_ns
            now = time.monotonic_ns()
            if now > next_due:
                missed = (now - next_due) // period_ns + 1
                with self._lock:
                    self._stats.overruns_total += int(missed)
                next_due += missed * period_ns
            stop.wait((next_due - now) / 1e9)

    def start(self) -> None:
        """Start the collection thread (the first poll does it); no-op once started or closed."""
        if self._thread is not None or self._closed or self._group.stop_event.is_set():
            return
        self._thread = threading.Thread(target=self._loop, name=f"collector-{self.name}", daemon=True)
        self._thread.start()

    # -- Source

    def poll(self, now_ns: int) -> int:
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
        for record in batch:
            try:
                self._emit(record)
            except Exception as exc:  # a sink's failure is counted, never stops the source
                with self._lock:
                    self._stats.sink_errors_total += 1
                log.debug("emit failed for %s: %s", self.name, exc)
        self._emitted += len(batch)
        if self._thread is None:
            self.start()  # after draining: the first poll hands over only what was there before it
        return len(batch)

    def stats(self) -> dict[str, int]:
        with self._lock:
            s = self._stats
            return {
                "samples_emitted": self._emitted,
                "samples_dropped_queue_full": self._dropped_queue_full,
                "collections": s.collections_total,
                "failures": s.failures_total,
                "overruns": s.overruns_total,
                "emit_errors": s.sink_errors_total,
            }

    def health(self, *, now_monotonic_ns: int | None = None) -> SourceHealth:
        """The last collection; a collection running past STALL_PERIODS periods counts as a
        failure lasting as long as it has run so far (a hung driver call shows as success 0)."""
        now = time.monotonic_ns() if now_monotonic_ns is None else now_monotonic_ns
        with self._lock:
            s = replace(self._stats)
        started = s.in_progress_since_monotonic_ns
        if started is not None and s.stalled(now):
            return SourceHealth(now - started, False, f"collection running for {(now - started) / 1e9:.1f} s")
        if s.collections_total == 0:
            return SourceHealth()
        return SourceHealth(s.last_duration_ns, s.last_success, s.last_error)

    def close(self, *, timeout_s: float | None = None) -> None:
        """Stop (with the group's shared deadline), close the collector unless stuck, flush."""
        if self._closed:
            return
        self._closed = True
        deadline = self._group.begin(timeout_s)
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.0))
            self.stuck = self._thread.is_alive()
        if self.stuck:
            log.warning("collector %s is still inside a collection: left running, not closed", self.name)
        else:
            try:
                self.collector.close()
            except Exception as exc:  # close errors are reported; the other sources still close
                log.warning("collector %s close failed: %s", self.name, exc)
        self.poll(0)  # what was collected before the stop

    def request_stop(self, timeout_s: float | None = None) -> None:
        """Tell its thread (and its group's) to stop now, starting the shared deadline."""
        self._group.begin(timeout_s)

    # -- reading

    def collector_stats(self) -> CollectorStats:
        with self._lock:
            return replace(self._stats)

    def latest(self) -> object | None:
        """The last successful sample (None before the first)."""
        with self._lock:
            return self._latest

    def memory_signal(self) -> MemorySignal | None:
        """The memory signal of the last sample, None when the last collection failed (stale)."""
        with self._lock:
            sample = self._latest if self._stats.last_success else None
        return sample.memory_signal() if isinstance(sample, HasMemorySignal) else None


def stop_all(sources: Iterable[object], *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> list[str]:
    """Stop and close every SampledSource in `sources` within one deadline; the names left stuck."""
    sampled = [s for s in sources if isinstance(s, SampledSource)]
    for source in sampled:
        source.request_stop(timeout_s)  # every thread is told before any is waited for
    for source in sampled:
        source.close(timeout_s=timeout_s)
    return [s.name for s in sampled if s.stuck]


def memory_signal(sources: Iterable[object]) -> MemorySignal | None:
    """The signal of the highest-priority sampled source that has a current one (nvml before host)."""
    sampled = sorted((s for s in sources if isinstance(s, SampledSource)), key=lambda s: s.memory_signal_priority)
    for source in sampled:
        signal = source.memory_signal()
        if signal is not None:
            return signal
    return None


@dataclass(frozen=True, slots=True)
class SampledSources:
    """The sampled sources built for one target, sharing one StopGroup."""

    sources: tuple[SampledSource, ...]
    unavailable: Mapping[str, str] = field(default_factory=dict)  # left out at build, with the reason

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def close(self, *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> list[str]:
        return stop_all(self.sources, timeout_s=timeout_s)


def build_sampled_sources(
    config: CollectorConfig,
    *,
    emit: Emit,
    enabled: Collection[str] | None = None,
    max_pending: int = DEFAULT_MAX_PENDING,
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
) -> SampledSources:
    """A SampledSource per enabled sampled collector, in memory-signal priority order. `enabled`
    names sources of any kind (stream names are the agent's and ignored here); None: the
    defaults. A factory raising SourceUnavailable leaves its collector out, with one log line."""
    specs = registered()
    if enabled is not None:
        check_names(enabled)
    group = StopGroup(timeout_s=stop_timeout_s)
    sources: list[SampledSource] = []
    unavailable: dict[str, str] = {}
    for name in sampled_names():
        spec = specs[name]
        assert spec.factory is not None  # a sampled spec always has one (SourceSpec checks)
        if not (spec.name in enabled if enabled is not None else spec.default_enabled):
            continue
        try:
            collector = spec.factory(config)
        except SourceUnavailable as exc:
            unavailable[spec.name] = str(exc)
            log.info("collector %s off: %s", spec.name, exc)
            continue
        sources.append(SampledSource(collector, emit=emit, max_pending=max_pending,
                                     memory_signal_priority=spec.memory_signal_priority, stop_group=group))
    return SampledSources(tuple(sources), unavailable)


# ---------------------------------------------------------------- flags


def flag_dest(name: str) -> str:
    """The argparse dest of --collector.NAME / --no-collector.NAME."""
    return f"collector_{name}"


NamespaceHook = Callable[[argparse.Namespace], None]


class _CollectorSwitch(argparse.Action):
    """--collector.NAME / --no-collector.NAME, and aliases turning several off at once: the last
    flag given wins."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        names: tuple[str, ...],
        enabled: bool | None = None,  # None: on for --collector.NAME, off for --no-collector.NAME
        on_change: NamespaceHook | None = None,
        default: object = None,
        help: str | None = None,
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)
        self.names = names
        self.enabled = enabled
        self.on_change = on_change

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        on = self.enabled if self.enabled is not None else not (option_string or "").startswith("--no-")
        for name in self.names:
            setattr(namespace, flag_dest(name), on)
        if self.on_change is not None:
            self.on_change(namespace)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def collectors_description() -> str:
    """The flags' group text: how to read them, and what cannot be turned off."""
    always = sorted(s.name for s in registered().values() if s.always_on)
    text = "Data sources: --no-collector.NAME turns one off, --collector.NAME back on."
    return f"{text} Always on: {', '.join(always)}." if always else text


def add_collector_flags(container: argparse._ActionsContainer, *, on_change: NamespaceHook | None = None) -> None:
    """--collector.NAME / --no-collector.NAME for every registered source that can be turned off."""
    for spec in sorted(registered().values(), key=lambda s: s.name):
        if spec.always_on:
            continue
        state = "on" if spec.default_enabled else "off"
        container.add_argument(
            f"--collector.{spec.name}", f"--no-collector.{spec.name}", dest=flag_dest(spec.name),
            action=_CollectorSwitch, names=(spec.name,), on_change=on_change,
            help=f"{spec.help} (default: {state})".replace("%", "%%"),
        )


def add_collector_alias(
    container: argparse._ActionsContainer,
    option: str,
    *,
    names: Sequence[str],
    enabled: bool,
    help: str,
    on_change: NamespaceHook | None = None,
) -> None:
    """A flag meaning the same as --[no-]collector.NAME for each of `names` (e.g. --no-nvtx)."""
    check_names(names)
    container.add_argument(
        option, dest=f"_alias_{option.lstrip('-').replace('-', '_')}", action=_CollectorSwitch,
        names=tuple(names), enabled=enabled, on_change=on_change, default=argparse.SUPPRESS,
        help=help.replace("%", "%%"),
    )


def enabled_collectors(args: argparse.Namespace) -> set[str]:
    """The sources to run: each flag given, else the source's default; always-on ones always."""
    out: set[str] = set()
    for spec in registered().values():
        chosen = getattr(args, flag_dest(spec.name), None)
        if spec.always_on or (spec.default_enabled if chosen is None else bool(chosen)):
            out.add(spec.name)
    return out


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
        description="Run every sampled collector for a while; print samples, the memory signal and stats.",
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

    def emit(record: object) -> None:
        assert isinstance(record, TelemetryRecord)
        if args.json:
            print(json.dumps({"collector": record.collector, "sample": _jsonable(record.sample)}), flush=True)
        else:
            print(f"{record.collector}: {record.sample}", flush=True)

    try:
        enabled = [n for n in args.collectors.split(",") if n] if args.collectors else None
        built = build_sampled_sources(config, emit=emit, enabled=enabled)
    except (UsageError, ValueError) as exc:
        print(f"collectors: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    end = time.monotonic() + args.seconds
    try:
        while (left_s := end - time.monotonic()) > 0:
            for source in built.sources:
                source.poll(time.monotonic_ns())  # as the daemon does; the first poll starts it
            time.sleep(min(config.period_s, left_s))
    finally:
        stuck = built.close()
    signal = memory_signal(built.sources)
    stats = [s.collector_stats() for s in built.sources]
    if args.json:
        print(json.dumps({"memory_signal": _jsonable(signal), "stats": _jsonable(stats),
                          "unavailable": dict(built.unavailable), "stuck": stuck}), flush=True)
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
