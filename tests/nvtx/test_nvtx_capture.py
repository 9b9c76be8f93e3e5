"""Every NVTX event of a real multi-threaded producer (the `nvtx` package, 8 threads, 3 domains,
nested ranges, marks, int/float payloads, int and named categories, start/end ranges) is captured
exactly: names, payloads, categories, nesting, thread ids and timestamps."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from nvtx_helpers import Capture, Producer, drain_until_finished

from moescope.collectors.nvtx import (
    KIND_PUSH,
    KIND_START,
    PAYLOAD_DOUBLE,
    PAYLOAD_I64,
    PAYLOAD_NONE,
    NvtxCollector,
    StringTable,
)


def _payload(value: int, ptype: int) -> int | float | None:
    if ptype == PAYLOAD_NONE:
        return None
    if ptype == PAYLOAD_I64:
        return int(np.uint64(value).view(np.int64))
    if ptype == PAYLOAD_DOUBLE:
        return float(np.uint64(value).view(np.float64))
    raise AssertionError(f"unexpected payload type {ptype}")


def _category(strings: StringTable, domain_id: int, category: int) -> int | str:
    return strings.categories.get((domain_id, category), category)


def _domain(strings: StringTable, domain_id: int) -> str | None:
    name = strings.domains[domain_id]
    return name or None


def expected_from_log(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The producer's own record -> the ranges and marks a perfect capture contains."""
    ranges: list[dict[str, Any]] = []
    marks: list[dict[str, Any]] = []
    stacks: dict[tuple[int, Any], list[dict[str, Any]]] = defaultdict(list)
    starts: dict[int, dict[str, Any]] = {}
    for ev in sorted(events, key=lambda e: e["t0"]):
        key = (ev["tid"], ev["domain"])
        stack = stacks[key]
        parent = (stack[-1]["message"], stack[-1]["payload"]) if stack else None
        if ev["kind"] == "push":
            stack.append(dict(ev, depth=len(stack), parent=parent))
        elif ev["kind"] == "pop":
            push = stack.pop()
            ranges.append(dict(push, kind=KIND_PUSH, end_t0=ev["t0"], end_t1=ev["t1"]))
        elif ev["kind"] == "mark":
            marks.append(dict(ev, parent=parent))
        elif ev["kind"] == "start":
            starts[ev["range_id"]] = ev
        elif ev["kind"] == "end":
            start = starts.pop(ev["range_id"])
            ranges.append(dict(start, kind=KIND_START, depth=-1, parent=None, end_t0=ev["t0"],
                               end_t1=ev["t1"], end_tid=ev["tid"]))
    assert not starts and not any(stacks.values()), "producer log is unbalanced"
    return ranges, marks


def captured(capture: Capture, strings: StringTable) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    all_ranges = capture.ranges()
    by_uid = {int(r["uid"]): r for r in all_ranges}
    ranges = []
    for r in all_ranges:
        parent = by_uid.get(int(r["parent_uid"]))
        ranges.append(
            {
                "kind": int(r["kind"]),
                "tid": int(r["tid"]),
                "domain": _domain(strings, int(r["domain_id"])),
                "message": strings.name(int(r["string_id"])),
                "payload": _payload(int(r["payload"]), int(r["payload_type"])),
                "category": _category(strings, int(r["domain_id"]), int(r["category"])),
                "depth": int(r["depth"]),
                "parent": None
                if parent is None
                else (
                    strings.name(int(parent["string_id"])),
                    _payload(int(parent["payload"]), int(parent["payload_type"])),
                ),
                "start_ns": int(r["start_ns"]),
                "end_ns": int(r["end_ns"]),
                "range_id": int(r["range_id"]),
                "parent_uid": int(r["parent_uid"]),
            }
        )
    marks = []
    for m in capture.marks():
        parent = by_uid.get(int(m["parent_uid"]))
        marks.append(
            {
                "tid": int(m["tid"]),
                "domain": _domain(strings, int(m["domain_id"])),
                "message": strings.name(int(m["string_id"])),
                "payload": _payload(int(m["payload"]), int(m["payload_type"])),
                "category": _category(strings, int(m["domain_id"]), int(m["category"])),
                "parent": None
                if parent is None
                else (
                    strings.name(int(parent["string_id"])),
                    _payload(int(parent["payload"]), int(parent["payload_type"])),
                ),
                "ts_ns": int(m["ts_ns"]),
            }
        )
    return ranges, marks


