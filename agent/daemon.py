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

DEFAULT_PERIOD_NS = 50_000_000  # drain period while busy: bounds ring occupancy and report delay
# A quiet loop ticks less often: after a round whose sources handled at most QUIET_EVENTS_PER_S
# events per second of its period, the period doubles, up to the idle period (50 -> 100 -> ... ->
# 3200 -> 4000 ms); a busier round brings it back to the base at once. A round costs ~0.8 ms however
# little it finds (every source's poll, every hook), which at the old 150 ms cap was 0.5 % of a core
# beside an idle runtime and a fifth of the agent's CPU at the reference load; and one that finds
# data costs ~7-8 ms more than its data (each stage's set-up: ring reads, numpy calls on small
# arrays, cold code and data after a sleep beside a busy runtime, the export's encode, the
# self-metrics; measured by part: the NVTX path ~4.3 ms a round, the request traces ~2.4, the
# self-metrics ~0.6): 1 s -> 2 s rounds took the reference load's main loop from 12.3 to 10.0 ms/s,
# 2 s -> 4 s from 9.0 to 7.0 (docs/benchmarks.md). 4 s is under the OpenTelemetry SDK's own 5 s
# span-batch delay and Prometheus' 15 s default scrape interval; what must be fresher
# asks for it: a live view, and a `--port` target waiting for its successor (agent/start.py caps
# the period at its rescan period through Observers.add_round_cap). The idle period is
# DEFAULT_IDLE_PERIOD_NS while nobody watches live, and LIVE_IDLE_PERIOD_MAX_NS at most while
# someone does (`agent top`, --tui: live_idle_period_ns; agent/observe.py paces it every round):
# what a live view shows is never older than it is refreshed at. Staleness is for the quiet loop
# only: a busy one (past QUIET_EVENTS_PER_S: nginx at 40k requests/s, any production-shape
# producer) runs at the base.
# What the rings absorb while a quiet loop sleeps is kept bounded by a peek every PEEK_PERIOD_NS
# (the old cap, on which the rings are sized): each source that can tell says whether its buffer is
# past BACKLOG_FILL (Source.backlogged, a few reads of shared memory), and one that is gets a round
# at once. The ingress ring holds 200 ms at its rate hint; a 65536-record NVTX ring holds 180 ms of
# moe/v1 at Qwen3-30B-A3B depth and 20 steps/s (~360k records/s), the heaviest producer measured.
# ~6.8k events/s is 1024 a round at 150 ms: the reference load (~14 steps/s, ~500 NVTX records/s)
# stays quiet, nginx at 40k requests/s or a production-shape producer does not.
# A thread that wakes on its own period anyway (the policy loop, every 200 ms) can take the peeks
# over (lend_peeks / outside_peek): on this VM a wake-up of an idle Python thread costs ~0.3-0.5 ms
# of CPU whatever it does, and the loop's six peeks a second were half its idle cost. A period up to
# OUTSIDE_PEEK_MAX_NS is accepted: the ingress ring holds at least 200 ms above its mark at its rate
# hint (probes/ingress/loader.py RING_HOLD_S); the moe/v2 rings hold seconds at production shapes.
QUIET_EVENTS_PER_S = 6_800
DEFAULT_IDLE_PERIOD_NS = 4_000_000_000  # nobody watching live (`agent start --quiet-drain-s`)
MIN_QUIET_DRAIN_S = 0.05  # the base period: never shorter
MAX_QUIET_DRAIN_S = 30.0  # the join keeps steps 120 s for their requests; windows are 10 s
LIVE_IDLE_PERIOD_MAX_NS = 1_000_000_000  # a live view reading: at most this, at most its refresh period
PEEK_PERIOD_NS = 150_000_000
OUTSIDE_PEEK_MAX_NS = 200_000_000

STOP_SIGNAL = "signal"
STOP_DURATION = "duration"


RecordSink = Callable[[Any], None]
# Called after each poll round with now_ns; returns a stop reason, or None to go on.
TickHook = Callable[[int], str | None]


