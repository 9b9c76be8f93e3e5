"""Routing-health math for Mixture-of-Experts layers: one place for every formula the agent reports.

Inputs, per MoE layer of one step (the NVTX convention, docs/traces-and-metrics.md):

* ``c_i`` — tokens the router sent to expert ``i`` (``moe.expert.tokens`` marks), ``i = 0 .. E-1``,
  before capacity; experts without a mark have ``c_i = 0``. With top-k routing ``N = sum_i c_i`` is
  k x (tokens in the batch): it counts routing decisions, and every load statistic is over them.
* ``d_i`` — tokens over expert ``i``'s capacity (``moe.expert.dropped`` marks).
* ``H_r`` — the router's mean token entropy in bits as the runtime reports it (``moe.router`` payload):
  the mean over tokens of ``-sum_i g_i log2 g_i`` of the token's gate distribution ``g``.

Load statistics of a count vector ``c`` of length ``E`` with ``N = sum c_i`` and ``p_i = c_i / N``:

* load entropy (bits)     ``H = -sum_{i: p_i > 0} p_i log2 p_i``          range ``[0, log2 E]``
* normalised entropy      ``H / log2 E``                                  range ``[0, 1]``, 1 = uniform
* Gini coefficient        ``G = sum_i sum_j |c_i - c_j| / (2 E N)``       range ``[0, 1 - 1/E]``
                          computed as ``G = 2 sum_k k x_(k) / (E N) - (E + 1) / E`` over the
                          ascending order statistics ``x_(1) <= .. <= x_(E)`` (same value, O(E log E))
* max share               ``max_i c_i / N``                               range ``[1/E, 1]``
* coefficient of variation ``CV = sigma / mu`` with the population standard deviation
                          ``sigma = sqrt(sum_i (c_i - mu)^2 / E)`` and ``mu = N / E``
* drop fraction           ``sum_i d_i / N``

Router entropy is normalised the same way: ``H_r / log2 E`` (healthy band 8.2-8.7 bits at
E = 16384, i.e. 0.586-0.621; DESIGN.md).

Edge cases (documented, tested):
* ``N = 0`` (no tokens): every ratio above is undefined and is NaN; ``tokens = 0`` is still reported.
* ``E = 1``: ``log2 E = 0``; a single expert is trivially balanced, so normalised entropy is 1.0
  (consistent with ``G = 0`` and ``CV = 0``), max share 1.0; normalised router entropy is NaN (a
  router with one choice has no distribution to measure).
* Negative counts or a count vector of the wrong length raise ``ValueError`` (a caller bug).

Per step (aggregate over the step's layers): the token-weighted mean of each per-layer statistic,
weighted by the layer's ``N`` (layers with ``N = 0`` carry no weight). For router entropy that is
exactly the mean entropy over all (token, layer) routing decisions of the step. Max share and Gini
are also reported as the worst layer (``max``), because one hot layer is what a monopoly looks like.
Summing the count vectors over layers instead would hide imbalance: expert 3 hot in layer 0 and
expert 5 hot in layer 1 would look balanced.

Sliding windows (for the policy rules): ``SlidingCounts`` keeps per-step count vectors of one layer
for ``duration_ns`` with O(1) add/evict (a running integer sum, so no float drift) and answers the
load statistics of the window's summed counts — "Gini per layer over 10 s" is the Gini of all tokens
routed in that layer in the last 10 s. Latency quantiles over a window (p99 of step latency, of
``moe.expert.load`` durations, of request latency) are ``moescope.latency.SlidingQuantile``'s:
nearest-rank, the one definition moescope reports. ``SlidingMean`` is a weighted mean over a window
(router entropy).
A window covers ``(now - duration_ns, now]``. Timestamps are expected non-decreasing; an earlier
one is kept and counted at the latest time seen (clamped), so eviction stays O(1).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from moescope.agent import native

NAN = float("nan")

CountVector = npt.NDArray[np.int64]


def as_counts(counts: Sequence[int] | npt.ArrayLike, *, num_experts: int | None = None) -> CountVector:
    """Validate and convert to an int64 vector (``ValueError`` on negative counts or wrong length)."""
    if type(counts) is np.ndarray and counts.dtype == np.int64 and counts.ndim == 1 and counts.size:
        # the hot case (the agent's own vectors): one reduction instead of the general checks
        if counts.min() < 0:
            raise ValueError("expert counts must be >= 0")
        if num_experts is not None and counts.size != num_experts:
            raise ValueError(f"expected {num_experts} experts, got {counts.size}")
        return counts.copy()
    arr = np.asarray(counts)
    if arr.ndim != 1:
        raise ValueError(f"expert counts must be a 1-D vector, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("expert counts must have at least one expert")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            raise ValueError("expert counts must be whole numbers")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"expert counts must be integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64, copy=True)
    if np.any(out < 0):
        raise ValueError("expert counts must be >= 0")
    if num_experts is not None and out.size != num_experts:
        raise ValueError(f"expected {num_experts} experts, got {out.size}")
    return out


def counts_from_marks(marks: Mapping[int, int], *, num_experts: int) -> CountVector:
    """Count vector from ``{expert: tokens}`` marks (experts without a mark have 0 tokens)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    out = [0] * num_experts  # a Python list, then one conversion: numpy item assignment is slow
    for expert, tokens in marks.items():
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} out of range 0..{num_experts - 1}")
        if tokens < 0:
            raise ValueError(f"expert {expert}: negative token count {tokens}")
        out[expert] += tokens
    if max(out) > INT64_MAX:  # a u64 mark past int64, or a sum past it: a bad payload, like a negative one
        raise ValueError(f"token count {max(out)} does not fit int64")
    return np.array(out, dtype=np.int64)


def load_entropy_bits(counts: Sequence[int] | npt.ArrayLike) -> float:
    """``H = -sum p_i log2 p_i`` over experts with tokens; NaN when no tokens."""
    c = as_counts(counts)
    total = int(c.sum())
    if total == 0:
        return NAN
    p = c[c > 0].astype(np.float64) / total
    h = float(-(p * np.log2(p)).sum())
    return max(h, 0.0)  # -0.0 and rounding below zero for a single loaded expert


def normalised_entropy(entropy_bits: float, num_experts: int) -> float:
    """``H / log2 E``; 1.0 for ``E = 1`` (trivially balanced); NaN stays NaN."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if math.isnan(entropy_bits):
        return NAN
    if num_experts == 1:
        return 1.0
    return entropy_bits / math.log2(num_experts)


def normalised_router_entropy(entropy_bits: float, num_experts: int) -> float:
    """Router mean token entropy ``H_r / log2 E``; NaN for ``E = 1`` or an unreported entropy."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts == 1 or math.isnan(entropy_bits):
        return NAN
    return entropy_bits / math.log2(num_experts)


