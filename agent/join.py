"""The join: kernel-timed requests + NVTX MoE steps + device samples, in one place.

Sources emit typed records (the daemon hands each to ``RequestJoin.sink``):

- ``IngressRecord`` when the kernel saw a request complete (probes/ingress);
- ``StepBatch`` of completed ``moe.step`` trees (collectors/nvtx → collectors/moe_convention);
- ``TelemetryRecord`` for every device/host sample (collectors/registry);
- ``RuntimeState`` when the runtime's control-socket ``stats`` changed (agent/policy/stats_source);
- ``NetSignalRecord`` for the kernel's network signals on the targets' ports (collectors/netsig).

The join turns them into ``JoinEvent``s and hands every event to every registered ``Output``
(agent/outputs: traces, metrics, the windows the policy and the live view read). It never builds a
span or writes a metric itself, and an output is added with ``add_output``, never edited in here.

Join rule: a step served a request when the step's ``moe.request`` marks carry the request's key
(the connection's fd), the step ran in the same process (pid == tgid), and the step started inside
the request's kernel-timed interval [first byte read, last byte written]. Steps end before the
response that depends on them is written, but the daemon polls NVTX and ingress one after the other:
with ``defer_requests`` (the agent's setting) a request record waits for the first tick that started
after it ended, by when all its steps have been drained (``drain_requests``). Buffered steps are
kept for ``step_retention_ns`` and bounded in count.

Each joined request carries its breakdown (``RequestJoined.breakdown``, agent/request_phases.py:
phases, TTFT/TPOT, tokens), computed here from its claimed steps before their layer trees are let
go; every output reads that one result.

Memory-source priority is decided here, once: the NVML signal wins; host / cgroup / budget signals
count only where NVML has none. Every output sees the chosen signal on ``TelemetrySeen``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.request_phases import RequestBreakdown, StepTimes, breakdown
from moescope.agent.routing_health import (
    NAN,
    LayerTable,
    StepsTable,
    counts_from_marks,
    empty_table,
    layer_table,
    stacked_view,
    steps_table,
)
from moescope.collectors.host import HostSample, MemorySignal
from moescope.collectors.moe_convention import ROUTER_NONE, LayerColumns, StepBatch, StepEvent
from moescope.collectors.netsig import NetSignalRecord
from moescope.collectors.nvml import NvmlSample
from moescope.collectors.registry import TelemetryRecord
from moescope.probes.ingress.loader import IngressRecord

log = logging.getLogger(__name__)

DEFAULT_STEP_RETENTION_NS = 120_000_000_000
DEFAULT_MAX_BUFFERED_STEPS = 20_000
# ... and in layers: a buffered step holds its layer tree until every request of its batch has
# claimed it, so at 58 layers the step bound alone let the buffer reach GBs (measured: 1.2 GB RSS
# at DeepSeek-V3 shape, 8 x 25 steps/s, ~9 KB per buffered layer). 50k layers: 12,500 steps of the
# reference model (L=4), 862 of DeepSeek-V3 (4 s at 200 steps/s); past it the oldest held tree is
# let go (step_trees_dropped_overflow, TreeDropped: its step span then has no layer subtree) and
# the step stays for its requests. (Until 2026-12-07 the oldest steps left the buffer instead,
# tree or none, so the trees' bound cut how long a step waited for its request.)
DEFAULT_MAX_BUFFERED_LAYERS = 50_000
# ... and in bytes, which is what grows with E: a layer's tree is its [2E] int32 routing row plus
# ~LAYER_TREE_OVERHEAD_BYTES of columns and health (2.2 KB at E = 256; 288 B at the reference's
# E = 16), and a table that is not those rows counts too (_own_tree). 8 MiB: ~65 DeepSeek-V3
# steps whose subtree a trace keeps (sampled-out and fully claimed steps let theirs go at once):
# the last ~18 s of kept subtrees at 200 steps/s with the traces' default sampling (~3.7 a
# second); an older kept step still waiting for its requests keeps its span and health, not its
# layer spans. At the reference shape (~1.2 KB a tree) it is ~7,000 steps, more than its 120 s
# retention keeps at its rates. 32 MiB held ~40 MB in steady state beside eight DeepSeek-V3
# producers, the agent's largest single part, which no request there ever claims
# (docs/benchmarks.md, "The agent's memory in steady state").
DEFAULT_MAX_BUFFERED_TREE_BYTES = 8 << 20
LAYER_TREE_OVERHEAD_BYTES = 160
# A kept step's table stays a view of its group (StepsTable) when everything the group holds is at
# most SHARED_GROUP_MAX_BYTES, or at most SHARED_GROUP_BYTES_PER_STEP for each of its steps: the
# copy (~10 µs a step, a dataclass and 13 arrays) buys nothing there, and the group keeps making
# the steps' health in one pass (agent/outputs/traces.py). The reference model's quiet 2 s rounds
# were groups of ~90-110 steps holding 64-128 KB (~1 KB a step; measured live, 2026-12-06; 4 s
# rounds since: twice that, within the per-step bound): until
# then the absolute bound alone copied every one of them, ~6 % of the agent's CPU at the reference
# load (docs/benchmarks.md). A DeepSeek-V3 batch (~2 MB, ~120 KB a step) is copied out of as before.
# At most a group's steps x 4 KiB stays pinned by one kept step, and only until it is retired.
SHARED_GROUP_MAX_BYTES = 64 << 10
SHARED_GROUP_BYTES_PER_STEP = 4 << 10
DRAIN_ALL_NS = 2**63 - 1
# At shutdown the buffered steps go out this many at a time, the outputs given a chance to drain
# between (``expire(flush=True, between=...)``): 20,000 held steps retired at once made more spans
# than the export queue holds, dropped in one burst at exit.
FLUSH_CHUNK_STEPS = 64
INT32_MAX = 2**31 - 1  # per-step token counts per expert fit (a bigger one is a bad payload, counted)


@dataclass(slots=True, init=False)
class BufferedStep:
    """One step while it waits for the requests it served (the join's unit of state). Its own
    __init__: the one dataclasses writes stays interpreted in the compiled build (~6x the cost)."""

    seq: int  # join-wide step number: outputs key their own per-step state by it
    step: StepEvent
    num_experts: int
    # routing and health of the step's routed layers as arrays, computed once per step: metrics,
    # windows and spans all read this
    table: LayerTable
    batch_size: int  # distinct request keys marked in the step
    claims: int
    # the step's time in moe.router and moe.expert.load ranges (whole batch), summed once when
    # buffered: the layer tree may be let go before a later batch-mate's breakdown needs them
    routing_ns: int
    expert_load_ns: int
    layer_count: int  # moe.layer ranges of the step (its tree may be let go before it retires)
    tree_bytes: int  # what the join counted for its tree (tree_bytes() when buffered; 0 once let go)
    retired: bool  # left the buffer
    # the steps of a parser batch whose tables were computed as one (``table`` is
    # group.step(group_index)): outputs add a run of such steps in one operation; None for a lone step
    group: StepsTable | None
    group_index: int

    def __init__(self, seq: int, step: StepEvent, num_experts: int, table: LayerTable, batch_size: int,
                 claims: int = 0, routing_ns: int = 0, expert_load_ns: int = 0, layer_count: int = 0,
                 tree_bytes: int = 0, retired: bool = False, group: StepsTable | None = None,
                 group_index: int = 0) -> None:
        self.seq = seq
        self.step = step
        self.num_experts = num_experts
        self.table = table
        self.batch_size = batch_size
        self.claims = claims
        self.routing_ns = routing_ns
        self.expert_load_ns = expert_load_ns
        self.layer_count = layer_count
        self.tree_bytes = tree_bytes
        self.retired = retired
        self.group = group
        self.group_index = group_index


# ---------------------------------------------------------------- what outputs receive


class KeySteps:
    """One request key's buffered steps, oldest first (RequestJoin's index by key): a list read
    from ``head`` on, its read part cut off once it is most of the list. A deque per key was ~620 B
    even for one step (its first 64-slot block): 25 MB of the agent at DeepSeek-V3 shape with eight
    producers' 4,096 request keys each (docs/benchmarks.md, "The agent's memory in steady state")."""

    __slots__ = ("steps", "head")

    def __init__(self) -> None:
        self.steps: list[BufferedStep] = []
        self.head = 0

    def __len__(self) -> int:
        return len(self.steps) - self.head

    def first(self) -> BufferedStep:
        return self.steps[self.head]

    def live(self) -> list[BufferedStep]:
        return self.steps[self.head:] if self.head else self.steps

    def drop_first(self) -> None:
        head = self.head + 1
        if head * 2 >= len(self.steps):  # (empty: the list starts over)
            del self.steps[:head]
            head = 0
        self.head = head


