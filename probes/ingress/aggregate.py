"""The probe's in-kernel request aggregate (`struct ingress_stats` in ingress.h), read by the agent.

The kernel adds every completed request to its target's slot of the per-CPU `stats` array before it
reserves the request's ring record, so these counts are exact whatever happens to per-request
records (ring full, sampled out). `RequestTotals` is one reading, summed over CPUs; readings
subtract (a delta since the last read) and add (several targets).

Latency histogram (log-linear over nanoseconds, the same layout in C and here):

* bucket 0 holds every latency below 2^10 ns (1.024 us);
* then, for each power of two 2^k, k = 10 .. 36, 16 equal sub-buckets [2^k + j * 2^(k-4),
  2^k + (j + 1) * 2^(k-4)), j = 0 .. 15 (1 + 27 * 16 = 433 buckets, up to 2^37 ns = 137 s);
* the last bucket also holds anything longer.

A bucket is at most 1/16 of its lower bound wide, so its midpoint is within 1/32 (3.1 %) of any
value in it: that is the error bound of every percentile computed here (nearest rank, reported as
the holding bucket's midpoint), for latencies of 1.024 us .. 137 s.
"""

from __future__ import annotations

import ctypes as ct
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from moescope.latency import percentile_rank

# Mirrors of ingress.h (a test compiles the header and compares).
LAT_SUB_BITS = 4
LAT_SUB = 1 << LAT_SUB_BITS
LAT_MIN_SHIFT = 10
LAT_MAX_SHIFT = 37
LAT_BUCKETS = 1 + (LAT_MAX_SHIFT - LAT_MIN_SHIFT) * LAT_SUB
COUNTERS = ("requests", "unanswered", "bytes_in", "bytes_out", "latency_sum_ns")


class IngressStats(ct.Structure):
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS] + [("latency", ct.c_uint64 * LAT_BUCKETS)]


STATS_WORDS = ct.sizeof(IngressStats) // 8


def bucket_of(latency_ns: int) -> int:
    """The histogram bucket of one latency (the kernel's latency_bucket())."""
    if latency_ns < 1 << LAT_MIN_SHIFT:
        return 0
    msb = latency_ns.bit_length() - 1
    if msb >= LAT_MAX_SHIFT:
        return LAT_BUCKETS - 1
    sub = (latency_ns >> (msb - LAT_SUB_BITS)) & (LAT_SUB - 1)
    return 1 + (msb - LAT_MIN_SHIFT) * LAT_SUB + sub


def _bucket_bounds() -> tuple[np.ndarray, np.ndarray]:
    low = np.zeros(LAT_BUCKETS, dtype=np.float64)
    high = np.zeros(LAT_BUCKETS, dtype=np.float64)
    high[0] = 1 << LAT_MIN_SHIFT
    for k in range(LAT_MIN_SHIFT, LAT_MAX_SHIFT):
        width = 1 << (k - LAT_SUB_BITS)
        for j in range(LAT_SUB):
            index = 1 + (k - LAT_MIN_SHIFT) * LAT_SUB + j
            low[index] = (1 << k) + j * width
            high[index] = low[index] + width
    high[-1] = math.inf  # the last bucket is open above
    return low, high


BUCKET_LOW_NS, BUCKET_HIGH_NS = _bucket_bounds()
# What a bucket reports: its midpoint; the open last bucket reports its lower bound.
BUCKET_VALUE_NS = np.where(np.isinf(BUCKET_HIGH_NS), BUCKET_LOW_NS, (BUCKET_LOW_NS + BUCKET_HIGH_NS) / 2)


@functools.lru_cache(maxsize=8)
def _prometheus_index(bounds_s: tuple[float, ...]) -> np.ndarray:
    """For each kernel bucket, the Prometheus bucket (index into bounds_s, len = +Inf) holding its midpoint."""
    bounds_ns = np.asarray(bounds_s, dtype=np.float64) * 1e9
    return np.searchsorted(bounds_ns, BUCKET_VALUE_NS, side="left")


