"""The sliding windows over joined events: the policy's signals and the live view's panels.

Both read the same windows (request latency, the model requests' phase breakdown, step latency,
expert-load latency, routing health per layer, rates, the latest device samples), so what the
policy acts on and what an operator sees are one set of numbers. Quantiles are
``moescope.latency`` nearest-rank, as everywhere else.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from moescope.agent import state as st
from moescope.agent.join import (
    BufferedStep,
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
from moescope.agent.phase_table import PHASE_ROWS, Phases, PhaseStat
from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.policy.rules import Signals, make_signals
from moescope.agent.request_phases import RequestBreakdown
from moescope.agent.routing_health import NAN, LayerTable, RoutingHealthWindow
from moescope.collectors.host import MemorySignal
from moescope.collectors.netsig import NetSignalWindow
from moescope.collectors.nvml import NvmlSample
from moescope.latency import SlidingQuantile, nearest_rank_position

# Signals fields WindowsOutput.signals computes: the phase rows' p99s by field, the network rates
_PHASE_SIGNALS = {f"request_phase_{row}_p99_ms": row for row in
                  ("receive", "queue", "prefill", "decode", "write", "inference", "expert_load", "routing")}
_NET_SIGNALS = frozenset(("listen_overflows_per_s", "tcp_retransmits_per_s", "tcp_resets_per_s"))
# every Signals field but the snapshot's time and the runtime's queues (its stats, not the windows)
_ALL_SIGNALS = frozenset(f.name for f in fields(Signals)) - {"t_s", "expert_queue_tokens"}

DEFAULT_WINDOW_NS = 10_000_000_000  # the policy's sliding windows (DESIGN.md: 10 s)
# The routing window sums steps per 1/20 of it (10 s: 0.5 s buckets) instead of keeping every
# step's counts: it spans 10-10.5 s, and holds ~20 [layers, E] sums whatever the step rate.
ROUTING_BUCKETS = 20
MAX_RANKS = 64  # producer processes with a row of their own (agent/metrics.py MAX_RANK_SERIES: the same bound)
MAX_RANK_STEPS = 4096  # steps kept per pid over the window (60 steps/s x 10 s is 600): the oldest leave first
RANK_RETENTION_NS = 60_000_000_000  # a pid with no step for this long leaves the ranks panel
MIN_RANK_SPAN_NS = 1_000_000_000  # rates over at least 1 s: a rank seen for 10 ms is not 100 steps/s


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


# PhaseWindow's columns: the table's rows, then the request, TTFT, TPOT (NaN: undefined), input
# tokens (NaN: not reported), output tokens, streamed (1: TTFT on the wire).
_ROWS = len(PHASE_ROWS)
_DURATION, _TTFT, _TPOT, _INPUT, _OUTPUT, _WIRE = range(_ROWS, _ROWS + 6)
_COLUMNS = _ROWS + 6
_QUANTILE_COLUMNS = [*range(_ROWS), _DURATION, _TTFT]  # defined for every request: the columns before TPOT


@dataclass(frozen=True, slots=True)
class _PhaseStats:
    table: Phases
    p99_ms: dict[str, float]  # per row, and "ttft" / "tpot"; NaN with no request


class PhaseWindow:
    """The "where the time goes" table (agent/phase_table.py) over the model requests whose last
    byte left in ``(now - duration_ns, now]``. Only requests with a breakdown count.

    A request is one slot of a float array per quantity (appended in O(1): the agent adds one per
    request); a query takes exact nearest-rank quantiles of the live rows with ``np.partition`` at the ranks
    ``moescope.latency.nearest_rank_position`` gives, and sums them for the shares, so it returns
    ``phase_table.summarize``'s numbers on the same requests. Queries between two changes share one
    computation (the policy and the live view ask several times a second). Times are kept
    non-decreasing as in SlidingQuantile; at ``max_samples`` live rows the oldest sixteenth leaves
    early (``overflow_evictions``; 100 000 rows is 10 000 requests/s over 10 s).
    """

    def __init__(self, *, duration_ns: int, max_samples: int = 100_000, initial_rows: int = 1024) -> None:
        self.duration_ns = duration_ns
        self.max_samples = max_samples
        self.overflow_evictions = 0
        rows = max(1, min(initial_rows, max_samples))
        self._t = np.zeros(rows, dtype=np.int64)
        self._v = np.zeros((_COLUMNS, rows), dtype=np.float64)  # a column per quantity: contiguous to rank
        self._head = 0  # live rows are [head, tail)
        self._tail = 0
        self._last_ns: int | None = None
        self._version = 0  # bumped on every change: the cache key
        self._cached: tuple[int, _PhaseStats] | None = None

    def __len__(self) -> int:
        return self._tail - self._head

    def add(self, b: RequestBreakdown) -> None:
        t = b.end_ns if self._last_ns is None else max(b.end_ns, self._last_ns)
        self._last_ns = t
        if self._tail == len(self._t):
            self._make_room()
        i = self._tail
        self._t[i] = t
        self._v[:, i] = (  # times in ms (ns / 1e6, as everywhere)
            b.receive_ns / 1e6, b.queue_ns / 1e6, b.prefill_ns / 1e6, b.decode_ns / 1e6, b.write_ns / 1e6,
            (b.prefill_ns + b.decode_ns) / 1e6, b.expert_load_ns / 1e6, b.routing_ns / 1e6, b.duration_ns / 1e6,
            b.ttft_ns / 1e6, math.nan if b.tpot_ns is None else b.tpot_ns / 1e6,
            math.nan if b.input_tokens is None else b.input_tokens, b.output_tokens,
            1.0 if b.ttft_source == "wire" else 0.0,
        )
        self._tail += 1
        self._version += 1
        self.evict(t)

    def _make_room(self) -> None:
        """The tail reached the end: compact, grow, or at the bound let the oldest go (counted)."""
        rows = len(self._t)
        live = self._tail - self._head
        if live > rows // 2 and rows < self.max_samples:  # grow (copying the live rows to the front)
            grown = min(2 * rows, self.max_samples)
            t, v = np.zeros(grown, dtype=np.int64), np.zeros((_COLUMNS, grown), dtype=np.float64)
            t[:live], v[:, :live] = self._t[self._head:self._tail], self._v[:, self._head:self._tail]
            self._t, self._v = t, v
            self._head, self._tail = 0, live
            return
        excess = live - (rows - max(1, rows // 16))  # at the bound: keep a sixteenth free (O(1) amortised)
        if excess > 0:
            self._head += excess
            self.overflow_evictions += excess
            live -= excess
            self._version += 1
        self._t[:live] = self._t[self._head:self._tail]
        self._v[:, :live] = self._v[:, self._head:self._tail]
        self._head, self._tail = 0, live

    def evict(self, now_ns: int) -> None:
        horizon = now_ns - self.duration_ns
        if self._head < self._tail and self._t[self._head] <= horizon:
            gone = int(np.searchsorted(self._t[self._head:self._tail], horizon, side="right"))
            self._head += gone
            self._version += 1

    def _stats(self, now_ns: int) -> _PhaseStats:
        self.evict(now_ns)
        cached = self._cached
        if cached is not None and cached[0] == self._version:
            return cached[1]
        stats = self._compute()
        self._cached = (self._version, stats)
        return stats

    def _compute(self) -> _PhaseStats:
        window_s = self.duration_ns / 1e9
        n = self._tail - self._head
        nan_p99 = dict.fromkeys((*PHASE_ROWS, "ttft", "tpot"), math.nan)
        if n == 0:
            return _PhaseStats(Phases(window_s=window_s), nan_p99)
        live = self._v[:, self._head:self._tail]
        k50, k99 = nearest_rank_position(n, 0.50), nearest_rank_position(n, 0.99)
        ranked = np.partition(live[:_TPOT], [k50, k99], axis=1)  # the rows, the request and TTFT
        p50 = dict(zip(_QUANTILE_COLUMNS, ranked[:, k50].tolist(), strict=True))
        p99 = dict(zip(_QUANTILE_COLUMNS, ranked[:, k99].tolist(), strict=True))
        sums = live.sum(axis=1).tolist()
        tpot = live[_TPOT]
        tpot = tpot[~np.isnan(tpot)]
        tpot50 = tpot99 = None
        if len(tpot):
            t50, t99 = nearest_rank_position(len(tpot), 0.50), nearest_rank_position(len(tpot), 0.99)
            tpot_ranked = np.partition(tpot, [t50, t99])
            tpot50, tpot99 = float(tpot_ranked[t50]), float(tpot_ranked[t99])
        inputs = live[_INPUT]
        reported = ~np.isnan(inputs)
        input_tokens = round(float(inputs[reported].sum())) if reported.any() else None
        output_tokens = round(sums[_OUTPUT])
        total = sums[_DURATION]
        rows = [PhaseStat(phase=phase, p50_ms=p50[i], p99_ms=p99[i], share=sums[i] / total if total > 0 else None)
                for i, phase in enumerate(PHASE_ROWS)]
        table = Phases(
            window_s=window_s,
            requests=n,
            rows=rows,
            duration_p50_ms=p50[_DURATION],
            duration_p99_ms=p99[_DURATION],
            ttft_p50_ms=p50[_TTFT],
            ttft_p99_ms=p99[_TTFT],
            ttft_wire=round(sums[_WIRE]),
            tpot_p50_ms=tpot50,
            tpot_p99_ms=tpot99,
            tpot_requests=len(tpot),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            input_tokens_per_s=None if input_tokens is None else input_tokens / window_s,
            output_tokens_per_s=output_tokens / window_s,
        )
        signal = {phase: p99[i] for i, phase in enumerate(PHASE_ROWS)}
        signal["ttft"] = p99[_TTFT]
        signal["tpot"] = math.nan if tpot99 is None else tpot99
        return _PhaseStats(table, signal)

    def p99(self, phase: str, now_ns: int) -> float:
        """One row's p99 (ms; NaN with no model request in the window)."""
        return self._stats(now_ns).p99_ms[phase]

    def ttft_p99(self, now_ns: int) -> float:
        return self._stats(now_ns).p99_ms["ttft"]

    def tpot_p99(self, now_ns: int) -> float:
        return self._stats(now_ns).p99_ms["tpot"]

    def table(self, now_ns: int) -> Phases:
        return self._stats(now_ns).table


