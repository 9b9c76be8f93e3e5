"""The parser's whole-batch (column-wise) path against its per-event path on generated step trees:
mostly well formed, with hostile edits (unknown and foreign names, wrong payload types, category 0,
a second router, marks in the wrong place, v1 marks, lost parents) and batch boundaries anywhere.
Both must give the same steps and the same counters, whatever the input."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from nvtx_helpers import Tape, assert_paths_agree, double_bits, parse_steps, string_table, tape_batches

from moescope.collectors import moe_convention
from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import (
    PAYLOAD_DOUBLE,
    PAYLOAD_I64,
    PAYLOAD_NONE,
    PAYLOAD_U64,
    NvtxBatch,
    StringTable,
)

DOMAIN = 1
NAMES = ["moe.step", "moe.layer", "moe.router", "moe.experts", "moe.expert.load", "moe.expert.ffn", "moe.request",
         "moe.expert.tokens", "moe.bogus", "attention"]
SID = {name: i + 1 for i, name in enumerate(NAMES)}
EDITS = ("none", "unknown name", "foreign name", "payload type", "category 0", "second router", "request on layer",
         "v1 mark", "lose parent", "no router", "no experts", "experts payload negative", "router payload int",
         "other E")


def _strings() -> StringTable:
    return string_table(SID, domain=DOMAIN)


_double = double_bits


step_shape = st.fixed_dictionaries({
    "layers": st.integers(0, 4),
    "loads": st.integers(0, 2),
    "ffns": st.integers(0, 1),
    "requests": st.lists(st.integers(0, 50), max_size=3),
    "edit": st.sampled_from(EDITS),
    "edit_at": st.integers(0, 30),
    "layer_payload_none": st.booleans(),
})


def _tape(steps: list[dict[str, Any]]) -> tuple[Tape, set[int]]:
    tape = Tape(SID)
    lost: set[int] = set()
    for s in steps:
        edit, at = s["edit"], s["edit_at"]
        count = [0]

        def here(count: list[int] = count, at: int = at) -> bool:
            count[0] += 1
            return count[0] - 1 == at

        step = tape.push("moe.step", payload=16)
        if edit == "payload type" and here():
            step["payload_type"] = PAYLOAD_DOUBLE
        for key in s["requests"]:
            tape.mark("moe.request", payload=key, ptype=PAYLOAD_U64 if key % 2 else PAYLOAD_I64)
        for layer in range(s["layers"]):
            row = tape.push("moe.layer", category=layer + 1, payload=8,
                            ptype=PAYLOAD_NONE if s["layer_payload_none"] else PAYLOAD_I64)
            if edit == "other E" and here():
                row["payload"] = 6
            if edit == "category 0" and here():
                row["category"] = 0
            if edit == "unknown name" and here():
                row["string_id"] = SID["moe.bogus"]
            if edit == "lose parent" and here():
                lost.add(row["uid"])
            routers = 2 if edit == "second router" and here() else 1
            if edit == "no router" and here():
                routers = 0
            for _ in range(routers):
                router = tape.push("moe.router", category=layer + 1, payload=_double(1.25 + layer),
                                   ptype=PAYLOAD_DOUBLE)
                if edit == "router payload int" and here():
                    router["payload"], router["payload_type"] = 3, PAYLOAD_I64
                if edit == "v1 mark" and here():
                    tape.mark("moe.expert.tokens", category=2, payload=5)
                tape.pop()
            if edit == "request on layer" and here():
                tape.mark("moe.request", payload=99)
            if edit == "foreign name" and here():
                tape.push("attention", category=layer + 1)
                tape.push("moe.expert.ffn", category=1, payload=3)  # a moe range inside a foreign one
                tape.pop()
                tape.pop()
            if not (edit == "no experts" and here()):
                experts = tape.push("moe.experts", category=layer + 1, payload=12)
                if edit == "experts payload negative" and here():
                    experts["payload"] = (1 << 64) - 5  # int64 -5
                for e in range(s["loads"]):
                    tape.push("moe.expert.load", category=e + 2, payload=4096 * (e + 1))
                    tape.pop()
                tape.pop()
            for e in range(s["ffns"]):
                tape.push("moe.expert.ffn", category=e + 1, payload=6)
                tape.pop()
            tape.pop()
        tape.pop()
    return tape, lost


def _batches(tape: Tape, lost: set[int], cuts: list[int]) -> list[NvtxBatch]:
    return tape_batches(tape, lost, cuts, _strings(), domain=DOMAIN)


def _run(batches: list[NvtxBatch], *, fast: bool) -> tuple[list[StepEvent], dict[str, int]]:
    steps, stats = parse_steps(batches, fast=fast)
    stats.pop("steps_columnar")
    stats.pop("steps_layer_columns")
    return steps, stats


@settings(max_examples=300, deadline=None)
@given(st.lists(step_shape, min_size=1, max_size=6), st.lists(st.integers(0, 200), max_size=4),
       st.sampled_from([1, moe_convention.COLUMN_MIN_LAYERS]))
def test_both_paths_give_the_same_steps_and_counts(steps: list[dict[str, Any]], cuts: list[int],
                                                   column_min_layers: int) -> None:
    """(column_min_layers 1: every clean step of this test's 0-4 layers takes LayerColumns too)"""
    tape, lost = _tape(steps)
    assert_paths_agree(_batches(tape, lost, cuts), _run, column_min_layers)


def test_well_formed_steps_in_one_batch_all_take_the_column_wise_path() -> None:
    shapes = [{"layers": 3, "loads": 1, "ffns": 1, "requests": [4, 5], "edit": "none", "edit_at": 0,
               "layer_payload_none": False}] * 4
    tape, lost = _tape(shapes)
    parser = MoeConventionParser(sink=lambda steps: None)
    for batch in _batches(tape, lost, []):
        parser(batch)
    stats = parser.stats()
    assert stats["steps"] == stats["steps_columnar"] == 4 and stats["layers"] == 12
    # and an edited one (a second router) falls back, counted the per-event way
    edited = [*shapes[:1], {**shapes[0], "edit": "second router", "edit_at": 1}]
    tape, lost = _tape(edited)
    parser = MoeConventionParser(sink=lambda steps: None)
    for batch in _batches(tape, lost, []):
        parser(batch)
    stats = parser.stats()
    assert stats["steps"] == 2 and stats["steps_columnar"] == 1 and stats["misplaced"] == 1