def gini(counts: Sequence[int] | npt.ArrayLike) -> float:
    """Gini coefficient ``sum_ij |c_i - c_j| / (2 E N)`` via sorted ranks; NaN when no tokens."""
    c = as_counts(counts)
    total = int(c.sum())
    if total == 0:
        return NAN
    e = c.size
    x = np.sort(c).astype(np.float64)
    ranks = np.arange(1, e + 1, dtype=np.float64)
    g = float(2.0 * (ranks * x).sum() / (e * total) - (e + 1) / e)
    return min(max(g, 0.0), 1.0)  # clamp float rounding at the exact bounds


def max_share(counts: Sequence[int] | npt.ArrayLike) -> float:
    """``max_i c_i / N``; NaN when no tokens."""
    c = as_counts(counts)
    total = int(c.sum())
    if total == 0:
        return NAN
    return float(c.max()) / total


def coefficient_of_variation(counts: Sequence[int] | npt.ArrayLike) -> float:
    """``sigma / mu`` with the population standard deviation; NaN when no tokens."""
    c = as_counts(counts)
    total = int(c.sum())
    if total == 0:
        return NAN
    x = c.astype(np.float64)
    mu = total / c.size
    return float(math.sqrt(float(((x - mu) ** 2).sum()) / c.size) / mu)


@dataclass(frozen=True, slots=True)
class LoadStats:
    """Load statistics of one count vector (one layer, or one layer over a window)."""

    num_experts: int
    tokens: int
    dropped: int
    entropy_bits: float
    entropy_normalised: float
    gini: float
    max_share: float
    cv: float
    drop_fraction: float


def load_stats(
    counts: Sequence[int] | npt.ArrayLike, *, dropped: Sequence[int] | npt.ArrayLike | None = None
) -> LoadStats:
    """All load statistics of ``counts`` (and the drop fraction of ``dropped``, same length)."""
    c = as_counts(counts)
    d_total = 0 if dropped is None else int(as_counts(dropped, num_experts=c.size).sum())
    if c.size <= SMALL_EXPERTS:
        return _load_stats_small(c.tolist(), d_total)
    total = int(c.sum())
    h = load_entropy_bits(c)
    return LoadStats(
        num_experts=int(c.size),
        tokens=total,
        dropped=d_total,
        entropy_bits=h,
        entropy_normalised=normalised_entropy(h, int(c.size)),
        gini=gini(c),
        max_share=max_share(c),
        cv=coefficient_of_variation(c),
        drop_fraction=(d_total / total) if total else NAN,
    )


# Up to this many experts load_stats computes in plain Python: numpy's per-call overhead dominates on
# small vectors (E = 16: ~6x faster); above it, the vectorised functions above.
SMALL_EXPERTS = 128


def _load_stats_small(c: list[int], d_total: int) -> LoadStats:
    """``load_stats`` of a validated count list, same formulas as the vectorised functions."""
    e = len(c)
    total = sum(c)
    if total == 0:
        return LoadStats(num_experts=e, tokens=0, dropped=d_total, entropy_bits=NAN, entropy_normalised=NAN,
                         gini=NAN, max_share=NAN, cv=NAN, drop_fraction=NAN)
    log2 = math.log2
    h = max(-math.fsum([(x / total) * log2(x / total) for x in c if x > 0]), 0.0)
    # exact integer rank sum: the same value the float sum gives while it is exact (< 2**53)
    rank_sum = sum([k * x for k, x in enumerate(sorted(c), 1)])
    g = min(max(2.0 * rank_sum / (e * total) - (e + 1) / e, 0.0), 1.0)
    mu = total / e
    cv = math.sqrt(math.fsum([(x - mu) ** 2 for x in c]) / e) / mu
    return LoadStats(
        num_experts=e,
        tokens=total,
        dropped=d_total,
        entropy_bits=h,
        entropy_normalised=normalised_entropy(h, e),
        gini=g,
        max_share=max(c) / total,
        cv=cv,
        drop_fraction=d_total / total,
    )


@dataclass(frozen=True, slots=True)
class LayerRouting:
    """What the runtime reported for one MoE layer in one step."""

    layer: int
    tokens_per_expert: CountVector
    dropped_per_expert: CountVector
    router_entropy_bits: float  # NaN when the runtime did not report it

    @classmethod
    def from_marks(
        cls,
        *,
        layer: int,
        num_experts: int,
        tokens: Mapping[int, int],
        dropped: Mapping[int, int] | None = None,
        router_entropy_bits: float = NAN,
    ) -> LayerRouting:
        return cls(
            layer=layer,
            tokens_per_expert=counts_from_marks(tokens, num_experts=num_experts),
            dropped_per_expert=counts_from_marks(dropped or {}, num_experts=num_experts),
            router_entropy_bits=float(router_entropy_bits),
        )


@dataclass(frozen=True, slots=True)
class LayerHealth:
    layer: int
    load: LoadStats
    router_entropy_bits: float
    router_entropy_normalised: float


def layer_health(routing: LayerRouting) -> LayerHealth:
    """Load statistics plus the router's entropy (bits and normalised) for one layer."""
    stats = load_stats(routing.tokens_per_expert, dropped=routing.dropped_per_expert)
    return LayerHealth(
        layer=routing.layer,
        load=stats,
        router_entropy_bits=routing.router_entropy_bits,
        router_entropy_normalised=normalised_router_entropy(routing.router_entropy_bits, stats.num_experts),
    )


@dataclass(frozen=True, slots=True)
class StepHealth:
    """Aggregate over one step's layers: token-weighted means, worst-layer maxima, totals."""

    layers: int
    tokens: int
    dropped: int
    drop_fraction: float
    router_entropy_bits: float
    router_entropy_normalised: float
    entropy_bits: float
    entropy_normalised: float
    gini: float
    gini_max: float
    max_share: float  # the worst layer's
    cv: float


def _weighted_mean(pairs: Iterable[tuple[float, int]]) -> float:
    """``sum w v / sum w`` over pairs with a finite value and positive weight; NaN if none."""
    num = 0.0
    den = 0
    for value, weight in pairs:
        if weight > 0 and not math.isnan(value):
            num += value * weight
            den += weight
    return num / den if den else NAN


