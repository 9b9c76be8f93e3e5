"""The poller's expert_queue_tokens over a run of states: what the per-expert loop it replaced gave
(kept below as the definition), key order included. Queues at and past the floor and their peaks,
penalised experts reported at 0, every expert reported for sticky_s after it was last busy and
dropped after, keys past the runtime's shape never reported, a new runtime's shape checked again."""

from __future__ import annotations

import dataclasses
import random

import pytest

from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.policy.stats_source import RuntimeStatsSignals

Key = tuple[int, int]


def definition(last_busy: dict[Key, float], state: RuntimeState, now_s: float, *, floor_setting: float,
               sticky_s: float) -> dict[Key, float]:
    """The loop over every sticky expert that `_queue` was until 2026-12-05."""
    floor = max(floor_setting, 1e-9)
    busy = [key for key, depth in state.queue_depth.items() if depth >= floor]
    busy += [key for key, peak in state.queue_peak.items() if peak >= floor]
    busy += [key for key, penalty in state.penalty.items() if penalty > 0]
    for key in busy:
        last_busy[key] = now_s
    queue: dict[Key, float] = {}
    for key, last_s in list(last_busy.items()):
        layer, expert = key
        if now_s - last_s > sticky_s or not (0 <= layer < state.layers and 0 <= expert < state.experts):
            del last_busy[key]
            continue
        value = max(state.queue_depth.get(key, 0), state.queue_peak.get(key, 0))
        queue[key] = float(value) if value >= floor else 0.0
    return queue


def base_state(layers: int, experts: int) -> RuntimeState:
    return RuntimeState.from_stats({
        "protocol": "moescope-control/1",
        "config": {"layers": layers, "experts": experts, "devices": ["cpu"], "primary_device": "cpu"},
        "layers": [{"layer": i} for i in range(layers)], "precision": {"default": "fp32"},
        "memory": {"devices": {}, "expert_bytes_fp32": 0}})


@pytest.mark.parametrize(("floor", "seed"), [(25.0, 1), (0.0, 2), (25.0, 3)])
def test_the_queue_signal_is_the_per_expert_loops(floor: float, seed: int) -> None:
    rng = random.Random(seed)
    signals = RuntimeStatsSignals("/nonexistent.sock", timeout_s=1.0, sticky_s=2.0, queue_floor=floor)
    held: dict[Key, float] = {}
    shape = (3, 8)
    now_s = 100.0
    for period in range(120):
        if period == 60:
            shape = (2, 6)  # another runtime on the socket: a smaller model
        if period == 90:
            shape = (3, 8)
        layers, experts = shape

        def some(n: int, top: int, layers: int = layers, experts: int = experts) -> dict[Key, int]:
            # a few keys past the shape too (a runtime's bad reply)
            return {(rng.randrange(layers + 1), rng.randrange(experts + 2)): rng.randrange(top) for _ in range(n)}

        idle = period % 7 in (5, 6)  # quiet stretches: stickiness runs out
        state = dataclasses.replace(
            base_state(layers, experts),
            queue_depth={} if idle else some(rng.randrange(6), 80),
            queue_peak={} if idle else some(rng.randrange(6), 80),
            penalty={key: 0.3 for key in some(rng.randrange(2), 2)} if period % 11 == 0 else {})
        now_s = round(now_s + 0.2 * rng.choice((1, 1, 1, 3, 6)), 6)
        got = signals._queue(state, now_s)
        want = definition(held, state, now_s, floor_setting=floor, sticky_s=2.0)
        assert list(got.items()) == list(want.items()), f"period {period}"
    assert any(value == 0.0 for value in got.values()) or not got


def test_the_queue_signal_is_vouched_for() -> None:
    # what the stats source hands the policy each period is made of checked (int, int) keys and
    # floats: Signals.targets takes it as it is (rules.vouch_expert_values), with no pass over it
    from moescope.agent.policy import rules
    from moescope.agent.policy.rules import Signals

    signals = RuntimeStatsSignals("/nonexistent.sock", timeout_s=1.0, queue_floor=25.0)
    state = dataclasses.replace(base_state(2, 3), queue_depth={(0, 1): 60, (1, 2): 3}, penalty={(1, 0): 0.3})
    queue = signals._queue(state, 100.0)
    assert queue == {(0, 1): 60.0, (1, 0): 0.0} and all(type(v) is float for v in queue.values())
    assert any(held is queue for held in rules._VOUCHED)
    assert Signals(t_s=100.0, expert_queue_tokens=queue).targets("expert_queue_tokens") is queue

