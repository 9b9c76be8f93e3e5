"""The one latency quantile definition moescope reports, and the structures that compute it.

Definition (every p50/p95/p99 the agent, the live view, the policy and the load generator print):
the **nearest-rank** ``q``-quantile of ``n`` values, ``0 <= q <= 1``, is the smallest value ``v``
such that at least ``q * n`` of the values are ``<= v``; that is the ``r``-th smallest value with
``r = max(1, ceil(q * n))``. It is always one of the observed values (no interpolation), p0 is the
minimum and p100 the maximum. ``q`` is taken as the decimal it is written as (``0.07``, ``99.9``),
so binary rounding of ``q * n`` never moves the rank. Empty input has no quantile: NaN (None for
the histogram).

Three ways to compute it, one rank rule (``nearest_rank``):

* ``nearest_rank(sorted_values, q)`` — exact, over an ascending sequence (the load generator).
* ``SlidingQuantile`` — exact, over the values of the last ``duration_ns`` (live view, policy
  windows, metrics-side summaries); on the same values it returns exactly ``nearest_rank``'s number.
* ``LatencyHistogram`` — fixed memory for a whole run (the exit summary): log-linear buckets,
  128 per power of two; it reports the lower bound of the bucket holding the nearest-rank value,
  so ``exact - exact / 128 <= reported <= exact`` (exact below 128).

Neutral module: imports nothing of moescope's agent, collectors, probes or examples.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from collections.abc import Sequence
from fractions import Fraction

__all__ = ["LatencyHistogram", "SlidingQuantile", "nearest_rank", "nearest_rank_position"]


def _exact_fraction(q: float, *, scale: int) -> tuple[int, int]:
    """``q / scale`` as the exact decimal ``q`` is written as (``repr``), checked to lie in [0, 1],
    as (numerator, denominator)."""
    if not isinstance(q, (int, float)) or isinstance(q, bool) or not math.isfinite(q):
        raise ValueError(f"quantile must be a number, got {q!r}")
    return _decimal_fraction(float(q), scale)


@functools.lru_cache(maxsize=64)  # callers ask the same few quantiles every tick
def _decimal_fraction(q: float, scale: int) -> tuple[int, int]:
    exact = Fraction(repr(q)) / scale
    if not 0 <= exact <= 1:
        bound = "[0, 1]" if scale == 1 else f"[0, {scale}]"
        raise ValueError(f"quantile must be in {bound}, got {q:g}")
    return exact.numerator, exact.denominator


def _rank(count: int, q_exact: tuple[int, int]) -> int:
    """1-based nearest rank: ``max(1, ceil(q * count))``, exact in integers (Fraction arithmetic
    cost ~6 us a call, and the trace sampler asks twice per step)."""
    numerator, denominator = q_exact
    return max(1, -(-numerator * count // denominator))


def percentile_rank(count: int, pct: float) -> int:
    """1-based nearest rank of the ``pct`` percentile (0..100) among ``count`` values: the rule of
    ``nearest_rank`` (``pct`` taken as the decimal it is written as; the fraction is cached)."""
    return _rank(count, _exact_fraction(pct, scale=100))


def nearest_rank_position(count: int, q: float) -> int:
    """0-based index of the nearest-rank ``q``-quantile (0..1) among ``count >= 1`` sorted values."""
    if count < 1:
        raise ValueError(f"nearest rank needs at least one value, got {count}")
    return _rank(count, _exact_fraction(q, scale=1)) - 1


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-quantile (0..1) of an ascending sequence; NaN when it is empty."""
    if not sorted_values:
        _exact_fraction(q, scale=1)  # a bad q is a caller bug even on empty input
        return math.nan
    return sorted_values[nearest_rank_position(len(sorted_values), q)]


class LatencyHistogram:
    """Log-linear histogram of non-negative integers (ns): 128 sub-buckets per power of two, so a
    reported percentile is within 1/128 (< 0.8 %) below the exact nearest-rank value. Fixed memory."""

    SUB_BITS = 7

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.count = 0

    def _bucket(self, value: int) -> int:
        if value < (1 << self.SUB_BITS):
            return value  # exact below 128
        shift = value.bit_length() - self.SUB_BITS - 1
        return ((shift + 1) << self.SUB_BITS) + ((value >> shift) & ((1 << self.SUB_BITS) - 1))

    def _bucket_low(self, bucket: int) -> int:
        if bucket < (1 << self.SUB_BITS):
            return bucket
        shift = (bucket >> self.SUB_BITS) - 1
        mantissa = (bucket & ((1 << self.SUB_BITS) - 1)) | (1 << self.SUB_BITS)
        return mantissa << shift

    def add(self, value: int) -> None:
        bucket = self._bucket(max(0, value))
        self._counts[bucket] = self._counts.get(bucket, 0) + 1
        self.count += 1

    def percentile(self, pct: float) -> int | None:
        """Nearest-rank percentile (``pct`` in 0..100) as its bucket's lower bound; None when empty."""
        _exact_fraction(pct, scale=100)  # a bad pct is a caller bug even on an empty histogram
        if self.count == 0:
            return None
        rank = percentile_rank(self.count, pct)
        seen = 0
        for bucket in sorted(self._counts):
            seen += self._counts[bucket]
            if seen >= rank:
                return self._bucket_low(bucket)
        return self._bucket_low(max(self._counts))  # unreachable: rank <= count


class SlidingQuantile:
    """Exact nearest-rank quantiles of the values seen in ``(now - duration_ns, now]``.

    A sorted list beside the time-ordered deque: add/evict are a binary search plus a memmove,
    cheap at the sizes a 10 s window holds. ``max_samples`` bounds memory: past it the oldest sample
    is evicted early and counted in ``overflow_evictions``. Timestamps are expected non-decreasing;
    an earlier one is kept at the latest time seen (clamped), so eviction stays O(1).
    """

    def __init__(self, *, duration_ns: int, max_samples: int = 100_000) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if duration_ns <= 0:
            raise ValueError(f"window duration must be > 0 ns, got {duration_ns}")
        self.duration_ns = int(duration_ns)
        self.max_samples = max_samples
        self.overflow_evictions = 0
        self._entries: deque[tuple[int, float]] = deque()
        self._sorted: list[float] = []
        self._last_ns: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, t_ns: int, value: float) -> None:
        v = float(value)
        if math.isnan(v):
            raise ValueError("cannot add NaN to a quantile window")
        t = t_ns if self._last_ns is None else max(t_ns, self._last_ns)
        self._last_ns = t
        self._entries.append((t, v))
        bisect.insort(self._sorted, v)
        if len(self._entries) > self.max_samples:
            self._pop_oldest()
            self.overflow_evictions += 1
        self.evict(t)

    def _pop_oldest(self) -> None:
        _, v = self._entries.popleft()
        del self._sorted[bisect.bisect_left(self._sorted, v)]

    def evict(self, now_ns: int) -> None:
        horizon = now_ns - self.duration_ns
        while self._entries and self._entries[0][0] <= horizon:
            self._pop_oldest()

    def quantile(self, q: float, now_ns: int | None = None) -> float:
        """Nearest-rank ``q``-quantile (0..1) of the window; NaN when it is empty."""
        if now_ns is not None:
            self.evict(now_ns)
        return nearest_rank(self._sorted, q)

    def p99(self, now_ns: int | None = None) -> float:
        return self.quantile(0.99, now_ns)
