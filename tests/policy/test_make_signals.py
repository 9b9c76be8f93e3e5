"""``make_signals`` (the policy wake's snapshot, made without the dataclass's generated __init__)
makes the same Signals as the constructor: every field, defaults included, fresh mappings per
snapshot, still frozen; and refuses a name Signals does not have, as the constructor does."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from moescope.agent.policy.rules import Signals, make_signals

CASES: list[dict[str, Any]] = [
    {},
    {"device_memory_used_ratio": 0.5, "expert_queue_tokens": {(0, 1): 60.0}},
    {"step_p99_ms": 12.5, "request_p99_ms": math.nan, "expert_load_gini": {3: 0.2},
     "router_entropy_ratio": {3: 0.9}, "request_tpot_p99_ms": 7.0, "tcp_resets_per_s": 1.5},
    {field.name: float(i) for i, field in enumerate(dataclasses.fields(Signals)) if field.name != "t_s"
     and field.default is not dataclasses.MISSING},
]


def _fields(s: Signals) -> dict[str, Any]:
    return {field.name: getattr(s, field.name) for field in dataclasses.fields(Signals)}


@pytest.mark.parametrize("values", CASES)
def test_the_same_snapshot_as_the_constructor(values: dict[str, Any]) -> None:
    made, built = make_signals(3.25, values), Signals(t_s=3.25, **values)
    got, want = _fields(made), _fields(built)
    assert got.keys() == want.keys()
    for name, value in want.items():  # (NaN == NaN for the float defaults)
        assert got[name] == value or (math.isnan(got[name]) and math.isnan(value)), name
        assert type(got[name]) is type(value), name
    assert type(made) is Signals


def test_mapping_defaults_are_fresh_and_the_snapshot_frozen() -> None:
    a, b = make_signals(1.0, {}), make_signals(2.0, {})
    assert a.expert_queue_tokens == {} and a.expert_queue_tokens is not b.expert_queue_tokens
    assert a.expert_load_gini is not b.expert_load_gini and a.router_entropy_ratio is not b.router_entropy_ratio
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step_p99_ms = 1.0  # type: ignore[misc]


def test_an_unknown_name_is_refused_as_the_constructor_refuses_it() -> None:
    with pytest.raises(TypeError, match="no_such_signal"):
        make_signals(1.0, {"no_such_signal": 1.0})
    with pytest.raises(TypeError):
        Signals(t_s=1.0, no_such_signal=1.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        make_signals(1.0, {"t_s": 2.0})  # (t_s is the first argument, not a value)
