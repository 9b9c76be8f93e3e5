"""load_stats' plain-Python path for small E against the vectorised numpy functions, and the fast
as_counts path against the general one (same values, same errors)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moescope.agent import routing_health as rh


def _numpy_stats(c: np.ndarray, d: np.ndarray) -> tuple[float, ...]:
    total = int(c.sum())
    h = rh.load_entropy_bits(c)
    return (total, int(d.sum()), h, rh.normalised_entropy(h, c.size), rh.gini(c), rh.max_share(c),
            rh.coefficient_of_variation(c), int(d.sum()) / total if total else math.nan)


@pytest.mark.parametrize("e", [1, 2, 3, 16, 64, rh.SMALL_EXPERTS])
def test_small_path_matches_numpy_functions(e: int) -> None:
    rng = np.random.default_rng(e)
    assert e <= rh.SMALL_EXPERTS  # these all take the small path
    for trial in range(50):
        c = rng.integers(0, 50, size=e) * (rng.random(e) < 0.7)
        if trial == 0:
            c[:] = 0  # no tokens: every ratio NaN
        d = np.minimum(c, rng.integers(0, 5, size=e))
        s = rh.load_stats(c, dropped=d)
        got = (s.tokens, s.dropped, s.entropy_bits, s.entropy_normalised, s.gini, s.max_share, s.cv, s.drop_fraction)
        want = _numpy_stats(c, d)
        assert s.num_experts == e
        for g, w in zip(got, want, strict=True):
            if isinstance(w, float) and math.isnan(w):
                assert math.isnan(g)
            else:
                assert g == pytest.approx(w, rel=1e-12, abs=1e-12)


def test_large_e_still_vectorised_and_equal() -> None:
    c = np.arange(rh.SMALL_EXPERTS + 1, dtype=np.int64)
    s = rh.load_stats(c)
    assert s.gini == pytest.approx(rh.gini(c), abs=1e-12) and s.tokens == int(c.sum())


def test_fast_as_counts_same_errors_and_copy() -> None:
    v = np.array([1, 2, 3], dtype=np.int64)
    out = rh.as_counts(v, num_experts=3)
    assert out is not v and out.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=">= 0"):
        rh.as_counts(np.array([1, -1], dtype=np.int64))
    with pytest.raises(ValueError, match="expected 4 experts, got 3"):
        rh.as_counts(v, num_experts=4)
    with pytest.raises(ValueError, match="at least one expert"):
        rh.as_counts(np.array([], dtype=np.int64))
    assert rh.counts_from_marks({0: 2, 3: 5}, num_experts=4).tolist() == [2, 0, 0, 5]
    assert rh.counts_from_marks({}, num_experts=2).dtype == np.int64
