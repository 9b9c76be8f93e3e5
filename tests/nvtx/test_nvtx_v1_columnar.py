"""moe/v1 steps (per-expert token and drop marks in each router, per-expert FFN ranges) through the
parser's whole-batch path against its per-event path (``fast=False``), on generated batches with
hostile edits: marks outside any layer or with no parent at all, duplicate experts, experts past E,
bad payload types, category 0, negative and huge counts, ranges whose pop never came (and parents
reported lost), batch boundaries anywhere. Both must give the same steps, the same counters, and
the same numbers once the agent's join has turned them into count matrices."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvtx_helpers import Tape, assert_paths_agree, double_bits, plain, string_table, tape_batches

from moescope.agent.join import RequestJoin
from moescope.collectors import moe_convention
from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import (
    PAYLOAD_DOUBLE,
    PAYLOAD_I32,
    PAYLOAD_I64,
    PAYLOAD_NONE,
    PAYLOAD_U64,
    NvtxBatch,
    StringTable,
)

DOMAIN = 1
NAMES = ["moe.step", "moe.layer", "moe.router", "moe.expert.ffn", "moe.expert.load", "moe.request",
         "moe.expert.tokens", "moe.expert.dropped", "attention"]
SID = {name: i + 1 for i, name in enumerate(NAMES)}
E = 6  # experts per layer (the moe.layer payload)
EDITS = ("none", "mark under step", "mark under layer", "mark with no parent", "mark payload double",
         "mark category 0", "mark huge", "mark huge unsigned", "mark past E", "router never popped",
         "layer never popped", "step never popped", "lose layer", "lose router", "ffn payload double",
         "ffn huge unsigned", "load", "other E", "no E", "second router", "router payload int", "foreign parent")


def _strings() -> StringTable:
    return string_table(SID, domain=DOMAIN)


_double = double_bits


def _u64(value: int) -> int:
    return value & ((1 << 64) - 1)  # a signed payload as its 64-bit pattern


counts = st.lists(st.tuples(st.integers(0, E - 1), st.integers(-3, 40)), max_size=8)  # duplicates on purpose
layer_shape = st.fixed_dictionaries({"tokens": counts, "dropped": counts,
                                     "ffns": st.lists(st.integers(0, E - 1), max_size=4, unique=True)})
step_shape = st.fixed_dictionaries({
    "layers": st.lists(layer_shape, max_size=5),
    "requests": st.lists(st.integers(0, 50), max_size=2),
    "edit": st.sampled_from(EDITS),
    "edit_at": st.integers(0, 6),
    "signed_type": st.sampled_from([PAYLOAD_I64, PAYLOAD_I32]),
})


def _tape(steps: list[dict[str, Any]]) -> tuple[Tape, set[int]]:
    tape = Tape(SID)
    lost: set[int] = set()
    for s in steps:
        edit, at = s["edit"], s["edit_at"]
        signed = s["signed_type"]
        step = tape.push("moe.step", payload=64)
        for key in s["requests"]:
            tape.mark("moe.request", payload=key, ptype=PAYLOAD_U64)
        if edit == "mark under step":
            tape.mark("moe.expert.tokens", category=2, payload=3)
        if edit == "mark with no parent":
            tape.mark("moe.expert.dropped", category=1, payload=2, parent=0)
        for index, shape in enumerate(s["layers"]):
            here = index == at % max(1, len(s["layers"]))
            experts = E + 1 if edit == "other E" and here else E
            layer = tape.push("moe.layer", category=index + 1, payload=experts,
                              ptype=PAYLOAD_NONE if edit == "no E" and here else PAYLOAD_I64)
            if edit == "lose layer" and here:
                lost.add(layer["uid"])
            if edit == "foreign parent" and here:
                tape.push("attention", category=index + 1)
            for _ in range(2 if edit == "second router" and here else 1):
                router = tape.push("moe.router", category=index + 1, payload=_double(1.5 + index),
                                   ptype=PAYLOAD_DOUBLE)
                if edit == "router payload int" and here:
                    router["payload"], router["payload_type"] = 2, PAYLOAD_I64
                if edit == "lose router" and here:
                    lost.add(router["uid"])
                for name, marks in (("moe.expert.tokens", shape["tokens"]), ("moe.expert.dropped", shape["dropped"])):
                    for expert, value in marks:
                        tape.mark(name, category=expert + 1, payload=_u64(value),
                                  ptype=signed if value < 0 or expert % 2 else PAYLOAD_U64)
                if here and edit == "mark payload double":
                    tape.mark("moe.expert.tokens", category=1, payload=_double(2.0), ptype=PAYLOAD_DOUBLE)
                if here and edit == "mark category 0":
                    tape.mark("moe.expert.dropped", category=0, payload=1)
                if here and edit == "mark huge":  # an int64 sum would wrap; Python's does not
                    tape.mark("moe.expert.tokens", category=4, payload=_u64(-(1 << 40)), ptype=PAYLOAD_I64)
                    for _ in range(2):
                        tape.mark("moe.expert.tokens", category=2, payload=1 << 62, ptype=PAYLOAD_I64)
                if here and edit == "mark huge unsigned":
                    tape.mark("moe.expert.tokens", category=2, payload=(1 << 63) + 5, ptype=PAYLOAD_U64)
                if here and edit == "mark past E":
                    tape.mark("moe.expert.tokens", category=E + 3, payload=4)
                tape.pop(recorded=not (edit == "router never popped" and here))
            if edit == "foreign parent" and here:
                tape.pop()
            if edit == "mark under layer" and here:
                tape.mark("moe.expert.tokens", category=1, payload=7)
            if edit == "load" and here:
                tape.push("moe.expert.load", category=2, payload=1 << 20)
                tape.pop()
            for expert in shape["ffns"]:
                ffn = tape.push("moe.expert.ffn", category=expert + 1, payload=5 + expert)
                if here and edit == "ffn payload double":
                    ffn["payload"], ffn["payload_type"] = _double(5.0), PAYLOAD_DOUBLE
                if here and edit == "ffn huge unsigned":
                    ffn["payload"], ffn["payload_type"] = (1 << 63) + 1, PAYLOAD_U64
                tape.pop()
            tape.pop(recorded=not (edit == "layer never popped" and here))
        assert tape.stack == [step["uid"]]
        tape.pop(recorded=edit != "step never popped")
    return tape, lost


def _batches(tape: Tape, lost: set[int], cuts: list[int]) -> list[NvtxBatch]:
    return tape_batches(tape, lost, cuts, _strings(), domain=DOMAIN)


def _parse(batches: list[NvtxBatch], *, fast: bool) -> tuple[list[StepEvent], dict[str, int]]:
    steps: list[StepEvent] = []
    parser = MoeConventionParser(sink=steps.extend, fast=fast)
    for batch in batches:
        parser(batch)
    stats = parser.stats()
    stats.pop("steps_columnar")
    stats.pop("steps_layer_columns")
    return steps, stats


def _joined(steps: list[StepEvent]) -> tuple[list[object], dict[str, int]]:
    """What the agent's join makes of the steps: per step E, the routed layers' count matrices and
    entropies, the router time; and its counters (layers left out for bad routing among them)."""
    join = RequestJoin(clock=lambda: 0)
    try:
        join.on_steps(steps)
    except OverflowError as exc:  # a count past int64 (agent/routing_health.counts_from_marks): the same for both
        return [type(exc).__name__], {}
    tables: list[object] = []
    for b in join._buffer:  # (the buffered steps: what every output reads)
        t = b.table
        tables.append((b.num_experts, b.routing_ns, b.layer_count, t.layers.tolist(), t.tokens.tolist(),
                       t.dropped.tolist(), t.router_entropy_bits.tolist(), t.gini.tolist()))
    return tables, join.stats()


@settings(max_examples=250, deadline=None)
@given(st.lists(step_shape, min_size=1, max_size=4), st.lists(st.integers(0, 150), max_size=4),
       st.sampled_from([1, moe_convention.COLUMN_MIN_LAYERS]))
def test_v1_whole_batch_path_equals_the_per_event_path(steps: list[dict[str, Any]], cuts: list[int],
                                                      column_min_layers: int) -> None:
    """(column_min_layers 1: every clean step of this test's 0-5 layers takes LayerColumns too)"""
    tape, lost = _tape(steps)
    fast_steps, slow_steps = assert_paths_agree(_batches(tape, lost, cuts), _parse, column_min_layers)
    assert _joined(fast_steps) == _joined(slow_steps)


def _clean_steps(count: int, layers: int) -> list[dict[str, Any]]:
    shape = {"tokens": [(0, 3), (2, 5), (2, 1), (5, 0)], "dropped": [(2, 1)], "ffns": [0, 2, 5]}
    return [{"layers": [shape] * layers, "requests": [7], "edit": "none", "edit_at": 0,
             "signed_type": PAYLOAD_I64}] * count


def test_clean_v1_steps_leave_the_parser_as_layer_columns() -> None:
    """Whole v1 steps in one batch: columns (per-expert marks summed, FFNs as arrays), and the
    numbers the marks carried: duplicates summed, a zero mark kept, E from the layer."""
    layers = moe_convention.COLUMN_MIN_LAYERS
    tape, lost = _tape(_clean_steps(3, layers))
    steps: list[StepEvent] = []
    parser = MoeConventionParser(sink=steps.extend)
    for batch in _batches(tape, lost, []):
        parser(batch)
    stats = parser.stats()
    assert stats["steps"] == stats["steps_layer_columns"] == 3
    assert stats["expert_marks"] == 3 * layers * 5 and stats["expert_ffns"] == 3 * layers * 3
    columns = steps[0].columns
    assert columns is not None and columns.num_experts == E and columns.counts is not None
    assert columns.counts[0].tolist() == [3, 0, 6, 0, 0, 0] + [0, 0, 1, 0, 0, 0]
    assert columns.ffns is not None and columns.ffns.expert.tolist()[:3] == [0, 2, 5]
    router = steps[0].layers[0].router
    assert router is not None and router.tokens == {0: 3, 2: 6, 5: 0} and router.dropped == {2: 1}
    assert [(f.expert, f.tokens) for f in steps[0].layers[0].ffns] == [(0, 5), (2, 7), (5, 10)]


@pytest.mark.parametrize("cut", ["after a layer", "inside a router"])
def test_a_v1_step_split_over_two_batches_still_leaves_as_columns(cut: str) -> None:
    """The first layers of a step in one batch, the rest and the step in the next: the whole layers
    are built column-wise and filed under the step, as the per-event path files their objects; a
    layer cut in two (its router's marks in both batches) is built by that path and joins them."""
    tape, lost = _tape(_clean_steps(1, 8))
    layer_four = next(i for i, (kind, row) in enumerate(tape.events)
                      if kind == "range" and tape.ranges[row]["string_id"] == SID["moe.layer"]
                      and tape.ranges[row]["category"] == 4)
    at = layer_four + 1
    if cut == "inside a router":  # two marks into the 5th layer's router
        at = next(i for i, (kind, row) in enumerate(tape.events) if i > layer_four and kind == "mark") + 2
    batches = _batches(tape, lost, [at])
    fast_steps: list[StepEvent] = []
    parser = MoeConventionParser(sink=fast_steps.extend)
    for batch in batches:
        parser(batch)
    fast_stats = parser.stats()
    slow_steps, slow_stats = _parse(batches, fast=False)
    assert fast_stats["steps_layer_columns"] == 1 and fast_stats["pending_children"] == 0
    assert {k: v for k, v in fast_stats.items() if not k.startswith("steps_")} == {
        k: v for k, v in slow_stats.items() if not k.startswith("steps_")}
    assert plain(fast_steps) == plain(slow_steps)
    assert [layer.layer for layer in fast_steps[0].layers] == list(range(8))
    assert _joined(fast_steps) == _joined(slow_steps)
