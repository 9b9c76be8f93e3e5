"""The agent's main loop: poll every data source on a period, hand records to sinks, stop cleanly.

Sources (the ingress probe today; the NVTX collector, host/NVML sampler later) implement `Source`
and push records through `Daemon.emit`, which fans them out to the sinks (records file, latency
summary; the trace pipeline, policy and TUI later). Tick hooks run after each poll round and may
ask the loop to stop (e.g. "every target exited"). Nothing here raises into a source: a failing
source or sink is logged and counted, and the others keep going.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from moescope.collectors.registry import Source

log = logging.getLogger(__name__)

DEFAULT_PERIOD_NS = 50_000_000  # drain period: bounds ring occupancy and report delay

STOP_SIGNAL = "signal"
STOP_DURATION = "duration"


RecordSink = Callable[[Any], None]
# Called after each poll round with now_ns; returns a stop reason, or None to go on.
TickHook = Callable[[int], str | None]


class Daemon:
    def __init__(self, *, period_ns: int = DEFAULT_PERIOD_NS, clock: Callable[[], int] = time.monotonic_ns) -> None:
        if period_ns <= 0:
            raise ValueError(f"period_ns must be positive, got {period_ns}")
        self.period_ns = period_ns
        self._clock = clock
        self.sources: list[Source] = []
        self.sinks: list[RecordSink] = []
        self.tick_hooks: list[TickHook] = []
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self.ticks = 0
        self.records = 0
        self.sink_errors = 0
        self.poll_errors = 0
        # Main-loop CPU (thread time) per source poll and per tick hook, in ns: where the agent's
        # own cost goes, for its summary (a source's poll includes the sinks it feeds).
        self.cpu_ns: dict[str, int] = {}
        self._hook_names: dict[TickHook, str] = {}

    def add_source(self, source: Source) -> None:
        self.sources.append(source)

    def add_sink(self, sink: RecordSink) -> None:
        self.sinks.append(sink)

    def add_tick_hook(self, hook: TickHook) -> None:
        self.tick_hooks.append(hook)
        self._hook_names[hook] = _hook_name(hook)

    def emit(self, record: Any) -> None:
        """Give one record to every sink. Never raises: sink failures are counted."""
        self.records += 1
        for sink in self.sinks:
            try:
                sink(record)
            except Exception:
                self.sink_errors += 1
                if self.sink_errors == 1:
                    log.exception("a record sink failed (further failures are only counted)")

    def stop(self, reason: str = STOP_SIGNAL) -> None:
        """Ask the loop to stop after its current round; safe from signal handlers and threads."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()

    def tick(self) -> str | None:
        """One round: poll every source, then run the hooks. Returns a stop reason or None."""
        now_ns = self._clock()
        cpu = self.cpu_ns
        t0 = time.thread_time_ns()
        for source in self.sources:
            try:
                source.poll(now_ns)
            except Exception:
                self.poll_errors += 1
                log.exception("source %s failed to poll", source.name)
            t1 = time.thread_time_ns()
            cpu[source.name] = cpu.get(source.name, 0) + t1 - t0
            t0 = t1
        self.ticks += 1
        for hook in self.tick_hooks:
            reason = hook(now_ns)
            t1 = time.thread_time_ns()
            name = self._hook_names.get(hook) or _hook_name(hook)
            cpu[name] = cpu.get(name, 0) + t1 - t0
            t0 = t1
            if reason is not None:
                return reason
        return None

    def cpu_line(self) -> str:
        """The main loop's CPU by part, largest first: `nvtx 1.23 s, ingress 0.10 s, ...`."""
        parts = sorted(self.cpu_ns.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {ns / 1e9:.2f} s" for name, ns in parts if ns >= 5_000_000)

    def run(self, *, duration_ns: int | None = None) -> str:
        """Tick every period until stopped, past the duration, or a hook returns a reason."""
        deadline_ns = None if duration_ns is None else self._clock() + duration_ns
        next_tick_ns = self._clock()
        while True:
            if self._stop.is_set():
                return self._stop_reason or STOP_SIGNAL
            reason = self.tick()
            if reason is not None:
                return reason
            now_ns = self._clock()
            if deadline_ns is not None and now_ns >= deadline_ns:
                return STOP_DURATION
            next_tick_ns += self.period_ns
            if next_tick_ns < now_ns:
                next_tick_ns = now_ns  # fell behind: no burst of catch-up ticks
            wake_ns = next_tick_ns if deadline_ns is None else min(next_tick_ns, deadline_ns)
            self._stop.wait(max(0, wake_ns - now_ns) / 1e9)

    def close(self) -> None:
        """Close every source (each flushes into the sinks). Errors are logged, never raised."""
        for source in self.sources:
            try:
                source.close()
            except Exception:
                log.exception("source %s failed to close", source.name)

    def stats(self) -> dict[str, dict[str, int]]:
        result: dict[str, dict[str, int]] = {
            "daemon": {
                "ticks": self.ticks,
                "records": self.records,
                "sink_errors": self.sink_errors,
                "poll_errors": self.poll_errors,
            }
        }
        for source in self.sources:
            result[source.name] = dict(source.stats())
        return result


def _hook_name(hook: TickHook) -> str:
    """`Observers._publish_metrics`, `Observers.build.drain_requests`: the hook's qualified name."""
    return getattr(hook, "__qualname__", "hook").replace(".<locals>", "")