def _nanmax(values: Iterable[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else NAN


def step_health(layers: Sequence[LayerHealth]) -> StepHealth:
    """Aggregate per-layer health into one step (see the module docstring for the definition)."""
    tokens = sum(h.load.tokens for h in layers)
    dropped = sum(h.load.dropped for h in layers)
    return StepHealth(
        layers=len(layers),
        tokens=tokens,
        dropped=dropped,
        drop_fraction=(dropped / tokens) if tokens else NAN,
        router_entropy_bits=_weighted_mean((h.router_entropy_bits, h.load.tokens) for h in layers),
        router_entropy_normalised=_weighted_mean((h.router_entropy_normalised, h.load.tokens) for h in layers),
        entropy_bits=_weighted_mean((h.load.entropy_bits, h.load.tokens) for h in layers),
        entropy_normalised=_weighted_mean((h.load.entropy_normalised, h.load.tokens) for h in layers),
        gini=_weighted_mean((h.load.gini, h.load.tokens) for h in layers),
        gini_max=_nanmax(h.load.gini for h in layers),
        max_share=_nanmax(h.load.max_share for h in layers),
        cv=_weighted_mean((h.load.cv, h.load.tokens) for h in layers),
    )


# ------------------------------------------------------------------ one step's layers as arrays

FloatVector = npt.NDArray[np.float64]
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
CountMatrix = npt.NDArray[np.int64] | npt.NDArray[np.int32]


@dataclass(slots=True, eq=False, init=False)
class LayerTable:
    """One step's routing and health as arrays over its routed layers (row ``i`` is layer
    ``layers[i]``): the same formulas as ``load_stats`` / ``layer_health``, computed for all layers
    at once (at E = 256, L = 58 the per-layer objects were most of the agent's CPU). Objects are
    made only on demand (``health(i)``). Read only by convention, not frozen: a table is made for
    every step, and a frozen dataclass's generated __init__ (interpreted even in the compiled
    build, one object.__setattr__ a field) cost ~2 us of it; this one is compiled."""

    layers: CountVector  # [L'] layer index of each row
    tokens: CountMatrix  # [L', E] tokens routed per expert (c_i); int32 or int64
    dropped: CountMatrix  # [L', E] tokens over capacity per expert (d_i), same dtype
    router_entropy_bits: FloatVector  # [L'] H_r as reported; NaN where not
    tokens_total: CountVector  # [L'] N
    dropped_total: CountVector
    entropy_bits: FloatVector
    entropy_normalised: FloatVector
    gini: FloatVector
    max_share: FloatVector
    cv: FloatVector
    drop_fraction: FloatVector
    router_entropy_normalised: FloatVector
    # [L', 2E]: tokens | dropped side by side, where they are views of one block (the join's): sums
    # over steps add it in one operation; None when the two came apart
    block: CountMatrix | None

    def __init__(self, *, layers: CountVector, tokens: CountMatrix, dropped: CountMatrix,
                 router_entropy_bits: FloatVector, tokens_total: CountVector, dropped_total: CountVector,
                 entropy_bits: FloatVector, entropy_normalised: FloatVector, gini: FloatVector,
                 max_share: FloatVector, cv: FloatVector, drop_fraction: FloatVector,
                 router_entropy_normalised: FloatVector, block: CountMatrix | None = None) -> None:
        self.layers = layers
        self.tokens = tokens
        self.dropped = dropped
        self.router_entropy_bits = router_entropy_bits
        self.tokens_total = tokens_total
        self.dropped_total = dropped_total
        self.entropy_bits = entropy_bits
        self.entropy_normalised = entropy_normalised
        self.gini = gini
        self.max_share = max_share
        self.cv = cv
        self.drop_fraction = drop_fraction
        self.router_entropy_normalised = router_entropy_normalised
        self.block = block

    def __len__(self) -> int:
        return int(self.layers.size)

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[1])

    def load(self, i: int) -> LoadStats:
        return LoadStats(
            num_experts=self.num_experts, tokens=int(self.tokens_total[i]), dropped=int(self.dropped_total[i]),
            entropy_bits=float(self.entropy_bits[i]), entropy_normalised=float(self.entropy_normalised[i]),
            gini=float(self.gini[i]), max_share=float(self.max_share[i]), cv=float(self.cv[i]),
            drop_fraction=float(self.drop_fraction[i]),
        )

    def health(self, i: int) -> LayerHealth:
        return LayerHealth(layer=int(self.layers[i]), load=self.load(i),
                           router_entropy_bits=float(self.router_entropy_bits[i]),
                           router_entropy_normalised=float(self.router_entropy_normalised[i]))

    def step_health(self) -> StepHealth:
        """``step_health`` of this step's layers (same definition; the columns as lists: a step has
        at most ~100 layers, where numpy's per-call cost would dominate)."""
        n = self.tokens_total.tolist()
        tokens = sum(n)
        dropped = int(self.dropped_total.sum())

        def weighted(values: FloatVector) -> float:
            return _weighted_mean(zip(values.tolist(), n, strict=True))

        return StepHealth(
            layers=len(self), tokens=tokens, dropped=dropped,
            drop_fraction=(dropped / tokens) if tokens else NAN,
            router_entropy_bits=weighted(self.router_entropy_bits),
            router_entropy_normalised=weighted(self.router_entropy_normalised),
            entropy_bits=weighted(self.entropy_bits), entropy_normalised=weighted(self.entropy_normalised),
            gini=weighted(self.gini), gini_max=_nanmax(self.gini.tolist()), max_share=_nanmax(self.max_share.tolist()),
            cv=weighted(self.cv),
        )


def layer_table(
    *, layers: npt.ArrayLike, tokens: npt.ArrayLike, dropped: npt.ArrayLike | None = None,
    router_entropy_bits: npt.ArrayLike | None = None, block: CountMatrix | None = None,
) -> LayerTable:
    """The ``LayerTable`` of count matrices ``tokens`` / ``dropped`` ([L', E], E >= 1) for rows
    ``layers``; ``block``, when given, is the [L', 2E] matrix they are the two halves of (kept if
    they still are after the dtype checks). ``ValueError`` on negative counts or mismatched shapes."""
    c = np.asarray(tokens)
    if c.ndim != 2 or c.shape[1] < 1:
        raise ValueError(f"token counts must be a [layers, experts] matrix with experts >= 1, got shape {c.shape}")
    if c.dtype.kind not in "iu":
        raise ValueError(f"expert counts must be integers, got dtype {c.dtype}")
    if c.dtype != np.int32:
        c = c.astype(np.int64, copy=False)  # int32 (the join's compact blocks) is kept as it is
    rows, e = c.shape
    d = np.zeros_like(c) if dropped is None else np.asarray(dropped)
    if d.dtype != c.dtype:
        d = d.astype(np.int64)
        c = c.astype(np.int64, copy=False)
    index = np.asarray(layers, dtype=np.int64).reshape(-1)
    h_r = np.full(rows, NAN) if router_entropy_bits is None else np.asarray(router_entropy_bits, dtype=np.float64)
    if d.shape != c.shape or index.shape != (rows,) or h_r.shape != (rows,):
        raise ValueError(
            f"shapes differ: tokens {c.shape}, dropped {d.shape}, layers {index.shape}, entropy {h_r.shape}"
        )
    if e == 1:
        router_norm = np.full(rows, NAN)
    else:
        router_norm = h_r / math.log2(e)
    if block is not None and not (block.shape == (rows, 2 * e) and block.dtype == c.dtype
                                  and np.shares_memory(block, c) and np.shares_memory(block, d)):
        block = None
    fast = _native_health(c, d) if rows else None
    if fast is not None:
        return LayerTable(layers=index, tokens=c, dropped=d, block=block, **_health_columns(fast, h_r, e))
    if rows and (c.min() < 0 or d.min() < 0):
        raise ValueError("expert counts must be >= 0")
    n = c.sum(axis=1, dtype=np.int64)
    n_drop = d.sum(axis=1, dtype=np.int64)
    has = n > 0
    safe = np.where(has, n, 1).astype(np.float64)
    top = int(c.max()) if c.size else 0
    # H = log2 N - sum c log2 c / N (the same sum as -sum p log2 p); c log2 c read from a table for
    # counts below TABLE_COUNTS (a gather instead of a log per entry: most of this function's time)
    if top < _CLOG_COUNTS:
        clogc = _CLOG2C[c].sum(axis=1)
    else:
        x = c.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            clogc = np.where(c > 0, x * np.log2(np.where(c > 0, x, 1.0)), 0.0).sum(axis=1)
    entropy = np.where(has, np.maximum(np.log2(safe) - clogc / safe, 0.0), NAN)
    entropy_norm = np.where(has, 1.0, NAN) if e == 1 else entropy / math.log2(e)
    rank_sum = _rank_sums(c, top)
    g = np.clip(2.0 * rank_sum / (e * safe) - (e + 1) / e, 0.0, 1.0)
    mu = safe / e
    # sigma^2 = (E sum c^2 - N^2) / E^2, exact in int64 for counts below 2^24 (E <= 2^16)
    if top < 1 << 24 and e <= 1 << 16:
        c64 = c.astype(np.int64)
        spread = np.einsum("ij,ij->i", c64, c64) * e - n * n
        cv = np.sqrt(spread.astype(np.float64)) / e / mu
    else:
        cv = np.sqrt(((c - mu[:, None]) ** 2).sum(axis=1) / e) / mu
    return LayerTable(
        layers=index, tokens=c, dropped=d, router_entropy_bits=h_r, tokens_total=n, dropped_total=n_drop,
        entropy_bits=entropy, entropy_normalised=entropy_norm,
        gini=np.where(has, g, NAN), max_share=np.where(has, c.max(axis=1, initial=0) / safe, NAN),
        cv=np.where(has, cv, NAN), drop_fraction=np.where(has, n_drop / safe, NAN),
        router_entropy_normalised=router_norm, block=block,
    )


_CLOG_COUNTS = 1 << 16  # counts with a precomputed c log2 c (512 KB of float64)
_CLOG2C = np.zeros(_CLOG_COUNTS)
_CLOG2C[1:] = np.arange(1, _CLOG_COUNTS) * np.log2(np.arange(1, _CLOG_COUNTS))


def _native_health(c: CountMatrix, d: CountMatrix) -> native.RowHealth | None:
    """layer_table's per-row numbers in one native pass (agent/native), or None where numpy makes
    them: no library built, another dtype, or counts past the exact-integer range."""
    if not native.available() or c.dtype not in _NATIVE_DTYPES or d.dtype != c.dtype:
        return None
    return native.count_rows(c, d, _CLOG2C)  # ValueError on a negative count, as the numpy path


_NATIVE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


@dataclass(frozen=True, slots=True, eq=False)
class StepsTable:
    """The LayerTables of k steps with the same R routed layers, computed in one pass: ``step(i)``
    is ``layer_table`` of step i's [R, 2E] block (views into these arrays). ``blocks`` is the
    steps' [k, R, 2E] counts (tokens | dropped), a view where they lie in one decoded buffer; the
    health columns hold k x R rows, step after step."""

    layers: CountVector  # [R], every step's
    blocks: CountMatrix  # [k, R, 2E]
    router_entropy_bits: FloatVector  # [k R]
    tokens_total: CountVector
    dropped_total: CountVector
    entropy_bits: FloatVector
    entropy_normalised: FloatVector
    gini: FloatVector
    max_share: FloatVector
    cv: FloatVector
    drop_fraction: FloatVector
    router_entropy_normalised: FloatVector

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def rows_per_step(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.blocks.shape[2]) // 2

    def step(self, i: int) -> LayerTable:
        r, e = self.rows_per_step, self.num_experts
        part = slice(i * r, (i + 1) * r)
        block = self.blocks[i]
        return LayerTable(
            layers=self.layers, tokens=block[:, :e], dropped=block[:, e:],
            router_entropy_bits=self.router_entropy_bits[part], tokens_total=self.tokens_total[part],
            dropped_total=self.dropped_total[part], entropy_bits=self.entropy_bits[part],
            entropy_normalised=self.entropy_normalised[part], gini=self.gini[part], max_share=self.max_share[part],
            cv=self.cv[part], drop_fraction=self.drop_fraction[part],
            router_entropy_normalised=self.router_entropy_normalised[part], block=block,
        )

    def per_step(self, column: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A [k R] column as [k, R]."""
        return column.reshape(len(self), self.rows_per_step)


def steps_table(*, layers: CountVector, blocks: CountMatrix, router_entropy_bits: FloatVector) -> StepsTable | None:
    """The StepsTable of [k, R, 2E] int32/int64 count blocks (every step's rows are ``layers``;
    ``router_entropy_bits`` [k R]), in one native pass; None where that pass does not apply (no
    library, counts past its exact range, E < 1): the caller takes ``layer_table`` per step.
    ValueError on a negative count, as layer_table."""
    k, rows, width = blocks.shape
    e = width // 2
    if (not native.available() or blocks.dtype not in _NATIVE_DTYPES or e < 1 or width != 2 * e
            or router_entropy_bits.shape != (k * rows,) or layers.shape != (rows,)):
        return None
    fast = native.count_rows(blocks[:, :, :e], blocks[:, :, e:], _CLOG2C)
    if fast is None:
        return None
    h_r = np.asarray(router_entropy_bits, dtype=np.float64)
    return StepsTable(layers=layers, blocks=blocks, **_health_columns(fast, h_r, e))


def _health_columns(fast: native.RowHealth, h_r: FloatVector, e: int) -> dict[str, npt.NDArray[Any]]:
    """The health columns of LayerTable and StepsTable from the native pass's rows (one definition
    of the normalisations: by log2 E; E = 1 has one outcome, normalised entropy 1 where routed)."""
    entropy = fast.entropy_bits
    return {
        "router_entropy_bits": h_r, "tokens_total": fast.total, "dropped_total": fast.dropped,
        "entropy_bits": entropy,
        "entropy_normalised": np.where(fast.total > 0, 1.0, NAN) if e == 1 else entropy / math.log2(e),
        "gini": fast.gini, "max_share": fast.max_share, "cv": fast.cv, "drop_fraction": fast.drop_fraction,
        "router_entropy_normalised": np.full(len(h_r), NAN) if e == 1 else h_r / math.log2(e),
    }


def _rank_sums(c: CountMatrix, top: int) -> CountVector:
    """Per row, ``sum_k k x_(k)`` over the ascending order statistics (exact integers, as
    _load_stats_small). Counts per expert are small next to E at decode shapes (k x tokens / E), so
    a per-row histogram of values stands in for the sort: n_v entries of value v after R_v smaller
    ones hold ranks R_v+1 .. R_v+n_v, i.e. add v (n_v R_v + n_v (n_v + 1) / 2)."""
    rows, e = c.shape
    if rows == 0 or top >= 4 * e:  # large counts: the histogram would outgrow the sort
        ranked: CountVector = (np.sort(c, axis=1) * np.arange(1, e + 1, dtype=np.int64)).sum(axis=1)
        return ranked
    width = top + 1
    flat = (np.arange(rows, dtype=np.int64)[:, None] * width + c).reshape(-1)
    n_v = np.bincount(flat, minlength=rows * width).reshape(rows, width)
    below = np.cumsum(n_v, axis=1) - n_v
    values = np.arange(width, dtype=np.int64)
    summed: CountVector = ((n_v * below + n_v * (n_v + 1) // 2) @ values).astype(np.int64)
    return summed


def empty_table(num_experts: int = 1) -> LayerTable:
    """A table with no layers (a step with no routed layer, or one whose layer tree was let go)."""
    zeros = np.zeros((0, max(1, num_experts)), dtype=np.int64)
    return layer_table(layers=np.zeros(0, dtype=np.int64), tokens=zeros, dropped=zeros,
                       router_entropy_bits=np.zeros(0))


def _check_duration(duration_ns: int) -> int:
    if duration_ns <= 0:
        raise ValueError(f"window duration must be > 0 ns, got {duration_ns}")
    return int(duration_ns)


class SlidingCounts:
    """Per-step count vectors of one layer over the last ``duration_ns``; O(1) entries per add/evict.

    ``stats(now_ns)`` gives ``load_stats`` of the window's summed counts (and drops).
    """

    def __init__(self, *, duration_ns: int, num_experts: int, bucket_ns: int = 0) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if bucket_ns < 0 or bucket_ns >= duration_ns:
            raise ValueError(f"bucket_ns must be in [0, duration_ns), got {bucket_ns}")
        self.duration_ns = _check_duration(duration_ns)
        self.num_experts = num_experts
        # 0: each step is an entry of its own, evicted exactly `duration_ns` after it. > 0: steps are
        # summed into buckets of `bucket_ns`, and a bucket leaves when its last step is that old: the
        # window then spans duration_ns to duration_ns + bucket_ns, and holds ~duration/bucket [L, E]
        # sums instead of every step's (at DeepSeek-V3 shape, 200 steps/s x 10 s x 119 KB = 238 MB)
        self.bucket_ns = bucket_ns
        self._open: _Bucket | None = None
        self._entries: deque[tuple[int, CountVector, CountVector]] = deque()
        self._sum = np.zeros(num_experts, dtype=np.int64)
        self._dropped_sum = np.zeros(num_experts, dtype=np.int64)
        self._last_ns: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self, t_ns: int, counts: Sequence[int] | npt.ArrayLike, *, dropped: Sequence[int] | npt.ArrayLike | None = None
    ) -> None:
        c = as_counts(counts, num_experts=self.num_experts)
        d = (
            np.zeros(self.num_experts, dtype=np.int64)
            if dropped is None
            else as_counts(dropped, num_experts=self.num_experts)
        )
        t = t_ns if self._last_ns is None else max(t_ns, self._last_ns)
        self._last_ns = t
        self._entries.append((t, c, d))
        self._sum += c
        self._dropped_sum += d
        self.evict(t)

    def evict(self, now_ns: int) -> None:
        """Drop entries at or before ``now_ns - duration_ns``."""
        horizon = now_ns - self.duration_ns
        while self._entries and self._entries[0][0] <= horizon:
            _, c, d = self._entries.popleft()
            self._sum -= c
            self._dropped_sum -= d

    def totals(self, now_ns: int | None = None) -> CountVector:
        """Summed counts in the window (a copy)."""
        if now_ns is not None:
            self.evict(now_ns)
        return self._sum.copy()

    def stats(self, now_ns: int | None = None) -> LoadStats:
        if now_ns is not None:
            self.evict(now_ns)
        return load_stats(self._sum, dropped=self._dropped_sum)


class SlidingMean:
    """Weighted mean of values over the last ``duration_ns`` (running sums, O(1) add/evict)."""

    def __init__(self, *, duration_ns: int) -> None:
        self.duration_ns = _check_duration(duration_ns)
        self._entries: deque[tuple[int, float, float]] = deque()
        self._num = 0.0
        self._den = 0.0
        self._last_ns: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, t_ns: int, value: float, *, weight: float = 1.0) -> None:
        """Add ``value`` with ``weight``; NaN values or non-positive weights are ignored."""
        t = t_ns if self._last_ns is None else max(t_ns, self._last_ns)
        self._last_ns = t
        if not math.isnan(value) and weight > 0:
            self._entries.append((t, float(value), float(weight)))
            self._num += value * weight
            self._den += weight
        self.evict(t)

    def evict(self, now_ns: int) -> None:
        horizon = now_ns - self.duration_ns
        while self._entries and self._entries[0][0] <= horizon:
            _, v, w = self._entries.popleft()
            self._num -= v * w
            self._den -= w
        if not self._entries:
            self._num = 0.0  # reset float drift whenever the window empties
            self._den = 0.0

    def mean(self, now_ns: int | None = None) -> float:
        if now_ns is not None:
            self.evict(now_ns)
        return self._num / self._den if self._entries else NAN


def add_rows(into: npt.NDArray[Any], rows: CountVector, values: npt.NDArray[Any], *, sign: int = 1) -> None:
    """``into[rows] += sign * values`` where ``rows`` may repeat (two routers reporting one layer):
    an in-place add on a slice when the rows are consecutive (a step's layers 0..L-1, the usual
    case), a fancy-indexed add when they are distinct (``np.add.at`` costs ~10x)."""
    listed = rows.tolist()
    if listed and listed == list(range(listed[0], listed[0] + len(listed))):
        part = into[listed[0] : listed[0] + len(listed)]  # a view: no gather, no scatter
        if sign > 0:
            part += values
        else:
            part -= values
    elif len(listed) < 2 or len(set(listed)) == len(listed):
        if sign > 0:
            into[rows] += values
        else:
            into[rows] -= values
    elif sign > 0:
        np.add.at(into, rows, values)
    else:
        np.subtract.at(into, rows, values)


def stacked_view(parts: Sequence[npt.NDArray[Any]]) -> npt.NDArray[Any] | None:
    """``np.stack(parts)`` without the copy, where the parts already lie evenly spaced in one buffer
    (the parser decodes a batch's step vectors as one strided array and hands each step its row):
    a [k, *shape] view, or None when they do not. Only memory the parts themselves cover is viewed."""
    first = parts[0]
    if not first.size or not all(p.base is first.base and p.shape == first.shape and p.dtype == first.dtype
                                  and p.strides == first.strides for p in parts):
        return None
    if (first.base is None and len(parts) > 1) or not first.flags.c_contiguous:
        return None
    origin = first.__array_interface__["data"][0]
    step = parts[1].__array_interface__["data"][0] - origin if len(parts) > 1 else first.nbytes
    if step < first.nbytes:
        return None  # overlapping or out of order
    for i, p in enumerate(parts):
        if p.__array_interface__["data"][0] != origin + i * step:
            return None
    return np.lib.stride_tricks.as_strided(first, shape=(len(parts), *first.shape), strides=(step, *first.strides),
                                           writeable=False)


def sum_steps(blocks: npt.NDArray[Any], *, bound: int) -> npt.NDArray[Any]:
    """``blocks.sum(axis=0)`` of [k, R, C] integer counts, ``bound`` an upper bound of any entry of
    the sum: in int32 (as the blocks are) when it fits, else int64. Row by row in place: numpy's
    reduction over the first axis of such a stack is ~2.5x slower at [20, 58, 512]."""
    wide = blocks.dtype != np.int32 or bound > INT32_MAX
    total = blocks[0].astype(np.int64 if wide else np.int32, copy=True)
    for part in blocks[1:]:
        total += part
    return total


class _Bucket:
    """The sums of the steps of one RoutingHealthWindow bucket: tokens | dropped as one [R, 2E]
    matrix (a step's block is one add), rows growing with the window's."""

    __slots__ = ("start_ns", "last_ns", "counts", "entropy_num", "entropy_den", "entropy_n")

    def __init__(self, start_ns: int, rows: int, num_experts: int) -> None:
        self.start_ns = self.last_ns = start_ns
        self.counts = np.zeros((rows, 2 * num_experts), dtype=np.int64)
        self.entropy_num = np.zeros(rows)
        self.entropy_den = np.zeros(rows)
        self.entropy_n = np.zeros(rows, dtype=np.int64)

    def grow(self, rows: int) -> None:
        extra = rows - len(self.counts)
        if extra <= 0:
            return
        self.counts = np.vstack([self.counts, np.zeros((extra, self.counts.shape[1]), dtype=np.int64)])
        self.entropy_num = np.concatenate([self.entropy_num, np.zeros(extra)])
        self.entropy_den = np.concatenate([self.entropy_den, np.zeros(extra)])
        self.entropy_n = np.concatenate([self.entropy_n, np.zeros(extra, dtype=np.int64)])


class RoutingHealthWindow:
    """Per-layer sliding windows of expert counts and router entropy (the policy's routing signals).

    ``add_table`` takes one step's ``LayerTable`` (``add_step`` its ``LayerRouting``s);
    ``layer_stats`` answers "Gini per layer over 10 s" and ``router_entropy_normalised`` the
    token-weighted mean router entropy over the window. All layers are one [layers, E] running sum:
    a step costs a few array operations whatever L is (the same sums ``SlidingCounts`` and
    ``SlidingMean`` keep per layer).
    """

    def __init__(self, *, duration_ns: int, num_experts: int, bucket_ns: int = 0) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if bucket_ns < 0 or bucket_ns >= duration_ns:
            raise ValueError(f"bucket_ns must be in [0, duration_ns), got {bucket_ns}")
        self.duration_ns = _check_duration(duration_ns)
        self.num_experts = num_experts
        # 0: each step is an entry of its own, evicted exactly `duration_ns` after it. > 0: steps are
        # summed into buckets of `bucket_ns`, and a bucket leaves when its last step is that old: the
        # window then spans duration_ns to duration_ns + bucket_ns, and holds ~duration/bucket [L, E]
        # sums instead of every step's (at DeepSeek-V3 shape, 200 steps/s x 10 s x 119 KB = 238 MB)
        self.bucket_ns = bucket_ns
        self._open: _Bucket | None = None
        # per step: (t, layer rows, tokens [L', E], dropped [L', E], entropy x weight, weight, entropy valid)
        self._entries: deque[tuple[int, CountVector, CountMatrix, CountMatrix, FloatVector, FloatVector,
                                   npt.NDArray[np.bool_]]] = deque()
        self._tokens = np.zeros((0, num_experts), dtype=np.int64)
        self._dropped = np.zeros((0, num_experts), dtype=np.int64)
        self._entropy_num = np.zeros(0)
        self._entropy_den = np.zeros(0)
        self._entropy_n = np.zeros(0, dtype=np.int64)  # valid entropy entries per layer (reset drift at 0)
        self._seen = np.zeros(0, dtype=bool)
        self._last_ns: int | None = None
        self._bucket_valid: deque[CountVector] = deque()  # closed buckets' valid-entropy counts per layer
        # bumped by every add, bucket close and eviction: table() between two changes is one
        # computation (the policy reads it 5 times a second, the metrics and the live view once a
        # second, and at the reference load the NVTX drain brings steps every 500 ms)
        self._version = 0
        self._cached_table: tuple[int, LayerTable] | None = None

    def _grow(self, rows: int) -> None:
        have = self._tokens.shape[0]
        if rows <= have:
            return
        extra = rows - have
        self._tokens = np.vstack([self._tokens, np.zeros((extra, self.num_experts), dtype=np.int64)])
        self._dropped = np.vstack([self._dropped, np.zeros((extra, self.num_experts), dtype=np.int64)])
        self._entropy_num = np.concatenate([self._entropy_num, np.zeros(extra)])
        self._entropy_den = np.concatenate([self._entropy_den, np.zeros(extra)])
        self._entropy_n = np.concatenate([self._entropy_n, np.zeros(extra, dtype=np.int64)])
        self._seen = np.concatenate([self._seen, np.zeros(extra, dtype=bool)])

    def add_step(self, t_ns: int, layers: Iterable[LayerRouting]) -> None:
        routings = list(layers)
        if not routings:
            self.evict(t_ns)
            return
        tokens = np.stack([as_counts(r.tokens_per_expert, num_experts=self.num_experts) for r in routings])
        dropped = np.stack([as_counts(r.dropped_per_expert, num_experts=self.num_experts) for r in routings])
        self.add_table(t_ns, layer_table(layers=[r.layer for r in routings], tokens=tokens, dropped=dropped,
                                         router_entropy_bits=[r.router_entropy_bits for r in routings]))

    def add_table(self, t_ns: int, table: LayerTable) -> None:
        """One step's routed layers (``ValueError`` if its E is not the window's)."""
        if len(table) and table.num_experts != self.num_experts:
            raise ValueError(f"expected {self.num_experts} experts, got {table.num_experts}")
        t = t_ns if self._last_ns is None else max(t_ns, self._last_ns)
        self._last_ns = t
        if len(table):
            self._version += 1
            rows = table.layers
            if rows.min() < 0:
                raise ValueError("layer indices must be >= 0")
            self._grow(int(rows.max()) + 1)
            weight = table.tokens_total.astype(np.float64)
            valid = ~np.isnan(table.router_entropy_bits) & (weight > 0)
            weighted = np.where(valid, table.router_entropy_bits * weight, 0.0)
            weight = np.where(valid, weight, 0.0)
            self._seen[rows] = True
            if self.bucket_ns:  # into the open bucket only: the totals take it whole when it closes
                self._add_to_bucket(t, rows, table, weighted, weight, valid)
                self._evict_closed(t)
                return
            add_rows(self._tokens, rows, table.tokens)
            add_rows(self._dropped, rows, table.dropped)
            add_rows(self._entropy_num, rows, weighted)
            add_rows(self._entropy_den, rows, weight)
            add_rows(self._entropy_n, rows, valid.astype(np.int64))
            self._entries.append((t, rows, table.tokens, table.dropped, weighted, weight, valid))
        self.evict(t)

    def add_run(self, times: Sequence[int], table: StepsTable, first: int = 0) -> None:
        """``add_table`` of steps ``first .. first + len(times) - 1`` of ``table`` at once. Steps
        that fall in one bucket are summed first and added as one (the per-step adds were most of
        this window's cost at DeepSeek-V3 shape); the window ends as the steps' ``add_table`` one by
        one leave it, up to float rounding of the entropy sums."""
        count = len(times)
        if not count:
            return
        if not self.bucket_ns or table.num_experts != self.num_experts or not table.rows_per_step:
            for i, t_ns in enumerate(times):
                self.add_table(t_ns, table.step(first + i))
            return
        rows = table.layers
        if rows.min() < 0:
            raise ValueError("layer indices must be >= 0")
        self._version += 1
        self._grow(int(rows.max()) + 1)
        self._seen[rows] = True
        part = slice(first, first + count)
        weight = table.per_step(table.tokens_total)[part].astype(np.float64)
        entropy = table.per_step(table.router_entropy_bits)[part]
        valid = ~np.isnan(entropy) & (weight > 0)
        weighted = np.where(valid, entropy * weight, 0.0)
        weight = np.where(valid, weight, 0.0)
        blocks = table.blocks[part]
        # no entry's sum exceeds the tokens and drops of all these steps together
        tokens, dropped = table.per_step(table.tokens_total)[part], table.per_step(table.dropped_total)[part]
        bound = int(tokens.sum()) + int(dropped.sum())
        start = 0
        last = self._last_ns
        for i, t_ns in enumerate(times):
            t = t_ns if last is None else max(t_ns, last)
            bucket = self._open
            if bucket is not None and t >= bucket.start_ns + self.bucket_ns:
                if i > start:
                    self._add_sums(rows, blocks[start:i], weighted[start:i], weight[start:i], valid[start:i], bound)
                    start = i
                self._close_bucket()
            if self._open is None:
                self._open = _Bucket(t, len(self._seen), self.num_experts)
            self._open.last_ns = t
            last = t
        self._last_ns = last
        self._add_sums(rows, blocks[start:], weighted[start:], weight[start:], valid[start:], bound)
        assert last is not None
        self._evict_closed(last)

    def _add_sums(self, rows: CountVector, blocks: npt.NDArray[Any], weighted: npt.NDArray[np.float64],
                  weight: npt.NDArray[np.float64], valid: npt.NDArray[np.bool_], bound: int) -> None:
        """Steps of the open bucket, summed: blocks [k, R, 2E], the rest [k, R]."""
        bucket = self._open
        assert bucket is not None
        bucket.grow(len(self._seen))
        add_rows(bucket.counts, rows, sum_steps(blocks, bound=bound))
        add_rows(bucket.entropy_num, rows, weighted.sum(axis=0))
        add_rows(bucket.entropy_den, rows, weight.sum(axis=0))
        add_rows(bucket.entropy_n, rows, valid.sum(axis=0, dtype=np.int64))

    def _add_to_bucket(self, t: int, rows: CountVector, table: LayerTable, weighted: FloatVector,
                       weight: FloatVector, valid: npt.NDArray[np.bool_]) -> None:
        bucket = self._open
        if bucket is not None and t >= bucket.start_ns + self.bucket_ns:
            self._close_bucket()
            bucket = None
        if bucket is None:
            bucket = self._open = _Bucket(t, len(self._seen), self.num_experts)
        bucket.grow(len(self._seen))
        bucket.last_ns = t
        e = self.num_experts
        if table.block is not None:
            add_rows(bucket.counts, rows, table.block)
        else:
            add_rows(bucket.counts[:, :e], rows, table.tokens)
            add_rows(bucket.counts[:, e:], rows, table.dropped)
        add_rows(bucket.entropy_num, rows, weighted)
        add_rows(bucket.entropy_den, rows, weight)
        add_rows(bucket.entropy_n, rows, valid.astype(np.int64))

    def _close_bucket(self) -> None:
        """The open bucket joins the totals and the entries."""
        b = self._open
        if b is None:
            return
        self._open = None
        self._version += 1
        n, e = len(b.counts), self.num_experts
        self._tokens[:n] += b.counts[:, :e]
        self._dropped[:n] += b.counts[:, e:]
        self._entropy_num[:n] += b.entropy_num
        self._entropy_den[:n] += b.entropy_den
        self._entropy_n[:n] += b.entropy_n
        self._entries.append((b.last_ns, np.arange(n), b.counts[:, :e], b.counts[:, e:], b.entropy_num,
                              b.entropy_den, b.entropy_n.astype(bool)))
        self._bucket_valid.append(b.entropy_n)

    def __len__(self) -> int:
        return len(self._entries) + (self._open is not None)

    def evict(self, now_ns: int) -> None:
        """Drop steps at or before ``now_ns - duration_ns`` (with buckets: buckets whose last step is)."""
        b = self._open
        if b is not None and b.last_ns <= now_ns - self.duration_ns:
            self._close_bucket()  # all of it is out of the window: it leaves through the entries
        self._evict_closed(now_ns)

    def _sums(self) -> tuple[CountMatrix, CountMatrix, FloatVector, FloatVector, CountVector]:
        """(tokens, dropped, entropy x weight, weight, valid-entropy count) per layer row over the
        window: the closed entries' running totals, plus the open bucket's (read, not closed)."""
        b = self._open
        if b is None:
            return self._tokens, self._dropped, self._entropy_num, self._entropy_den, self._entropy_n
        n, e = len(b.counts), self.num_experts
        tokens, dropped = self._tokens.copy(), self._dropped.copy()
        num, den, valid = self._entropy_num.copy(), self._entropy_den.copy(), self._entropy_n.copy()
        tokens[:n] += b.counts[:, :e]
        dropped[:n] += b.counts[:, e:]
        num[:n] += b.entropy_num
        den[:n] += b.entropy_den
        valid[:n] += b.entropy_n
        return tokens, dropped, num, den, valid

    def _evict_closed(self, now_ns: int) -> None:
        horizon = now_ns - self.duration_ns
        emptied = False
        while self._entries and self._entries[0][0] <= horizon:
            _, rows, tokens, dropped, weighted, weight, valid = self._entries.popleft()
            add_rows(self._tokens, rows, tokens, sign=-1)
            add_rows(self._dropped, rows, dropped, sign=-1)
            add_rows(self._entropy_num, rows, weighted, sign=-1)
            add_rows(self._entropy_den, rows, weight, sign=-1)
            counts = self._bucket_valid.popleft() if self.bucket_ns else valid.astype(np.int64)
            add_rows(self._entropy_n, rows, counts, sign=-1)
            emptied = True
        if emptied:
            self._version += 1
            empty = self._entropy_n == 0  # reset float drift wherever a layer's entropy window emptied
            self._entropy_num[empty] = 0.0
            self._entropy_den[empty] = 0.0

    def layers(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self._seen)]

    def layer_totals(self, layer: int, now_ns: int) -> CountVector:
        """Tokens per expert of ``layer`` summed over the window (zeros for an unseen layer)."""
        self.evict(now_ns)
        if not 0 <= layer < len(self._seen) or not self._seen[layer]:
            return np.zeros(self.num_experts, dtype=np.int64)
        return self._sums()[0][layer].copy()

    def layer_stats(self, layer: int, now_ns: int) -> LoadStats:
        self.evict(now_ns)
        if not 0 <= layer < len(self._seen) or not self._seen[layer]:
            return load_stats(np.zeros(self.num_experts, dtype=np.int64))
        tokens, dropped, *_ = self._sums()
        return load_stats(tokens[layer], dropped=dropped[layer])

    def table(self, now_ns: int) -> LayerTable:
        """The window's summed counts of every seen layer as one ``LayerTable`` (router entropy:
        the window's token-weighted mean per layer). Read-only arrays: the same table answers
        every call until the window changes."""
        self.evict(now_ns)
        cached = self._cached_table
        if cached is not None and cached[0] == self._version:
            return cached[1]
        tokens, dropped, num, den, valid = self._sums()
        rows = np.flatnonzero(self._seen)
        with np.errstate(invalid="ignore", divide="ignore"):
            entropy = np.where(valid[rows] > 0, num[rows] / den[rows], NAN)
        table = layer_table(layers=rows, tokens=tokens[rows], dropped=dropped[rows], router_entropy_bits=entropy)
        for field in fields(table):
            column = getattr(table, field.name)
            if isinstance(column, np.ndarray):
                column.flags.writeable = False  # shared by every reader until the next change
        self._cached_table = (self._version, table)
        return table

    def max_gini(self, now_ns: int) -> tuple[int, float]:
        """The layer with the highest windowed Gini and that Gini; ``(-1, NaN)`` with no data."""
        table = self.table(now_ns)
        finite = ~np.isnan(table.gini)
        if not finite.any():
            return (-1, NAN)
        at = int(np.flatnonzero(finite)[np.argmax(table.gini[finite])])  # the first layer of the highest
        return (int(table.layers[at]), float(table.gini[at]))

    def router_entropy_bits(self, layer: int, now_ns: int) -> float:
        self.evict(now_ns)
        _, _, num, den, valid = self._sums()
        if not 0 <= layer < len(self._seen) or valid[layer] <= 0:
            return NAN
        return float(num[layer] / den[layer])

    def router_entropy_normalised(self, now_ns: int) -> float:
        """Token-weighted mean over layers and window of ``H_r / log2 E``."""
        self.evict(now_ns)
        tokens, _, num, den, valid = self._sums()
        pairs = []
        for layer in self.layers():
            bits = float(num[layer] / den[layer]) if valid[layer] > 0 else NAN
            pairs.append((normalised_router_entropy(bits, self.num_experts), int(tokens[layer].sum())))
        return _weighted_mean(pairs)
