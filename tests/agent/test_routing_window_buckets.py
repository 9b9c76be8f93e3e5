"""RoutingHealthWindow with buckets (what the agent's windows use): the same sums as the exact
window over the steps it still holds, a bucket leaving whole once its last step is older than
the window, and nothing held past it (the exact window keeps every step's counts)."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.agent import routing_health as rh

E = 8
WINDOW_NS = 10_000_000_000
BUCKET_NS = 500_000_000


def _table(rng: np.random.Generator, layers: list[int]) -> rh.LayerTable:
    tokens = rng.integers(0, 40, size=(len(layers), E))
    dropped = np.minimum(tokens, rng.integers(0, 3, size=(len(layers), E)))
    return rh.layer_table(layers=layers, tokens=tokens, dropped=dropped,
                          router_entropy_bits=rng.uniform(0.5, 3.0, size=len(layers)))


def test_bucketed_window_sums_what_its_buckets_hold() -> None:
    rng = np.random.default_rng(4)
    bucketed = rh.RoutingHealthWindow(duration_ns=WINDOW_NS, num_experts=E, bucket_ns=BUCKET_NS)
    steps: list[tuple[int, rh.LayerTable]] = []
    t = 0
    for i in range(600):
        t += int(rng.integers(1, 120)) * 1_000_000  # 1-120 ms apart: buckets of a few to a hundred steps
        layers = [0, 1, 2] if i < 300 else [0, 1, 2, 3]  # a layer appears later: rows grow mid-bucket
        table = _table(rng, layers)
        bucketed.add_table(t, table)
        steps.append((t, table))
        if i % 37 == 0 or i == 599:
            # the steps still held: every bucket whose last step is inside the window, i.e. at least
            # every step of the last WINDOW_NS, and none older than WINDOW_NS + BUCKET_NS
            held = bucketed.table(t)
            inside = [(ts, tb) for ts, tb in steps if ts > t - WINDOW_NS]
            older = [(ts, tb) for ts, tb in steps if t - WINDOW_NS - BUCKET_NS < ts <= t - WINDOW_NS]
            total_inside = sum(int(tb.tokens_total.sum()) for _, tb in inside)
            total_older = sum(int(tb.tokens_total.sum()) for _, tb in older)
            assert total_inside <= int(held.tokens_total.sum()) <= total_inside + total_older
    # exactly: bucket by bucket, rebuilt from the steps with the window's own rule
    now = steps[-1][0]
    buckets: list[list[tuple[int, rh.LayerTable]]] = []
    for ts, tb in steps:
        if not buckets or ts >= buckets[-1][0][0] + BUCKET_NS:
            buckets.append([])
        buckets[-1].append((ts, tb))
    kept = [b for b in buckets if b[-1][0] > now - WINDOW_NS]
    want = np.zeros((4, E), dtype=np.int64)
    for b in kept:
        for _, tb in b:
            want[tb.layers] += tb.tokens
    held = bucketed.table(now)
    np.testing.assert_array_equal(held.tokens, want[held.layers])
    assert len(bucketed) <= WINDOW_NS // BUCKET_NS + 2  # what it holds is bounded by buckets, not steps


def test_a_window_that_empties_reads_as_empty() -> None:
    rng = np.random.default_rng(5)
    w = rh.RoutingHealthWindow(duration_ns=WINDOW_NS, num_experts=E, bucket_ns=BUCKET_NS)
    w.add_table(1_000, _table(rng, [0, 1]))
    w.add_table(2_000, _table(rng, [0, 1]))
    later = 2_000 + WINDOW_NS + 1
    assert int(w.table(later).tokens_total.sum()) == 0 and len(w) == 0
    assert np.isnan(w.router_entropy_bits(0, later))


def test_bucket_must_be_shorter_than_the_window() -> None:
    with pytest.raises(ValueError, match="bucket_ns"):
        rh.RoutingHealthWindow(duration_ns=WINDOW_NS, num_experts=E, bucket_ns=WINDOW_NS)


@pytest.mark.parametrize("bucket_ns", [0, BUCKET_NS])
def test_a_table_read_twice_between_changes_is_one_and_moves_with_every_change(bucket_ns: int) -> None:
    rng = np.random.default_rng(9)
    window = rh.RoutingHealthWindow(duration_ns=WINDOW_NS, num_experts=E, bucket_ns=bucket_ns)
    window.add_table(1_000_000_000, _table(rng, [0, 1]))
    first = window.table(1_100_000_000)
    assert window.table(1_200_000_000) is first  # nothing changed: the held table
    with pytest.raises(ValueError):
        first.tokens[0, 0] = 7  # shared by every reader: read-only
    added = _table(rng, [1, 2])
    window.add_table(1_300_000_000, added)  # a step: a new table with it
    second = window.table(1_300_000_000)
    assert second is not first
    np.testing.assert_array_equal(second.layers, [0, 1, 2])
    assert int(second.tokens_total.sum()) == int(first.tokens_total.sum()) + int(added.tokens_total.sum())
    # time alone moves it: past the window the first step leaves, then the second
    later = window.table(1_000_000_000 + WINDOW_NS + bucket_ns + 1)
    assert int(later.tokens_total.sum()) == (0 if bucket_ns else int(added.tokens_total.sum()))
    gone = window.table(1_300_000_000 + WINDOW_NS + bucket_ns + 1)
    assert int(gone.tokens_total.sum()) == 0
