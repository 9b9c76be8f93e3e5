"""The hot event classes write their own constructors (the dataclass-generated ones stay interpreted
in the compiled build): they must keep the dataclass's fields, defaults, equality and replace()."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moescope.agent.join import BufferedStep, step_times
from moescope.agent.request_phases import StepTimes
from moescope.agent.routing_health import empty_table
from moescope.collectors.moe_convention import (
    ExpertFfnEvent,
    ExpertLoadEvent,
    ExpertsEvent,
    LayerEvent,
    RouterEvent,
    StepEvent,
)


def test_defaults_are_the_declared_ones_and_fresh_per_object() -> None:
    a, b = LayerEvent(3, 10, 20), LayerEvent(3, 10, 20)
    assert (a.router, a.num_experts, a.loads, a.ffns, a.experts) == (None, None, [], [], None)
    a.loads.append(ExpertLoadEvent(1, 11, 12, 64))
    assert b.loads == []  # (a default list is not shared, as field(default_factory=list) had it)
    r = RouterEvent(3, 10, 11, 2.5)
    assert (r.tokens, r.dropped, r.vector, r.counts, r.timed) == ({}, {}, None, None, True)
    assert RouterEvent(3, 10, 11, 2.5).tokens is not r.tokens
    assert ExpertsEvent(10, 20, 7).time_us is None


def test_keywords_equality_repr_and_replace() -> None:
    counts = np.arange(4, dtype=np.int32)
    r = RouterEvent(layer=1, start_ns=2, end_ns=3, entropy_bits=None, counts=counts, timed=False)
    layer = LayerEvent(layer=1, start_ns=2, end_ns=9, router=r, num_experts=2,
                       experts=ExpertsEvent(start_ns=4, end_ns=8, tokens=6, time_us=None),
                       ffns=[ExpertFfnEvent(expert=0, start_ns=4, end_ns=5, tokens=3)])
    assert layer == LayerEvent(1, 2, 9, r, 2, [], [ExpertFfnEvent(0, 4, 5, 3)], ExpertsEvent(4, 8, 6))
    assert layer != dataclasses.replace(layer, end_ns=10)
    moved = dataclasses.replace(layer, start_ns=5)
    assert (moved.start_ns, moved.end_ns, moved.router, moved.ffns) == (5, 9, r, layer.ffns)
    assert repr(ExpertLoadEvent(1, 2, 3, None)) == "ExpertLoadEvent(expert=1, start_ns=2, end_ns=3, bytes_moved=None)"
    assert [f.name for f in dataclasses.fields(LayerEvent)] == [
        "layer", "start_ns", "end_ns", "router", "num_experts", "loads", "ffns", "experts"]
    with pytest.raises(TypeError):
        LayerEvent(1, 2)  # type: ignore[call-arg]


def test_buffered_step_and_step_times() -> None:
    step = StepEvent(pid=1, tid=1, start_ns=100, end_ns=250, tokens=None, requests=[7])
    b = BufferedStep(seq=4, step=step, num_experts=16, table=empty_table(16), batch_size=1)
    assert (b.claims, b.routing_ns, b.expert_load_ns, b.layer_count, b.tree_bytes, b.retired, b.group,
            b.group_index) == (0, 0, 0, 0, 0, False, None, 0)
    b.routing_ns, b.expert_load_ns = 30, 40
    times = step_times(b, key=7)
    assert type(times) is StepTimes
    assert times == StepTimes(start_ns=100, end_ns=250, routing_ns=30, expert_load_ns=40)
    assert (times.input_tokens, times.output_tokens) == (None, None)
    step.request_tokens = {7: (5, 1)}
    assert step_times(b, key=7) == StepTimes(100, 250, 30, 40, input_tokens=5, output_tokens=1)
    assert step_times(b, key=8) == StepTimes(100, 250, 30, 40)
