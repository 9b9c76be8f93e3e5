"""The trace output's whole-step attribute functions against their per-layer definitions.

``top_experts_by_row`` (top experts of every layer of a step in one call) must give, row by row, what
the definition gives: the 16 largest values, largest first, ties by expert id, and those values.
``step_health_attributes`` must give the very floats ``LayerTable.step_health()`` gives (bit for bit:
the spans carry them), and ``_experts_time_by_position`` what ``_experts_time_attributes`` gives for
each layer.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest

from moescope.agent.outputs import traces
from moescope.agent.outputs.traces import TOP_EXPERTS_ON_SPANS, TraceOutput, top_experts_by_row
from moescope.agent.routing_health import LayerTable, empty_table, layer_table
from moescope.collectors.moe_convention import ExpertsEvent, LayerEvent


def _definition(row: list[float] | list[int]) -> list[int]:
    """Largest first, ties by expert id: the sort the spans document, written out."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:TOP_EXPERTS_ON_SPANS]


def _check_rows(matrix: np.ndarray) -> None:
    ids, values = top_experts_by_row(matrix)
    assert len(ids) == len(values) == matrix.shape[0]
    for row, got_ids, got_values in zip(matrix, ids, values, strict=True):
        assert got_ids == traces._top_experts(row)  # the per-layer function the spans used
        if not np.isnan(row).any():
            assert got_ids == _definition(row.tolist())
        assert got_values == row[got_ids].tolist()
        assert [type(v) for v in got_values] == [type(v) for v in row[got_ids].tolist()]  # ints stay ints


@pytest.mark.parametrize("experts", [1, 5, 16, 17, 32, 33, 64, 256])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_integer_rows_match_the_per_layer_definition(experts: int, dtype: type) -> None:
    rng = np.random.default_rng(experts)
    for trial in range(20):
        # few distinct values: many ties, also at the 16th place
        high = 3 if trial % 2 else 40
        matrix: np.ndarray = rng.integers(0, high, size=(7, experts)).astype(dtype)
        if trial == 0:
            matrix[:] = 0  # every expert tied
        _check_rows(matrix)


def test_negative_and_large_counts() -> None:
    rng = np.random.default_rng(1)
    negative = rng.integers(-5, 5, size=(6, 256))
    _check_rows(negative)
    # at and past the range where count * E + id is exact: the row-by-row path, same answer
    near = np.full((3, 256), 1 << 53, dtype=np.int64)
    near[:, ::7] -= 1
    _check_rows(near)
    huge = rng.integers(0, 1 << 62, size=(3, 256), dtype=np.int64)
    huge[:, 3] = huge[:, 200]  # a tie among huge counts
    _check_rows(huge)
    unsigned = np.full((2, 256), (1 << 64) - 1, dtype=np.uint64)
    unsigned[:, 10] = 0
    ids, _ = top_experts_by_row(unsigned)
    assert ids == [traces._top_experts(row) for row in unsigned]


def test_float_rows_with_and_without_ties_and_nan() -> None:
    rng = np.random.default_rng(2)
    distinct = rng.random((58, 256)) * 100
    _check_rows(distinct)
    tied = np.round(rng.random((10, 256)) * 4) / 4  # ties at the 16th value: row by row
    _check_rows(tied)
    signed_zeros = np.zeros((2, 256))
    signed_zeros[0, ::3] = -0.0
    signed_zeros[1, 5] = np.inf
    signed_zeros[1, 9] = -np.inf
    _check_rows(signed_zeros)
    with_nan = distinct[:4].copy()
    with_nan[1, 17] = np.nan
    with_nan[2, :20] = np.nan
    _check_rows(with_nan)  # NaN: exactly what the per-layer function does
    assert top_experts_by_row(np.zeros((0, 256))) == ([], [])