def test_every_event_captured_exactly(start_producer: Callable[..., Producer]) -> None:
    producer = start_producer("--mode", "exact", "--threads", "8", "--rounds", "40")
    producer.expect_line("ready")
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        drain_until_finished(collector)
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    log = producer.log()
    events = log["events"]
    exp_ranges, exp_marks = expected_from_log(events)
    got_ranges, got_marks = captured(capture, collector.strings)

    # nothing lost, nothing invented, no anomaly
    assert stats["records_received"] == len(events)
    assert stats["ranges_completed"] == len(exp_ranges) == len(got_ranges)
    assert stats["marks"] == len(exp_marks) == len(got_marks)
    for name in ("dropped_ring_full", "pop_without_push", "end_without_start", "unknown_string_id",
                 "unknown_domain_id", "messages_lost", "lost_uncommitted", "ranges_open_at_exit",
                 "sink_errors", "unknown_kind", "dropped_string_full"):
        assert stats[name] == 0, (name, stats)
    assert len({e["tid"] for e in events if e["kind"] == "push"}) == 8

    def key(item: dict[str, Any]) -> tuple[Any, ...]:
        return (item["kind"], item["tid"], str(item["domain"]), item["message"])

    def mark_key(item: dict[str, Any]) -> tuple[Any, ...]:
        return (item["tid"], str(item["domain"]), item["message"])

    # ranges: group by (kind, tid, domain, message), compare in time order
    exp_groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    got_groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in exp_ranges:
        exp_groups[key(r)].append(r)
    for r in got_ranges:
        got_groups[key(r)].append(r)
    assert exp_groups.keys() == got_groups.keys()
    worst_ns = 0
    for k, exp_list in exp_groups.items():
        exp_list.sort(key=lambda r: r["t0"])
        got_list = sorted(got_groups[k], key=lambda r: r["start_ns"])
        assert len(exp_list) == len(got_list), k
        for e, g in zip(exp_list, got_list, strict=True):
            assert g["payload"] == e["payload"], (k, e, g)
            assert g["category"] == e["category"], (k, e, g)
            assert g["depth"] == e["depth"], (k, e, g)
            assert g["parent"] == e["parent"], (k, e, g)
            # the library's CLOCK_MONOTONIC stamp lies between the producer's reads around the call
            assert e["t0"] <= g["start_ns"] <= e["t1"], (k, e, g)
            assert e["end_t0"] <= g["end_ns"] <= e["end_t1"], (k, e, g)
            worst_ns = max(worst_ns, e["t1"] - e["t0"], e["end_t1"] - e["end_t0"])
            if g["kind"] == KIND_START:
                assert g["range_id"] == e["range_id"]

    exp_m: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    got_m: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for m in exp_marks:
        exp_m[mark_key(m)].append(m)
    for m in got_marks:
        got_m[mark_key(m)].append(m)
    assert exp_m.keys() == got_m.keys()
    for k, exp_list in exp_m.items():
        exp_list.sort(key=lambda m: m["t0"])
        got_list = sorted(got_m[k], key=lambda m: m["ts_ns"])
        assert len(exp_list) == len(got_list), k
        for e, g in zip(exp_list, got_list, strict=True):
            assert (g["payload"], g["category"], g["parent"]) == (e["payload"], e["category"], e["parent"]), (e, g)
            assert e["t0"] <= g["ts_ns"] <= e["t1"], (k, e, g)
    # the cross-thread start/end ranges were captured with their starting thread
    cross = [r for r in got_ranges if r["message"] == "cross"]
    assert len(cross) == 8
    print(f"widest producer-side bracket around one NVTX call: {worst_ns} ns")


def test_late_attach_to_running_producer(start_producer: Callable[..., Producer]) -> None:
    """A process started earlier with the variable: attaching mid-run captures from then on;
    pops of ranges opened before the attach are counted, not paired with anything."""
    producer = start_producer("--mode", "steady")
    producer.expect_line("ready")
    producer.expect_line("steady")
    time.sleep(0.3)  # let it run unobserved: nothing is recorded while no agent is attached
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        deadline = time.monotonic() + 60
        while collector.stats()["ranges_completed"] < 2000:
            assert time.monotonic() < deadline
            collector.poll(time.monotonic_ns())
            time.sleep(0.005)
        producer.go()  # stop
        drain_until_finished(collector)
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    ranges = capture.ranges()
    names = collector.strings.names(ranges["string_id"])
    uids = {int(u): str(n) for u, n in zip(ranges["uid"], names, strict=True)}
    inner = ranges[names == "steady.inner"]
    outer = ranges[names == "steady.outer"]
    assert len(inner) >= 1000 and len(outer) >= 1000
    # every inner range hangs under an outer one, except one whose outer began before the attach
    orphans = inner[inner["parent_uid"] == 0]
    assert len(orphans) <= 1
    assert all(uids[int(p)] == "steady.outer" for p in inner["parent_uid"] if p != 0)
    assert (outer["depth"] == 0).all() and (inner["depth"][inner["parent_uid"] != 0] == 1).all()
    assert stats["pop_without_push"] <= 2
    assert stats["dropped_ring_full"] == 0 and stats["lost_uncommitted"] == 0
    log = producer.log()
    assert stats["ranges_completed"] < 2 * log["loops"]  # it ran before we attached
