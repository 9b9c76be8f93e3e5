"""The join's buffer is bounded by the bytes of the layer trees it holds, not only by steps and
layers: at E = 256 a layer's tree is ~2 KB. Past the bound the oldest step leaves (counted as
steps_evicted_overflow and retired as evicted), and a released tree no longer counts."""

from __future__ import annotations

import numpy as np

from moescope.agent.join import LAYER_TREE_OVERHEAD_BYTES, RequestJoin, StepRetired
from moescope.collectors.moe_convention import LayerEvent, RouterEvent, StepEvent

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


class _Sink:
    name = "sink"

    def __init__(self) -> None:
        self.retired: list[StepRetired] = []

    def export(self, batch: object) -> None:
        self.retired.extend(e for e in batch if isinstance(e, StepRetired))  # type: ignore[attr-defined]

    def layer_tree_needed(self, _b: object) -> bool:
        return True  # as a trace output keeping every subtree


def test_the_oldest_step_leaves_when_the_trees_outgrow_their_bytes() -> None:
    join = RequestJoin(max_buffered_tree_bytes=2 * TREE + TREE // 2, clock=lambda: 0)
    sink = _Sink()
    join.add_output(sink)  # type: ignore[arg-type]
    join.on_steps([_step(0), _step(1)])
    assert join.stats()["buffered_tree_bytes"] == 2 * TREE and not sink.retired
    join.on_steps([_step(2)])
    stats = join.stats()
    assert stats["steps_evicted_overflow"] == 1 and stats["buffered_steps"] == 2
    assert stats["buffered_tree_bytes"] == 2 * TREE
    assert [r.evicted for r in sink.retired] == [True] and sink.retired[0].step.step.start_ns == 1_000_000


def test_released_trees_do_not_count() -> None:
    join = RequestJoin(max_buffered_tree_bytes=TREE, clock=lambda: 0)  # no output reads trees
    join.on_steps([_step(i) for i in range(5)])
    stats = join.stats()
    assert stats["step_trees_released_unread"] == 5 and stats["buffered_tree_bytes"] == 0
    assert stats["steps_evicted_overflow"] == 0 and stats["buffered_steps"] == 5
