"""A parser batch's steps whose routing blocks lie evenly spaced in one buffer (the decoded moe/v2
step vectors of a batch) get their tables from one health pass (StepsTable), and the routing window
adds a run of them in one operation: the same tables, counters and window sums as one step at a time."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moescope.agent.join import BufferedStep, JoinEvent, RequestJoin, StepSeen
from moescope.agent.outputs.windows import WindowsOutput
from moescope.agent.routing_health import (
    LayerTable,
    RoutingHealthWindow,
    StepsTable,
    layer_table,
    stacked_view,
    steps_table,
    sum_steps,
)
from moescope.collectors.moe_convention import ROUTER_RANGE, LayerColumns, LayerEvent, RouterEvent, StepEvent

L, E = 6, 8
TABLE_FIELDS = ("layers", "tokens", "dropped", "router_entropy_bits", "tokens_total", "dropped_total",
                "entropy_bits", "entropy_normalised", "gini", "max_share", "cv", "drop_fraction",
                "router_entropy_normalised", "block")


def _columns(counts: np.ndarray, entropy: np.ndarray, *, start_ns: int) -> LayerColumns:
    start = start_ns + np.arange(L, dtype=np.int64) * 100
    return LayerColumns(
        layer=np.arange(L, dtype=np.int64), start_ns=start, end_ns=start + 50, num_experts=E,
        router_kind=np.full(L, ROUTER_RANGE, dtype=np.int8), router_start_ns=start + 1, router_end_ns=start + 9,
        entropy_bits=entropy, has_routing=np.ones(L, dtype=bool), counts=counts,
        has_experts=np.zeros(L, dtype=bool), experts_start_ns=np.zeros(L, dtype=np.int64),
        experts_end_ns=np.zeros(L, dtype=np.int64), experts_tokens=np.zeros(L, dtype=np.int64), experts_time_us=None)


def _steps(counts: np.ndarray, entropy: np.ndarray, ends_ns: list[int], *, copy: bool) -> list[StepEvent]:
    """One step per [L, 2E] block of ``counts`` (a [k, L, 2E] array or an evenly strided view of
    one); ``copy`` gives each step its own array (no run)."""
    steps = []
    for i, end in enumerate(ends_ns):
        step = StepEvent(7, 7, end - 5_000, end, 64, [i + 1])
        block = counts[i].copy() if copy else counts[i]
        step.set_columns(_columns(block, entropy[i].copy() if copy else entropy[i], start_ns=end - 4_000))
        steps.append(step)
    return steps


class _Seen:
    name = "seen"

    def __init__(self) -> None:
        self.steps: list[BufferedStep] = []
        self.tables: list[LayerTable] = []  # as exported: a tree nobody reads is let go after
        self.groups: list[StepsTable | None] = []

    def export(self, batch: Sequence[JoinEvent]) -> None:
        for event in batch:
            if isinstance(event, StepSeen):
                self.steps.append(event.step)
                self.tables.append(event.step.table)
                self.groups.append(event.step.group)

    def force_flush(self) -> None:
        pass

    def shutdown(self, deadline_ns: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


def _join(clock_ns: int) -> tuple[RequestJoin, _Seen, WindowsOutput]:
    join = RequestJoin(clock=lambda: clock_ns)
    seen, windows = _Seen(), WindowsOutput(clock=lambda: clock_ns)
    join.add_output(seen)
    join.add_output(windows)
    return join, seen, windows


def _assert_tables_equal(a: LayerTable, b: LayerTable) -> None:
    for name in TABLE_FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


Fed = tuple[RequestJoin, "_Seen", WindowsOutput]  # a join, its seen steps and its windows (_join)


def _assert_same_outcome(grouped: Fed, single: Fed, now: int) -> None:
    """The joins fed steps as runs and one at a time: the same tables, counters and window sums (the
    one-at-a-time side never formed a group)."""
    (grouped_join, grouped_seen, grouped_windows), (single_join, single_seen, single_windows) = grouped, single
    assert all(g is None for g in single_seen.groups)
    for a, b in zip(grouped_seen.tables, single_seen.tables, strict=True):
        _assert_tables_equal(a, b)
    assert grouped_join.stats() == single_join.stats()
    ga, sa = grouped_windows._routing, single_windows._routing
    assert ga is not None and sa is not None
    for x, y in zip(ga._sums(), sa._sums(), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12)
    assert len(ga) == len(sa)
    _assert_tables_equal(ga.table(now), sa.table(now))


def _batch(rng: np.random.Generator, k: int, *, dtype: type = np.int32) -> tuple[np.ndarray, np.ndarray]:
    counts: np.ndarray = rng.integers(0, 40, size=(k, L, 2 * E)).astype(dtype)
    counts[:, :, E:] //= 8  # fewer drops than tokens
    entropy = rng.uniform(0.5, 3.0, size=(k, L))
    entropy[rng.random((k, L)) < 0.2] = np.nan  # routers without an entropy
    return counts, entropy


@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("negative", [False, True])
def test_a_run_of_steps_in_one_buffer_gets_the_tables_of_one_at_a_time(negative: bool, spaced: bool) -> None:
    rng = np.random.default_rng(5)
    counts, entropy = _batch(rng, 12)
    if spaced:  # the blocks apart in one buffer, as the decoder's strided view of a batch's payloads
        wide = np.zeros((12, L + 3, 2 * E), dtype=np.int32)
        wide[:, :L] = counts
        counts = wide[:, :L]
    if negative:
        counts[4, 2, 3] = -1  # a bad count: the whole run takes the step-by-step path, its layer counted
    now = 50_000_000_000
    ends = [now - 3_000_000_000 + i * 40_000_000 for i in range(12)]  # 40 ms apart: across window buckets
    grouped_join, grouped, grouped_windows = _join(now)
    single_join, single, single_windows = _join(now)
    grouped_join.on_steps(_steps(counts, entropy, ends, copy=False))
    single_join.on_steps(_steps(counts, entropy, ends, copy=True))
    assert len(grouped.steps) == len(single.steps) == 12
    assert all((g is None) is negative for g in grouped.groups)  # the run was found (or refused)
    _assert_same_outcome((grouped_join, grouped, grouped_windows), (single_join, single, single_windows), now)


def test_a_run_stops_where_layers_or_experts_change() -> None:
    rng = np.random.default_rng(9)
    counts, entropy = _batch(rng, 6)
    steps = _steps(counts, entropy, [10_000_000 * (i + 1) for i in range(6)], copy=False)
    odd = steps[3].columns
    assert odd is not None
    odd.layer = odd.layer + 1  # another layer set: the run is cut there (its block stays back to back)
    join, seen, _ = _join(100_000_000)
    join.on_steps(steps)
    groups = seen.groups
    assert groups[0] is groups[1] is groups[2] is not None
    assert groups[3] is None  # alone between two runs
    assert groups[4] is groups[5] is not None and groups[4] is not groups[0]
    assert [b.group_index for b in seen.steps] == [0, 1, 2, 0, 0, 1]
    assert seen.tables[3].layers.tolist() == list(range(1, L + 1))


def _object_steps(counts: np.ndarray, entropy: np.ndarray, ends_ns: list[int]) -> list[StepEvent]:
    """Steps built as objects (a step of fewer than COLUMN_MIN_LAYERS layers, as the reference
    model's): each layer a router with its own moe/v2 routing vector (a copy)."""
    steps = []
    for i, end in enumerate(ends_ns):
        step = StepEvent(7, 7, end - 5_000, end, 64, [i + 1])
        for layer in range(L):
            at = end - 4_000 + layer * 100
            bits = float(entropy[i, layer])
            router = RouterEvent(layer, at + 1, at + 9, None if np.isnan(bits) else bits,
                                 counts=counts[i, layer].copy())
            step.layers.append(LayerEvent(layer, at, at + 50, router=router))
        steps.append(step)
    return steps


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("negative", [False, True])
def test_a_run_of_object_steps_gets_the_tables_of_one_at_a_time(negative: bool, dtype: type) -> None:
    """Object steps (the reference model's L = 4) with whole routing vectors: one health pass for a
    parser batch's run, the same tables, counters and window sums as one step at a time."""
    rng = np.random.default_rng(11)
    counts, entropy = _batch(rng, 9, dtype=dtype)
    if negative:
        counts[5, 1, 2] = -1  # the run takes the one-by-one path, the bad layer counted
    now = 50_000_000_000
    ends = [now - 3_000_000_000 + i * 40_000_000 for i in range(9)]
    grouped_join, grouped, grouped_windows = _join(now)
    single_join, single, single_windows = _join(now)
    for join in (grouped_join, single_join):  # E learned from a first step, as from the stream's first batch
        join.on_steps(_object_steps(counts[:1], entropy[:1], [ends[0] - 1_000_000]))
    run = _object_steps(counts, entropy, ends)
    routers = [[layer.router for layer in step.layers] for step in run]  # (the join lets the trees go)
    grouped_join.on_steps(run)
    for step in _object_steps(counts, entropy, ends):  # one at a time: no run
        single_join.on_steps([step])
    assert len(grouped.steps) == len(single.steps) == 10
    assert all((g is None) is negative for g in grouped.groups[1:])  # the run was found (or refused)
    _assert_same_outcome((grouped_join, grouped, grouped_windows), (single_join, single, single_windows), now)
    if not negative:  # each router's counts are now its row of the run's block (the decoded vectors can go)
        for buffered, group, step_routers in zip(grouped.steps[1:], grouped.groups[1:], routers, strict=True):
            assert group is not None  # (as exported)
            for router, row in zip(step_routers, group.blocks[buffered.group_index], strict=True):
                assert router is not None and router.counts is not None
                assert np.shares_memory(router.counts, row)


def test_an_object_run_stops_where_layers_or_the_vectors_change() -> None:
    rng = np.random.default_rng(12)
    counts, entropy = _batch(rng, 6)
    ends = [10_000_000 * (i + 1) for i in range(6)]
    steps = _object_steps(counts, entropy, ends)
    steps[2].layers[3].router.counts = steps[2].layers[3].router.counts.astype(np.int64)  # type: ignore[union-attr]
    steps[4].layers.pop()  # one layer fewer
    join, seen, _ = _join(100_000_000)
    join.on_steps(_object_steps(counts[:1], entropy[:1], [1_000_000]))
    join.on_steps(steps)
    groups = seen.groups[1:]
    assert groups[0] is groups[1] is not None
    assert groups[2] is None and groups[4] is None  # another vector type; another layer set
    assert groups[3] is None and groups[5] is None  # runs of one
    assert seen.tables[1 + 4].layers.tolist() == list(range(L - 1))


def test_stacked_view_only_for_parts_that_lie_back_to_back() -> None:
    whole = np.arange(4 * 3 * 5, dtype=np.int32).reshape(4, 3, 5)
    parts = [whole[i] for i in range(4)]
    view = stacked_view(parts)
    assert view is not None and np.shares_memory(view, whole)
    np.testing.assert_array_equal(view, whole)
    spaced = stacked_view([whole[0], whole[2]])  # evenly spaced: a strided view
    assert spaced is not None and np.shares_memory(spaced, whole)
    np.testing.assert_array_equal(spaced, whole[::2])
    assert stacked_view([whole[0], whole[1], whole[3]]) is None  # uneven
    assert stacked_view([whole[1], whole[0]]) is None  # out of order
    assert stacked_view([p.copy() for p in parts]) is None  # separate arrays
    assert stacked_view([whole[0], whole[1].astype(np.int64)]) is None
    assert stacked_view([whole[i][:, :4] for i in range(4)]) is None  # not contiguous rows


@pytest.mark.parametrize("bound", [100, 2**31])
def test_sum_steps_is_the_sum_in_a_wide_enough_type(bound: int) -> None:
    blocks = np.full((3, 2, 4), 2**29, dtype=np.int32)
    total = sum_steps(blocks, bound=bound)
    if bound > 2**31 - 1:
        assert total.dtype == np.int64 and int(total[0, 0]) == 3 * 2**29
    else:
        assert total.dtype == np.int32
    np.testing.assert_array_equal(sum_steps(blocks[:, :, :1] // 2**20, bound=100), np.full((2, 1), 3 * 2**9))


def test_steps_table_rows_are_layer_table_per_step() -> None:
    rng = np.random.default_rng(3)
    counts, entropy = _batch(rng, 5)
    table = steps_table(layers=np.arange(L), blocks=counts, router_entropy_bits=entropy.reshape(-1))
    assert table is not None and len(table) == 5
    for i in range(5):
        one = layer_table(layers=np.arange(L), tokens=counts[i][:, :E], dropped=counts[i][:, E:],
                          router_entropy_bits=entropy[i], block=counts[i])
        _assert_tables_equal(table.step(i), one)
    counts[2, 1, 0] = -4
    with pytest.raises(ValueError):
        steps_table(layers=np.arange(L), blocks=counts, router_entropy_bits=entropy.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 9),
    rows=st.integers(1, 4),
    gaps_ms=st.lists(st.integers(0, 900), min_size=9, max_size=9),
    seed=st.integers(0, 2**16),
    start_ms=st.integers(0, 30_000),
    first=st.integers(0, 2),
)
def test_add_run_leaves_the_window_as_add_table_step_by_step(k: int, rows: int, gaps_ms: list[int], seed: int,
                                                             start_ms: int, first: int) -> None:
    rng = np.random.default_rng(seed)
    e = 5
    blocks = rng.integers(0, 9, size=(first + k, rows, 2 * e)).astype(np.int32)
    blocks[rng.random((first + k, rows)) < 0.2] = 0  # rows with no tokens
    entropy = np.where(rng.random((first + k) * rows) < 0.25, np.nan, rng.uniform(0, 2, (first + k) * rows))
    table = steps_table(layers=rng.permutation(6)[:rows], blocks=blocks, router_entropy_bits=entropy)
    assert table is not None
    times = list(np.cumsum([start_ms * 1_000_000] + [g * 1_000_000 for g in gaps_ms[: k - 1]]).tolist())
    if k > 2:
        times[1], times[2] = times[2], times[1]  # out of order: both take the later one
    bucketed, stepped = (RoutingHealthWindow(duration_ns=10_000_000_000, num_experts=e, bucket_ns=500_000_000)
                         for _ in range(2))
    for w in (bucketed, stepped):
        w.add_table(0, table.step(0))  # an earlier step: an open bucket to go on with or close
    bucketed.add_run(times, table, first)
    for i, t in enumerate(times):
        stepped.add_table(t, table.step(first + i))
    for x, y in zip(bucketed._sums(), stepped._sums(), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
    assert len(bucketed) == len(stepped)
    assert bucketed.layers() == stepped.layers()
    later = times[-1] + 10_000_000_000
    for x, y in zip(bucketed.table(later).tokens_total, stepped.table(later).tokens_total, strict=True):
        assert x == y


class _KeepsTrees(_Seen):
    """An output that reads every step's tree (as traces do for a kept subtree)."""

    def layer_tree_needed(self, b: BufferedStep) -> bool:
        return True


@pytest.mark.parametrize("pad_rows", [0, 200])
def test_a_step_kept_with_its_tree_holds_copies_not_its_batch(pad_rows: int) -> None:
    # a kept step's block and columns were views into the batch's decoded payloads: after the
    # join it must own them (else each kept step pins its whole batch), with the same numbers.
    # Its table stays a view of its group where all the group holds is small (the reference
    # model's rounds: SHARED_GROUP_MAX_BYTES); a batch past that is copied out of.
    from moescope.agent.join import SHARED_GROUP_MAX_BYTES

    rng = np.random.default_rng(11)
    counts, entropy = _batch(rng, 6)
    payload = np.zeros((6, L + pad_rows, 2 * E), dtype=np.int32)  # the steps' blocks within the decoded batch
    payload[:, :L] = counts
    counts = payload[:, :L]
    big = payload.nbytes > SHARED_GROUP_MAX_BYTES
    assert big is (pad_rows > 0)
    join = RequestJoin(clock=lambda: 100_000_000)
    keeper = _KeepsTrees()
    join.add_output(keeper)
    join.on_steps(_steps(counts, entropy, [10_000_000 * (i + 1) for i in range(6)], copy=False))
    assert all(g is not None for g in keeper.groups)  # they were a run
    for i, b in enumerate(keeper.steps):
        assert b.step.layer_count == L  # tree kept
        columns = b.step.columns
        assert columns is not None and columns.counts is not None
        for held in (columns.counts, columns.entropy_bits):
            assert not np.shares_memory(held, payload) and not np.shares_memory(held, entropy)
        if big:  # the run let go, the table its own: the same numbers as the columns' counts, one copy
            assert b.group is None
            for own in (b.table.block, b.table.tokens, b.table.gini):
                assert own is not None and not np.shares_memory(own, payload)
            assert b.table.block is columns.counts
        else:  # the run kept: the table is its row of the group's arrays
            assert b.group is not None and b.group is keeper.groups[i] and b.group_index == i
            assert np.shares_memory(b.table.block, payload) and np.shares_memory(b.table.gini, b.group.gini)
        _assert_tables_equal(b.table, keeper.tables[i])
        np.testing.assert_array_equal(columns.counts, counts[i])


@pytest.mark.parametrize("pad_rows", [0, 600])
def test_a_long_round_of_small_steps_stays_one_group(pad_rows: int) -> None:
    # The reference model's quiet rounds: ~100 steps of ~1 KB each, past SHARED_GROUP_MAX_BYTES in
    # all but within SHARED_GROUP_BYTES_PER_STEP a step: the kept steps stay views of their group
    # (no copy per step; the group makes their health in one pass). Steps of ~40 KB each (as a
    # production-shape batch; here padded) are copied out of, however many there are.
    from moescope.agent.join import (
        SHARED_GROUP_BYTES_PER_STEP,
        SHARED_GROUP_MAX_BYTES,
        _group_bytes,
        shared_group_bound,
    )

    k = 80
    rng = np.random.default_rng(13)
    counts, entropy = _batch(rng, k)
    payload = np.zeros((k, L + pad_rows, 2 * E), dtype=np.int32)  # the steps' blocks within the decoded batch
    payload[:, :L] = counts
    counts = payload[:, :L]
    shared = payload.nbytes <= SHARED_GROUP_BYTES_PER_STEP * k
    assert shared is (pad_rows == 0)
    join = RequestJoin(clock=lambda: 100_000_000)
    keeper = _KeepsTrees()
    join.add_output(keeper)
    join.on_steps(_steps(counts, entropy, [10_000_000 * (i + 1) for i in range(k)], copy=False))
    group = keeper.groups[0]
    assert group is not None and all(g is group for g in keeper.groups)  # one run
    assert _group_bytes(group) > SHARED_GROUP_MAX_BYTES  # past the absolute bound either way
    assert (_group_bytes(group) <= shared_group_bound(k)) is shared
    for i, b in enumerate(keeper.steps):
        assert b.step.layer_count == L  # tree kept
        if shared:  # the run kept: each table its row of the group's arrays
            assert b.group is group and b.group_index == i
            assert np.shares_memory(b.table.block, payload) and np.shares_memory(b.table.gini, group.gini)
        else:  # the run let go, each table its own
            assert b.group is None
            assert not np.shares_memory(b.table.block, payload) and not np.shares_memory(b.table.gini, group.gini)
        _assert_tables_equal(b.table, keeper.tables[i])


def test_a_kept_table_unlike_its_counts_is_its_own_copy_and_counts_toward_the_tree_bound() -> None:
    # A layer that routed without a routing row (has_routing False) has its row zeroed in the
    # table: the block is not the columns' counts, so the kept step holds both, and the join's
    # tree bytes (its bound on what kept trees hold) count the table's copy as well.
    from moescope.agent.join import tree_bytes

    rng = np.random.default_rng(17)
    counts, entropy = _batch(rng, 2)
    counts[:, 2] += 1  # a non-zero row to zero
    payload = np.zeros((2, L + 600, 2 * E), dtype=np.int32)  # past the shared-group bound: copied out of
    payload[:, :L] = counts
    views = payload[:, :L]
    steps = _steps(views, entropy, [10_000_000, 20_000_000], copy=False)
    for step in steps:
        assert step.columns is not None
        step.columns.has_routing = np.ones(L, dtype=bool)
        step.columns.has_routing[2] = False
    join = RequestJoin(clock=lambda: 100_000_000)
    keeper = _KeepsTrees()
    join.add_output(keeper)
    join.on_steps(steps)
    held = 0
    for i, b in enumerate(keeper.steps):
        columns = b.step.columns
        assert columns is not None and columns.counts is not None and b.table.block is not None
        assert not np.shares_memory(b.table.block, columns.counts)
        assert not np.shares_memory(b.table.block, payload) and not np.shares_memory(columns.counts, payload)
        np.testing.assert_array_equal(columns.counts, counts[i])
        assert not b.table.block[2].any() and (b.table.block[2] != counts[i, 2]).any()
        assert b.tree_bytes == tree_bytes(b) + b.table.block.nbytes
        held += b.tree_bytes
    assert join.stats()["buffered_tree_bytes"] == held
    # retiring them gives back all of it, the tables' copies included
    join.expire(flush=True)
    assert join.stats()["buffered_tree_bytes"] == 0