@dataclass(frozen=True, slots=True)
class StepSeen:
    """A completed step entered the join (every step, exactly once)."""

    step: BufferedStep
    experts_changed: bool  # E differs from the previous step's: per-E windows restart


@dataclass(frozen=True, slots=True)
class RequestJoined:
    """A kernel-timed request with the buffered steps that served it, oldest first."""

    record: IngressRecord
    steps: tuple[BufferedStep, ...]
    first_claims: tuple[bool, ...]  # per step: this request is the first of its batch to arrive
    # where its time went (agent/request_phases.py); None when no step carried it
    breakdown: RequestBreakdown | None = None


@dataclass(frozen=True, slots=True)
class TreeDropped:
    """A buffered step's layer tree let go before its requests claimed it: the trees held were past
    max_buffered_layers or max_buffered_tree_bytes. The step stays buffered for its requests (its
    metrics were counted at StepSeen); an output that meant to read its tree takes what it needs
    now (the traces: the step span's health; the span then carries no layer subtree)."""

    step: BufferedStep


@dataclass(frozen=True, slots=True)
class StepRetired:
    """A step left the buffer; ``step.claims == 0``: no request claimed it."""

    step: BufferedStep
    evicted: bool = False  # pushed out early by max_buffered_steps (dropped, counted), not retention


@dataclass(frozen=True, slots=True)
class TelemetrySeen:
    """A device or host sample, with the memory signal the agent uses from now on."""

    collector: str
    sample: NvmlSample | HostSample | object
    memory: MemorySignal | None


@dataclass(frozen=True, slots=True)
class RuntimeSeen:
    """The runtime's own view (control-socket stats): per-layer precision, residency, pools."""

    state: RuntimeState
    layer_precision: dict[int, str]


@dataclass(frozen=True, slots=True)
class NetSignalSeen:
    """Kernel network signals: counter increases since the previous reading, retransmit/reset events."""

    record: NetSignalRecord


