"""LayerTable (one step's layers as arrays) against textbook formulas computed row by row, in each
of its regimes: small counts (the c log2 c table and the value histogram for Gini), counts past
4·E (the sort), counts past the table (log2 per entry), rows with no tokens, E = 1."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moescope.agent import routing_health as rh


def _textbook(c: np.ndarray, d: np.ndarray) -> dict[str, float]:
    x = c.astype(np.float64)
    n = x.sum()
    if n == 0:
        return dict.fromkeys(("entropy", "gini", "max_share", "cv", "drop"), math.nan)
    p = x[x > 0] / n
    return {
        "entropy": float(-(p * np.log2(p)).sum()),
        "gini": float(np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) * n)),  # all ordered pairs
        "max_share": float(x.max() / n),
        "cv": float(x.std() / x.mean()),
        "drop": float(d.sum() / n),
    }


def _matrix(rng: np.random.Generator, *, layers: int, experts: int, top: int, dtype: type) -> np.ndarray:
    c = rng.integers(0, top + 1, size=(layers, experts)) * (rng.random((layers, experts)) < 0.6)
    if layers > 2:
        c[1] = 0  # a layer with no tokens
        c[2] = 0
        c[2, experts - 1] = top  # one loaded expert
    return c.astype(dtype)


@pytest.mark.parametrize("experts", [1, 2, 16, 128, 256])
@pytest.mark.parametrize("top", [1, 40, 3000, 100_000])  # histogram, histogram/sort by E, sort, past the table
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_layer_table_equals_the_textbook_row_by_row(experts: int, top: int, dtype: type) -> None:
    rng = np.random.default_rng(experts * 7 + top)
    c = _matrix(rng, layers=9, experts=experts, top=top, dtype=dtype)
    d = np.minimum(c, rng.integers(0, 3, size=c.shape)).astype(dtype)
    h_r = rng.uniform(0.0, 8.0, size=len(c))
    table = rh.layer_table(layers=np.arange(len(c)) * 2, tokens=c, dropped=d, router_entropy_bits=h_r)
    assert table.layers.tolist() == list(range(0, 2 * len(c), 2))
    for i in range(len(c)):
        want = _textbook(c[i], d[i])
        assert int(table.tokens_total[i]) == int(c[i].sum()) and int(table.dropped_total[i]) == int(d[i].sum())
        got = {"entropy": table.entropy_bits[i], "gini": table.gini[i], "max_share": table.max_share[i],
               "cv": table.cv[i], "drop": table.drop_fraction[i]}
        for key, value in want.items():
            if math.isnan(value):
                assert math.isnan(got[key]), (key, i)
            else:
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, i)
        if experts == 1:
            assert math.isnan(table.router_entropy_normalised[i])
            assert table.entropy_normalised[i] == 1.0 or math.isnan(want["entropy"])
        else:
            assert table.router_entropy_normalised[i] == pytest.approx(h_r[i] / math.log2(experts), rel=1e-12)
        # and the per-layer path (load_stats) gives the same numbers
        if c[i].sum():
            s = rh.load_stats(c[i], dropped=d[i])
            assert (s.entropy_bits, s.gini, s.cv) == pytest.approx(
                (table.entropy_bits[i], table.gini[i], table.cv[i]), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("top", [0, 1, 7, 200, 5000])
def test_rank_sums_by_histogram_equal_the_sort(top: int) -> None:
    rng = np.random.default_rng(top)
    c = rng.integers(0, top + 1, size=(13, 64)).astype(np.int32)
    sorted_rank_sums = (np.sort(c, axis=1) * np.arange(1, 65)).sum(axis=1)
    assert rh._rank_sums(c, int(c.max())).tolist() == sorted_rank_sums.tolist()


def test_layer_table_refuses_negative_counts() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        rh.layer_table(layers=[0], tokens=np.array([[1, -1]], dtype=np.int32))