class RankWindow:
    """Per producer process (pid, one per expert-parallel rank): its steps over the window, for the
    live view's ranks panel. At most ``max_ranks`` pids are tracked; a new pid past that takes the
    slot of a pid with no step for ``retention_ns``, else its steps are counted in ``untracked_steps``.

    A step is in the window by when the agent saw it (``seen_ns``, the export's clock), as the
    header's steps/s counts them, not by when it ended: the steps of the last round's interval
    arrive only at the next round, so counting ends over ``(now - window, now]`` read every rank
    that share low (8 % at 25 steps/s, rounds up to 1 s apart, a 10 s window)."""

    def __init__(self, *, window_ns: int, max_ranks: int = MAX_RANKS, max_steps: int = MAX_RANK_STEPS,
                 retention_ns: int = RANK_RETENTION_NS) -> None:
        self.window_ns = window_ns
        self.max_ranks = max_ranks
        self.retention_ns = retention_ns
        self._max_steps = max_steps
        # pid -> (when seen ns, duration ms, tokens) of its steps, oldest first
        self._steps: dict[int, deque[tuple[int, float, int]]] = {}
        self._first_ns: dict[int, int] = {}  # when the pid's first step ended (rates over what was seen)
        self._last_ns: dict[int, int] = {}
        self._totals: dict[int, int] = {}
        self.untracked_steps = 0

    def add(self, *, pid: int, end_ns: int, duration_ms: float, tokens: int | None,
            seen_ns: int | None = None) -> None:
        """One step that ended at ``end_ns`` and reached the agent at ``seen_ns`` (default: at its end)."""
        seen = end_ns if seen_ns is None else seen_ns
        steps = self._steps.get(pid)
        if steps is None:
            if len(self._steps) >= self.max_ranks and not self._free_slot(end_ns):
                self.untracked_steps += 1
                return
            steps = self._steps[pid] = deque(maxlen=self._max_steps)
            self._first_ns[pid], self._totals[pid] = end_ns, 0
        steps.append((seen, duration_ms, tokens if tokens is not None and tokens > 0 else 0))
        self._last_ns[pid] = max(end_ns, self._last_ns.get(pid, end_ns))
        self._totals[pid] += 1

    def _free_slot(self, now_ns: int) -> bool:
        stale = [pid for pid, last in self._last_ns.items() if last < now_ns - self.retention_ns]
        for pid in stale:
            self._forget(pid)
        return bool(stale)

    def _forget(self, pid: int) -> None:
        for table in (self._steps, self._first_ns, self._last_ns, self._totals):
            table.pop(pid, None)

    def panel(self, now_ns: int, *, nvtx_drops: dict[int, int] | None = None,
              comms: dict[int, str] | None = None, exited: Collection[int] = ()) -> st.Ranks:
        """One row per pid with a step in the last ``retention_ns``, sorted by pid; ``exited``: the
        pids known to have exited (their rows are marked)."""
        self._free_slot(now_ns)
        horizon = now_ns - self.window_ns
        rows = []
        for pid in sorted(self._steps):
            steps = self._steps[pid]
            while steps and steps[0][0] <= horizon:
                steps.popleft()
            span_ns = max(MIN_RANK_SPAN_NS, min(self.window_ns, now_ns - self._first_ns[pid]))
            p50 = p99 = None
            tokens_per_s = None
            if steps:
                durations = np.fromiter((d for _, d, _ in steps), dtype=np.float64, count=len(steps))
                k50, k99 = nearest_rank_position(len(steps), 0.50), nearest_rank_position(len(steps), 0.99)
                ranked = np.partition(durations, [k50, k99])
                p50, p99 = float(ranked[k50]), float(ranked[k99])
                tokens = sum(t for _, _, t in steps)
                tokens_per_s = tokens / (span_ns / 1e9) if tokens else 0.0
            rows.append(st.Rank(
                pid=pid,
                comm=(comms or {}).get(pid),
                steps_per_s=len(steps) / (span_ns / 1e9),
                step_p50_ms=p50,
                step_p99_ms=p99,
                tokens_per_s=tokens_per_s,
                steps_total=self._totals[pid],
                nvtx_drops_total=None if nvtx_drops is None else nvtx_drops.get(pid),
                exited=pid in exited,
            ))
        return st.Ranks(window_s=self.window_ns / 1e9, ranks=rows, max_ranks=self.max_ranks,
                        untracked_steps=self.untracked_steps)