JoinEvent = StepSeen | RequestJoined | TreeDropped | StepRetired | TelemetrySeen | RuntimeSeen | NetSignalSeen


class Output(Protocol):
    """Where joined events go (OpenTelemetry's exporter shape): traces, metrics, windows, ..."""

    name: str

    def export(self, batch: Sequence[JoinEvent]) -> None:
        """Handle events in order; must not raise into the join (errors are counted there anyway)."""
        ...

    def force_flush(self) -> None:
        """Write out anything held back (e.g. per-step metrics summed between scrapes)."""
        ...

    # Optional: ``layer_tree_needed(step: BufferedStep) -> bool``, asked right after a step's
    # StepSeen. An output that reads a buffered step's layer tree or table after its StepSeen (the
    # trace output, for the subtrees it keeps) says so; when none does, the join lets the tree go at
    # once instead of holding it until every request of the batch has claimed the step. Outputs
    # without the method read both only during StepSeen.

    def shutdown(self, deadline_ns: int) -> None:
        """Flush and release, finishing by ``deadline_ns`` (CLOCK_MONOTONIC)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for the agent's summary."""
        ...


def expert_precisions(state: RuntimeState, layer: int) -> tuple[str | None, list[str]]:
    """A layer's experts' precisions as the runtime reports them, and the most common one."""
    precisions = [state.precision.get((layer, e), state.precision_default) for e in range(state.experts)]
    return (max(set(precisions), key=precisions.count) if precisions else None), precisions


def precision_text(base: str | None, precisions: list[str]) -> str | None:
    """The experts' common precision, or "fp32+2" when two experts of the layer run another one
    (the live view and ``moe.precision`` use the same text)."""
    others = sum(1 for p in precisions if p != base)
    return f"{base}+{others}" if others else base


def layer_precision_of(state: RuntimeState) -> dict[int, str]:
    """Each layer's precision as one string (``precision_text``)."""
    out: dict[int, str] = {}
    for layer in range(state.layers):
        base, precisions = expert_precisions(state, layer)
        text = precision_text(base, precisions)
        if text is not None:
            out[layer] = text
    return out


def tree_bytes(b: BufferedStep) -> int:
    """What a buffered step's layer tree holds, about (0 once it was let go): its columns' arrays
    where it has them (a moe/v1 step's int64 counts, mask and FFN ranges are ~350 KB at
    qwen3-30b-a3b shape), else an estimate per layer object."""
    columns = b.step.columns
    if columns is not None and b.step.layer_count:
        return _columns_bytes(columns)
    return b.step.layer_count * (8 * b.num_experts + LAYER_TREE_OVERHEAD_BYTES)


def _columns_bytes(columns: LayerColumns) -> int:
    total = 0
    for name in _COLUMN_ARRAYS:
        value = getattr(columns, name)
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, tuple):  # FfnColumns
            total += sum(a.nbytes for a in value if isinstance(a, np.ndarray))
    for vector in columns.experts_time_us or ():
        if vector is not None:
            total += vector.nbytes
    return total + len(columns) * LAYER_TREE_OVERHEAD_BYTES


def _own_tree(b: BufferedStep) -> int:
    """A step kept with its tree (for its trace subtree) gets its own copies of the arrays that are
    views into its parser batch (the decoded step vectors are strided views of the batch's payload
    copy): else one kept step would hold its whole batch's payloads (~2 MB at DeepSeek-V3 shape)
    for as long as it is buffered. Its table's routing block is the same numbers as its columns'
    counts where every layer is routed (moe/v2 at DeepSeek-V3 shape: 119 KB a step): then the two
    share one copy. Returns the bytes of a block the table holds apart from the columns (what
    tree_bytes did not count)."""
    columns = b.step.columns
    counts = columns.counts if columns is not None else None
    if columns is not None:
        for name in _COLUMN_ARRAYS:
            value = getattr(columns, name)
            if isinstance(value, np.ndarray) and value.base is not None:
                setattr(columns, name, value.copy())
            elif isinstance(value, tuple):  # FfnColumns: arrays of the batch's ranges
                setattr(columns, name, type(value)(*(np.copy(a) for a in value)))
        if columns.experts_time_us is not None:
            columns.experts_time_us = [None if v is None else v.copy() for v in columns.experts_time_us]
    table = b.table
    owned = columns.counts if columns is not None else None
    if table.block is not None and table.block.base is not None:
        if b.group is not None and _group_bytes(b.group) <= shared_group_bound(len(b.group)):
            return 0  # a small group is kept whole (SHARED_GROUP_MAX_BYTES, SHARED_GROUP_BYTES_PER_STEP)
        block = table.block
        if (owned is not None and owned is not counts and owned.dtype == block.dtype and owned.shape == block.shape
                and np.array_equal(owned, block)):
            block = owned  # (read-only from here on, like every buffered step's arrays)
        else:
            block = block.copy()
        e = table.num_experts
        b.table = dataclasses.replace(
            table, tokens=block[:, :e], dropped=block[:, e:], block=block,
            **{name: getattr(table, name).copy() for name in _TABLE_COLUMNS},
        )
    b.group = None
    # tree_bytes counted a columnar step's arrays, not its table's block unless it is their counts
    # (an object step's estimate covers its routers' rows, which are views of the block)
    held = b.table.block
    if owned is None or held is None or held is owned or held.base is owned:
        return 0
    return int(held.nbytes)


