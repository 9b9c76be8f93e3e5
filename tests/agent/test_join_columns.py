"""The join's table from a step's LayerColumns (the parser's path for clean moe/v2 steps at depth):
the same LayerTable as from the step's LayerEvent objects, and a negative count (int32 or int64
rows) leaves its layer out, counted, as on the object path."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.agent.join import RequestJoin
from moescope.collectors.moe_convention import ROUTER_RANGE, LayerColumns, StepEvent

L, E = 10, 8


def _columns(counts: np.ndarray) -> LayerColumns:
    start = np.arange(L, dtype=np.int64) * 100 + 1_000
    return LayerColumns(
        layer=np.arange(L, dtype=np.int64), start_ns=start, end_ns=start + 50, num_experts=E,
        router_kind=np.full(L, ROUTER_RANGE, dtype=np.int8), router_start_ns=start + 1, router_end_ns=start + 9,
        entropy_bits=np.linspace(0.5, 2.5, L), has_routing=np.ones(L, dtype=bool), counts=counts,
        has_experts=np.zeros(L, dtype=bool), experts_start_ns=np.zeros(L, dtype=np.int64),
        experts_end_ns=np.zeros(L, dtype=np.int64), experts_tokens=np.zeros(L, dtype=np.int64), experts_time_us=None)


def _tables(counts: np.ndarray) -> tuple[object, object, int, int]:
    step = StepEvent(3, 3, 1_000, 5_000, 64, [7])
    step.set_columns(_columns(counts))
    twin = StepEvent(3, 3, 1_000, 5_000, 64, [7], None, _columns(counts).materialize())  # the object path
    a, b = RequestJoin(clock=lambda: 0), RequestJoin(clock=lambda: 0)
    ta, tb = a._table(step, E), b._table(twin, E)
    return ta, tb, a.stats()["layers_bad_routing"], b.stats()["layers_bad_routing"]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("negative", [False, True])
def test_columns_give_the_object_path_table(dtype: type, negative: bool) -> None:
    counts: np.ndarray = np.random.default_rng(2).integers(0, 30, size=(L, 2 * E)).astype(dtype)
    if negative:
        counts[4, 3] = -1
    ta, tb, bad_a, bad_b = _tables(counts)
    assert bad_a == bad_b == (1 if negative else 0)
    for name in ("layers", "tokens", "dropped", "tokens_total", "gini", "entropy_bits", "router_entropy_bits"):
        np.testing.assert_array_equal(getattr(ta, name), getattr(tb, name), err_msg=name)
    assert (4 in ta.layers.tolist()) is not negative  # type: ignore[attr-defined]


@pytest.mark.parametrize("count", [2**63, 2**62])
def test_a_v1_count_past_int64_is_a_bad_layer_not_a_raise(count: int) -> None:
    # a u64 mark of 2^63 or more (or marks summing past int64) is a bad payload: the layer is left
    # out of the health and counted, as a negative count is; it must not raise into the pipeline
    from moescope.collectors.moe_convention import LayerEvent, RouterEvent

    layers = [LayerEvent(layer=i, start_ns=1_000 + i, end_ns=2_000, num_experts=E,
                         router=RouterEvent(layer=i, start_ns=1_000, end_ns=1_500, entropy_bits=1.0,
                                            tokens={0: 5, 1: 3}))
              for i in range(3)]
    router = layers[1].router
    assert router is not None
    router.tokens = {0: count, 1: count}  # 2^62 + 2^62 = 2^63: the sum leaves int64 too
    step = StepEvent(3, 3, 1_000, 5_000, 64, [7], None, layers)
    join = RequestJoin(clock=lambda: 0)
    table = join._table(step, E)
    assert table.layers.tolist() == [0, 2]
    assert join.stats()["layers_bad_routing"] == 1
