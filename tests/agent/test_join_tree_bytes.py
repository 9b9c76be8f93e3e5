"""The join's buffer is bounded by the bytes of the layer trees it holds, not only by steps and
layers: at E = 256 a layer's tree is ~2 KB. Past the bound the oldest held tree goes (TreeDropped
to the outputs first, counted as step_trees_dropped_overflow) while its step stays buffered for its
requests, and a released tree no longer counts."""

from __future__ import annotations

import numpy as np

from moescope.agent.join import LAYER_TREE_OVERHEAD_BYTES, RequestJoin, StepRetired, TreeDropped
from moescope.collectors.moe_convention import LayerEvent, RouterEvent, StepEvent
from moescope.probes.ingress.loader import IngressRecord

E = 16
LAYERS = 4
TREE = LAYERS * (8 * E + LAYER_TREE_OVERHEAD_BYTES)


def _step(i: int) -> StepEvent:
    start = 1_000_000 * (i + 1)
    layers = [LayerEvent(layer, start + 10 * layer, start + 10 * layer + 5,
                         RouterEvent(layer, start + 10 * layer, start + 10 * layer + 1, 2.0,
                                     counts=np.arange(2 * E, dtype=np.int32)), E)
              for layer in range(LAYERS)]
    return StepEvent(7, 7, start, start + 100, 16, [100 + i], None, layers)


def _request(*, key: int, start_ns: int, end_ns: int) -> IngressRecord:
    return IngressRecord(7, 7, key, 0, 0, 2, "127.0.0.1", 40000, start_ns, end_ns, end_ns, 100, 100, 0)


class _Sink:
    name = "sink"

    def __init__(self) -> None:
        self.retired: list[StepRetired] = []
        self.dropped: list[tuple[int, int]] = []  # (step start, its layers) as TreeDropped showed it

    def export(self, batch: object) -> None:
        self.retired.extend(e for e in batch if isinstance(e, StepRetired))  # type: ignore[attr-defined]
        # the tree is still there when its readers hear it goes
        self.dropped.extend((e.step.step.start_ns, len(e.step.step.layers))
                            for e in batch if isinstance(e, TreeDropped))  # type: ignore[attr-defined]

    def layer_tree_needed(self, _b: object) -> bool:
        return True  # as a trace output keeping every subtree


def test_the_oldest_tree_goes_when_the_trees_outgrow_their_bytes_and_its_step_stays() -> None:
    join = RequestJoin(max_buffered_tree_bytes=2 * TREE + TREE // 2, clock=lambda: 0)
    sink = _Sink()
    join.add_output(sink)  # type: ignore[arg-type]
    join.on_steps([_step(0), _step(1)])
    assert join.stats()["buffered_tree_bytes"] == 2 * TREE and not sink.dropped
    join.on_steps([_step(2)])
    stats = join.stats()
    assert stats["step_trees_dropped_overflow"] == 1 and stats["steps_evicted_overflow"] == 0
    assert stats["buffered_steps"] == 3 and stats["buffered_tree_bytes"] == 2 * TREE
    assert stats["buffered_layers"] == 2 * LAYERS
    assert sink.dropped == [(1_000_000, LAYERS)] and not sink.retired
    oldest = join._buffer[0]
    assert oldest.step.start_ns == 1_000_000 and not oldest.step.layers and oldest.tree_bytes == 0
    # a tree its requests let go since is not dropped again: the next oldest held one goes
    join.on_request(_request(key=101, start_ns=1_500_000, end_ns=2_600_000))  # claims step 1: its tree goes
    assert join.stats()["buffered_tree_bytes"] == TREE
    join.on_steps([_step(3), _step(4)])
    assert sink.dropped == [(1_000_000, LAYERS), (3_000_000, LAYERS)]
    assert join.stats()["buffered_tree_bytes"] == 2 * TREE and join.stats()["buffered_steps"] == 5
    join.expire(flush=True)  # every step leaves by retention, none evicted
    assert len(sink.retired) == 5 and not any(r.evicted for r in sink.retired)
    assert join.stats()["buffered_tree_bytes"] == 0 and not join._trees


def test_released_trees_do_not_count() -> None:
    join = RequestJoin(max_buffered_tree_bytes=TREE, clock=lambda: 0)  # no output reads trees
    join.on_steps([_step(i) for i in range(5)])
    stats = join.stats()
    assert stats["step_trees_released_unread"] == 5 and stats["buffered_tree_bytes"] == 0
    assert stats["steps_evicted_overflow"] == 0 and stats["buffered_steps"] == 5