SHARE_DECIMALS = 6  # the live view's expert shares: 1e-6 of a layer's tokens (shorter state JSON)


def expert_shares(tokens: np.ndarray) -> tuple[list[list[float]], int, list[list[st.HotExpert]]]:
    """Per row of a [layers, E] token matrix: its share per bin of experts (at most
    st.MAX_EXPERT_BINS bins; [] for a row with no tokens), experts per bin, and its
    st.HOT_EXPERTS hottest experts (ties: lower id first): what st.bin_expert_shares and
    st.hottest_experts give row by row, for all rows at once."""
    rows, e = tokens.shape
    per_bin = max(1, math.ceil(e / st.MAX_EXPERT_BINS))
    totals = tokens.sum(axis=1, dtype=np.int64)
    safe = np.where(totals > 0, totals, 1).astype(np.float64)
    padded = tokens if e % per_bin == 0 else np.pad(tokens, ((0, 0), (0, per_bin - e % per_bin)))
    binned = padded.reshape(rows, -1, per_bin).sum(axis=2) / safe[:, None]
    share_rows = np.round(binned, SHARE_DECIMALS).tolist()
    k = min(st.HOT_EXPERTS, e)
    top = np.argsort(-tokens, axis=1, kind="stable")[:, :k]
    top_share = (np.take_along_axis(tokens, top, axis=1) / safe[:, None]).tolist()
    has = (totals > 0).tolist()
    shares = [row if ok else [] for row, ok in zip(share_rows, has, strict=True)]
    hot = [[st.HotExpert(expert=x, share=v) for x, v in zip(ids, vals, strict=True)] if ok else []
           for ids, vals, ok in zip(top.tolist(), top_share, has, strict=True)]
    return shares, per_bin, hot


