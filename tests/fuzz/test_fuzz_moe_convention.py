"""The moe/v1 convention parser under hostile event streams: random moe.* and other ranges and
marks, wrong nesting, wrong payload types, absurd categories, negative and huge values, parents
that never complete. Nothing escapes; every moe.* event is counted exactly once; what waits for a
parent stays under the caps (docs/hardening.md)."""

from __future__ import annotations

import numpy as np
from fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st

from moescope.collectors import moe_convention as conv
from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import MARK_DTYPE, RANGE_DTYPE, NvtxBatch, StringTable

MOE_DOMAIN, OTHER_DOMAIN = 1, 2
NAMES = ["moe.step", "moe.layer", "moe.router", "moe.expert.load", "moe.expert.ffn", "moe.request",
         "moe.expert.tokens", "moe.expert.dropped", "moe.bogus", "moe.", "other", "\udcff", ""]
NAME_IDS = {name: i + 1 for i, name in enumerate(NAMES)}  # string id 0: no message; len+1: unknown id
UNKNOWN_SID = len(NAMES) + 1


def table() -> StringTable:
    strings = StringTable()
    strings.domains[MOE_DOMAIN] = "moe"
    strings.domains[OTHER_DOMAIN] = "aux"
    for name, sid in NAME_IDS.items():
        strings.add_string(sid, name)
    return strings


U64 = st.integers(0, (1 << 64) - 1)
U32 = st.integers(0, (1 << 32) - 1)
event_fields = st.fixed_dictionaries({
    "string_id": st.sampled_from([*NAME_IDS.values(), 0, UNKNOWN_SID]),
    "domain_id": st.sampled_from([MOE_DOMAIN, MOE_DOMAIN, MOE_DOMAIN, OTHER_DOMAIN, 0, 99]),
    "payload_type": st.integers(0, 10),
    "payload": st.one_of(U64, st.integers(0, 64)),
    "category": st.one_of(st.integers(0, 9), U32),
    "tid": st.integers(1, 3),
    "ts": st.one_of(U64, st.integers(0, 10**6)),
    "dur": st.one_of(U64, st.integers(0, 10**4)),
    "parent": st.integers(0, 40),  # an index into the uids (or 0, or a uid never seen)
    "depth": st.integers(-1, 6),
    "is_mark": st.booleans(),
})


def build_batch(events: list[dict[str, int]], lost: list[int], *, uid_base: int) -> tuple[NvtxBatch, int, int]:
    """(batch, moe.* events in it, moe.expert.load/ffn ranges with category 0)."""
    ranges = [e for e in events if not e["is_mark"]]
    marks = [e for e in events if e["is_mark"]]
    r = np.zeros(len(ranges), dtype=RANGE_DTYPE)
    for i, e in enumerate(ranges):
        r[i]["uid"] = uid_base + i + 1
        r[i]["parent_uid"] = uid_base + e["parent"] if e["parent"] else 0
        r[i]["start_ns"] = e["ts"]
        r[i]["end_ns"] = (e["ts"] + e["dur"]) % (1 << 64)
        for name in ("payload", "tid", "domain_id", "string_id", "category", "payload_type"):
            r[i][name] = e[name]
        r[i]["depth"] = e["depth"]
    m = np.zeros(len(marks), dtype=MARK_DTYPE)
    for i, e in enumerate(marks):
        m[i]["parent_uid"] = uid_base + e["parent"] if e["parent"] else 0
        m[i]["ts_ns"] = e["ts"]
        for name in ("payload", "tid", "domain_id", "string_id", "category", "payload_type"):
            m[i][name] = e[name]
    by_id = {sid: name for name, sid in NAME_IDS.items()}
    moe = [e for e in events if e["domain_id"] == MOE_DOMAIN and by_id.get(e["string_id"], "").startswith("moe.")]
    uncategorised_experts = sum(
        1 for e in moe if not e["is_mark"] and by_id[e["string_id"]] in (conv.EXPERT_LOAD, conv.EXPERT_FFN)
        and e["category"] == 0
    )
    lost_uids = np.array([uid_base + x for x in lost], dtype=np.uint64)
    return NvtxBatch(pid=4242, ranges=r, marks=m, strings=table(), lost_uids=lost_uids), len(moe), uncategorised_experts


@fuzz(200)
@given(st.lists(st.tuples(st.lists(event_fields, max_size=40), st.lists(st.integers(1, 40), max_size=3)),
                min_size=1, max_size=4),
       st.booleans())
def test_any_event_stream_is_parsed_or_counted(batches: list[tuple[list[dict[str, int]], list[int]]],
                                               sink_fails: bool) -> None:
    delivered: list[StepEvent] = []
    calls: list[int] = []

    def sink(steps: list[StepEvent]) -> None:
        delivered.extend(steps)
        calls.append(len(steps))
        if sink_fails:
            raise RuntimeError("the pipeline's bug")

    parser = MoeConventionParser(sink=sink)
    moe_events = 0
    uncategorised = 0
    for n, (events, lost) in enumerate(batches):
        # uids overlap across batches on purpose (parents from earlier batches, or never seen)
        batch, moe, unc = build_batch(events, lost, uid_base=n * 20)
        parser(batch)
        moe_events += moe
        uncategorised += unc
    stats = parser.stats()
    counted = (stats["steps"] + stats["layers"] + stats["routers"] + stats["expert_loads"] + stats["expert_ffns"]
               + stats["request_marks"] + stats["expert_marks"] + stats["unknown_names"])
    assert counted + uncategorised == moe_events  # every moe.* event in exactly one count
    assert len(delivered) == stats["steps"]
    assert stats["sink_errors"] == (len(calls) if sink_fails else 0)  # a failing sink is counted, parsing goes on
    assert all(n > 0 for n in calls)
    assert stats["pending_parents"] <= conv.MAX_PENDING_PARENTS
    assert stats["pending_children"] == sum(conv._events(v) for v in parser._pending.values())
    for step in delivered:
        assert isinstance(step.tokens, int | None)
        for layer in step.layers:
            assert layer.layer >= 0 and (layer.num_experts is None or layer.num_experts > 0)


