"""Helpers shared by the NVTX tests: the producer handle, a capturing sink, the drain loop."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import (
    INJECTION_ENV,
    MARK_DTYPE,
    PAYLOAD_I64,
    RANGE_DTYPE,
    RING_DIR_ENV,
    NvtxBatch,
    NvtxCollector,
    StringTable,
    injection_env,
)

HERE = Path(__file__).resolve().parent
PRODUCER = HERE / "producer.py"
REPO = HERE.parent.parent
WAIT_S = 90.0  # generous: only bounds waiting on a shared, noisy 2-core machine


@dataclass
class Producer:
    proc: subprocess.Popen[str]
    log_path: Path
    ring_dir: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect_line(self, wanted: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == wanted, f"producer said {line!r}, expected {wanted!r}"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait(self) -> int:
        return self.proc.wait(timeout=WAIT_S)

    def log(self) -> dict[str, Any]:
        return json.loads(self.log_path.read_text())


@dataclass
class Capture:
    """Sink that keeps every batch the collector hands over."""

    batches: list[NvtxBatch] = field(default_factory=list)

    def __call__(self, batch: NvtxBatch) -> None:
        self.batches.append(batch)

    def ranges(self) -> np.ndarray:
        parts = [b.ranges for b in self.batches]
        return np.concatenate(parts) if parts else np.empty(0, dtype=RANGE_DTYPE)

    def lost_uids(self) -> set[int]:
        return {int(u) for b in self.batches for u in b.lost_uids}

    def marks(self) -> np.ndarray:
        parts = [b.marks for b in self.batches]
        return np.concatenate(parts) if parts else np.empty(0, dtype=MARK_DTYPE)


def drain_until_finished(collector: NvtxCollector, *, poll_sleep_s: float = 0.002) -> None:
    """Polls (as the daemon does) until the target exited and everything was drained."""
    deadline = time.monotonic() + WAIT_S
    while not collector.finished:
        assert time.monotonic() < deadline, f"collector never finished: {collector.stats()}"
        collector.poll(time.monotonic_ns())
        time.sleep(poll_sleep_s)


def parse_producer(producer: Producer, **collector_args: Any) -> tuple[list[StepEvent], dict[str, int], NvtxCollector]:
    """The moe.* steps of a producer that prints "ready" and then waits for "go": attach, let it run,
    drain until it has exited 0 and nothing is left. Returns the steps, the parser's counters and
    the collector, closed (its stats() and strings still read)."""
    producer.expect_line("ready")
    steps: list[StepEvent] = []
    parser = MoeConventionParser(sink=steps.extend)
    collector = NvtxCollector(producer.pid, sink=parser, directory=producer.ring_dir, **collector_args)
    try:
        producer.go()
        drain_until_finished(collector)
        assert producer.wait() == 0
    finally:
        collector.close()
    return steps, parser.stats(), collector


def producer_env(ring_dir: Path, *, inject: bool = True, pythonpath: bool = False) -> dict[str, str]:
    """The environment a test's producer runs in: its rings under ``ring_dir``; the injection library
    where ``inject`` (never one inherited from the test's own environment); the repository on
    PYTHONPATH where ``pythonpath`` (a script that imports moescope)."""
    env = dict(os.environ)
    env.pop(INJECTION_ENV, None)
    env[RING_DIR_ENV] = str(ring_dir)
    if inject:
        env.update(injection_env())
    if pythonpath:
        env["PYTHONPATH"] = str(REPO)
    return env


def nonzero(values: list[int]) -> dict[int, int]:
    """expert -> count for the experts with a non-zero count: how the parser's routing reads back."""
    return {e: n for e, n in enumerate(values) if n}


def close_harness(collector: NvtxCollector | None, proc: subprocess.Popen[str]) -> None:
    """A harness run's cleanup, whatever happened: the collector closed, the process group gone."""
    if collector is not None:
        collector.close()
    kill_group(proc)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill a started process's whole group (it runs in its own session) and close its pipes."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def parse_steps(batches: list[NvtxBatch], *, fast: bool) -> tuple[list[StepEvent], dict[str, int]]:
    """The steps and counters the convention parser gets from ``batches`` (``fast``: the column-wise
    path for well-formed steps; else every event one by one)."""
    steps: list[StepEvent] = []
    parser = MoeConventionParser(sink=steps.extend, fast=fast)
    for batch in batches:
        parser(batch)
    return steps, parser.stats()


def plain(value: object) -> object:
    """A parsed event tree as plain values (arrays as dtype kind + list), for exact comparison."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.tolist())
    # the public fields (a dataclass's, or StepEvent's: its layers whether held as objects or columns)
    slots = getattr(type(value), "__match_args__", None) or getattr(type(value), "__slots__", None)
    if slots and not isinstance(value, (int, float, str)):
        return (type(value).__name__, {name: plain(getattr(value, name)) for name in slots})
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def string_table(sids: dict[str, int], *, domain: int, domain_name: str = "moe") -> StringTable:
    """The agent's string table for a tape: ``domain`` named, every name under its id."""
    table = StringTable()
    table.domains[domain] = domain_name
    for name, sid in sids.items():
        table.add_string(sid, name)
    return table


def double_bits(x: float) -> int:
    """A double payload as the 64 bits the ring carries."""
    value: int = struct.unpack("<Q", struct.pack("<d", x))[0]
    return value


class Tape:
    """One thread's NVTX events in ring order, as the agent's nesting would hand them on: completed
    ranges and marks with their parents (names as string ids from ``sids``)."""

    def __init__(self, sids: dict[str, int]) -> None:
        self.sids = sids
        self.t = 1000
        self.uid = 0
        self.stack: list[int] = []
        self.open: dict[int, dict[str, Any]] = {}
        self.ranges: list[dict[str, Any]] = []
        self.marks: list[dict[str, Any]] = []
        self.events: list[tuple[str, int]] = []  # ("range" | "mark", index), in completion order

    def push(self, name: str, *, category: int = 0, payload: int = 0, ptype: int = PAYLOAD_I64) -> dict[str, Any]:
        self.t += 7
        self.uid += 1
        row = {"uid": self.uid, "parent_uid": self.stack[-1] if self.stack else 0, "start_ns": self.t,
               "string_id": self.sids[name], "category": category, "payload": payload, "payload_type": ptype,
               "depth": len(self.stack)}
        self.stack.append(self.uid)
        self.open[self.uid] = row
        return row

    def pop(self, *, recorded: bool = True) -> int:
        """Ends the innermost range; `recorded` False: its pop never reaches the ring."""
        self.t += 5
        uid = self.stack.pop()
        row = self.open.pop(uid)
        if recorded:
            row["end_ns"] = self.t
            self.ranges.append(row)
            self.events.append(("range", len(self.ranges) - 1))
        return uid

    def mark(self, name: str, *, category: int = 0, payload: int = 0, ptype: int = PAYLOAD_I64,
             parent: int | None = None) -> None:
        self.t += 3
        self.marks.append({"parent_uid": self.stack[-1] if parent is None else parent, "ts_ns": self.t,
                           "string_id": self.sids[name], "category": category, "payload": payload,
                           "payload_type": ptype})
        self.events.append(("mark", len(self.marks) - 1))


def tape_batches(tape: Tape, lost: set[int], cuts: list[int], strings: StringTable, *, domain: int,
                 tid: int = 77) -> list[NvtxBatch]:
    """The tape's events cut into NvtxBatches at ``cuts``: ranges whose uid is in ``lost`` are
    reported lost (lost_uids) where the range would have been."""
    events, ranges, marks = tape.events, tape.ranges, tape.marks
    bounds = sorted({min(c, len(events)) for c in cuts} | {0, len(events)})
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        part = events[lo:hi]
        rows = [ranges[i] for kind, i in part if kind == "range"]
        dropped = [r["uid"] for r in rows if r["uid"] in lost]
        rows = [r for r in rows if r["uid"] not in lost]
        range_rows = np.zeros(len(rows), dtype=RANGE_DTYPE)
        for i, r in enumerate(rows):
            for k, v in r.items():
                range_rows[i][k] = v
            range_rows[i]["domain_id"], range_rows[i]["tid"] = domain, tid
        mrows = [marks[i] for kind, i in part if kind == "mark"]
        mark_rows = np.zeros(len(mrows), dtype=MARK_DTYPE)
        for i, m in enumerate(mrows):
            for k, v in m.items():
                mark_rows[i][k] = v
            mark_rows[i]["domain_id"], mark_rows[i]["tid"] = domain, tid
        out.append(NvtxBatch(pid=9, ranges=range_rows, marks=mark_rows, strings=strings,
                             lost_uids=np.array(dropped, dtype=np.uint64)))
    return out


def assert_paths_agree(batches: list[NvtxBatch],
                       run: Callable[..., tuple[list[StepEvent], dict[str, int]]],
                       column_min_layers: int) -> tuple[list[StepEvent], list[StepEvent]]:
    """``run(batches, fast=...)`` both ways, the whole-batch path with COLUMN_MIN_LAYERS set to
    ``column_min_layers``: the same counters and steps; returns (fast steps, per-event steps)."""
    import pytest

    from moescope.collectors import moe_convention

    with pytest.MonkeyPatch.context() as m:
        m.setattr(moe_convention, "COLUMN_MIN_LAYERS", column_min_layers)
        fast_steps, fast_stats = run(batches, fast=True)
    slow_steps, slow_stats = run(batches, fast=False)
    assert fast_stats == slow_stats
    assert plain(fast_steps) == plain(slow_steps)
    return fast_steps, slow_steps