# What the policy passes as WindowsOutput.signals(reuse_ns=...): the window fields computed less than
# this long ago (and under a tenth of the window) are handed back while no data came in since. The
# policy asks every 200 ms, and between the main loop's rounds (up to 4 s at light load) only the
# windows' ends move: at most ~1 s of ageing on its 10 s windows, against ~100 µs of a cold policy
# wake-up each time (the routing table, three p99s: ~0.4 ms/s at the reference load). Other readers
# (the default, 0) get the windows exactly as they stand.
SIGNALS_REUSE_NS = 1_000_000_000


@dataclass(slots=True, frozen=True)
class _HeldSignals:
    """signals()'s window fields as computed at ``at_ns`` over the data of ``version``, for ``want``."""

    version: int
    at_ns: int
    want: frozenset[str]
    values: dict[str, object]


class WindowsOutput:
    name = "windows"

    def __init__(self, *, window_ns: int = DEFAULT_WINDOW_NS, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.window_ns = window_ns
        self.clock = clock
        self._lock = threading.Lock()  # signals() / panels() run on the policy and publisher threads
        self._request_latency_ms = SlidingQuantile(duration_ns=window_ns)
        self._phases = PhaseWindow(duration_ns=window_ns)  # same span of time as the request window
        self._step_ms = SlidingQuantile(duration_ns=window_ns)
        self._load_ms = SlidingQuantile(duration_ns=window_ns)
        self._routing: RoutingHealthWindow | None = None
        # the last routing table read for signals() and its Gini and entropy dicts (_routing_signals)
        self._routing_held: tuple[LayerTable, dict[int, float], dict[int, float]] | None = None
        self._request_rate = EventRate()
        self._error_rate = EventRate()
        self._step_rate = EventRate()
        self._errors_total = 0
        self._memory: MemorySignal | None = None
        self._nvml: NvmlSample | None = None
        self._layer_precision: dict[int, str] = {}
        self._runtime: RuntimeState | None = None
        self._net = NetSignalWindow(window_ns=window_ns)
        self._ranks = RankWindow(window_ns=window_ns)
        # signals(reuse_ns=...): the window fields the last call computed, for a caller that takes
        # them again while no data came in (``_version``: every export that brought some)
        self._version = 0
        self._held_signals: _HeldSignals | None = None

    # ------------------------------------------------------------------ Output
    def export(self, batch: Sequence[JoinEvent]) -> None:
        now = self.clock()
        run: list[BufferedStep] = []  # consecutive steps of one join StepGroup: one routing add
        with self._lock:
            if batch:
                self._version += 1  # (signals() computes its fields afresh)
            for event in batch:
                match event:
                    case RequestJoined(record=record, breakdown=breakdown):
                        self._request_latency_ms.add(record.end_ns, (record.end_ns - record.start_ns) / 1e6)
                        if breakdown is not None:
                            self._phases.add(breakdown)
                        self._request_rate.add(now)
                        if not record.answered:
                            self._errors_total += 1
                            self._error_rate.add(now)
                    case StepSeen(step=b, experts_changed=changed):
                        step = b.step
                        self._step_ms.add(step.end_ns, step.duration_ns / 1e6)
                        self._step_rate.add(now)
                        self._ranks.add(pid=step.pid, end_ns=step.end_ns, duration_ms=step.duration_ns / 1e6,
                                        tokens=step.tokens, seen_ns=now)
                        for load in step.expert_loads():
                            self._load_ms.add(load.end_ns, load.duration_ns / 1e6)
                        if changed:
                            self._add_routing_run(run)
                            self._routing = None  # windows are per E: restart them
                        if b.num_experts > 0:
                            if self._routing is None:
                                self._routing = RoutingHealthWindow(
                                    duration_ns=self.window_ns, num_experts=b.num_experts,
                                    bucket_ns=self.window_ns // ROUTING_BUCKETS,
                                )
                            if not (run and b.group is not None and b.group is run[-1].group
                                    and b.group_index == run[-1].group_index + 1):
                                self._add_routing_run(run)
                            if b.group is not None:
                                run.append(b)
                            else:
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
            self._add_routing_run(run)

    def _add_routing_run(self, run: list[BufferedStep]) -> None:
        """The routing window takes a run of one group's steps in one add (then the run is empty)."""
        if not run:
            return
        group = run[0].group
        assert group is not None and self._routing is not None
        self._routing.add_run([b.step.end_ns for b in run], group, run[0].group_index)
        run.clear()

    def force_flush(self) -> None:
        return None

    def shutdown(self, deadline_ns: int) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ the policy's view
    def signals(self, t_s: float | None = None, *, wanted: Collection[str] | None = None,
                overrides: Mapping[str, object] | None = None, reuse_ns: int = 0) -> Signals:
        """The windows now (NaN where there is no data). ``wanted``: the Signals fields to compute
        (the policy's rules' signals; None: every one); the others are left NaN / empty. The policy
        asks five times a second, and most of its default rules read a few of the twenty.
        ``overrides``: fields from elsewhere (the runtime's queues), set in the one Signals made
        (dataclasses.replace on it after was a fifth of an idle policy period). ``reuse_ns``: the
        window fields the last call computed are handed back if no data came in since and it was
        less than this long ago (and under a tenth of the window): the policy's SIGNALS_REUSE_NS;
        0 (the default): the windows as they stand now."""
        now = self.clock()
        want = _ALL_SIGNALS if wanted is None else wanted
        if overrides:  # not computed here only to be replaced (the kernel's request p99, the runtime's memory)
            want = frozenset(want).difference(overrides)
        with self._lock:
            held = self._held_signals
            if (reuse_ns > 0 and held is not None and held.version == self._version
                    and 0 <= now - held.at_ns < min(reuse_ns, self.window_ns // 10) and held.want == want):
                fields = held.values  # no data since, the windows moved on by less than the reuse
            else:
                fields = self._window_fields(now, want)
                self._held_signals = _HeldSignals(self._version, now, frozenset(want), fields)
        # (the held fields are never written to: the overrides go into a merged copy)
        return make_signals(now / 1e9 if t_s is None else t_s, {**fields, **overrides} if overrides else fields)

    def _window_fields(self, now: int, want: Collection[str]) -> dict[str, object]:
        """signals()'s fields from the windows at ``now`` (the caller holds the lock)."""
        values: dict[str, object] = {}
        routing = self._routing
        if routing is not None and ("expert_load_gini" in want or "router_entropy_ratio" in want):
            gini, entropy = self._routing_signals(routing.table(now))  # every layer's window at once
            if "expert_load_gini" in want:
                values["expert_load_gini"] = gini
            if "router_entropy_ratio" in want:
                values["router_entropy_ratio"] = entropy
        if "device_memory_used_ratio" in want:
            memory = self._memory
            values["device_memory_used_ratio"] = memory.ratio if memory is not None else NAN
        if "step_p99_ms" in want:
            values["step_p99_ms"] = self._step_ms.p99(now)
        if "expert_load_p99_ms" in want:
            values["expert_load_p99_ms"] = self._load_ms.p99(now)
        if "request_p99_ms" in want:
            values["request_p99_ms"] = self._request_latency_ms.p99(now)
        if any(name in want for name in _NET_SIGNALS):
            net = self._net.rates(now)
            values.update(listen_overflows_per_s=net.listen_overflows_per_s,
                          tcp_retransmits_per_s=net.retransmits_per_s, tcp_resets_per_s=net.resets_per_s)
        phases = self._phases
        for name, row in _PHASE_SIGNALS.items():
            if name in want:
                values[name] = phases.p99(row, now)
        if "request_ttft_p99_ms" in want:
            values["request_ttft_p99_ms"] = phases.ttft_p99(now)
        if "request_tpot_p99_ms" in want:
            values["request_tpot_p99_ms"] = phases.tpot_p99(now)
        return values

    def _routing_signals(self, table: LayerTable) -> tuple[dict[int, float], dict[int, float]]:
        """The policy's Gini and router-entropy ratio per layer of a routing table (NaN left out),
        made once per table: the window hands the same table back until it changes, and between
        the main loop's rounds (up to 4 s) the policy asks twenty times (its caller copies nothing:
        Signals are read only)."""
        held = self._routing_held
        if held is not None and held[0] is table:
            return held[1], held[2]
        layers = table.layers.tolist()
        gini = {k: v for k, v in zip(layers, table.gini.tolist(), strict=True) if not math.isnan(v)}
        entropy = {k: v for k, v in zip(layers, table.router_entropy_normalised.tolist(), strict=True)
                   if not math.isnan(v)}
        self._routing_held = (table, gini, entropy)
        return gini, entropy

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

    def ranks_panel(self, *, nvtx_drops: dict[int, int] | None = None,
                    comms: dict[int, str] | None = None, exited: Collection[int] = ()) -> st.Ranks:
        """The live view's ranks panel: steps per producer process (pid) over the window."""
        with self._lock:
            return self._ranks.panel(self.clock(), nvtx_drops=nvtx_drops, comms=comms, exited=exited)

    def phases_panel(self) -> Phases:
        """The live view's "where the time goes" panel: the phase window the policy reads."""
        with self._lock:
            return self._phases.table(self.clock())

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
                shares, per_bin, hot = expert_shares(table.tokens)
                for i, layer in enumerate(table.layers.tolist()):
                    layers.append(
                        st.MoeLayer(
                            layer=layer,
                            num_experts=routing.num_experts,
                            experts_per_bin=per_bin if shares[i] else 1,
                            expert_token_share=shares[i],
                            hot_experts=hot[i],
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