def shared_group_bound(steps: int) -> int:
    """The most a group of ``steps`` steps may hold for its kept steps to stay views of it."""
    return max(SHARED_GROUP_MAX_BYTES, SHARED_GROUP_BYTES_PER_STEP * steps)


def _group_bytes(group: StepsTable) -> int:
    """What keeping a view of ``group`` holds: its health columns and its blocks' whole buffer (a
    view into a decoded batch holds the batch; an owner of unknown size counts as too large)."""
    total = sum(int(getattr(group, name).nbytes) for name in _GROUP_COLUMNS)
    base: Any = group.blocks.base
    for _ in range(4):  # to the owner: a view's base, an as_strided wrapper's .base, a buffer's object
        if isinstance(base, np.ndarray) and base.base is None:
            break
        owner = getattr(base, "base", None)
        if owner is None:
            break
        base = owner
    if base is None:
        return total + int(group.blocks.nbytes)
    if isinstance(base, np.ndarray):
        return total + int(base.nbytes)
    try:
        return total + memoryview(base).nbytes
    except TypeError:
        return 1 << 62  # unknown: never small enough to keep


_GROUP_COLUMNS = tuple(f.name for f in dataclasses.fields(StepsTable) if f.name != "blocks")
_COLUMN_ARRAYS = tuple(f.name for f in dataclasses.fields(LayerColumns)
                       if f.name not in ("num_experts", "experts_time_us"))
_TABLE_COLUMNS = tuple(f.name for f in dataclasses.fields(LayerTable) if f.name not in ("tokens", "dropped", "block"))


def step_phase_times(step: StepEvent) -> tuple[int, int]:
    """(routing ns, expert-load ns) of one step: its moe.router and moe.expert.load ranges summed
    (a range that ends before it starts counts 0)."""
    columns = step.columns
    if columns is not None:
        return columns.routing_ns(), 0  # a columnar step has no expert-load ranges
    routing_ns = load_ns = 0
    for layer in step.layers:
        router = layer.router
        if router is not None:
            routing_ns += max(0, router.end_ns - router.start_ns)
        for load in layer.loads:
            load_ns += max(0, load.end_ns - load.start_ns)
    return routing_ns, load_ns


def step_times(b: BufferedStep, *, key: int) -> StepTimes:
    """What the request breakdown needs of one of its steps; tokens only where the step reports
    this request's (moe.step.requests); a step that reports others' but not this one's reports none."""
    step = b.step
    tokens = step.request_tokens.get(key) if step.request_tokens is not None else None
    # (the NamedTuple's fields in order, made by tuple.__new__: its generated __new__ is interpreted
    # Python, ~240 ns a call against ~60, and a request has one of these per step that served it)
    return tuple.__new__(StepTimes, (step.start_ns, step.end_ns, b.routing_ns, b.expert_load_ns,
                                     None if tokens is None else tokens[0], None if tokens is None else tokens[1]))