def test_rejects_a_vector() -> None:
    with pytest.raises(ValueError, match="matrix"):
        top_experts_by_row(np.arange(10))


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _same(got: object, want: object) -> bool:
    if isinstance(want, float):
        return isinstance(got, float) and (math.isnan(got) and math.isnan(want) or _bits(got) == _bits(want))
    return type(got) is type(want) and got == want


def _want(t: LayerTable) -> dict[str, float | int]:
    s = t.step_health()
    return {
        "moe.router.entropy_bits": s.router_entropy_bits,
        "moe.router.entropy_normalized": s.router_entropy_normalised,
        "moe.expert_load.gini": s.gini,
        "moe.expert_load.gini_max": s.gini_max,
        "moe.expert_load.max_share": s.max_share,
        "moe.tokens.dropped": s.dropped,
        "moe.tokens.drop_fraction": s.drop_fraction,
    }


def test_step_health_attributes_equal_step_health_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    for trial in range(60):
        layers, experts = int(rng.integers(1, 70)), int(rng.choice([1, 8, 64, 256]))
        tokens = rng.poisson(2, size=(layers, experts)) * (rng.random((layers, experts)) < 0.8)
        if trial % 5 == 0:
            tokens[rng.random(layers) < 0.3] = 0  # layers with no tokens: weight 0, ratios NaN
        dropped = np.minimum(tokens, rng.integers(0, 3, size=(layers, experts)))
        entropy = rng.random(layers) * math.log2(max(experts, 2))
        entropy[rng.random(layers) < 0.2] = np.nan  # not reported
        t = layer_table(layers=np.arange(layers), tokens=tokens, dropped=dropped, router_entropy_bits=entropy)
        got = traces.step_health_attributes(t)
        want = _want(t)
        assert list(got) == list(want)
        for key, value in want.items():
            assert _same(got[key], value), (trial, key, got[key], value)


def test_step_health_attributes_edge_values() -> None:
    t = layer_table(layers=[0, 1, 2], tokens=[[3, 1], [0, 0], [2, 2]], dropped=[[1, 0], [0, 0], [0, 0]],
                    router_entropy_bits=[-0.0, 0.5, np.nan])
    cases = [
        t,
        dataclasses.replace(t, router_entropy_bits=np.array([-0.0, 1.0, -0.0])),  # -0.0 first: the loop gives +0.0
        dataclasses.replace(t, router_entropy_bits=np.array([np.inf, 1.0, -np.inf])),  # inf - inf: NaN
        dataclasses.replace(t, gini=np.array([np.nan, np.nan, np.nan])),  # no value: NaN mean and max
        dataclasses.replace(t, tokens_total=np.array([0, 0, 0])),  # no weight anywhere
    ]
    every_layer = layer_table(layers=[0, 1], tokens=[[3, 1], [2, 2]], router_entropy_bits=[-0.0, -0.0])
    cases.append(every_layer)  # only -0.0 terms: the loop's sum is +0.0, accumulate's alone would be -0.0
    for case in cases:
        got = traces.step_health_attributes(case)
        for key, value in _want(case).items():
            assert _same(got[key], value), (key, got[key], value)
    assert traces.step_health_attributes(empty_table(4)) == {}  # no routed layer: no aggregates


def test_expert_times_of_a_step_equal_the_per_layer_attributes() -> None:
    rng = np.random.default_rng(4)

    def layer(i: int, time_us: np.ndarray | None, *, experts: bool = True) -> LayerEvent:
        run = ExpertsEvent(start_ns=10 * i, end_ns=10 * i + 5, tokens=8, time_us=time_us) if experts else None
        return LayerEvent(layer=i, start_ns=10 * i, end_ns=10 * i + 9, experts=run)

    ties = np.round(rng.random(256) * 3).astype(np.float32)  # float32, ties at the bound: row by row
    layers = [
        layer(0, rng.random(256).astype(np.float32)),
        layer(1, None),
        layer(2, rng.random(16) * 10),  # narrow: the whole array
        layer(3, None, experts=False),
        layer(4, rng.random(128)),  # another width
        layer(5, ties),
        layer(6, rng.random(256).astype(np.float32)),
    ]
    got = traces._experts_time_by_position(layers)
    want = [TraceOutput._experts_time_attributes(x) or None for x in layers]
    assert got == want
    assert sum(1 for g in got if g is not None) == 5


