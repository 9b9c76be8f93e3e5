"""The moe/v2 and moe/v1 NVTX conventions (docs/nvtx-convention.md) -> typed MoE events.

Input: NvtxBatch from collectors/nvtx.py (completed ranges and marks with parent links). Output:
one StepEvent per completed `moe.step` range, holding its request keys and its layers; each layer
holds its router (entropy, per-expert tokens and drops), expert loads and expert FFNs, all with
CLOCK_MONOTONIC timestamps, thread and process ids.

Nesting carries context: children always complete before their parent (push/pop), so a child waits
in `pending` under its parent's uid until the parent completes (or is reported lost by the
collector: its children are then counted as orphans). Steps are keyed by (pid, tid). Unknown
`moe.*` names, malformed payloads or categories, and events in the wrong place are counted in
stats(), never raised.

| name                 | kind                    | category   | payload                    |
|----------------------|-------------------------|------------|----------------------------|
| moe.step             | range                   | -          | int tokens in batch        |
| moe.request          | mark inside moe.step    | -          | int request key            |
| moe.layer            | range                   | layer + 1  | int experts in layer (v1)  |
| moe.router           | range                   | layer + 1  | double mean entropy (bits) |
| moe.expert.tokens    | mark inside moe.router  | expert + 1 | int tokens routed          |
| moe.expert.dropped   | mark inside moe.router  | expert + 1 | int tokens over capacity   |
| moe.expert.load      | range                   | expert + 1 | int bytes moved            |
| moe.expert.ffn       | range                   | expert + 1 | int tokens                 |
| moe.routing (v2)     | mark inside moe.router  | layer + 1  | int vector [2E]: tokens, over capacity |
| moe.experts (v2)     | range inside moe.layer  | layer + 1  | int assignments computed   |
| moe.experts.time (v2)| mark inside moe.experts | layer + 1  | float vector [E]: µs per expert |
| moe.step.device (v2) | mark inside moe.step    | -          | float vector [L]: µs per layer |
| moe.step.routing (v2)| mark inside moe.step    | -          | int vector [L·2E]: moe.routing of every layer |
| moe.step.entropy (v2.2) | mark inside moe.step | -          | float vector [L]: router entropy (bits) per layer |
| moe.step.requests (v2.1) | mark inside moe.step | -        | int vector [3R]: keys, input, output tokens |

Whole batches: a step whose tree is complete in one batch and well formed (known names in their
places, one router and one experts range per layer, v1 per-expert marks only inside routers with
small integer payloads, nothing of it pending from an earlier batch) is assembled column-wise
(`_fast_steps`: nesting resolved with numpy, payloads and vectors decoded per batch); with
COLUMN_MIN_LAYERS layers or more (and no expert-load ranges) it leaves as LayerColumns, with no
Python object per layer, per expert mark or per FFN range: v1 marks summed per (layer, kind,
expert) into an int64 [L, 2E] block, FFN ranges as arrays. A step split over batches is built the
same way layer by layer: each batch's complete, well-formed layers are filed under their step as
("columns", LayerColumns) entries (one event per layer, as the per-event path files its layer
objects), and the step joins them when it ends. Every other event takes the per-event path below,
which keeps every count. Both give the same StepEvents and counters (tests/nvtx, `fast=False`).

v2's routing vector stays an array (``RouterEvent.counts``, [2E]); a v1 step built event by event
sums its per-expert marks into dicts (``RouterEvent.tokens`` / ``dropped``), and a v1 step built
column-wise holds the same sums in ``LayerColumns.counts`` (``marked``: which had a mark), giving
the same dicts when materialized. ``RouterEvent.tokens_by_expert()`` reads either the same way, and
the agent turns all of them into the same count matrices, so both conventions give identical numbers.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from moescope.collectors.nvtx import (
    PAYLOAD_DOUBLE,
    PAYLOAD_FLOAT,
    PAYLOAD_I32,
    PAYLOAD_I64,
    PAYLOAD_NONE,
    PAYLOAD_U32,
    PAYLOAD_U64,
    NvtxBatch,
    StringTable,
)

DOMAIN = "moe"
STEP = "moe.step"
REQUEST = "moe.request"
LAYER = "moe.layer"
ROUTER = "moe.router"
EXPERT_TOKENS = "moe.expert.tokens"
EXPERT_DROPPED = "moe.expert.dropped"
EXPERT_LOAD = "moe.expert.load"
EXPERT_FFN = "moe.expert.ffn"
ROUTING = "moe.routing"
EXPERTS = "moe.experts"
EXPERTS_TIME = "moe.experts.time"
STEP_DEVICE = "moe.step.device"
STEP_ROUTING = "moe.step.routing"
STEP_REQUESTS = "moe.step.requests"
STEP_ENTROPY = "moe.step.entropy"
RANGE_NAMES = frozenset({STEP, LAYER, ROUTER, EXPERT_LOAD, EXPERT_FFN, EXPERTS})
MARK_NAMES = frozenset({REQUEST, EXPERT_TOKENS, EXPERT_DROPPED, ROUTING, EXPERTS_TIME, STEP_DEVICE, STEP_ROUTING,
                        STEP_REQUESTS, STEP_ENTROPY})

# Children waiting for a parent that never completes (e.g. the process died mid-step) are bounded.
MAX_PENDING_PARENTS = 100_000
# ... and so are the children waiting in all (one parent that never ends could collect any number).
MAX_PENDING_CHILDREN = 1_000_000

_INT_TYPES = frozenset({PAYLOAD_U64, PAYLOAD_I64, PAYLOAD_U32, PAYLOAD_I32})
_SIGNED_TYPES = frozenset({PAYLOAD_I64, PAYLOAD_I32})
# mark names as small codes, for the column-wise mark pass
(_OTHER, _UNKNOWN, _REQUEST, _TOKENS, _DROPPED, _ROUTING, _EXPERTS_TIME, _STEP_DEVICE, _STEP_ROUTING,
 _STEP_REQUESTS, _STEP_ENTROPY) = range(11)
_VECTOR_CODES = (_ROUTING, _EXPERTS_TIME, _STEP_DEVICE, _STEP_ROUTING, _STEP_REQUESTS, _STEP_ENTROPY)
_INT_VECTOR_CODES = (_ROUTING, _STEP_ROUTING, _STEP_REQUESTS)
_IS_VECTOR_CODE = np.zeros(16, dtype=bool)  # mark code -> a v2 vector mark
_IS_VECTOR_CODE[list(_VECTOR_CODES)] = True
_ROUTING_CODES = (_ROUTING, _STEP_ROUTING)  # counted as routing_vectors
_FLOAT_TYPES = frozenset({PAYLOAD_DOUBLE, PAYLOAD_FLOAT})
NAN = float("nan")


def _type_table(types: frozenset[int]) -> np.ndarray:
    """payload_type (uint16) -> member of `types`, as a lookup table (np.isin costs ~30x a gather
    on a batch's few rows)."""
    table = np.zeros(1 << 16, dtype=bool)
    table[sorted(types)] = True
    return table


_IS_INT, _IS_SIGNED, _IS_FLOAT = _type_table(_INT_TYPES), _type_table(_SIGNED_TYPES), _type_table(_FLOAT_TYPES)
_IS_UNSIGNED = _IS_INT & ~_IS_SIGNED
_U64_AS_DOUBLE = struct.Struct("<Q"), struct.Struct("<d")  # the payload's 64 bits read as a double
# Columns read once per batch as Python lists: per-row numpy field access costs ~10x a list index.
_RANGE_COLUMNS = ("uid", "parent_uid", "start_ns", "end_ns", "payload", "payload_type", "category", "tid")


# The parser's event classes write their own __init__ (init=False): the one dataclasses generates is
# interpreted Python even in the compiled build (~180 ns a call against ~30 compiled), and the
# parser makes several a layer. The fields, defaults, eq and repr stay the dataclass's; replace()
# works (every field is a keyword of __init__).
@dataclass(slots=True, init=False)
class RouterEvent:
    layer: int
    start_ns: int
    end_ns: int
    entropy_bits: float | None
    # moe/v1: the per-expert marks summed (expert -> tokens routed before capacity / over it)
    tokens: dict[int, int]
    dropped: dict[int, int]
    # v2: the moe.routing vector as sent ([2E]: tokens, then over capacity); its layer checks the
    # length against E and moves it to `counts`
    vector: np.ndarray | None
    # v2: the checked routing row, [2E] of the integer type sent (tokens routed per expert, then over
    # capacity); kept as an array end to end (the agent's step path works on [layers, E] matrices)
    counts: np.ndarray | None
    # False: no moe.router range (moe/v2.2 step vectors gave entropy and routing); start = end = the
    # layer's start, and no routing time is counted
    timed: bool

    def __init__(self, layer: int, start_ns: int, end_ns: int, entropy_bits: float | None,
                 tokens: dict[int, int] | None = None, dropped: dict[int, int] | None = None,
                 vector: np.ndarray | None = None, counts: np.ndarray | None = None, timed: bool = True) -> None:
        self.layer = layer
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.entropy_bits = entropy_bits
        self.tokens = {} if tokens is None else tokens
        self.dropped = {} if dropped is None else dropped
        self.vector = vector
        self.counts = counts
        self.timed = timed

    def routed(self) -> int:
        """Tokens routed in this layer (sum over experts, before capacity)."""
        if self.counts is not None:
            return int(self.counts[: len(self.counts) // 2].sum())
        return sum(self.tokens.values())

    def over_capacity(self) -> int:
        if self.counts is not None:
            return int(self.counts[len(self.counts) // 2 :].sum())
        return sum(self.dropped.values())

    def experts_seen(self) -> int:
        """1 + the largest expert id with a count (v1), or E of the vector (v2); 0 with neither."""
        if self.counts is not None:
            return len(self.counts) // 2
        return 1 + max((*self.tokens, *self.dropped), default=-1)

    def tokens_by_expert(self) -> dict[int, int]:
        """{expert: tokens routed} for the experts with a non-zero count, whichever convention."""
        if self.counts is not None:
            return _nonzero_counts(self.counts[: len(self.counts) // 2])
        return {e: n for e, n in self.tokens.items() if n}

    def dropped_by_expert(self) -> dict[int, int]:
        if self.counts is not None:
            return _nonzero_counts(self.counts[len(self.counts) // 2 :])
        return {e: n for e, n in self.dropped.items() if n}

    @property
    def has_routing(self) -> bool:
        return self.counts is not None or bool(self.tokens) or bool(self.dropped)


@dataclass(slots=True, init=False)
class ExpertLoadEvent:
    expert: int
    start_ns: int
    end_ns: int
    bytes_moved: int | None

    def __init__(self, expert: int, start_ns: int, end_ns: int, bytes_moved: int | None) -> None:
        self.expert = expert
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.bytes_moved = bytes_moved

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True, init=False)
class ExpertFfnEvent:
    expert: int
    start_ns: int
    end_ns: int
    tokens: int | None

    def __init__(self, expert: int, start_ns: int, end_ns: int, tokens: int | None) -> None:
        self.expert = expert
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.tokens = tokens

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True, init=False)
class ExpertsEvent:
    """v2: all experts of a layer (one fused kernel, or the loop over experts)."""

    start_ns: int
    end_ns: int
    tokens: int | None  # assignments computed
    time_us: np.ndarray | None  # per expert (moe.experts.time), where the runtime has it

    def __init__(self, start_ns: int, end_ns: int, tokens: int | None, time_us: np.ndarray | None = None) -> None:
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.tokens = tokens
        self.time_us = time_us

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True, init=False)
class LayerEvent:
    layer: int
    start_ns: int
    end_ns: int
    router: RouterEvent | None
    num_experts: int | None  # moe/v1 `moe.layer` payload; None from v0 producers
    loads: list[ExpertLoadEvent]
    ffns: list[ExpertFfnEvent]
    experts: ExpertsEvent | None  # v2

    def __init__(self, layer: int, start_ns: int, end_ns: int, router: RouterEvent | None = None,
                 num_experts: int | None = None, loads: list[ExpertLoadEvent] | None = None,
                 ffns: list[ExpertFfnEvent] | None = None, experts: ExpertsEvent | None = None) -> None:
        self.layer = layer
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.router = router
        self.num_experts = num_experts
        self.loads = [] if loads is None else loads
        self.ffns = [] if ffns is None else ffns
        self.experts = experts

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


# LayerColumns.router_kind: how a layer's router is known
ROUTER_NONE, ROUTER_RANGE, ROUTER_STEP_VECTORS = 0, 1, 2


class FfnColumns(NamedTuple):
    """A step's moe.expert.ffn ranges (runtimes that loop over experts) as arrays, in (layer, start)
    order."""

    layer: np.ndarray  # int64 [F]: index of the FFN's layer in its LayerColumns (not the layer id)
    expert: np.ndarray  # int64 [F]
    start_ns: np.ndarray  # int64 [F]
    end_ns: np.ndarray  # int64 [F]
    tokens: np.ndarray  # int64 [F]: the payload, signed as sent


@dataclass(slots=True, eq=False)
class LayerColumns:
    """One step's layers as arrays, in start order: what the whole-batch path makes of a clean
    step (every layer with the same E, no expert-load ranges, nothing malformed), so the agent's
    step path reads columns and makes no Python object per layer or per expert. A moe/v1 step's
    per-expert marks arrive summed in ``counts`` (int64; ``marked`` says which entries had a mark)
    and its FFN ranges in ``ffns``. ``materialize()`` builds the same LayerEvent objects the
    per-event path would, for whoever reads ``StepEvent.layers``."""

    layer: np.ndarray  # int64 [L] layer index
    start_ns: np.ndarray  # int64 [L]
    end_ns: np.ndarray  # int64 [L]
    num_experts: int  # E, every layer's moe.layer payload
    router_kind: np.ndarray  # int8 [L]: ROUTER_NONE, ROUTER_RANGE (a moe.router range), ROUTER_STEP_VECTORS
    router_start_ns: np.ndarray  # int64 [L] (where router_kind == ROUTER_RANGE)
    router_end_ns: np.ndarray  # int64 [L]
    entropy_bits: np.ndarray  # float64 [L] (where a router is known)
    has_routing: np.ndarray  # bool [L]: counts[i] is the layer's routing row
    counts: np.ndarray | None  # [L, 2E] tokens routed | over capacity, integer as sent (None: no routing at all)
    has_experts: np.ndarray  # bool [L]: a moe.experts range
    experts_start_ns: np.ndarray  # int64 [L]
    experts_end_ns: np.ndarray  # int64 [L]
    experts_tokens: np.ndarray  # int64 [L]
    experts_time_us: list[np.ndarray | None] | None  # moe.experts.time per layer (None: none at all)
    # moe/v1: [L, 2E] bool, True where counts[i, j] sums at least one moe.expert.tokens (j < E) or
    # moe.expert.dropped (j >= E) mark; None: the counts came from v2 vectors (or there are none)
    marked: np.ndarray | None = None
    ffns: FfnColumns | None = None  # moe.expert.ffn ranges (None: none)

    def __len__(self) -> int:
        return len(self.layer)

    def routing_ns(self) -> int:
        """The moe.router ranges' time summed (a range that ends before it starts counts 0)."""
        timed = self.router_kind == ROUTER_RANGE
        if not timed.any():
            return 0
        return int(np.maximum(self.router_end_ns[timed] - self.router_start_ns[timed], 0).sum())

    def materialize(self) -> list[LayerEvent]:
        counts = self.counts
        times = self.experts_time_us
        out: list[LayerEvent] = []
        e = self.num_experts
        v1 = self._v1_dicts()
        ffns = self._ffn_objects()
        for i, (layer, start, end, kind, r_start, r_end, entropy, routed, has_x, x_start, x_end, x_tokens) in enumerate(
            zip(self.layer.tolist(), self.start_ns.tolist(), self.end_ns.tolist(), self.router_kind.tolist(),
                self.router_start_ns.tolist(), self.router_end_ns.tolist(), self.entropy_bits.tolist(),
                self.has_routing.tolist(), self.has_experts.tolist(), self.experts_start_ns.tolist(),
                self.experts_end_ns.tolist(), self.experts_tokens.tolist(), strict=True)):
            router = None
            if kind == ROUTER_RANGE and v1 is not None:
                tokens, dropped = v1.get(i) or ({}, {})
                router = RouterEvent(layer, r_start, r_end, entropy, tokens, dropped, None, None)
            elif kind == ROUTER_RANGE:
                router = RouterEvent(layer, r_start, r_end, entropy, {}, {}, None,
                                     counts[i] if routed and counts is not None else None)
            elif kind == ROUTER_STEP_VECTORS:
                router = RouterEvent(layer, start, start, entropy, {}, {}, None,
                                     counts[i] if routed and counts is not None else None, False)
            fused = ExpertsEvent(x_start, x_end, x_tokens, times[i] if times is not None else None) if has_x else None
            out.append(LayerEvent(layer, start, end, router, e, [], ffns.get(i, []) if ffns else [], fused))
        return out

    def _v1_dicts(self) -> dict[int, tuple[dict[int, int], dict[int, int]]] | None:
        """moe/v1: layer index -> ({expert: tokens}, {expert: over capacity}) of its marked entries
        (as the per-event path sums them); None for a step whose counts are not v1 marks."""
        if self.marked is None or self.counts is None:
            return None
        e = self.num_experts
        rows, cols = np.nonzero(self.marked)
        out: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
        for i, j, n in zip(rows.tolist(), cols.tolist(), self.counts[rows, cols].tolist(), strict=True):
            pair = out.get(i)
            if pair is None:
                pair = out[i] = ({}, {})
            if j < e:
                pair[0][j] = n
            else:
                pair[1][j - e] = n
        return out

    def _ffn_objects(self) -> dict[int, list[ExpertFfnEvent]] | None:
        ffns = self.ffns
        if ffns is None:
            return None
        out: dict[int, list[ExpertFfnEvent]] = {}
        for i, expert, start, end, tokens in zip(ffns.layer.tolist(), ffns.expert.tolist(), ffns.start_ns.tolist(),
                                                 ffns.end_ns.tolist(), ffns.tokens.tolist(), strict=True):
            out.setdefault(i, []).append(ExpertFfnEvent(expert, start, end, tokens))
        return out


class StepEvent:
    """One completed ``moe.step``: its request keys and its layers. A step from the whole-batch
    path holds its layers as LayerColumns and makes the LayerEvent list only when ``layers`` is
    read (traces of a kept subtree, tests); the agent's step path reads ``columns``."""

    __slots__ = ("pid", "tid", "start_ns", "end_ns", "tokens", "requests", "request_tokens", "_layers",
                 "device_time_us", "_columns")
    # (a ClassVar: mypyc, which compiles this module, keeps it on the class for `match`)
    __match_args__: ClassVar[tuple[str, ...]] = ("pid", "tid", "start_ns", "end_ns", "tokens", "requests",
                                                 "request_tokens", "layers", "device_time_us")

    def __init__(self, pid: int, tid: int, start_ns: int, end_ns: int, tokens: int | None,
                 requests: list[int] | None = None, request_tokens: dict[int, tuple[int, int]] | None = None,
                 layers: list[LayerEvent] | None = None, device_time_us: np.ndarray | None = None, *,
                 columns: LayerColumns | None = None) -> None:
        self.pid = pid
        self.tid = tid
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.tokens = tokens
        self.requests: list[int] = [] if requests is None else requests  # request keys marked inside the step
        # moe.step.requests (moe/v2.1): request key -> (input tokens, output tokens) in this step; None
        # when the producer does not report per-request tokens
        self.request_tokens = request_tokens
        self._layers: list[LayerEvent] | None = [] if layers is None and columns is None else layers
        self.device_time_us = device_time_us  # v2 moe.step.device: per layer, where the runtime has it
        self._columns = columns

    @property
    def layers(self) -> list[LayerEvent]:
        if self._layers is None:
            assert self._columns is not None
            self._layers = self._columns.materialize()
        return self._layers

    @layers.setter
    def layers(self, value: list[LayerEvent]) -> None:
        self._layers, self._columns = value, None

    def set_columns(self, columns: LayerColumns) -> None:
        self._layers, self._columns = None, columns

    @property
    def columns(self) -> LayerColumns | None:
        """The layers as arrays (whole-batch path), None for a step built event by event."""
        return self._columns

    @property
    def layer_count(self) -> int:
        return len(self._columns) if self._columns is not None else len(self._layers or ())

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def expert_loads(self) -> list[ExpertLoadEvent]:
        """Every moe.expert.load range of the step (a columnar step has none)."""
        if self._columns is not None:
            return []
        return [load for layer in self._layers or () for load in layer.loads]

    def without_layers(self) -> StepEvent:
        """The same step with no layer tree (what a buffered step keeps once nothing reads it)."""
        return StepEvent(self.pid, self.tid, self.start_ns, self.end_ns, self.tokens, self.requests,
                         self.request_tokens, [], self.device_time_us)

    def _fields(self) -> tuple[object, ...]:
        return (self.pid, self.tid, self.start_ns, self.end_ns, self.tokens, self.requests, self.request_tokens,
                self.layers, self.device_time_us)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepEvent):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaced

    def __repr__(self) -> str:
        return (f"StepEvent(pid={self.pid}, tid={self.tid}, start_ns={self.start_ns}, end_ns={self.end_ns}, "
                f"tokens={self.tokens}, requests={self.requests}, layers={self.layer_count})")


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The record the NVTX path emits: the steps one parser round completed, in end order."""

    steps: tuple[StepEvent, ...]


StepSink = Callable[[list[StepEvent]], None]

_STAT_NAMES = (
    "steps", "layers", "routers", "expert_loads", "expert_ffns", "request_marks", "expert_marks",
    "unknown_names", "malformed_payloads", "malformed_categories", "misplaced", "orphans",
    "pending_overflow", "sink_errors", "routing_vectors", "experts_ranges", "malformed_vectors",
    "steps_columnar",  # of `steps`: built by the whole-batch path
    "steps_layer_columns",  # ... of which their layers held as LayerColumns (no object per layer)
)


# range names as small codes, for the column-wise step pass
_R_OTHER, _R_UNKNOWN, _R_STEP, _R_LAYER, _R_ROUTER, _R_EXPERTS, _R_LOAD, _R_FFN = range(8)
_RANGE_CODES = {STEP: _R_STEP, LAYER: _R_LAYER, ROUTER: _R_ROUTER, EXPERTS: _R_EXPERTS, EXPERT_LOAD: _R_LOAD,
                EXPERT_FFN: _R_FFN}
_NO_PARENT = 8  # the parent column of the tables below for "parent not in this batch"


def _parent_table(rows: int, allowed: dict[int, tuple[int, ...]]) -> np.ndarray:
    table = np.zeros((rows, 9), dtype=bool)
    for child, parents in allowed.items():
        table[child, list(parents)] = True
    return table


_ANY = tuple(range(9))
# Where each range may sit in a column-wise step ([child code, parent code]); anything else sends
# the whole step to the per-event path, which counts it. Non-moe ranges are ignored (as there).
_RANGE_PARENT_OK = _parent_table(8, {
    _R_STEP: _ANY, _R_OTHER: _ANY, _R_LAYER: (_R_STEP,), _R_ROUTER: (_R_LAYER,), _R_EXPERTS: (_R_LAYER,),
    _R_LOAD: (_R_LAYER, _R_EXPERTS), _R_FFN: (_R_LAYER, _R_EXPERTS),
})
_MARK_PARENT_OK = _parent_table(11, {
    _OTHER: _ANY, _REQUEST: (_R_STEP,), _STEP_DEVICE: (_R_STEP,), _STEP_ROUTING: (_R_STEP,),
    _STEP_REQUESTS: (_R_STEP,), _STEP_ENTROPY: (_R_STEP,), _ROUTING: (_R_ROUTER,), _EXPERTS_TIME: (_R_EXPERTS,),
    _TOKENS: (_R_ROUTER,), _DROPPED: (_R_ROUTER,),
})
# A v1 per-expert mark's value is summed column-wise only below this magnitude, so int64 sums of any
# batch are exact (the per-event path sums Python ints); a larger one sends its step that way.
_V1_MAX_ABS_VALUE = 1 << 32
# v1 counts of a step become an int64 [L, 2E] block only up to this E (a hostile E would allocate
# L x 2E); a larger layer keeps its routing as dicts (the per-layer objects).
MAX_V1_COLUMN_EXPERTS = 4096
COLUMN_MIN_LAYERS = 8  # a step of fewer layers is built as objects (the column set-up costs more)
_MAX_NESTING = 64  # parent hops resolved per batch; deeper (never well formed) -> per-event path


class _RangeRow(NamedTuple):
    uid: int
    parent_uid: int
    start_ns: int
    end_ns: int
    payload: int
    payload_type: int
    category: int
    tid: int


# The request keys the parser holds to hand out one int object per key (a bounded set: past it, it
# starts over; a key's steps then hold two equal ints, nothing else changes).
REQUEST_KEYS_HELD = 1 << 16


class MoeConventionParser:
    """An NvtxCollector sink: feed it NvtxBatch objects; completed steps go to `sink` per batch."""

    def __init__(self, *, sink: StepSink, fast: bool = True) -> None:
        self._sink = sink
        self.fast = fast  # False: every event takes the per-event path (tests compare the two)
        # string id -> range / mark code, for the last string table seen (see _code_tables)
        self._luts: tuple[StringTable, int, np.ndarray, np.ndarray] | None = None
        self._pending: dict[int, list[Any]] = {}  # parent uid -> completed children
        self._pending_events: dict[int, int] = {}  # parent uid -> events its children stand for
        self._pending_children = 0  # events waiting (a grouped expert-count entry counts its events)
        # parent uids whose waiting children are all ("columns", LayerColumns) entries: a step of
        # them can still be built column-wise when it ends
        self._column_parents: set[int] = set()
        # moe.request keys seen, each once (_fast_steps). Typed Any, not int: compiled, an int is
        # unboxed and boxed anew on its way into a list (a new object past the small ints)
        self._request_keys: dict[Any, Any] = {}
        self._stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        out["pending_parents"] = len(self._pending)
        out["pending_children"] = self._pending_children
        return out

    def __call__(self, batch: NvtxBatch) -> None:
        domain_id = batch.strings.domain_id(DOMAIN)
        if domain_id is None:
            return
        steps: list[StepEvent] = []
        name_of = batch.strings.strings.get  # string id -> text (None: unknown)
        mark_rows = np.flatnonzero(batch.marks["domain_id"] == domain_id)
        range_rows = np.flatnonzero(batch.ranges["domain_id"] == domain_id)
        if len(range_rows) and self.fast:
            steps, range_rows, mark_rows = self._fast_steps(batch, range_rows, mark_rows)
        if len(mark_rows):
            self._marks(batch, mark_rows, name_of)
        ranges = batch.ranges[range_rows]
        if len(ranges):
            # deepest first: within one batch a child is filed before its parent collects it
            ranges = ranges[np.argsort(-ranges["depth"].astype(np.int64), kind="stable")]
            names = [name_of(i) for i in ranges["string_id"].tolist()]
            columns = [ranges[c].tolist() for c in _RANGE_COLUMNS]
            for name, *row in zip(names, *columns, strict=True):
                step = self._range(_RangeRow(*row), name, batch.pid)
                if step is not None:
                    steps.append(step)
        for uid in batch.lost_uids.tolist():
            # a parent whose end was lost (dropped, or its thread/process ended): its children
            # can never be placed
            self._stats["orphans"] += self._take(int(uid))[1]
        if len(self._pending) > MAX_PENDING_PARENTS or self._pending_children > MAX_PENDING_CHILDREN:
            self._stats["pending_overflow"] += self._pending_children
            self._pending.clear()
            self._pending_events.clear()
            self._column_parents.clear()
            self._pending_children = 0
        if steps:
            steps.sort(key=lambda s: s.start_ns)
            try:
                self._sink(steps)
            except Exception:  # the pipeline's code: counted, parsing goes on
                self._stats["sink_errors"] += 1

    # -- payload checks

    def _int(self, row: Any) -> int | None:
        payload_type = row.payload_type
        if payload_type not in _INT_TYPES:
            self._stats["malformed_payloads"] += 1
            return None
        value: int = row.payload
        if payload_type in _SIGNED_TYPES and value >= 1 << 63:
            value -= 1 << 64
        return value

    def _float(self, row: Any) -> float | None:
        if row.payload_type not in _FLOAT_TYPES:
            self._stats["malformed_payloads"] += 1
            return None
        u64, f64 = _U64_AS_DOUBLE
        value: float = f64.unpack(u64.pack(row.payload))[0]
        return value

    def _index(self, row: Any) -> int | None:
        """Layer or expert index from a category (id + 1; 0 means none)."""
        category: int = row.category
        if category == 0:
            self._stats["malformed_categories"] += 1
            return None
        return category - 1

    def _file(self, parent_uid: int, child: Any, events: int = 1) -> None:
        if parent_uid == 0:
            self._stats["orphans"] += events
            return
        if not _is_columns(child):
            self._column_parents.discard(parent_uid)
        elif parent_uid not in self._pending:
            self._column_parents.add(parent_uid)
        self._pending.setdefault(parent_uid, []).append(child)
        self._pending_events[parent_uid] = self._pending_events.get(parent_uid, 0) + events
        self._pending_children += events

    def _take(self, parent_uid: int) -> tuple[list[Any], int]:
        """The children waiting for parent_uid, no longer pending, and how many events they are."""
        children = self._pending.pop(parent_uid, None)
        if children is None:
            return [], 0
        self._column_parents.discard(parent_uid)
        events = self._pending_events.pop(parent_uid)
        self._pending_children -= events
        return children, events

    # -- whole steps, column-wise

    def _fast_steps(self, batch: NvtxBatch, range_rows: np.ndarray,
                    mark_rows: np.ndarray) -> tuple[list[StepEvent], np.ndarray, np.ndarray]:
        """The batch's complete, well-formed steps built column-wise; returns them and the range and
        mark rows left for the per-event path."""
        # (every row is the domain's, normally: no copy of the batch then)
        ranges = batch.ranges if len(range_rows) == len(batch.ranges) else batch.ranges[range_rows]
        n = len(ranges)
        range_lut, mark_lut = self._code_tables(batch)
        code = range_lut[np.minimum(ranges["string_id"], len(range_lut) - 1)]
        is_step = code == _R_STEP
        if not is_step.any() and not (code == _R_LAYER).any():
            return [], range_rows, mark_rows
        uid = ranges["uid"]
        by_uid = np.argsort(uid, kind="stable")
        sorted_uid = uid[by_uid]

        def row_of(uids: np.ndarray) -> np.ndarray:
            """Index in `ranges` of each uid, -1 where it is not in this batch (or is 0: no parent)."""
            at = np.minimum(np.searchsorted(sorted_uid, uids), n - 1)
            return np.where((sorted_uid[at] == uids) & (uids != 0), by_uid[at], -1)

        parent = row_of(ranges["parent_uid"])
        is_layer = code == _R_LAYER
        is_unit = is_step | is_layer

        def enclosing(stop: np.ndarray) -> np.ndarray | None:
            """Each range's nearest enclosing `stop` row (itself for one), -1 for none, by pointer
            jumping; None when the nesting is too deep to be ours."""
            top = np.arange(n)
            for _ in range(_MAX_NESTING):
                up = parent[top]
                move = (up >= 0) & ~stop[top]
                if not move.any():
                    return np.where(stop[top], top, -1)
                top = np.where(move, up, top)
            return None

        root = enclosing(is_step)  # each range's step
        if root is None:
            return [], range_rows, mark_rows  # nesting too deep to be ours: every event the slow way
        rooted = root >= 0
        parent_code = np.where(parent >= 0, code[parent], _NO_PARENT)
        category = ranges["category"]
        parent_uid = ranges["parent_uid"]
        # a layer whose step is not in this batch (it ends in a later one): built here, filed under it
        loose = is_layer & (parent < 0) & (parent_uid != 0)
        bad_range = ~(_RANGE_PARENT_OK[code, parent_code] | loose) | ((category == 0) & (code > _R_STEP))
        absorbable = np.empty(0, dtype=np.uint64)  # steps whose waiting children are only layer columns
        if self._pending:
            waiting = np.fromiter(self._pending, dtype=np.uint64, count=len(self._pending))
            waited = np.isin(uid, waiting)  # children of it came in an earlier batch
            if self._column_parents:
                absorbable = np.fromiter(self._column_parents, dtype=np.uint64, count=len(self._column_parents))
                waited &= ~(is_step & np.isin(uid, absorbable))
            bad_range |= waited
        marks = batch.marks if len(mark_rows) == len(batch.marks) else batch.marks[mark_rows]
        mcode = mark_lut[np.minimum(marks["string_id"], len(mark_lut) - 1)]
        mparent = row_of(marks["parent_uid"])
        mroot = np.where(mparent >= 0, root[mparent], -1)
        mparent_code = np.where(mparent >= 0, code[mparent], _NO_PARENT)
        mptype = marks["payload_type"]
        bad_mark = ~_MARK_PARENT_OK[mcode, mparent_code] | ((mcode == _REQUEST) & ~_IS_INT[mptype])
        # moe/v1 per-expert marks: summed as arrays when their payload is a small integer and they
        # name an expert; anything else (counted as malformed there) takes the per-event path
        is_expert_mark = (mcode == _TOKENS) | (mcode == _DROPPED)
        expert_values: np.ndarray | None = None
        if is_expert_mark.any():
            expert_values, value_ok = _v1_values(marks["payload"], mptype)
            bad_mark |= is_expert_mark & ~(value_ok & (marks["category"] != 0))
        bad = np.zeros(n, dtype=bool)  # per step row: its tree is sent the per-event way
        flagged: list[np.ndarray] = []  # the range rows, then the mark rows, flagged (for the layers below)
        flagged_marks: list[np.ndarray] = []

        def flag(rows: np.ndarray) -> None:
            """Range rows that only the per-event path places: their step is not built here."""
            bad[root[rows[rooted[rows]]]] = True
            flagged.append(rows)

        def flag_marks(rows: np.ndarray) -> None:
            bad[mroot[rows[mroot[rows] >= 0]]] = True
            flagged_marks.append(rows)

        flag(np.flatnonzero(bad_range))
        flag_marks(np.flatnonzero(bad_mark))
        # one router and one experts range per layer, one vector of each kind per parent
        for kind in (_R_ROUTER, _R_EXPERTS):
            rows = np.flatnonzero((code == kind) & (parent >= 0))
            flag(rows[_repeated(parent[rows])])
        vector_rows = np.flatnonzero(_IS_VECTOR_CODE[mcode] & (mparent >= 0))
        flag_marks(vector_rows[_repeated(mparent[vector_rows] * 16 + mcode[vector_rows])])
        expert_rows = np.flatnonzero(is_expert_mark & (mparent >= 0))
        if len(expert_rows) and len(vector_rows):
            # a router with a moe.routing vector and v1 marks: the per-event path's precedence rules
            routing_routers = mparent[vector_rows[mcode[vector_rows] == _ROUTING]]
            flag_marks(expert_rows[np.isin(mparent[expert_rows], routing_routers)])
        fast_step = is_step & ~bad
        in_fast = rooted & fast_step[np.maximum(root, 0)]
        in_fast_mark = (mroot >= 0) & fast_step[np.maximum(mroot, 0)]
        # layers built on their own and filed as the per-event path would: loose ones, and the
        # well-formed layers of a step that takes the per-event path (e.g. one split over batches)
        free = np.zeros(n, dtype=bool)
        unit = enclosing(is_unit) if loose.any() or bad[is_step].any() else None  # each range's step or layer
        if unit is not None:
            bad_unit = np.zeros(n, dtype=bool)  # per layer row: its subtree cannot be built here
            munit = np.where(mparent >= 0, unit[mparent], -1)
            for rows in flagged:
                bad_unit[unit[rows[unit[rows] >= 0]]] = True
                # a bad layer is filed under its parent by the per-event path: that parent's unit waits
                nested = rows[is_layer[rows] & (parent[rows] >= 0)]
                outer = unit[parent[nested]]
                bad_unit[outer[outer >= 0]] = True
            for rows in flagged_marks:
                bad_unit[munit[rows[munit[rows] >= 0]]] = True
            free = is_layer & ~bad_unit & (loose | (rooted & (parent == root) & ~fast_step[np.maximum(root, 0)]))
            if free.any():
                in_fast |= (unit >= 0) & free[np.maximum(unit, 0)]
                in_fast_mark |= (munit >= 0) & free[np.maximum(munit, 0)]
        if not in_fast.any():
            return [], range_rows, mark_rows
        stats = self._stats

        payload, ptype = ranges["payload"], ranges["payload_type"]
        row_lists: list[_RowLists] = []  # made only for steps built as objects (a list per column of the batch)

        def int_of(i: int) -> int | None:
            if not row_lists:
                row_lists.append(_RowLists.of(ranges))
            lists = row_lists[0]
            t = lists.ptypes[i]
            if t in _SIGNED_TYPES:
                return lists.signed[i]
            if t in _INT_TYPES:
                return lists.unsigned[i]
            stats["malformed_payloads"] += 1
            return None

        steps: dict[int, StepEvent] = {}
        step_rows = np.flatnonzero(fast_step)
        step_types = ptype[step_rows]
        step_int = _IS_INT[step_types]
        stats["malformed_payloads"] += len(step_rows) - int(np.count_nonzero(step_int))
        for i, t, t0, t1, is_int, is_signed, as_unsigned, as_signed in zip(
                step_rows.tolist(), ranges["tid"][step_rows].tolist(), ranges["start_ns"][step_rows].tolist(),
                ranges["end_ns"][step_rows].tolist(), step_int.tolist(), _IS_SIGNED[step_types].tolist(),
                payload[step_rows].tolist(), payload.view(np.int64)[step_rows].tolist(), strict=True):
            tokens = as_signed if is_signed else as_unsigned if is_int else None
            steps[i] = StepEvent(batch.pid, t, t0, t1, tokens, [], None, [], None)
        stats["steps"] += len(steps)
        stats["steps_columnar"] += len(steps)
        # marks: request keys in mark order; vectors decoded per batch, checked as the per-event path does
        requests = np.flatnonzero(in_fast_mark & (mcode == _REQUEST))
        stats["request_marks"] += len(requests)
        keys = self._request_keys
        if len(keys) > REQUEST_KEYS_HELD:
            keys.clear()
        for parent_row, value, payload_type in zip(mparent[requests].tolist(), marks["payload"][requests].tolist(),
                                                   mptype[requests].tolist(), strict=True):
            key = _signed(value, payload_type)
            # one int object per key: a request's key is in each of its steps, buffered for minutes
            # (~28 B a key a step beyond the small ints: 4.5 MB at 20k steps of 8 keys)
            held: Any = steps[parent_row].requests  # (Any: the object setdefault gives is appended as it is)
            held.append(keys.setdefault(key, key))
        vectors: dict[tuple[int, int], np.ndarray] = {}
        fast_vectors = vector_rows[in_fast_mark[vector_rows]]
        vector_codes, vector_parents = mcode[fast_vectors], mparent[fast_vectors]
        found = 0
        for members, block in batch.mark_blocks(mark_rows[fast_vectors]):
            codes_in = vector_codes[members].tolist()
            parents_in = vector_parents[members].tolist()
            found += len(codes_in)
            if isinstance(block, np.ndarray):  # one dtype for the block's rows: checked once
                dtype_kind = block.dtype.kind
                fits = {code: dtype_kind in ("iu" if code in _INT_VECTOR_CODES else "fiu") for code in set(codes_in)}
                for parent_row, code_at, vector in zip(parents_in, codes_in, block, strict=True):
                    if fits[code_at]:
                        vectors[(parent_row, code_at)] = vector
                    else:
                        stats["malformed_vectors"] += 1
                continue
            for parent_row, code_at, decoded in zip(parents_in, codes_in, block, strict=True):
                if decoded is not None and _vector_ok(decoded, code_at):
                    vectors[(parent_row, code_at)] = decoded
                else:
                    stats["malformed_vectors"] += 1
        stats["routing_vectors"] += sum(1 for (_, code_at) in vectors if code_at in _ROUTING_CODES)
        stats["malformed_vectors"] += len(fast_vectors) - found  # no payload recorded (EXT lost, not EXT)
        # per layer: its router, its experts range, its loads and FFNs (rows in `ranges`)
        router_at = np.full(n, -1, dtype=np.int64)
        experts_at = np.full(n, -1, dtype=np.int64)
        for kind, into, stat in ((_R_ROUTER, router_at, "routers"), (_R_EXPERTS, experts_at, "experts_ranges")):
            rows = np.flatnonzero(in_fast & (code == kind))
            into[parent[rows]] = rows
            stats[stat] += len(rows)
        # expert load / FFN ranges, in (layer row, start) order; objects only for steps built as objects
        leaves = np.flatnonzero(in_fast & ((code == _R_LOAD) | (code == _R_FFN)))
        owner = np.empty(0, dtype=np.int64)
        if len(leaves):
            owner = np.where(parent_code[leaves] == _R_LAYER, parent[leaves], parent[parent[leaves]])
            order = np.lexsort((ranges["start_ns"][leaves], owner))
            leaves, owner = leaves[order], owner[order]
        leaf_is_load = code[leaves] == _R_LOAD
        loads_count = int(np.count_nonzero(leaf_is_load))
        stats["expert_loads"] += loads_count
        stats["expert_ffns"] += len(leaves) - loads_count
        # v1 per-expert marks of these steps: (router row, dropped?, expert, value), summed below
        v1 = _V1Marks.empty()
        if expert_values is not None:
            at = expert_rows[in_fast_mark[expert_rows]]
            stats["expert_marks"] += len(at)
            v1 = _V1Marks(router=mparent[at].astype(np.int64), dropped=mcode[at] == _DROPPED,
                          expert=marks["category"][at].astype(np.int64) - 1, value=expert_values[at])
        free_rows = np.flatnonzero(free)
        layer_rows = np.flatnonzero(in_fast & is_layer & ~free)
        layer_rows = layer_rows[np.lexsort((ranges["start_ns"][layer_rows], root[layer_rows]))]
        stats["layers"] += len(layer_rows) + len(free_rows)
        in_step_layer = np.zeros(n, dtype=bool)  # the layers of fast steps (not the free ones)
        in_step_layer[layer_rows] = True
        layer_root = root[layer_rows]
        step_layers: dict[int, tuple[int, int]] = {}  # step row -> its layers' [first, end) in layer_rows
        if len(layer_rows):
            cut = np.flatnonzero(layer_root[1:] != layer_root[:-1]) + 1
            firsts = [0, *cut.tolist()]
            ends = [*cut.tolist(), len(layer_rows)]
            step_layers = {r: (f, e) for r, f, e in zip(layer_root[firsts].tolist(), firsts, ends, strict=True)}
        # layers of steps that end here, filed as columns by earlier batches (the steps' pending children)
        absorbed: dict[int, list[LayerColumns]] = {}
        if len(absorbable):
            for i, step_uid in zip(step_rows.tolist(), uid[step_rows].tolist(), strict=True):
                if step_uid in self._column_parents:
                    absorbed[i] = [child[1] for child in self._take(step_uid)[0]]
        layer_count = {i: e - f for i, (f, e) in step_layers.items()}
        for i, parts in absorbed.items():
            layer_count[i] = layer_count.get(i, 0) + sum(len(p) for p in parts)
        columns = None  # LayerColumns pay off from COLUMN_MIN_LAYERS layers a step (below, objects are cheaper)
        if any(layer_count[i] >= COLUMN_MIN_LAYERS for i in step_layers):
            of_steps = in_step_layer[owner]
            v1_of_steps = in_step_layer[parent[v1.router]]
            columns = _BatchLayers(ranges, layer_rows, router_at[layer_rows], experts_at[layer_rows], vectors,
                                   leaves=leaves[of_steps], leaf_owner=owner[of_steps],
                                   leaf_is_load=leaf_is_load[of_steps],
                                   v1=v1.subset(v1_of_steps).with_layer(parent))
        object_steps: list[int] = []
        for i, step in steps.items():
            step.device_time_us = vectors.get((i, _STEP_DEVICE))
            first, end = step_layers.get(i, (0, 0))
            routing, entropy = vectors.get((i, _STEP_ROUTING)), vectors.get((i, _STEP_ENTROPY))
            cols = None
            if columns is not None and end > first and layer_count.get(i, 0) >= COLUMN_MIN_LAYERS:
                cols = columns.of_step(first, end, routing, entropy)
            earlier = absorbed.get(i)
            if earlier:  # (step vectors over layers of several batches: objects, as the per-event path)
                whole = None
                if routing is None and entropy is None and (cols is not None or end == first):
                    whole = _concat_columns([*earlier, cols] if cols is not None else earlier)
                cols = whole
            if cols is not None:
                step.set_columns(cols)
                stats["steps_layer_columns"] += 1
                self._finish_step(step, None, vectors.get((i, _STEP_REQUESTS)), None)
            else:
                object_steps.append(i)
        # free layers (their step ends in a later batch, or takes the per-event path): as columns where
        # they can be, filed under their step
        as_columns = np.zeros(n, dtype=bool)
        loose_rows = np.flatnonzero(free)
        if len(loose_rows):
            loose_rows = loose_rows[np.lexsort((ranges["start_ns"][loose_rows], parent_uid[loose_rows]))]
            in_loose = np.zeros(n, dtype=bool)
            in_loose[loose_rows] = True
            of_loose, v1_of_loose = in_loose[owner], in_loose[parent[v1.router]]
            loose_layers = _BatchLayers(ranges, loose_rows, router_at[loose_rows], experts_at[loose_rows], vectors,
                                        leaves=leaves[of_loose], leaf_owner=owner[of_loose],
                                        leaf_is_load=leaf_is_load[of_loose],
                                        v1=v1.subset(v1_of_loose).with_layer(parent))
            parents_of = parent_uid[loose_rows]
            bounds = (np.flatnonzero(parents_of[1:] != parents_of[:-1]) + 1).tolist()
            for f, e, step_uid in zip([0, *bounds], [*bounds, len(loose_rows)], parents_of[[0, *bounds]].tolist(),
                                      strict=True):
                part = loose_layers.of_step(f, e, None, None)
                if part is not None:
                    self._file(step_uid, ("columns", part), events=len(part))  # one event per layer, as objects
                    as_columns[loose_rows[f:e]] = True
        free_objects = free & ~as_columns
        if object_steps or free_objects.any():
            if not row_lists:
                row_lists.append(_RowLists.of(ranges))
            lists = row_lists[0]
            batch_columns = (lists.start, lists.end, lists.cat, lists.ptypes, lists.floats)
            as_objects = free_objects.copy()  # layer rows built as objects: these free ones, those of object steps
            of_object_step = np.zeros(n, dtype=bool)
            of_object_step[object_steps] = True
            as_objects[layer_rows[of_object_step[root[layer_rows]]]] = True
            loads_of, ffns_of = self._leaf_objects(leaves, owner, leaf_is_load, as_objects[owner], batch_columns,
                                                   int_of)
            v1_of = v1.dicts(as_objects[parent[v1.router]])
            free_rows = np.flatnonzero(free_objects)
            if len(free_rows):
                rows = free_rows[np.argsort(ranges["start_ns"][free_rows], kind="stable")]
                built = self._layer_objects(rows.tolist(), router_at[rows].tolist(), experts_at[rows].tolist(),
                                            batch_columns, vectors, loads_of, ffns_of, v1_of, int_of)
                for parent_uid_of, layer in zip(parent_uid[rows].tolist(), built, strict=True):
                    self._file(parent_uid_of, layer)  # as the per-event path files a completed layer
            for i in object_steps:
                step = steps[i]
                first, end = step_layers.get(i, (0, 0))
                rows = layer_rows[first:end]
                layers = self._layer_objects(rows.tolist(), router_at[rows].tolist(), experts_at[rows].tolist(),
                                             batch_columns, vectors, loads_of, ffns_of, v1_of, int_of)
                earlier = absorbed.get(i)
                if earlier:
                    layers = [layer for part in earlier for layer in part.materialize()] + layers
                    layers.sort(key=lambda layer: layer.start_ns)
                step.layers = layers
                self._finish_step(step, vectors.get((i, _STEP_ROUTING)), vectors.get((i, _STEP_REQUESTS)),
                                  vectors.get((i, _STEP_ENTROPY)))
        return list(steps.values()), range_rows[~in_fast], mark_rows[~in_fast_mark]

    @staticmethod
    def _leaf_objects(leaves: np.ndarray, owner: np.ndarray, is_load: np.ndarray, wanted: np.ndarray,
                      batch_columns: tuple[list[int], list[int], list[int], list[int], list[float]],
                      int_of: Callable[[int], int | None],
                      ) -> tuple[dict[int, list[ExpertLoadEvent]], dict[int, list[ExpertFfnEvent]]]:
        """The expert load and FFN ranges among `leaves` (in layer row, start order) that `wanted`
        selects, as objects per layer row."""
        start, end, cat, _, _ = batch_columns
        loads_of: dict[int, list[ExpertLoadEvent]] = {}
        ffns_of: dict[int, list[ExpertFfnEvent]] = {}
        for i, layer_row, load in zip(leaves[wanted].tolist(), owner[wanted].tolist(), is_load[wanted].tolist(),
                                      strict=True):
            if load:
                loads_of.setdefault(layer_row, []).append(ExpertLoadEvent(cat[i] - 1, start[i], end[i], int_of(i)))
            else:
                ffns_of.setdefault(layer_row, []).append(ExpertFfnEvent(cat[i] - 1, start[i], end[i], int_of(i)))
        return loads_of, ffns_of

    def _layer_objects(self, rows: list[int], router_rows: list[int], experts_rows: list[int],
                       batch_columns: tuple[list[int], list[int], list[int], list[int], list[float]],
                       vectors: dict[tuple[int, int], np.ndarray], loads_of: dict[int, list[ExpertLoadEvent]],
                       ffns_of: dict[int, list[ExpertFfnEvent]],
                       v1_of: dict[int, tuple[dict[int, int], dict[int, int]]],
                       int_of: Callable[[int], int | None]) -> list[LayerEvent]:
        """One step's layers as objects, one small loop per layer: a step not clean enough for
        LayerColumns (expert loads, mixed E, a malformed payload or vector, few layers). `batch_columns`
        are the batch's start, end, category, payload type and payload-as-double columns as lists;
        `v1_of`: router row -> its v1 marks summed ({expert: tokens}, {expert: over capacity})."""
        stats = self._stats
        start, end, cat, ptypes, floats = batch_columns
        out: list[LayerEvent] = []
        # positional construction (keyword arguments cost twice as much)
        for i, r, x in zip(rows, router_rows, experts_rows, strict=True):
            experts = None if ptypes[i] == PAYLOAD_NONE else int_of(i)
            if experts is not None and experts <= 0:
                experts = None
            router = None
            if r >= 0:
                if ptypes[r] in _FLOAT_TYPES:
                    entropy: float | None = floats[r]
                else:
                    stats["malformed_payloads"] += 1
                    entropy = None
                tokens, dropped = v1_of.get(r) or ({}, {})
                router = RouterEvent(cat[r] - 1, start[r], end[r], entropy, tokens, dropped,
                                     vectors.get((r, _ROUTING)), None)
            fused = None
            if x >= 0:
                fused = ExpertsEvent(start[x], end[x], int_of(x), vectors.get((x, _EXPERTS_TIME)))
                if fused.time_us is not None and experts is not None and len(fused.time_us) != experts:
                    stats["malformed_vectors"] += 1
                    fused.time_us = None
            layer = LayerEvent(cat[i] - 1, start[i], end[i], router, experts, loads_of.get(i) or [],
                               ffns_of.get(i) or [], fused)
            if router is not None and router.vector is not None:  # _routing_from_vector, inline
                vector, router.vector = router.vector, None
                if len(vector) == 2 * (experts or len(vector) // 2) and len(vector):
                    router.counts = vector
                else:
                    stats["malformed_vectors"] += 1  # routing left out; the layer's timing still counts
            out.append(layer)
        return out

    def _code_tables(self, batch: NvtxBatch) -> tuple[np.ndarray, np.ndarray]:
        """Range and mark codes indexed by string id (the last entry: any id past the table, not ours),
        rebuilt only when the batch's string table is another one or has grown."""
        strings = batch.strings
        key = len(strings.strings)  # the table only grows (collectors/nvtx.py StringTable)
        cached = self._luts
        if cached is not None and cached[0] is strings and cached[1] == key:
            return cached[2], cached[3]
        size = max(strings.strings, default=0) + 2
        range_lut = np.full(size, _R_OTHER, dtype=np.int64)
        mark_lut = np.full(size, _OTHER, dtype=np.int64)
        for sid, text in strings.strings.items():
            if text.startswith("moe."):
                range_lut[sid], mark_lut[sid] = _range_code(text), _mark_code(text)
        self._luts = (strings, key, range_lut, mark_lut)
        return range_lut, mark_lut

    def _finish_layer(self, layer: LayerEvent) -> None:
        """A layer's checks once its children are in: routing vector against E, experts.time length."""
        self._routing_from_vector(layer)
        fused = layer.experts
        if (fused is not None and fused.time_us is not None and layer.num_experts is not None
                and len(fused.time_us) != layer.num_experts):
            self._stats["malformed_vectors"] += 1
            fused.time_us = None

    def _finish_step(self, step: StepEvent, routing: np.ndarray | None, requests: np.ndarray | None,
                     entropy: np.ndarray | None) -> None:
        if entropy is not None:
            self._entropy_from_step_vector(step, entropy)
        if routing is not None:
            self._routing_from_step_vector(step, routing)
        if requests is not None:
            self._requests_from_step_vector(step, requests)

    # -- marks and ranges

    def _marks(self, batch: NvtxBatch, mark_rows: np.ndarray, name_of: Callable[[int], str | None]) -> None:
        """Marks, column-wise: a v1 step has a token and a drop mark per expert per layer, so these
        are most of its events. Expert marks are summed per (parent, kind, expert) and filed as one
        ("counts", kind, {expert: n}, events) entry per parent and kind; v2 vector marks are filed
        as ("vector", code, array) — one per layer or step."""
        marks = batch.marks[mark_rows]
        sids = marks["string_id"]
        uniq, inverse = np.unique(sids, return_inverse=True)
        codes = np.array([_mark_code(name_of(sid)) for sid in uniq.tolist()], dtype=np.int8)[inverse]
        unknown = codes == _UNKNOWN
        self._stats["unknown_names"] += int(np.count_nonzero(unknown))
        ptype = marks["payload_type"]
        valid_int = _IS_INT[ptype]
        ours = (codes == _REQUEST) | (codes == _TOKENS) | (codes == _DROPPED)
        self._stats["malformed_payloads"] += int(np.count_nonzero(ours & ~valid_int))
        vectors = np.flatnonzero(_IS_VECTOR_CODE[codes])
        if len(vectors):
            self._vector_marks(batch, mark_rows[vectors], codes[vectors], marks["parent_uid"][vectors])
        requests = np.flatnonzero(codes == _REQUEST)
        if len(requests):
            self._stats["request_marks"] += len(requests)
            for parent, value, payload_type in zip(
                marks["parent_uid"][requests].tolist(),
                marks["payload"][requests].tolist(),
                ptype[requests].tolist(),
                strict=True,
            ):
                if payload_type in _INT_TYPES:
                    self._file(parent, ("request", _signed(value, payload_type)))
        expert_rows = (codes == _TOKENS) | (codes == _DROPPED)
        n_expert = int(np.count_nonzero(expert_rows))
        if not n_expert:
            return
        self._stats["expert_marks"] += n_expert
        category = marks["category"]
        self._stats["malformed_categories"] += int(np.count_nonzero(expert_rows & (category == 0)))
        keep = np.flatnonzero(expert_rows & valid_int & (category != 0))
        if not len(keep):
            return
        # one entry per (parent, kind): sort by them, then sum per expert in Python over the runs
        parent = marks["parent_uid"][keep]
        kind = codes[keep]
        order = np.lexsort((kind, parent))
        parent, kind = parent[order].tolist(), kind[order].tolist()
        expert = (category[keep][order].astype(np.int64) - 1).tolist()
        values = marks["payload"][keep][order].tolist()
        types = ptype[keep][order].tolist()
        start = 0
        n = len(parent)
        while start < n:
            end = start + 1
            while end < n and parent[end] == parent[start] and kind[end] == kind[start]:
                end += 1
            counts: dict[int, int] = {}
            for i in range(start, end):
                counts[expert[i]] = counts.get(expert[i], 0) + _signed(values[i], types[i])
            self._file(
                parent[start],
                ("counts", "tokens" if kind[start] == _TOKENS else "dropped", counts, end - start),
                events=end - start,
            )
            start = end

    def _vector_marks(self, batch: NvtxBatch, rows: np.ndarray, codes: np.ndarray, parents: np.ndarray) -> None:
        """v2 vector marks: decoded once each (there are O(layers) of them per step)."""
        vectors = batch.mark_arrays(rows)
        for vector, code, parent in zip(vectors, codes.tolist(), parents.tolist(), strict=True):
            if not _vector_ok(vector, code):
                self._stats["malformed_vectors"] += 1
                continue
            if code in _ROUTING_CODES:
                self._stats["routing_vectors"] += 1
            self._file(parent, ("vector", code, vector))

    def _routing_from_vector(self, layer: LayerEvent) -> None:
        """v2: the router's [2E] vector, checked against the layer's E, as its routing counts."""
        router = layer.router
        if router is None or router.vector is None:
            return
        vector, router.vector = router.vector, None
        n = len(vector)
        experts = layer.num_experts or n // 2
        if n != 2 * experts or n == 0:
            self._stats["malformed_vectors"] += 1  # routing left out; the layer's timing still counts
            return
        _set_routing(router, vector)

    def _routing_from_step_vector(self, step: StepEvent, vector: np.ndarray) -> None:
        """moe.step.routing: one [2E] row per moe.layer of the step, in order, all layers at once
        (one payload per step instead of one per layer: what a Python producer can afford at scale)."""
        layers = sorted(step.layers, key=lambda layer: layer.layer)
        sizes = [2 * (layer.num_experts or 0) for layer in layers]
        if not layers or 0 in sizes or sum(sizes) != len(vector):
            self._stats["malformed_vectors"] += 1
            return
        counts = vector
        at = 0
        for layer, size in zip(layers, sizes, strict=True):
            router = layer.router
            row, at = counts[at : at + size], at + size
            if router is None or router.has_routing:
                continue  # a layer with no router has no routing; one with its own keeps it
            _set_routing(router, row)

    def _entropy_from_step_vector(self, step: StepEvent, vector: np.ndarray) -> None:
        """moe.step.entropy (moe/v2.2): each moe.layer's router entropy, in layer-index order; a
        layer with no moe.router range gets an untimed router holding it (and then its row of
        moe.step.routing). A length other than the step's layer count is malformed and left out."""
        layers = sorted(step.layers, key=lambda layer: layer.layer)
        if not layers or len(vector) != len(layers):
            self._stats["malformed_vectors"] += 1
            return
        for layer, bits in zip(layers, vector.astype(np.float64).tolist(), strict=True):
            if layer.router is None:
                layer.router = RouterEvent(layer.layer, layer.start_ns, layer.start_ns, bits, timed=False)

    def _requests_from_step_vector(self, step: StepEvent, vector: np.ndarray) -> None:
        """moe.step.requests: [R keys | R input tokens | R output tokens] -> ``request_tokens``, and
        its keys united with the step's ``moe.request`` keys. A length that is not 3·R, or negative
        token counts, is counted as malformed and the vector left out (the marks' keys still count)."""
        n = len(vector)
        r = n // 3
        if n % 3 or (r and int(np.minimum.reduce(vector[r:])) < 0):  # (the ufunc: no Python wrapper a step)
            self._stats["malformed_vectors"] += 1
            return
        tokens: dict[int, tuple[int, int]] = {}
        for key, n_in, n_out in zip(vector[:r].tolist(), vector[r : 2 * r].tolist(), vector[2 * r :].tolist(),
                                    strict=True):
            had = tokens.get(key)
            tokens[key] = (n_in, n_out) if had is None else (had[0] + n_in, had[1] + n_out)  # a key twice: summed
        step.request_tokens = tokens
        marked = set(step.requests)
        step.requests.extend(key for key in tokens if key not in marked)

    def _range(self, row: Any, name: str | None, pid: int) -> StepEvent | None:
        if name is None or not name.startswith("moe."):
            # not ours; moe.* events nested in it are in the wrong place
            self._stats["misplaced"] += self._take(row.uid)[1]
            return None
        if name not in RANGE_NAMES:
            self._stats["unknown_names"] += 1
            self._stats["misplaced"] += self._take(row.uid)[1]  # children of an unknown range
            return None
        start_ns, end_ns = row.start_ns, row.end_ns
        children, child_events = self._take(row.uid)
        parent = row.parent_uid
        if name == STEP:
            self._stats["steps"] += 1
            step = StepEvent(pid=pid, tid=row.tid, start_ns=start_ns, end_ns=end_ns, tokens=self._int(row))
            step_routing: np.ndarray | None = None
            step_requests: np.ndarray | None = None
            step_entropy: np.ndarray | None = None
            parts: list[LayerColumns] = []  # layers the whole-batch path filed as columns
            for child in children:
                if isinstance(child, LayerEvent):
                    step.layers.append(child)
                elif _is_columns(child):
                    parts.append(child[1])
                elif isinstance(child, tuple) and child[0] == "request":
                    step.requests.append(child[1])
                elif _is_vector(child, _STEP_DEVICE) and step.device_time_us is None:
                    step.device_time_us = child[2]
                elif _is_vector(child, _STEP_ROUTING) and step_routing is None:
                    step_routing = child[2]
                elif _is_vector(child, _STEP_REQUESTS) and step_requests is None:
                    step_requests = child[2]
                elif _is_vector(child, _STEP_ENTROPY) and step_entropy is None:
                    step_entropy = child[2]
                else:
                    self._stats["misplaced"] += _events([child])
            if parts:
                whole = None
                if step_routing is None and step_entropy is None:  # (step vectors: on the objects below)
                    own = _columns_of_layers(step.layers, parts[0].num_experts) if step.layers else None
                    if own is not None or not step.layers:
                        pieces = sorted([*parts, *([own] if own is not None else [])], key=lambda c: int(c.start_ns[0]))
                        whole = _concat_columns(pieces)
                if whole is not None:
                    step.set_columns(whole)
                    self._stats["steps_layer_columns"] += 1
                    self._finish_step(step, None, step_requests, None)
                    return step
                step.layers.extend(layer for part in parts for layer in part.materialize())
            step.layers.sort(key=lambda layer: layer.start_ns)
            self._finish_step(step, step_routing, step_requests, step_entropy)
            return step
        if name == LAYER:
            self._stats["layers"] += 1
            layer_index = self._index(row)
            if layer_index is None:
                return None  # a layer that does not say which: counted, left out with its children
            experts = self._int(row) if row.payload_type != PAYLOAD_NONE else None
            layer = LayerEvent(
                layer=layer_index,
                start_ns=start_ns,
                end_ns=end_ns,
                num_experts=experts if experts and experts > 0 else None,
            )
            for child in children:
                if isinstance(child, RouterEvent) and layer.router is None:
                    layer.router = child
                elif isinstance(child, ExpertLoadEvent):
                    layer.loads.append(child)
                elif isinstance(child, ExpertFfnEvent):
                    layer.ffns.append(child)
                elif isinstance(child, tuple) and child[0] == "experts" and layer.experts is None:
                    layer.experts = child[1]
                    layer.loads.extend(child[2])
                    layer.ffns.extend(child[3])
                else:
                    self._stats["misplaced"] += _events([child])
            self._finish_layer(layer)
            layer.loads.sort(key=lambda e: e.start_ns)
            layer.ffns.sort(key=lambda e: e.start_ns)
            self._file(parent, layer)
            return None
        if name == ROUTER:
            self._stats["routers"] += 1
            router_layer = self._index(row)
            if router_layer is None:
                return None
            router = RouterEvent(layer=router_layer, start_ns=start_ns, end_ns=end_ns,
                                 entropy_bits=self._float(row))
            for child in children:
                if _is_vector(child, _ROUTING) and router.vector is None:
                    router.vector = child[2]
                elif isinstance(child, tuple) and child[0] == "counts":
                    into = router.tokens if child[1] == "tokens" else router.dropped
                    if into:
                        for expert_id, n in child[2].items():
                            into[expert_id] = into.get(expert_id, 0) + n
                    else:
                        into.update(child[2])
                else:
                    self._stats["misplaced"] += _events([child])
            if router.vector is not None and (router.tokens or router.dropped):
                # both conventions in one router: the vector wins, the marks are counted as misplaced
                self._stats["misplaced"] += sum(c[3] for c in children if isinstance(c, tuple) and c[0] == "counts")
                router.tokens, router.dropped = {}, {}
            self._file(parent, router)
            return None
        if name == EXPERTS:
            self._stats["experts_ranges"] += 1
            if self._index(row) is None:
                self._stats["misplaced"] += child_events
                return None
            fused = ExpertsEvent(start_ns=start_ns, end_ns=end_ns, tokens=self._int(row))
            loads: list[ExpertLoadEvent] = []
            ffns: list[ExpertFfnEvent] = []
            for child in children:
                if isinstance(child, ExpertLoadEvent):
                    loads.append(child)
                elif isinstance(child, ExpertFfnEvent):
                    ffns.append(child)
                elif _is_vector(child, _EXPERTS_TIME) and fused.time_us is None:
                    fused.time_us = child[2]
                else:
                    self._stats["misplaced"] += _events([child])
            self._file(parent, ("experts", fused, loads, ffns), events=1 + len(loads) + len(ffns))
            return None
        expert = self._index(row)
        self._stats["misplaced"] += child_events
        if expert is None:
            return None
        if name == EXPERT_LOAD:
            self._stats["expert_loads"] += 1
            self._file(
                parent, ExpertLoadEvent(expert=expert, start_ns=start_ns, end_ns=end_ns, bytes_moved=self._int(row))
            )
        else:
            self._stats["expert_ffns"] += 1
            self._file(parent, ExpertFfnEvent(expert=expert, start_ns=start_ns, end_ns=end_ns, tokens=self._int(row)))
        return None


class _BatchLayers:
    """The whole batch's moe.layer rows (in step, then start order) as arrays, and which of them a
    LayerColumns can hold as they are: an integer E > 0, a router payload that is a double, an
    experts payload that is a non-negative integer, vectors of the right length, no expert-load
    ranges under them, FFN ranges with integer payloads, v1 marks naming experts below E (E at most
    MAX_V1_COLUMN_EXPERTS). ``of_step`` cuts one step's columns out, or answers None (per-event
    objects)."""

    def __init__(self, ranges: np.ndarray, layer_rows: np.ndarray, router_rows: np.ndarray,
                 experts_rows: np.ndarray, vectors: dict[tuple[int, int], np.ndarray], *,
                 leaves: np.ndarray, leaf_owner: np.ndarray, leaf_is_load: np.ndarray, v1: _V1Marks) -> None:
        payload, ptype = ranges["payload"], ranges["payload_type"]
        signed_payload = payload.view(np.int64)

        def int_values(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """(value, is a non-negative integer) per row; an unsigned value past int64 is not."""
            types = ptype[rows]
            is_signed = _IS_SIGNED[types]
            values = signed_payload[rows]
            ok = (is_signed | _IS_UNSIGNED[types]) & (values >= 0)
            return values, ok

        self.layer = ranges["category"][layer_rows].astype(np.int64) - 1
        self.start_ns = ranges["start_ns"][layer_rows].astype(np.int64)
        self.end_ns = ranges["end_ns"][layer_rows].astype(np.int64)
        self.experts, experts_ok = int_values(layer_rows)
        clean = experts_ok & (self.experts > 0)
        self.has_router = router_rows >= 0
        r = np.maximum(router_rows, 0)
        clean &= ~self.has_router | _IS_FLOAT[ptype[r]]
        self.router_start_ns = np.where(self.has_router, ranges["start_ns"][r].astype(np.int64), 0)
        self.router_end_ns = np.where(self.has_router, ranges["end_ns"][r].astype(np.int64), 0)
        self.entropy_bits = np.where(self.has_router, payload.view(np.float64)[r], NAN)
        self.has_experts = experts_rows >= 0
        x = np.maximum(experts_rows, 0)
        self.experts_tokens, tokens_ok = int_values(x)
        clean &= ~self.has_experts | tokens_ok
        self.experts_start_ns = np.where(self.has_experts, ranges["start_ns"][x].astype(np.int64), 0)
        self.experts_end_ns = np.where(self.has_experts, ranges["end_ns"][x].astype(np.int64), 0)
        self.ffn_at = self.v1_at = np.empty(0, dtype=np.int64)  # (none: the common moe/v2 case)
        self.ffn: FfnColumns | None = None
        self.v1 = v1
        if len(leaves) or len(v1.router):
            position = np.full(len(ranges), -1, dtype=np.int64)  # range row -> its index in layer_rows
            position[layer_rows] = np.arange(len(layer_rows))
        if len(leaves):
            clean[position[leaf_owner[leaf_is_load]]] = False  # expert loads: objects (the join times them)
            # FFN ranges (v1 runtimes that loop over experts) as columns, in (layer, start) order
            ffn = leaves[~leaf_is_load]
            ffn_at = position[leaf_owner[~leaf_is_load]]
            ffn_tokens, ffn_ok = _int64_values(payload[ffn], ptype[ffn])
            clean[ffn_at[~ffn_ok]] = False  # a payload the per-event path counts (or a huge unsigned one)
            order = np.lexsort((ranges["start_ns"][ffn], ffn_at))
            self.ffn_at = ffn_at[order]
            self.ffn = FfnColumns(self.ffn_at, ranges["category"][ffn][order].astype(np.int64) - 1,
                                  ranges["start_ns"][ffn][order].astype(np.int64),
                                  ranges["end_ns"][ffn][order].astype(np.int64), ffn_tokens[order])
        if len(v1.router):
            # v1 per-expert marks, by layer index in layer_rows; an expert id >= E stays a dict key
            assert v1.layer is not None
            v1_at = position[v1.layer]
            v1_experts = self.experts[v1_at]
            clean[v1_at[(v1.expert >= v1_experts) | (v1_experts > MAX_V1_COLUMN_EXPERTS)]] = False
            order = np.argsort(v1_at, kind="stable")
            self.v1_at = v1_at[order]
            self.v1 = _V1Marks(v1.router[order], v1.dropped[order], v1.expert[order], v1.value[order])
        # per-layer vectors (moe/v2 moe.routing in each router, moe.experts.time in each experts range)
        self.routing: list[np.ndarray | None] | None = None
        self.times: list[np.ndarray | None] | None = None
        codes = {code for _, code in vectors}
        if _ROUTING in codes:
            self.routing = [vectors.get((i, _ROUTING)) if i >= 0 else None for i in router_rows.tolist()]
        if _EXPERTS_TIME in codes:
            self.times = [vectors.get((i, _EXPERTS_TIME)) if i >= 0 else None for i in experts_rows.tolist()]
        self.clean = clean

    def of_step(self, first: int, end: int, routing: np.ndarray | None,
                entropy: np.ndarray | None) -> LayerColumns | None:
        at = slice(first, end)
        n = end - first
        experts = self.experts[at]
        e = int(experts[0])
        if not self.clean[at].all() or (experts != e).any():
            return None
        layer = self.layer[at]
        order = np.argsort(layer, kind="stable")  # the step vectors' rows are in layer-index order
        in_order = bool((order == np.arange(n)).all())
        rank = order if in_order else np.argsort(order, kind="stable")
        has_router = self.has_router[at]
        kind = np.where(has_router, ROUTER_RANGE, ROUTER_NONE).astype(np.int8)
        entropy_bits = self.entropy_bits[at]
        if entropy is not None:
            if len(entropy) != n:
                return None  # counted by the per-event path
            if not has_router.all():
                entropy_bits = entropy_bits.copy()
                missing = ~has_router
                entropy_bits[missing] = entropy.astype(np.float64)[rank][missing]
                kind[missing] = ROUTER_STEP_VECTORS
        counts: np.ndarray | None = None
        has_routing = np.zeros(n, dtype=bool)
        own = self.routing[first:end] if self.routing is not None else None
        if own is not None and any(v is not None for v in own):
            if routing is not None:
                return None  # rows of both kinds: the per-event path's precedence rules
            present = [v for v in own if v is not None]
            if any(len(v) != 2 * e or v.dtype != present[0].dtype for v in present):
                return None
            if len(present) == n:
                counts = np.stack(present)
                has_routing[:] = True
            else:
                counts = np.zeros((n, 2 * e), dtype=present[0].dtype)
                has_routing = np.array([v is not None for v in own], dtype=bool)
                counts[has_routing] = np.stack(present)
        elif routing is not None:
            if len(routing) != n * 2 * e:
                return None
            by_index = routing.reshape(n, 2 * e)
            counts = by_index if in_order else by_index[rank]
            has_routing = kind > ROUTER_NONE
        marked: np.ndarray | None = None
        lo, hi = np.searchsorted(self.v1_at, (first, end)).tolist() if len(self.v1_at) else (0, 0)
        if hi > lo:  # moe/v1 marks: summed per (layer, tokens | over capacity, expert) into [n, 2E]
            if counts is not None or routing is not None:
                return None  # v1 marks beside v2 vectors: the per-event path's precedence rules
            marks = self.v1
            flat = (self.v1_at[lo:hi] - first) * (2 * e) + marks.dropped[lo:hi] * e + marks.expert[lo:hi]
            summed = np.zeros(n * 2 * e, dtype=np.int64)
            np.add.at(summed, flat, marks.value[lo:hi])
            marked = np.zeros(n * 2 * e, dtype=bool)
            marked[flat] = True
            counts, marked = summed.reshape(n, 2 * e), marked.reshape(n, 2 * e)
            has_routing = np.asarray(marked.any(axis=1))
        times = self.times[first:end] if self.times is not None else None
        if times is not None and any(t is not None and len(t) != e for t in times):
            return None
        ffns = None
        lo, hi = np.searchsorted(self.ffn_at, (first, end)).tolist() if len(self.ffn_at) else (0, 0)
        if hi > lo and self.ffn is not None:
            f = self.ffn
            ffns = FfnColumns(f.layer[lo:hi] - first, f.expert[lo:hi], f.start_ns[lo:hi], f.end_ns[lo:hi],
                              f.tokens[lo:hi])
        return LayerColumns(layer, self.start_ns[at], self.end_ns[at], e, kind, self.router_start_ns[at],
                            self.router_end_ns[at], entropy_bits, has_routing, counts, self.has_experts[at],
                            self.experts_start_ns[at], self.experts_end_ns[at], self.experts_tokens[at], times,
                            marked, ffns)


_MARK_CODES = {
    REQUEST: _REQUEST, EXPERT_TOKENS: _TOKENS, EXPERT_DROPPED: _DROPPED,
    ROUTING: _ROUTING, EXPERTS_TIME: _EXPERTS_TIME, STEP_DEVICE: _STEP_DEVICE, STEP_ROUTING: _STEP_ROUTING,
    STEP_REQUESTS: _STEP_REQUESTS, STEP_ENTROPY: _STEP_ENTROPY,
}


class _RowLists(NamedTuple):
    """A batch's range columns as Python lists, for the steps built as objects (per-row numpy field
    access costs ~10x a list index)."""

    start: list[int]
    end: list[int]
    cat: list[int]
    ptypes: list[int]
    floats: list[float]  # the payload's bits as a double
    unsigned: list[int]
    signed: list[int]

    @staticmethod
    def of(ranges: np.ndarray) -> _RowLists:
        payload = ranges["payload"]
        return _RowLists(ranges["start_ns"].tolist(), ranges["end_ns"].tolist(), ranges["category"].tolist(),
                         ranges["payload_type"].tolist(), payload.view(np.float64).tolist(), payload.tolist(),
                         payload.view(np.int64).tolist())


class _V1Marks(NamedTuple):
    """A batch's moe/v1 per-expert marks under the routers of whole-batch steps, as columns."""

    router: np.ndarray  # int64: the router's row in the batch's domain ranges
    dropped: np.ndarray  # bool: moe.expert.dropped (else moe.expert.tokens)
    expert: np.ndarray  # int64: category - 1
    value: np.ndarray  # int64: the payload as the producer meant it (|value| < _V1_MAX_ABS_VALUE)
    layer: np.ndarray | None = None  # int64: the router's layer row (with_layer)

    @staticmethod
    def empty() -> _V1Marks:
        none = np.empty(0, dtype=np.int64)
        return _V1Marks(none, np.empty(0, dtype=bool), none, none)

    def subset(self, wanted: np.ndarray) -> _V1Marks:
        return _V1Marks(self.router[wanted], self.dropped[wanted], self.expert[wanted], self.value[wanted])

    def with_layer(self, parent: np.ndarray) -> _V1Marks:
        return self._replace(layer=parent[self.router])

    def dicts(self, wanted: np.ndarray) -> dict[int, tuple[dict[int, int], dict[int, int]]]:
        """router row -> ({expert: tokens}, {expert: over capacity}) summed over the marks that
        `wanted` selects: one numpy sort and sum, then one dict entry per (router, kind, expert)."""
        at = np.flatnonzero(wanted)
        out: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
        if not len(at):
            return out
        router, dropped, expert, value = self.router[at], self.dropped[at], self.expert[at], self.value[at]
        order = np.lexsort((expert, dropped, router))
        router, dropped, expert, value = router[order], dropped[order], expert[order], value[order]
        new = np.ones(len(at), dtype=bool)
        new[1:] = (router[1:] != router[:-1]) | (dropped[1:] != dropped[:-1]) | (expert[1:] != expert[:-1])
        firsts = np.flatnonzero(new)
        sums = np.add.reduceat(value, firsts)
        for r, is_dropped, e, n in zip(router[firsts].tolist(), dropped[firsts].tolist(), expert[firsts].tolist(),
                                       sums.tolist(), strict=True):
            pair = out.get(r)
            if pair is None:
                pair = out[r] = ({}, {})
            pair[1 if is_dropped else 0][e] = n
        return out


def _v1_values(payload: np.ndarray, payload_type: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value as int64, summable column-wise) of v1 per-expert mark payloads: an integer type and
    |value| < _V1_MAX_ABS_VALUE, so int64 sums equal the per-event path's Python-int sums."""
    as_signed = payload.view(np.int64)
    small = np.where(_IS_SIGNED[payload_type], (as_signed > -_V1_MAX_ABS_VALUE) & (as_signed < _V1_MAX_ABS_VALUE),
                     payload < _V1_MAX_ABS_VALUE)
    return as_signed, _IS_INT[payload_type] & small


def _int64_values(payload: np.ndarray, payload_type: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value as int64, the per-event path's integer equals it) of integer payloads: an integer
    type, and an unsigned one below 2**63."""
    as_signed = payload.view(np.int64)
    return as_signed, _IS_SIGNED[payload_type] | (_IS_UNSIGNED[payload_type] & (as_signed >= 0))


def _set_routing(router: RouterEvent, row: np.ndarray) -> None:
    """A [2E] integer routing row (tokens routed per expert, then over capacity) as the router's
    counts, in the integer type it was sent in (the join checks the range when it copies it)."""
    router.counts = row


def _nonzero_counts(counts: np.ndarray) -> dict[int, int]:
    nz = np.flatnonzero(counts)
    return dict(zip(nz.tolist(), counts[nz].tolist(), strict=True))


def _is_columns(child: Any) -> bool:
    """A pending ("columns", LayerColumns) entry: layers of a step that ends in a later batch."""
    return isinstance(child, tuple) and child[0] == "columns"


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _columns_of_layers(layers: list[LayerEvent], e: int) -> LayerColumns | None:
    """A few layers built as objects (one that was split over batches) as columns, for a step whose
    other layers arrived as columns; None where columns cannot hold them exactly as they are."""
    layers = sorted(layers, key=lambda layer: layer.start_ns)
    n = len(layers)
    kind = np.zeros(n, dtype=np.int8)
    router_start, router_end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    entropy = np.full(n, NAN)
    has_experts = np.zeros(n, dtype=bool)
    x_start, x_end, x_tokens = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    counts = np.zeros((n, 2 * e), dtype=np.int64)
    marked = np.zeros((n, 2 * e), dtype=bool)
    ffn_rows: list[tuple[int, int, int, int, int]] = []

    def fits(value: int | None) -> bool:
        return value is not None and _INT64_MIN <= value <= _INT64_MAX

    for i, layer in enumerate(layers):
        if layer.num_experts != e or layer.loads:
            return None
        router = layer.router
        if router is not None:
            if (not router.timed or router.entropy_bits is None or router.vector is not None
                    or router.counts is not None):
                return None
            kind[i], router_start[i], router_end[i], entropy[i] = (ROUTER_RANGE, router.start_ns, router.end_ns,
                                                                   router.entropy_bits)
            for offset, per_expert in ((0, router.tokens), (e, router.dropped)):
                for expert, value in per_expert.items():
                    if not 0 <= expert < e or not fits(value):
                        return None
                    counts[i, offset + expert], marked[i, offset + expert] = value, True
        fused = layer.experts
        if fused is not None:
            tokens = fused.tokens
            if fused.time_us is not None or tokens is None or not fits(tokens):
                return None
            has_experts[i], x_start[i], x_end[i], x_tokens[i] = True, fused.start_ns, fused.end_ns, tokens
        for ffn in layer.ffns:
            if not fits(ffn.tokens) or not fits(ffn.expert):
                return None
            ffn_rows.append((i, ffn.expert, ffn.start_ns, ffn.end_ns, ffn.tokens or 0))
    v1 = bool(marked.any())
    ffns = None
    if ffn_rows:
        ffns = FfnColumns(*(np.array(column, dtype=np.int64) for column in zip(*ffn_rows, strict=True)))
    return LayerColumns(np.array([layer.layer for layer in layers], dtype=np.int64),
                        np.array([layer.start_ns for layer in layers], dtype=np.int64),
                        np.array([layer.end_ns for layer in layers], dtype=np.int64), e, kind, router_start,
                        router_end, entropy, np.asarray(marked.any(axis=1)), counts if v1 else None, has_experts,
                        x_start, x_end, x_tokens, None, marked if v1 else None, ffns)


def _concat_columns(parts: list[LayerColumns]) -> LayerColumns | None:
    """One step's layer columns from its parts (earlier batches' first), or None where they do not
    join as they are (another E, v1 marks beside v2 vectors, integer types apart, out of start order):
    the step is then built as objects."""
    if len(parts) == 1:
        return parts[0]
    e = parts[0].num_experts
    start_ns = np.concatenate([p.start_ns for p in parts])
    if any(p.num_experts != e for p in parts) or (len(start_ns) > 1 and (np.diff(start_ns) < 0).any()):
        return None
    with_counts = [p for p in parts if p.counts is not None]
    counts = marked = None
    if with_counts:
        v1 = [p.marked is not None for p in with_counts]
        dtype = with_counts[0].counts.dtype if with_counts[0].counts is not None else None
        if any(v != v1[0] for v in v1) or any(p.counts is not None and p.counts.dtype != dtype for p in with_counts):
            return None
        counts = np.concatenate([p.counts if p.counts is not None else np.zeros((len(p), 2 * e), dtype=dtype)
                                 for p in parts])
        if v1[0]:
            marked = np.concatenate([p.marked if p.marked is not None else np.zeros((len(p), 2 * e), dtype=bool)
                                     for p in parts])
    times: list[np.ndarray | None] | None = None
    if any(p.experts_time_us is not None for p in parts):
        times = [t for p in parts for t in (p.experts_time_us if p.experts_time_us is not None else [None] * len(p))]
    ffns = None
    if any(p.ffns is not None for p in parts):
        offsets = np.cumsum([0, *(len(p) for p in parts)]).tolist()
        own = [(p.ffns, at) for p, at in zip(parts, offsets, strict=False) if p.ffns is not None]
        ffns = FfnColumns(*(np.concatenate([getattr(f, name) + (at if name == "layer" else 0) for f, at in own])
                            for name in FfnColumns._fields))

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    return LayerColumns(joined("layer"), start_ns, joined("end_ns"), e, joined("router_kind"),
                        joined("router_start_ns"), joined("router_end_ns"), joined("entropy_bits"),
                        joined("has_routing"), counts, joined("has_experts"), joined("experts_start_ns"),
                        joined("experts_end_ns"), joined("experts_tokens"), times, marked, ffns)


def _is_vector(child: Any, code: int) -> bool:
    return isinstance(child, tuple) and child[0] == "vector" and child[1] == code


def _vector_ok(vector: np.ndarray | None, code: int) -> bool:
    """A decoded vector mark of the right shape and kind (int routing, numeric times)."""
    if vector is None or vector.ndim != 1:
        return False
    return vector.dtype.kind in ("iu" if code in _INT_VECTOR_CODES else "fiu")


def _repeated(keys: np.ndarray) -> np.ndarray:
    """Indices of the entries of `keys` (small non-negative ints: row indices) whose value occurs
    more than once; a count per value, no sort."""
    if len(keys) < 2:
        return np.empty(0, dtype=np.int64)
    counts = np.bincount(keys)
    if counts.max() < 2:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(counts[keys] > 1)


def _range_code(name: str | None) -> int:
    if not name or not name.startswith("moe."):
        return _R_OTHER
    return _RANGE_CODES.get(name, _R_UNKNOWN)


def _mark_code(name: str | None) -> int:
    if not name or not name.startswith("moe."):
        return _OTHER
    return _MARK_CODES.get(name, _UNKNOWN)


def _signed(value: int, payload_type: int) -> int:
    """An integer payload as the producer meant it (int64/int32 arrive as their 64-bit pattern)."""
    if payload_type in _SIGNED_TYPES and value >= 1 << 63:
        return value - (1 << 64)
    return value


def _events(children: list[Any]) -> int:
    """How many events a list of pending children stands for (a grouped count entry carries its own)."""
    total = 0
    for c in children:
        if isinstance(c, tuple) and c[0] == "counts":
            total += c[3]
        elif _is_columns(c):
            total += len(c[1])
        elif isinstance(c, tuple) and c[0] == "experts":
            total += 1 + len(c[2]) + len(c[3])
        else:
            total += 1
    return total