@dataclass(frozen=True, slots=True, eq=False)
class RequestTotals:
    """Counts of completed requests (one reading, or a delta between two)."""

    requests: int = 0
    unanswered: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    latency_sum_ns: int = 0
    latency: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # empty = all zero

    @property
    def answered(self) -> int:
        return self.requests - self.unanswered

    def histogram(self) -> np.ndarray:
        return self.latency if self.latency.size else np.zeros(LAT_BUCKETS, dtype=np.int64)

    @classmethod
    def from_words(cls, words: np.ndarray) -> RequestTotals:
        """From a struct ingress_stats as 64-bit words (already summed over CPUs)."""
        values = words.astype(np.int64)
        requests, unanswered, bytes_in, bytes_out, latency_sum_ns = (int(v) for v in values[: len(COUNTERS)])
        return cls(requests, unanswered, bytes_in, bytes_out, latency_sum_ns, values[len(COUNTERS) :].copy())

    @classmethod
    def of_latencies(cls, latencies_ns: Iterable[int], *, unanswered: int = 0, bytes_in: int = 0,
                     bytes_out: int = 0) -> RequestTotals:
        """Totals of answered requests with these latencies (and `unanswered` more): the loader's own
        flushed requests, and tests."""
        counts = np.zeros(LAT_BUCKETS, dtype=np.int64)
        total_ns = 0
        n = 0
        for value in latencies_ns:
            counts[bucket_of(max(0, value))] += 1
            total_ns += max(0, value)
            n += 1
        return cls(n + unanswered, unanswered, bytes_in, bytes_out, total_ns, counts)

    def __add__(self, other: RequestTotals) -> RequestTotals:
        return RequestTotals(
            self.requests + other.requests, self.unanswered + other.unanswered, self.bytes_in + other.bytes_in,
            self.bytes_out + other.bytes_out, self.latency_sum_ns + other.latency_sum_ns,
            self.histogram() + other.histogram(),
        )

    def __sub__(self, other: RequestTotals) -> RequestTotals:
        return RequestTotals(
            self.requests - other.requests, self.unanswered - other.unanswered, self.bytes_in - other.bytes_in,
            self.bytes_out - other.bytes_out, self.latency_sum_ns - other.latency_sum_ns,
            self.histogram() - other.histogram(),
        )

    def percentile_ns(self, pct: float) -> float | None:
        """Nearest-rank percentile (0..100) of answered latencies, as the holding bucket's value
        (within 3.1 % of the exact one, module docstring); None when no request was answered."""
        counts = self.histogram()
        total = int(counts.sum())
        if total <= 0:
            return None
        if not 0 <= pct <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {pct:g}")
        # moescope.latency's rank rule, its decimal fraction cached (a Fraction parsed from repr on
        # every call was most of the policy's request p99, five times a second)
        rank = percentile_rank(total, pct)
        bucket = int(np.searchsorted(np.cumsum(counts), rank, side="left"))
        return float(BUCKET_VALUE_NS[min(bucket, LAT_BUCKETS - 1)])

    def prometheus_buckets(self, bounds_s: Sequence[float]) -> list[int]:
        """Counts per Prometheus bucket (not cumulative): one per bound, then +Inf. A kernel bucket
        goes to the first bound at or above its midpoint (so a request within 3.1 % of a bound
        may be counted on the other side of it)."""
        index = _prometheus_index(tuple(bounds_s))
        counts = np.bincount(index, weights=self.histogram(), minlength=len(bounds_s) + 1)
        return [int(round(c)) for c in counts]


def sum_over_cpus(per_cpu: Sequence[IngressStats]) -> RequestTotals:
    """One slot's per-CPU values added up."""
    words = np.zeros(STATS_WORDS, dtype=np.uint64)
    for value in per_cpu:
        words += np.frombuffer(memoryview(value).cast("B"), dtype=np.uint64)
    return RequestTotals.from_words(words)
