"""Every routing-health number checked against an independent numpy computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moescope.agent import routing_health as rh

counts_st = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=64)
nonzero_counts_st = counts_st.filter(lambda c: sum(c) > 0)


def ref_entropy(c: np.ndarray) -> float:
    p = c / c.sum()
    return float(-np.sum(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0)))


def ref_gini(c: np.ndarray) -> float:
    # Mean absolute difference over all ordered pairs / (2 * mean): the textbook definition.
    x = c.astype(np.float64)
    return float(np.abs(x[:, None] - x[None, :]).mean() / (2 * x.mean()))


def ref_cv(c: np.ndarray) -> float:
    x = c.astype(np.float64)
    return float(np.std(x) / np.mean(x))


@settings(max_examples=200, deadline=None)
@given(nonzero_counts_st)
def test_load_stats_match_numpy(counts: list[int]) -> None:
    c = np.array(counts)
    e = len(counts)
    s = rh.load_stats(counts)
    assert s.tokens == int(c.sum())
    assert s.entropy_bits == pytest.approx(ref_entropy(c), abs=1e-9)
    expected_norm = 1.0 if e == 1 else ref_entropy(c) / np.log2(e)
    assert s.entropy_normalised == pytest.approx(expected_norm, abs=1e-9)
    assert s.gini == pytest.approx(ref_gini(c), abs=1e-9)
    assert s.max_share == pytest.approx(c.max() / c.sum(), abs=1e-12)
    assert s.cv == pytest.approx(ref_cv(c), abs=1e-9)
    assert 0.0 <= s.gini <= 1.0 - 1.0 / e + 1e-12
    assert 0.0 <= s.entropy_bits <= math.log2(e) + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=0), min_size=1, max_size=16))
def test_zero_tokens_is_nan(counts: list[int]) -> None:
    s = rh.load_stats(counts)
    assert s.tokens == 0
    for value in (s.entropy_bits, s.entropy_normalised, s.gini, s.max_share, s.cv, s.drop_fraction):
        assert math.isnan(value)


def test_known_values() -> None:
    uniform = rh.load_stats([5] * 8)
    assert uniform.entropy_bits == pytest.approx(3.0)
    assert uniform.entropy_normalised == pytest.approx(1.0)
    assert uniform.gini == 0.0
    assert uniform.cv == 0.0
    assert uniform.max_share == pytest.approx(1 / 8)
    mono = rh.load_stats([0, 0, 0, 12])
    assert mono.entropy_bits == 0.0
    assert mono.gini == pytest.approx(0.75)  # 1 - 1/E
    assert mono.max_share == 1.0
    assert mono.cv == pytest.approx(math.sqrt(3))


def test_single_expert() -> None:
    s = rh.load_stats([7])
    assert (s.entropy_bits, s.entropy_normalised, s.gini, s.max_share, s.cv) == (0.0, 1.0, 0.0, 1.0, 0.0)
    assert math.isnan(rh.normalised_router_entropy(0.0, 1))


def test_router_entropy_normalisation_matches_design_band() -> None:
    assert rh.normalised_router_entropy(8.2, 16384) == pytest.approx(8.2 / 14)
    assert rh.normalised_router_entropy(7.5, 16384) == pytest.approx(0.5357, abs=1e-4)
    assert math.isnan(rh.normalised_router_entropy(float("nan"), 16))


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError):
        rh.load_stats([1, -1])
    with pytest.raises(ValueError):
        rh.load_stats([])
    with pytest.raises(ValueError):
        rh.load_stats([1.5, 2])
    with pytest.raises(ValueError):
        rh.counts_from_marks({9: 1}, num_experts=4)
    with pytest.raises(ValueError):
        rh.load_stats([1, 2], dropped=[1])


def test_drop_fraction() -> None:
    s = rh.load_stats([10, 30], dropped=[0, 5])
    assert s.dropped == 5
    assert s.drop_fraction == pytest.approx(5 / 40)


layer_st = st.tuples(
    st.lists(st.integers(min_value=0, max_value=500), min_size=4, max_size=4),
    st.floats(min_value=0.0, max_value=2.0, allow_nan=False),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(layer_st, min_size=1, max_size=6))
def test_step_aggregate_is_token_weighted(layers: list[tuple[list[int], float]]) -> None:
    healths = [
        rh.layer_health(
            rh.LayerRouting.from_marks(
                layer=i, num_experts=4, tokens=dict(enumerate(c)), router_entropy_bits=h
            )
        )
        for i, (c, h) in enumerate(layers)
    ]
    step = rh.step_health(healths)
    vecs = [np.array(c) for c, _ in layers]
    w = np.array([v.sum() for v in vecs], dtype=np.float64)
    assert step.tokens == int(w.sum())
    live = w > 0
    if not live.any():
        assert math.isnan(step.gini) and math.isnan(step.router_entropy_bits)
        return
    ww = w[live]
    live_vecs = [v for v, ok in zip(vecs, live) if ok]
    assert step.gini == pytest.approx(np.average([ref_gini(v) for v in live_vecs], weights=ww), abs=1e-9)
    assert step.gini_max == pytest.approx(max(ref_gini(v) for v in live_vecs), abs=1e-9)
    assert step.max_share == pytest.approx(max(v.max() / v.sum() for v in live_vecs), abs=1e-12)
    assert step.entropy_bits == pytest.approx(np.average([ref_entropy(v) for v in live_vecs], weights=ww), abs=1e-9)
    assert step.cv == pytest.approx(np.average([ref_cv(v) for v in live_vecs], weights=ww), abs=1e-9)
    hs = np.array([h for _, h in layers])[live]
    assert step.router_entropy_bits == pytest.approx(np.average(hs, weights=ww), abs=1e-9)
    assert step.router_entropy_normalised == pytest.approx(np.average(hs / 2.0, weights=ww), abs=1e-9)


step_events_st = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=3_000),  # time increment, ms
        st.lists(st.integers(min_value=0, max_value=100), min_size=5, max_size=5),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(step_events_st, st.integers(min_value=1, max_value=10_000))
def test_sliding_counts_equal_bruteforce(events: list[tuple[int, list[int]]], window_ms: int) -> None:
    duration_ns = window_ms * 1_000_000
    win = rh.SlidingCounts(duration_ns=duration_ns, num_experts=5)
    t = 0
    seen: list[tuple[int, np.ndarray]] = []
    for dt_ms, counts in events:
        t += dt_ms * 1_000_000
        win.add(t, counts, dropped=[x // 3 for x in counts])
        seen.append((t, np.array(counts)))
        inside = [c for ts, c in seen if ts > t - duration_ns]
        expected = np.sum(inside, axis=0)
        assert np.array_equal(win.totals(), expected)
        s = win.stats(t)
        if expected.sum() == 0:
            assert math.isnan(s.gini)
        else:
            assert s.gini == pytest.approx(ref_gini(expected), abs=1e-9)
            assert s.entropy_bits == pytest.approx(ref_entropy(expected), abs=1e-9)
            assert s.dropped == int(sum((c // 3).sum() for c in inside))
        assert len(win) == len(inside)


def test_out_of_order_time_is_clamped() -> None:
    win = rh.SlidingCounts(duration_ns=100, num_experts=2)
    win.add(1_000, [1, 0])
    win.add(500, [0, 1])  # earlier timestamp: counted at t=1000
    assert win.totals().tolist() == [1, 1]
    assert win.totals(1_099).tolist() == [1, 1]
    assert win.totals(1_100).tolist() == [0, 0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3_000),
            st.floats(min_value=0, max_value=4, allow_nan=False),
            st.integers(min_value=0, max_value=50),
        ),
        min_size=1,
        max_size=50,
    )
)
def test_sliding_mean_equals_numpy(events: list[tuple[int, float, int]]) -> None:
    duration_ns = 2_000_000_000
    win = rh.SlidingMean(duration_ns=duration_ns)
    t = 0
    seen: list[tuple[int, float, int]] = []
    for dt_ms, value, weight in events:
        t += dt_ms * 1_000_000
        win.add(t, value, weight=weight)
        seen.append((t, value, weight))
        inside = [(v, w) for ts, v, w in seen if ts > t - duration_ns and w > 0]
        if not inside:
            assert math.isnan(win.mean(t))
        else:
            vals, ws = zip(*inside)
            assert win.mean(t) == pytest.approx(float(np.average(vals, weights=ws)), rel=1e-9, abs=1e-9)


def test_routing_health_window_per_layer() -> None:
    e = 4
    win = rh.RoutingHealthWindow(duration_ns=10_000_000_000, num_experts=e)
    rng = np.random.default_rng(7)
    history: list[tuple[int, int, np.ndarray, float]] = []
    for step in range(40):
        t = step * 500_000_000
        layers = []
        for layer in range(3):
            c = rng.integers(0, 50, size=e) * (1 + 3 * (layer == 2) * (np.arange(e) == 0))
            h = float(rng.uniform(0.5, 2.0))
            layers.append(rh.LayerRouting(layer, c.astype(np.int64), np.zeros(e, np.int64), h))
            history.append((t, layer, c, h))
        win.add_step(t, layers)
    now = 39 * 500_000_000
    inside = [(layer, c, h) for t, layer, c, h in history if t > now - 10_000_000_000]
    for layer in range(3):
        total = np.sum([c for lyr, c, _ in inside if lyr == layer], axis=0)
        assert win.layer_stats(layer, now).gini == pytest.approx(ref_gini(total), abs=1e-9)
    layer, g = win.max_gini(now)
    assert layer == 2
    hs = np.array([h for _, _, h in inside])
    ws = np.array([c.sum() for _, c, _ in inside])
    assert win.router_entropy_normalised(now) == pytest.approx(np.average(hs / 2.0, weights=ws), rel=1e-9)