@pytest.mark.parametrize("seed", range(6))
def test_steps_health_attributes_are_each_steps_floats_bit_for_bit(seed: int) -> None:
    # a run of the join's grouped steps: the attributes for all of them at once are, step by
    # step, the per-step function's (the same floats, the same types), NaN and empty layers too
    from moescope.agent.routing_health import steps_table

    rng = np.random.default_rng(seed)
    k, rows, e = 7, 11, 16
    blocks = rng.integers(0, 50, size=(k, rows, 2 * e)).astype(np.int32)
    blocks[:, :, e:] //= 10
    entropy = rng.uniform(0.1, 4.0, size=k * rows)
    if seed % 2:
        blocks[2, 4] = 0  # a layer with no tokens in step 2
        entropy[5 * rows + 1] = np.nan  # no router entropy for a layer of step 5
    table = steps_table(layers=np.arange(rows), blocks=blocks, router_entropy_bits=entropy)
    assert table is not None
    together = traces.steps_health_attributes(table)
    one_by_one = [traces.step_health_attributes(table.step(i)) for i in range(k)]
    assert len(together) == k
    for got, want in zip(together, one_by_one, strict=True):
        assert got.keys() == want.keys()
        for name, value in want.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[name]), name  # type: ignore[arg-type]
            else:
                assert got[name] == value and type(got[name]) is type(value), name
                if isinstance(value, float):
                    assert struct.pack("<d", got[name]) == struct.pack("<d", value), name


def _same_values(got: list[object], want: list[object]) -> None:
    """Equal Python values of the same types, NaN where NaN (bit for bit for floats)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(w, float):
            assert struct.pack("<d", g) == struct.pack("<d", w)
        else:
            assert g == w


@pytest.mark.parametrize("experts", [16, 64, 65, 256])
@pytest.mark.parametrize("seed", range(3))
def test_a_groups_table_lists_are_each_steps_lists(experts: int, seed: int) -> None:
    # the layer spans' health of a step still in its join group is read from lists made once for
    # the group: step by step, the per-step lists (the same values and types; the top experts past
    # MAX_ARRAY_EXPERTS), NaN and empty layers too
    from moescope.agent.routing_health import steps_table

    rng = np.random.default_rng(seed)
    k, rows = 9, 5
    blocks = rng.integers(0, 4 if seed == 2 else 50, size=(k, rows, 2 * experts)).astype(np.int32)
    blocks[:, :, experts:] //= 10
    blocks[3, 1] = 0  # a layer with no tokens
    entropy = rng.uniform(0.1, 4.0, size=k * rows)
    entropy[2 * rows + 3] = np.nan  # a router without an entropy
    table = steps_table(layers=rng.permutation(8)[:rows], blocks=blocks, router_entropy_bits=entropy)
    assert table is not None
    layers, columns, first, second = traces._group_lists(table)
    assert len(columns) == len(traces._HEALTH_COLUMNS)
    for i in range(k):
        s_layers, s_columns, s_first, s_second = traces._table_lists(table.step(i))
        part = slice(i * rows, (i + 1) * rows)
        assert layers == s_layers
        for column, s_column in zip(columns, s_columns, strict=True):
            _same_values(column[part], s_column)
        for lists, s_lists in ((first, s_first), (second, s_second)):
            assert len(lists[part]) == len(s_lists) == rows
            for row, s_row in zip(lists[part], s_lists, strict=True):
                _same_values(row, s_row)
        if experts > traces.MAX_ARRAY_EXPERTS:  # top experts: 16 ids and their tokens
            assert all(len(row) == traces.TOP_EXPERTS_ON_SPANS for row in s_first)
        else:
            assert s_first == table.step(i).tokens.tolist()