def test_children_of_a_parent_that_never_ends_are_bounded() -> None:
    """A moe.step that never ends, collecting request marks forever: past MAX_PENDING_CHILDREN they
    are given up and counted, so the parser's memory stays bounded."""
    parser = MoeConventionParser(sink=lambda steps: None)
    per_batch = 250_000
    marks = np.zeros(per_batch, dtype=MARK_DTYPE)
    marks["parent_uid"] = 7  # never completes
    marks["domain_id"] = MOE_DOMAIN
    marks["string_id"] = NAME_IDS["moe.request"]
    marks["payload_type"] = 1
    batches = conv.MAX_PENDING_CHILDREN // per_batch + 2
    for _ in range(batches):
        parser(NvtxBatch(pid=1, ranges=np.zeros(0, dtype=RANGE_DTYPE), marks=marks, strings=table()))
        assert parser.stats()["pending_children"] <= conv.MAX_PENDING_CHILDREN
    stats = parser.stats()
    assert stats["request_marks"] == batches * per_batch
    assert stats["pending_overflow"] + stats["pending_children"] == batches * per_batch
    assert stats["pending_overflow"] > 0


def reference_marks(
    events: list[dict[str, int]],
) -> tuple[dict[tuple[int, str, int], int], list[tuple[int, int]], dict[str, int]]:
    """The convention's mark rules, one mark at a time (docs/nvtx-convention.md): what the parser
    files per (parent, kind, expert), the request keys per parent, and the counters."""
    by_id = {sid: name for name, sid in NAME_IDS.items()}
    counts: dict[tuple[int, str, int], int] = {}
    requests: list[tuple[int, int]] = []
    stats = dict.fromkeys(("unknown_names", "malformed_payloads", "malformed_categories", "request_marks",
                           "expert_marks", "orphans"), 0)
    for e in events:
        name = by_id.get(e["string_id"], "")
        if e["domain_id"] != MOE_DOMAIN or not name.startswith("moe."):
            continue
        if name not in conv.MARK_NAMES:
            stats["unknown_names"] += 1
            continue
        value: int | None = e["payload"]
        if e["payload_type"] not in conv._INT_TYPES:
            stats["malformed_payloads"] += 1
            value = None
        elif e["payload_type"] in conv._SIGNED_TYPES and e["payload"] >= 1 << 63:
            value = e["payload"] - (1 << 64)
        parent = e["parent"]
        if name == conv.REQUEST:
            stats["request_marks"] += 1
            if value is not None:
                if parent:
                    requests.append((parent, value))
                else:
                    stats["orphans"] += 1
            continue
        stats["expert_marks"] += 1
        if e["category"] == 0:
            stats["malformed_categories"] += 1
            continue
        if value is None:
            continue
        if not parent:
            stats["orphans"] += 1
            continue
        kind = "tokens" if name == conv.EXPERT_TOKENS else "dropped"
        key = (parent, kind, e["category"] - 1)
        counts[key] = counts.get(key, 0) + value
    return counts, requests, stats


mark_fields = st.fixed_dictionaries({
    "string_id": st.sampled_from([NAME_IDS[n] for n in ("moe.expert.tokens", "moe.expert.dropped", "moe.request",
                                                        "moe.bogus", "other")] + [0, UNKNOWN_SID]),
    "domain_id": st.sampled_from([MOE_DOMAIN, MOE_DOMAIN, MOE_DOMAIN, OTHER_DOMAIN]),
    "payload_type": st.sampled_from([*sorted(conv._INT_TYPES), 0, 5, 6, 9]),
    "payload": st.one_of(st.integers(0, 64), st.integers((1 << 64) - 8, (1 << 64) - 1), U64),
    "category": st.integers(0, 5),
    "tid": st.just(1),
    "ts": st.integers(0, 10**6),
    "dur": st.just(0),
    "parent": st.integers(0, 4),
    "depth": st.just(0),
    "is_mark": st.just(True),
})


@fuzz(200)
@given(st.lists(mark_fields, max_size=60))
def test_marks_column_wise_equal_the_one_at_a_time_rules(events: list[dict[str, int]]) -> None:
    # the parser sums expert marks per (parent, kind, expert) with array operations; the reference
    # applies the rules mark by mark: what is filed, and every counter, must be the same
    marks_only = [dict(e, is_mark=True) for e in events]
    batch, _, _ = build_batch(marks_only, [], uid_base=0)
    parser = MoeConventionParser(sink=lambda steps: None)
    parser(batch)
    want_counts, want_requests, want_stats = reference_marks(marks_only)
    got_counts: dict[tuple[int, str, int], int] = {}
    got_requests: list[tuple[int, int]] = []
    for parent, children in parser._pending.items():
        for child in children:
            if child[0] == "request":
                got_requests.append((parent, child[1]))
            else:
                _, kind, per_expert, _events = child
                for expert, n in per_expert.items():
                    got_counts[(parent, kind, expert)] = got_counts.get((parent, kind, expert), 0) + n
    assert got_counts == want_counts
    assert sorted(got_requests) == sorted(want_requests)
    stats = parser.stats()
    assert {k: stats[k] for k in want_stats} == want_stats
    assert stats["pending_children"] == sum(conv._events(v) for v in parser._pending.values())
