"""agent/native's routing-health reductions against routing_health's numpy definitions: the same
integers exactly and the same floats to rounding, on generated count matrices (all-zero rows,
E = 1, strided views of a [layers, 2E] block, counts past the histogram and the c log2 c table),
and the same errors. setup.py builds the library: here it must be loaded, never skipped."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moescope.agent import native, routing_health
from moescope.agent.routing_health import LayerTable, layer_table

FIELDS = ("tokens_total", "dropped_total", "entropy_bits", "entropy_normalised", "gini", "max_share", "cv",
          "drop_fraction", "router_entropy_bits", "router_entropy_normalised")


def _numpy_table(**kwargs: object) -> LayerTable:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(routing_health.native, "available", lambda: False)
        return layer_table(**kwargs)  # type: ignore[arg-type]


def _assert_same(fast: LayerTable, slow: LayerTable) -> None:
    for name in FIELDS:
        a, b = getattr(fast, name), getattr(slow, name)
        if a.dtype.kind in "iu":
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True, err_msg=name)


def test_the_library_is_built_and_loaded() -> None:
    assert native.available(), f"{native.LIBRARY} missing: setup.py builds it (make test runs setup)"


counts = st.one_of(st.integers(0, 12), st.integers(0, 3000), st.integers(60_000, 70_000), st.integers(0, 1 << 25))


@settings(max_examples=300, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 9), st.integers(1, 40)),
    data=st.data(),
    dtype=st.sampled_from([np.int32, np.int64]),
    strided=st.booleans(),
)
def test_native_equals_numpy(shape: tuple[int, int], data: st.DataObject,
                             dtype: type, strided: bool) -> None:
    rows, e = shape
    block = data.draw(hnp.arrays(dtype, (rows, 2 * e), elements=counts))
    zero_rows = data.draw(st.lists(st.integers(0, rows - 1), max_size=rows))
    block[zero_rows, :e] = 0
    tokens, dropped = (block[:, :e], block[:, e:]) if strided else (block[:, :e].copy(), block[:, e:].copy())
    kwargs = dict(layers=np.arange(rows), tokens=tokens, dropped=dropped,
                  router_entropy_bits=np.linspace(0.5, 3.0, rows))
    _assert_same(layer_table(**kwargs), _numpy_table(**kwargs))


def test_a_zipf_step_at_deepseek_shape() -> None:
    rng = np.random.default_rng(3)
    weights = 1.0 / np.arange(1, 257)
    tokens = np.stack([rng.multinomial(512, rng.permutation(weights / weights.sum())) for _ in range(58)])
    tokens = tokens.astype(np.int32)
    dropped = np.maximum(tokens - 5, 0).astype(np.int32)
    kwargs = dict(layers=np.arange(58), tokens=tokens, dropped=dropped, router_entropy_bits=np.full(58, 6.5))
    fast = layer_table(**kwargs)  # type: ignore[arg-type]
    _assert_same(fast, _numpy_table(**kwargs))
    assert np.isfinite(fast.gini).all() and (fast.tokens_total == 512).all()


def test_negative_counts_are_refused_the_same_way() -> None:
    tokens = np.array([[1, 2, 3], [0, -1, 4]], dtype=np.int64)
    with pytest.raises(ValueError, match=">= 0"):
        layer_table(layers=[0, 1], tokens=tokens)
    with pytest.raises(ValueError, match=">= 0"):
        _numpy_table(layers=[0, 1], tokens=tokens)
    dropped = np.array([[0, 0, -2], [0, 0, 0]], dtype=np.int64)
    with pytest.raises(ValueError, match=">= 0"):
        layer_table(layers=[0, 1], tokens=np.abs(tokens), dropped=dropped)


def test_counts_past_the_exact_range_take_the_float_path() -> None:
    tokens = np.array([[1 << 25, 3, 0, 9]], dtype=np.int64)
    assert native.count_rows(tokens, np.zeros_like(tokens), routing_health._CLOG2C) is None
    table = layer_table(layers=[0], tokens=tokens)
    assert table.tokens_total.tolist() == [(1 << 25) + 12] and 0.0 < float(table.gini[0]) <= 1.0
