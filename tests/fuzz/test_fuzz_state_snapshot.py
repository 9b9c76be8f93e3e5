"""The live-state snapshot reader (`agent top`'s input) under hostile files: random JSON, recorded
snapshots with fields replaced by random JSON, random bytes, deep nesting and huge numbers. The
reader returns a Snapshot or raises SourceUnavailable with one printable line; nothing else."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

from fuzzing import fuzz
from hypothesis import event, given
from hypothesis import strategies as st

from moescope import errors
from moescope.agent.state import Snapshot, read_snapshot, to_json

FIXTURES = Path(__file__).resolve().parent.parent / "tui" / "fixtures"
RECORDED = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))]

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.sampled_from([10**400, -(10**400), 1 << 64, -1, 0]), st.text(max_size=10),
              st.sampled_from(["armed", "firing", ">", "<", "\n", "\x1b[31m"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.extend(paths(v, (*prefix, k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.extend(paths(v, (*prefix, i)))
    return out


@st.composite
def mutated_snapshots(draw: st.DrawFn) -> Any:
    tree = copy.deepcopy(draw(st.sampled_from(RECORDED)))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(tree)))
        if not where:
            continue
        parent = tree
        for step in where[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.booleans()):
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = draw(json_values)
    return tree


def check(data: bytes) -> str:
    """Reads `data` as a state file; returns which documented outcome it had."""
    with tempfile.NamedTemporaryFile(suffix=".state.json") as f:
        f.write(data)
        f.flush()
        try:
            snapshot = read_snapshot(Path(f.name))
        except errors.SourceUnavailable as exc:
            message = str(exc)
            assert message.isprintable() and message.startswith(f.name), message
            return "SourceUnavailable"
    assert isinstance(snapshot, Snapshot)
    to_json(snapshot)  # what was accepted can be written back (the publisher's own format)
    return "Snapshot"


def dump(tree: Any) -> bytes:
    try:
        return json.dumps(tree).encode("utf-8", "surrogatepass")
    except ValueError:  # an integer over Python's digit limit: write its digits by hand
        return b"1" + b"0" * 5000


@fuzz(250)
@given(mutated_snapshots())
def test_recorded_snapshots_with_hostile_fields(tree: Any) -> None:
    event(check(dump(tree)))


@fuzz(150)
@given(st.one_of(json_values.map(dump), st.binary(max_size=200),
                 st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n),
                 st.integers(1, 100_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
                 st.integers(4000, 6000).map(lambda n: b'{"version": 1, "taken_unix_s": 1' + b"0" * n + b"}")))
def test_random_json_and_bytes(data: bytes) -> None:
    event(check(data))


def test_recorded_snapshots_still_read() -> None:
    assert len(RECORDED) >= 3
    for tree in RECORDED:
        assert check(json.dumps(tree).encode()) == "Snapshot"