class Daemon:
    def __init__(
        self,
        *,
        period_ns: int = DEFAULT_PERIOD_NS,
        idle_period_ns: int = DEFAULT_IDLE_PERIOD_NS,
        peek_period_ns: int = PEEK_PERIOD_NS,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if period_ns <= 0:
            raise ValueError(f"period_ns must be positive, got {period_ns}")
        if idle_period_ns < period_ns:
            raise ValueError(f"idle_period_ns must be >= period_ns ({period_ns}), got {idle_period_ns}")
        if peek_period_ns <= 0:
            raise ValueError(f"peek_period_ns must be positive, got {peek_period_ns}")
        self.period_ns = period_ns
        self.idle_period_ns = idle_period_ns  # (set_idle_period: the live view's pacing)
        self.quiet_period_ns = idle_period_ns  # the configured cap (--quiet-drain-s) pacing returns to
        self.peek_period_ns = peek_period_ns
        self.current_period_ns = period_ns  # the period the loop runs at now (base when busy)
        self.last_handled = 0  # events the sources handled in the last round (their poll results)
        self._clock = clock
        self.sources: list[Source] = []
        self._backlogs: list[Callable[[], bool]] = []  # the sources' backlogged(), where they have one
        self.sinks: list[RecordSink] = []
        self.tick_hooks: list[TickHook] = []
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        # The loop's only sleep: set by stop() and by an outside peek that found a backlog.
        self._wake = threading.Event()
        # Held for a whole round and by an outside peek (never waited on by the latter): the
        # sources' rings are opened and closed inside rounds only.
        self._round_lock = threading.Lock()
        self._peeks_lent = False  # another thread peeks for the loop (lend_peeks): the loop does not
        self._outside_backlog = False  # an outside peek found a backlog: the round is due now
        self.ticks = 0
        self.records = 0
        self.sink_errors = 0
        self.poll_errors = 0
        self.peeks = 0  # looks at the sources' backlogs between two rounds
        self.outside_peeks = 0  # ... of them, the ones another thread made (lend_peeks)
        self.early_rounds = 0  # rounds brought forward by a backlogged source
        # Main-loop CPU (thread time) per source poll and per tick hook, in ns: where the agent's
        # own cost goes, for its summary and /metrics (a source's poll includes the sinks it feeds).
        # Written by this loop only; another thread reads it whole (a copy under the GIL).
        self.cpu_ns: dict[str, int] = {}
        self._hook_names: dict[TickHook, str] = {}

    def add_source(self, source: Source) -> None:
        self.sources.append(source)
        backlogged = getattr(source, "backlogged", None)
        if callable(backlogged):
            self._backlogs.append(backlogged)

    def add_sink(self, sink: RecordSink) -> None:
        self.sinks.append(sink)

    def add_tick_hook(self, hook: TickHook, *, name: str | None = None) -> None:
        """Run ``hook`` after every round; its CPU is counted under ``name`` (default: its
        qualified name) in ``cpu_ns``, the summary and moescope_agent_work_cpu_seconds."""
        self.tick_hooks.append(hook)
        self._hook_names[hook] = name or _hook_name(hook)

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
        self._wake.set()

    def tick(self) -> str | None:
        """One round: poll every source, then run the hooks. Returns a stop reason or None."""
        with self._round_lock:
            return self._tick()

    def _tick(self) -> str | None:
        now_ns = self._clock()
        cpu = self.cpu_ns
        t0 = time.thread_time_ns()
        handled = 0
        for source in self.sources:
            try:
                handled += source.poll(now_ns) or 0  # a source returning None counts as none handled
            except Exception:
                self.poll_errors += 1
                log.exception("source %s failed to poll", source.name)
            t1 = time.thread_time_ns()
            cpu[source.name] = cpu.get(source.name, 0) + t1 - t0
            t0 = t1
        self.last_handled = handled
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
        return cpu_parts_line(self.cpu_ns)

    def rounds_line(self) -> str:
        """`31 rounds (2 brought forward by a filling ring), 180 peeks (150 by another thread)`:
        how the loop paced itself."""
        return (f"{self.ticks} rounds ({self.early_rounds} brought forward by a filling ring), "
                f"{self.peeks} peeks ({self.outside_peeks} by another thread)")

    def set_idle_period(self, idle_period_ns: int) -> None:
        """The quiet loop's longest period from now on (never under the base period); a period
        already longer is cut to it at once, from the next round."""
        idle = max(self.period_ns, int(idle_period_ns))
        self.idle_period_ns = idle
        if self.current_period_ns > idle:
            self.current_period_ns = idle

    def next_period_ns(self) -> int:
        """The period after the round just run: the base when it was busy (more than
        QUIET_EVENTS_PER_S over the period it ran at), else twice as long, up to the idle period."""
        if self.last_handled * 1_000_000_000 > QUIET_EVENTS_PER_S * self.current_period_ns:
            self.current_period_ns = self.period_ns
        else:
            self.current_period_ns = min(self.idle_period_ns, self.current_period_ns * 2)
        return self.current_period_ns

    def backlogged(self) -> bool:
        """Whether a source's buffer is past its mark now (a peek: no source is polled). A failing
        check is counted as a poll error and read as not backlogged."""
        self.peeks += 1
        for check in self._backlogs:
            try:
                if check():
                    return True
            except Exception:
                self.poll_errors += 1
                log.debug("a source's backlog check failed", exc_info=True)
        return False

    def lend_peeks(self, period_ns: int) -> bool:
        """Another thread will call outside_peek() every `period_ns` from now on, and the loop stops
        peeking itself. Refused (False: the loop keeps its own peeks) past OUTSIDE_PEEK_MAX_NS, which
        the rings are sized for."""
        self._peeks_lent = 0 < period_ns <= OUTSIDE_PEEK_MAX_NS
        return self._peeks_lent

    def take_back_peeks(self) -> None:
        """The lending thread stops: the loop peeks itself again, from its next wait."""
        self._peeks_lent = False
        self._wake.set()  # a wait planned without peeks is cut short

    def outside_peek(self) -> bool:
        """A peek at the sources' backlogs from another thread (see lend_peeks); a backlog wakes the
        loop for a round now. Never waits: while a round runs (it drains anyway) nothing is read."""
        if not self._backlogs or not self._round_lock.acquire(blocking=False):
            return False
        try:
            self.outside_peeks += 1
            found = self.backlogged()
        finally:
            self._round_lock.release()
        if found:
            self._outside_backlog = True
            self._wake.set()
        return found

    def run(self, *, duration_ns: int | None = None) -> str:
        """Tick every period (longer while quiet) until stopped, past the duration, or a hook
        returns a reason."""
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
            next_tick_ns += self.next_period_ns()
            if next_tick_ns < now_ns:
                next_tick_ns = now_ns  # fell behind: no burst of catch-up ticks
            next_tick_ns = self._sleep_until(next_tick_ns, deadline_ns, now_ns)

    def _sleep_until(self, tick_ns: int, deadline_ns: int | None, now_ns: int) -> int:
        """Wait for the next round, peeking at the sources' backlogs every peek period on the way;
        returns when the round is due (brought forward to now by a backlogged source), or stopped."""
        due_ns = tick_ns if deadline_ns is None else min(tick_ns, deadline_ns)
        while now_ns < due_ns:
            # no source to peek at, or another thread peeking: one wait until the round
            own_peeks = bool(self._backlogs) and not self._peeks_lent
            wait_ns = min(due_ns - now_ns, self.peek_period_ns) if own_peeks else due_ns - now_ns
            woken = self._wake.wait(wait_ns / 1e9)
            if self._stop.is_set():
                break
            now_ns = self._clock()
            if woken:
                self._wake.clear()
                if self._outside_backlog:  # an outside peek found a ring filling
                    return self._bring_forward(now_ns)
                continue  # peeks handed back: plan the rest of the wait again
            if own_peeks and now_ns < due_ns and self.backlogged():
                return self._bring_forward(now_ns)
        return tick_ns

    def _bring_forward(self, now_ns: int) -> int:
        self._outside_backlog = False
        self.early_rounds += 1
        self.current_period_ns = self.period_ns  # busy again: the base until quiet
        return now_ns

    def close(self) -> None:
        """Close every source (each flushes into the sinks). Errors are logged, never raised."""
        with self._round_lock:  # not under an outside peek
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
                "peeks": self.peeks,
                "outside_peeks": self.outside_peeks,
                "early_rounds": self.early_rounds,
            }
        }
        for source in self.sources:
            result[source.name] = dict(source.stats())
        return result


def cpu_parts_line(cpu_ns: dict[str, int]) -> str:
    """CPU by part, largest first, parts of 5 ms and more: `nvtx 1.23 s, requests 0.10 s, ...`."""
    parts = sorted(cpu_ns.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {ns / 1e9:.2f} s" for name, ns in parts if ns >= 5_000_000)


def _hook_name(hook: TickHook) -> str:
    """`Observers._publish_metrics`, `Observers.build.drain_requests`: the hook's qualified name."""
    return getattr(hook, "__qualname__", "hook").replace(".<locals>", "")


def live_idle_period_ns(interval_s: float) -> int:
    """The quiet loop's idle period while a live view reads: its refresh period (``--interval``),
    between the base period and LIVE_IDLE_PERIOD_MAX_NS."""
    return min(LIVE_IDLE_PERIOD_MAX_NS, max(DEFAULT_PERIOD_NS, int(interval_s * 1e9)))