class RequestJoin:
    """Joins the sources and fans the joined events out to the registered outputs."""

    def __init__(
        self,
        *,
        num_experts: int | None = None,
        step_retention_ns: int = DEFAULT_STEP_RETENTION_NS,
        max_buffered_steps: int = DEFAULT_MAX_BUFFERED_STEPS,
        max_buffered_layers: int = DEFAULT_MAX_BUFFERED_LAYERS,
        max_buffered_tree_bytes: int = DEFAULT_MAX_BUFFERED_TREE_BYTES,
        clock: Callable[[], int] = time.monotonic_ns,
        defer_requests: bool = False,
    ) -> None:
        self.step_retention_ns = step_retention_ns
        self.max_buffered_steps = max_buffered_steps
        self.max_buffered_layers = max_buffered_layers
        self.max_buffered_tree_bytes = max_buffered_tree_bytes
        self._buffered_layers = 0  # layer trees held by buffered steps (trimmed ones count 0)
        self._buffered_tree_bytes = 0  # ... and their size (tree_bytes)
        self.clock = clock
        # sink() holds request records until drain_requests(now_ns) (a daemon tick hook) sees they ended
        # before the tick started: the steps of such a request were in the NVTX ring when it was drained.
        self.defer_requests = defer_requests
        self._deferred: list[IngressRecord] = []
        self._configured_experts = num_experts
        self._num_experts = num_experts or 0
        self._lock = threading.Lock()  # records arrive on the daemon thread; stats() may run elsewhere
        self._outputs: list[Output] = []
        self._tree_readers: list[Callable[[BufferedStep], bool]] = []  # outputs' layer_tree_needed
        self._output_errors: dict[str, int] = {}
        # (pid, request key) -> buffered steps carrying that key, oldest first
        self._by_key: dict[tuple[int, int], KeySteps] = {}
        self._buffer: deque[BufferedStep] = deque()
        # the buffered steps that kept their layer tree, oldest first (some since let go or retired:
        # skipped): the trees' bounds let the oldest go first (_drop_trees_over_bounds)
        self._trees: deque[BufferedStep] = deque()
        self._seq = 0
        self._memory: MemorySignal | None = None
        self._empty_tables: dict[int, LayerTable] = {}  # per E: what a step without its tree holds
        # gen_ai.request.model: the runtime's stats "model", latest seen (one control socket per agent)
        self._model: str | None = None
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "requests", "requests_unanswered", "requests_joined", "steps", "steps_joined",
                "steps_unjoined", "steps_evicted_overflow", "step_trees_dropped_overflow", "telemetry_samples",
                "runtime_states", "experts_grown", "layers_bad_routing", "records_unknown",
                "step_trees_released_unread",
            ),
            0,
        )

    # ------------------------------------------------------------------ outputs
    def add_output(self, output: Output) -> None:
        self._outputs.append(output)
        needed = getattr(output, "layer_tree_needed", None)  # the optional part of Output
        if needed is not None:
            self._tree_readers.append(needed)

    @property
    def outputs(self) -> list[Output]:
        return list(self._outputs)

    def _export(self, batch: Sequence[JoinEvent]) -> None:
        if not batch:
            return
        for output in self._outputs:
            try:
                output.export(batch)
            except Exception:  # one output's bug must not cost the others their data
                n = self._output_errors.get(output.name, 0) + 1
                self._output_errors[output.name] = n
                if n == 1:
                    log.exception("output %s failed (further failures are only counted)", output.name)

    # ------------------------------------------------------------------ inputs
    def sink(self, record: object) -> None:
        """The daemon's record sink: one handler per record type."""
        match record:
            case IngressRecord():
                if self.defer_requests:
                    with self._lock:
                        self._deferred.append(record)
                else:
                    self.on_request(record)
            case StepBatch():
                self.on_steps(record.steps)
            case TelemetryRecord():
                self.on_telemetry(record)
            case RuntimeState():
                self.on_runtime_state(record)
            case NetSignalRecord():
                self._export([NetSignalSeen(record)])
            case _:
                with self._lock:
                    self._counts["records_unknown"] += 1

    def on_request(self, record: IngressRecord) -> None:
        """One kernel-timed request."""
        with self._lock:
            self._counts["requests"] += 1
            if not record.answered:
                self._counts["requests_unanswered"] += 1
            steps = self._claim_steps(record)
            first = tuple(b.claims == 1 for b in steps)
            phases = breakdown(record, [step_times(b, key=record.fd) for b in steps], model=self._model)
        self._export([RequestJoined(record, tuple(steps), first, phases)])
        with self._lock:
            for b in steps:
                if b.claims >= b.batch_size:
                    # Every request of the batch has been handed out: only the step's header is
                    # needed until it leaves the buffer, so let its layer tree go (most of the heap).
                    self._release_tree_locked(b)

    def on_steps(self, steps: Iterable[StepEvent]) -> None:
        """Completed ``moe.step`` trees from the convention parser."""
        events: list[JoinEvent] = []
        batch = list(steps)
        grouped = self._group_tables(batch)
        for i, step in enumerate(batch):
            with self._lock:
                events.extend(self._add_step(step, grouped.get(i)))
        self._export(events)
        self._release_unread_trees(events)
        self._drop_trees_over_bounds()
        self.expire()

    def on_telemetry(self, record: TelemetryRecord) -> None:
        """An NVML sample or a host memory sample (registry collectors)."""
        sample = record.sample
        with self._lock:
            self._counts["telemetry_samples"] += 1
            if isinstance(sample, NvmlSample):
                signal = sample.memory_signal()
                if signal is not None:
                    self._memory = signal
            elif isinstance(sample, HostSample):
                signal = sample.memory_signal()
                if signal is not None and (self._memory is None or self._memory.source != "nvml"):
                    self._memory = signal  # host/cgroup/budget: the signal where NVML has none
            memory = self._memory
        self._export([TelemetrySeen(record.collector, sample, memory)])

    def on_runtime_state(self, state: RuntimeState) -> None:
        """The runtime's control-socket stats changed (precision per layer, residency, pools)."""
        with self._lock:
            self._counts["runtime_states"] += 1
            if state.model is not None:
                self._model = state.model
        self._export([RuntimeSeen(state, layer_precision_of(state))])

    def drain_requests(self, now_ns: int) -> None:
        """Daemon tick hook: join the deferred requests that ended before this tick started.

        The daemon polls its sources one after another; a request can end (and its record be read)
        after the NVTX ring was drained in the same tick, while its steps, which ended before its
        response, wait in that ring. Every source of this tick was polled at or after ``now_ns``, so
        a request with ``end_ns < now_ns`` has all its steps buffered now; later ones wait a tick.
        """
        with self._lock:
            ready = [r for r in self._deferred if r.end_ns < now_ns]
            if not ready:
                return None
            self._deferred = [r for r in self._deferred if r.end_ns >= now_ns]
        for record in sorted(ready, key=lambda r: r.end_ns):
            self.on_request(record)
        return None

    # ------------------------------------------------------------------ steps
    def _experts_for(self, step: StepEvent) -> tuple[int, bool]:
        """E: the moe.layer payload (moe/v1) wins; else --num-experts; else the largest expert id seen."""
        columns = step.columns
        if columns is not None:
            reported = columns.num_experts
        else:
            reported = max((layer.num_experts or 0 for layer in step.layers), default=0)
        if reported:
            wanted = reported
        elif self._configured_experts:
            wanted = self._configured_experts
        else:
            seen = 0
            for layer in step.layers:
                router = layer.router
                if router is not None:
                    seen = max(seen, router.experts_seen())
                for load in layer.loads:
                    seen = max(seen, load.expert + 1)
                for ffn in layer.ffns:
                    seen = max(seen, ffn.expert + 1)
            wanted = max(seen, self._num_experts)
        changed = wanted != self._num_experts
        if changed:
            self._counts["experts_grown"] += 1
            self._num_experts = wanted
        return self._num_experts, changed

    def _add_step(self, step: StepEvent, grouped: tuple[StepsTable, int] | None = None) -> list[JoinEvent]:
        self._counts["steps"] += 1
        num_experts, changed = self._experts_for(step)
        self._seq += 1
        if grouped is not None and grouped[0].num_experts == num_experts:
            group, index = grouped
            buffered = BufferedStep(self._seq, step, num_experts, group.step(index), len(set(step.requests)),
                                    group=group, group_index=index)
        else:
            buffered = BufferedStep(self._seq, step, num_experts, self._table(step, num_experts),
                                    len(set(step.requests)))
        buffered.routing_ns, buffered.expert_load_ns = step_phase_times(step)
        buffered.layer_count = layers = step.layer_count
        self._buffer.append(buffered)
        for key in set(step.requests):
            queue = self._by_key.get((step.pid, key))
            if queue is None:
                queue = self._by_key[(step.pid, key)] = KeySteps()
            queue.steps.append(buffered)
        events: list[JoinEvent] = [StepSeen(buffered, changed)]
        self._buffered_layers += layers
        buffered.tree_bytes = tree_bytes(buffered)
        self._buffered_tree_bytes += buffered.tree_bytes
        while len(self._buffer) > self.max_buffered_steps:
            self._counts["steps_evicted_overflow"] += 1
            events.append(StepRetired(self._retire_oldest_locked(), evicted=True))
        return events

    def _group_tables(self, steps: list[StepEvent]) -> dict[int, tuple[StepsTable, int]]:
        """Runs of steps with the same reported E and layers, every layer routed: one health pass
        (``steps_table``) for each run instead of a ``layer_table`` per step (the health pass and
        its call cost were a third of the join's time per step at DeepSeek-V3 shape, and most of it
        at the reference model's, where a step's work is small next to each call's). A run is of
        column steps whose routing blocks lie evenly spaced in one decoded array (a batch of moe/v2
        step vectors), or of object steps whose layers each carry a whole routing vector. Steps
        outside a run, or in a run with a bad count, take ``_table`` one by one."""
        out: dict[int, tuple[StepsTable, int]] = {}
        run: list[int] = []
        run_key: tuple[object, ...] | None = None

        def close() -> None:
            if len(run) > 1:
                group = self._group_table([steps[i] for i in run])
                if group is not None:
                    out.update((i, (group, n)) for n, i in enumerate(run))
            run.clear()

        for i, step in enumerate(steps):
            key = self._group_key(step)
            if key is None or key != run_key:
                close()
            run_key = key
            if key is not None:
                run.append(i)
        close()
        return out

    def _group_key(self, step: StepEvent) -> tuple[object, ...] | None:
        """What steps of one run share (None: the step is built alone): a column step's E, layers
        and block layout; an object step's E, layer indices and vector dtype."""
        columns = step.columns
        if columns is not None:
            if (columns.counts is None or columns.counts.dtype != np.int32 or not columns.num_experts
                    or columns.counts.shape[1] != 2 * columns.num_experts
                    or not columns.has_routing.all() or not (columns.router_kind > ROUTER_NONE).all()):
                return None
            return ("columns", columns.num_experts, columns.layer.tobytes())
        width = 2 * self._num_experts
        layers = step.layers
        if not width or not layers:
            return None
        dtype = None
        for layer in layers:
            router = layer.router
            counts = router.counts if router is not None else None
            if counts is None or counts.shape != (width,) or (dtype is not None and counts.dtype != dtype):
                return None
            if layer.num_experts and 2 * layer.num_experts != width:
                return None  # the moe.layer payload names another E: _experts_for decides
            dtype = counts.dtype
        return ("objects", width, dtype, tuple(layer.layer for layer in layers))

    def _group_table(self, steps: list[StepEvent]) -> StepsTable | None:
        head = steps[0].columns
        if head is not None:
            columns = [step.columns for step in steps]
            blocks = stacked_view([c.counts for c in columns if c is not None and c.counts is not None])
            if blocks is None or len(blocks) != len(steps):
                return None
            layers = head.layer
            entropy = np.concatenate([c.entropy_bits for c in columns if c is not None])
        else:
            routers = [[layer.router for layer in step.layers] for step in steps]
            # (_group_key: every layer has a router with counts of one shape and dtype; np.array of
            # the nested lists is np.stack's result without its Python-level wrapper: ~1.5 us, not ~10)
            blocks = np.array([[r.counts for r in rs] for rs in routers])  # type: ignore[union-attr]
            layers = np.array([layer.layer for layer in steps[0].layers], dtype=np.int64)
            entropy = np.array([NAN if r is None or r.entropy_bits is None else r.entropy_bits
                                for rs in routers for r in rs], dtype=np.float64)
        try:  # a negative count anywhere: every step of the run takes the one-by-one path
            group = steps_table(layers=layers, blocks=blocks, router_entropy_bits=entropy)
        except ValueError:
            return None
        if group is not None and head is None:
            for n, rs in enumerate(routers):  # the same counts, now views of the block: the decoded vectors can go
                for row, router in zip(group.blocks[n], rs, strict=True):
                    if router is not None:
                        router.counts = row
        return group

    def _drop_trees_over_bounds(self) -> None:
        """After the unread trees went: while the trees still held are over the layer or byte bound,
        the oldest held tree goes (TreeDropped first, so its readers take what they need); its step
        stays buffered for its requests, counted in step_trees_dropped_overflow."""
        dropping: list[BufferedStep] = []
        with self._lock:
            trees = self._trees
            self._prune_trees_locked()
            layers, size = self._buffered_layers, self._buffered_tree_bytes
            while trees and (layers > self.max_buffered_layers or size > self.max_buffered_tree_bytes):
                b = trees.popleft()  # (held: the front is pruned)
                layers -= b.step.layer_count
                size -= b.tree_bytes
                dropping.append(b)
                self._prune_trees_locked()
        if not dropping:
            return
        self._export([TreeDropped(b) for b in dropping])
        with self._lock:
            for b in dropping:
                self._release_tree_locked(b)
            self._counts["step_trees_dropped_overflow"] += len(dropping)

    def _table(self, step: StepEvent, num_experts: int) -> LayerTable:
        """The step's routed layers as [layers, E] count matrices and their health, all at once.

        moe/v2 rows arrive as arrays (``RouterEvent.counts``) and are copied in; v1's per-expert
        dicts are converted. A layer with bad counts (an expert id >= a configured E, a negative
        count) is left out of the health and counted (``layers_bad_routing``); its timing stays."""
        columns = step.columns
        if columns is not None and columns.num_experts == num_experts:
            return self._columns_table(columns, num_experts)
        routers = [layer for layer in step.layers if layer.router is not None]
        if num_experts <= 0 or not routers:
            return empty_table(max(1, num_experts))
        # one int32 [layers, 2E] block per step: tokens | over capacity. int32 halves what a
        # buffered step holds (at DeepSeek-V3 shape 58 x 512 counts: 119 KB instead of 238 KB)
        both = np.zeros((len(routers), 2 * num_experts), dtype=np.int32)
        of_layer = [layer.router for layer in routers if layer.router is not None]  # (all of them: typed)
        entropy = np.array([NAN if r.entropy_bits is None else r.entropy_bits for r in of_layer], dtype=np.float64)
        index = np.array([layer.layer for layer in routers], dtype=np.int64)
        keep = np.ones(len(routers), dtype=bool)
        # moe/v2 rows of the full [2E] length and one dtype (every layer, normally): one stack, one
        # range check and one copy for all of them; the others one by one below
        full = [(i, r.counts) for i, r in enumerate(of_layer)
                if r.counts is not None and len(r.counts) == 2 * num_experts]
        stacked = [(i, c) for i, c in full if c.dtype == full[0][1].dtype]
        if stacked:
            block = np.array([c for _, c in stacked])  # (np.stack's result: one length, one dtype)
            fits = (block.min(axis=1) >= 0) & (block.max(axis=1) <= INT32_MAX)
            at = np.array([i for i, _ in stacked], dtype=np.int64)
            both[at[fits]] = block[fits]
            keep[at[~fits]] = False
        done = {i for i, _ in stacked}
        for i, layer in enumerate(routers):
            if i in done:
                continue
            router = layer.router
            assert router is not None
            counts = router.counts
            if counts is not None:
                half = len(counts) // 2
                if half > num_experts or (half and not 0 <= counts.min() <= counts.max() <= INT32_MAX):
                    keep[i] = False
                    continue
                both[i, :half] = counts[:half]
                both[i, num_experts : num_experts + half] = counts[half:]
                continue
            try:
                tokens = counts_from_marks(router.tokens, num_experts=num_experts)
                dropped = counts_from_marks(router.dropped, num_experts=num_experts)
            except ValueError:
                keep[i] = False
                continue
            if max(int(tokens.max()), int(dropped.max())) > INT32_MAX:
                keep[i] = False
                continue
            both[i, :num_experts], both[i, num_experts:] = tokens, dropped
        if not keep.all():
            self._counts["layers_bad_routing"] += int((~keep).sum())
            both, entropy, index = both[keep], entropy[keep], index[keep]
        for row, layer in zip(both, (layer for layer, kept in zip(routers, keep, strict=True) if kept), strict=True):
            router = layer.router
            if router is not None and router.counts is not None:
                router.counts = row  # the same counts, now a view of the block: the decoded vector can go
        return layer_table(layers=index, tokens=both[:, :num_experts], dropped=both[:, num_experts:],
                           router_entropy_bits=entropy, block=both)

    def _columns_table(self, columns: LayerColumns, num_experts: int) -> LayerTable:
        """_table for a step whose layers are columns (E = num_experts): its routing block is used
        as it is (the decoded step vector, or the stacked layer vectors), range-checked at once and
        cast only when it is not int32 already."""
        routed = columns.router_kind > ROUTER_NONE
        if not routed.any():
            return empty_table(max(1, num_experts))
        rows = np.flatnonzero(routed)
        every = len(rows) == len(columns)
        counts = columns.counts
        if counts is None:
            block = np.zeros((len(rows), 2 * num_experts), dtype=np.int32)  # routers that sent no routing
        else:
            block = counts if every else counts[rows]
            unrouted = ~columns.has_routing[rows]
            if unrouted.any():
                block = block.copy()
                block[unrouted] = 0
        entropy, index = columns.entropy_bits[rows], columns.layer[rows]
        if block.dtype == np.int32:
            try:  # layer_table refuses a negative count itself (in its one pass): no pass of our own
                return layer_table(layers=index, tokens=block[:, :num_experts], dropped=block[:, num_experts:],
                                   router_entropy_bits=entropy, block=block)
            except ValueError:
                pass  # a negative count: its row is found and left out below
        fits = block.min(axis=1) >= 0
        if block.dtype != np.int32:
            fits &= block.max(axis=1) <= INT32_MAX
        if not fits.all():
            self._counts["layers_bad_routing"] += int((~fits).sum())
            block, entropy, index = block[fits], entropy[fits], index[fits]
        block = block.astype(np.int32, copy=False)
        return layer_table(layers=index, tokens=block[:, :num_experts], dropped=block[:, num_experts:],
                           router_entropy_bits=entropy, block=block)

    def _claim_steps(self, record: IngressRecord) -> list[BufferedStep]:
        """Buffered steps of this request (same pid, key == fd, started inside its interval)."""
        queue = self._by_key.get((record.tgid, record.fd))
        if queue is None or not len(queue):
            return []
        mine = [b for b in queue.live() if record.start_ns <= b.step.start_ns <= record.end_ns]
        mine.sort(key=lambda b: b.step.start_ns)  # arrival order is end order: two model threads can interleave
        if mine:
            self._counts["requests_joined"] += 1
        for b in mine:
            b.claims += 1
        # A later request on this fd starts after this one ended: older entries can go.
        while len(queue) and queue.first().step.start_ns <= record.end_ns:
            queue.drop_first()
        if not len(queue):
            del self._by_key[(record.tgid, record.fd)]
        return mine

    def _release_unread_trees(self, events: Sequence[JoinEvent]) -> None:
        """Steps whose layer tree no output reads after StepSeen (a trace subtree sampled out, or
        no trace output) let it go now: at production depth the buffer is mostly these trees."""
        readers = self._tree_readers
        seen = [e.step for e in events if isinstance(e, StepSeen)]
        unread = [b for b in seen if b.step.layer_count and not any(needed(b) for needed in readers)]
        if unread:
            with self._lock:
                for b in unread:
                    self._release_tree_locked(b)
                self._counts["step_trees_released_unread"] += len(unread)
        if len(unread) < len(seen):
            released = {id(b) for b in unread}
            with self._lock:
                for b in seen:
                    if id(b) not in released:
                        made = _own_tree(b)  # the table's own copy counts toward the bound too
                        if b.tree_bytes and not b.retired:
                            b.tree_bytes += made
                            self._buffered_tree_bytes += made
                            self._trees.append(b)

    def _release_tree_locked(self, b: BufferedStep) -> None:
        if b.retired or not b.step.layer_count:
            return
        self._buffered_layers -= b.step.layer_count
        self._buffered_tree_bytes -= b.tree_bytes
        b.tree_bytes = 0
        b.step = b.step.without_layers()
        b.group = None
        table = self._empty_tables.get(b.num_experts)
        if table is None:
            table = self._empty_tables[b.num_experts] = empty_table(b.num_experts)
        b.table = table

    def _prune_trees_locked(self) -> None:
        """The kept-trees deque's stale front goes: steps retired, or whose tree was let go since
        (claimed by all its requests, or dropped over the bounds)."""
        trees = self._trees
        while trees and (trees[0].retired or not trees[0].tree_bytes):
            trees.popleft()

    def _retire_oldest_locked(self) -> BufferedStep:
        b = self._buffer.popleft()
        b.retired = True
        self._buffered_layers -= b.step.layer_count
        self._buffered_tree_bytes -= b.tree_bytes
        b.tree_bytes = 0
        self._prune_trees_locked()  # (in buffer order: what leaves the buffer leaves its front)
        for key in set(b.step.requests):
            q = self._by_key.get((b.step.pid, key))
            if q is not None and len(q) and q.first() is b:
                q.drop_first()
                if not len(q):
                    del self._by_key[(b.step.pid, key)]
        if b.claims:
            self._counts["steps_joined"] += 1
        else:
            self._counts["steps_unjoined"] += 1
        return b

    def expire(self, *, flush: bool = False, between: Callable[[], object] | None = None) -> None:
        """Retire buffered steps past retention (all with ``flush``); outputs see each retirement.
        With ``flush`` and ``between``, the steps go out FLUSH_CHUNK_STEPS at a time and
        ``between()`` runs after each chunk (the agent's close: the trace export drains)."""
        if flush:
            self.drain_requests(DRAIN_ALL_NS)  # the sources are closed: every request left is final
        now = self.clock()
        chunk = FLUSH_CHUNK_STEPS if flush and between is not None else None
        while True:
            retired: list[JoinEvent] = []
            with self._lock:
                while self._buffer and (flush or self._buffer[0].step.end_ns < now - self.step_retention_ns):
                    retired.append(StepRetired(self._retire_oldest_locked()))
                    if chunk is not None and len(retired) == chunk:
                        break
                more = chunk is not None and bool(self._buffer)
            self._export(retired)
            if not more:
                return
            assert between is not None
            between()

    # ------------------------------------------------------------------ reading
    @property
    def num_experts(self) -> int:
        return self._num_experts

    def memory(self) -> MemorySignal | None:
        """The memory signal chosen by the priority rule (NVML first), or None."""
        return self._memory

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
            out["buffered_steps"] = len(self._buffer)
            out["buffered_layers"] = self._buffered_layers
            out["buffered_tree_bytes"] = self._buffered_tree_bytes
            out["output_errors"] = sum(self._output_errors.values())
            return out
