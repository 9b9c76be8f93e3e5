"""moescope/latency.py: the one nearest-rank quantile, exact (list, sliding window) and bucketed
(histogram within 1/128), checked against a brute-force reading of the definition."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moescope.latency import LatencyHistogram, SlidingQuantile, nearest_rank, nearest_rank_position

# (q for the exact ones, the same quantile in percent for the histogram), written as decimals
QUANTILES = [(0.0, 0.0), (0.07, 7.0), (0.5, 50.0), (0.9, 90.0), (0.95, 95.0), (0.99, 99.0), (0.999, 99.9), (1.0, 100.0)]


def by_definition(values: Sequence[float], q_decimal: str) -> float:
    """The smallest value v with at least q * n of the values <= v (exact rational q)."""
    q = Fraction(q_decimal)
    return min(v for v in values if sum(1 for x in values if x <= v) >= q * len(values))


def exact_nearest_rank(values: list[int], pct: float) -> int:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


# --- LatencyHistogram (moved from tests/ingress/test_ingress_units.py) -------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=300),
    st.sampled_from([50.0, 90.0, 99.0, 100.0]),
)
def test_histogram_percentile_within_one_128th_of_exact(values: list[int], pct: float) -> None:
    hist = LatencyHistogram()
    for v in values:
        hist.add(v)
    exact = exact_nearest_rank(values, pct)
    got = hist.percentile(pct)
    assert got is not None
    assert got <= exact
    assert exact - got <= exact / 128


def test_histogram_empty_is_none() -> None:
    assert LatencyHistogram().percentile(50) is None


# --- SlidingQuantile (moved from tests/export/test_routing_health.py) --------------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=2_000), st.floats(min_value=0, max_value=1e4, allow_nan=False)),
        min_size=1,
        max_size=80,
    ),
    st.integers(min_value=1, max_value=5_000),
    st.sampled_from(["0.0", "0.5", "0.9", "0.99", "1.0"]),
)
def test_sliding_quantile_equals_the_definition(events: list[tuple[int, float]], window_ms: int, q: str) -> None:
    duration_ns = window_ms * 1_000_000
    win = SlidingQuantile(duration_ns=duration_ns)
    t = 0
    seen: list[tuple[int, float]] = []
    for dt_ms, value in events:
        t += dt_ms * 1_000_000
        win.add(t, value)
        seen.append((t, value))
        inside = [v for ts, v in seen if ts > t - duration_ns]
        assert win.quantile(float(q), t) == by_definition(inside, q)


def test_sliding_quantile_empty_and_overflow() -> None:
    win = SlidingQuantile(duration_ns=10, max_samples=3)
    assert math.isnan(win.p99())
    for i in range(5):
        win.add(0, float(i))
    assert len(win) == 3
    assert win.overflow_evictions == 2
    assert win.quantile(0.0) == 2.0
    win.add(100, 7.0)
    assert len(win) == 1 and win.p99() == 7.0


def test_sliding_quantile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="max_samples"):
        SlidingQuantile(duration_ns=10, max_samples=0)
    with pytest.raises(ValueError, match="duration"):
        SlidingQuantile(duration_ns=0)
    win = SlidingQuantile(duration_ns=10)
    with pytest.raises(ValueError, match="NaN"):
        win.add(0, math.nan)
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="quantile"):
            win.quantile(bad)


# --- one definition, three implementations ---------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**11), min_size=1, max_size=200), st.sampled_from(QUANTILES))
def test_window_list_and_histogram_agree_on_the_same_data(values_ns: list[int], quantile: tuple[float, float]) -> None:
    q, pct = quantile
    window = SlidingQuantile(duration_ns=10**18)  # holds every value
    hist = LatencyHistogram()
    for i, v in enumerate(values_ns):
        window.add(i, v)
        hist.add(v)
    exact = nearest_rank(sorted(values_ns), q)  # the load generator's summary
    assert window.quantile(q) == exact  # the live view / policy: the very same number
    assert exact == by_definition(values_ns, repr(q))
    got = hist.percentile(pct)  # the exit summary: the value's bucket's lower bound
    assert got is not None and got <= exact and exact - got <= exact / 128
    if exact < 128:
        assert got == exact  # exact below 128 ns


def test_rank_follows_the_decimal_not_its_binary_rounding() -> None:
    # 0.07 * 100 is 7.000000000000001 in binary floating point: a naive ceil would pick rank 8
    assert nearest_rank(list(range(1, 101)), 0.07) == 7
    assert nearest_rank_position(1000, 0.999) == 998
    hist = LatencyHistogram()
    for v in range(1, 1001):
        hist.add(v)
    assert hist.percentile(7) == 70 and hist.percentile(99.9) == 999 - 999 % 4  # bucket width 4 at 512..1023


def test_nearest_rank_edges() -> None:
    assert math.isnan(nearest_rank([], 0.5))
    assert nearest_rank([3.0], 0.0) == 3.0 and nearest_rank([3.0], 1.0) == 3.0
    assert nearest_rank([1.0, 2.0], 0.5) == 1.0 and nearest_rank([1.0, 2.0], 0.51) == 2.0
    for bad in (-0.01, 1.01, math.nan):
        with pytest.raises(ValueError, match="quantile"):
            nearest_rank([1.0], bad)
        with pytest.raises(ValueError, match="quantile"):
            nearest_rank([], bad)
    with pytest.raises(ValueError, match="quantile"):
        LatencyHistogram().percentile(101)
    with pytest.raises(ValueError, match="at least one"):
        nearest_rank_position(0, 0.5)
