"""The runtime's stats page (moescope/stats_page.py): what the reference runtime writes equals its
`stats` reply; the policy's poller reads it between socket calls and calls again when it must; and
a reader refuses or survives every bad page (links, FIFOs, other owners, wrong shapes, pages cut
short under it, a writer stuck mid-update) with a one-line error, never a hang or a crash."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from policy_helpers import ControlProxy, StartRuntime

from moescope.agent.policy.actuator import RuntimeState
from moescope.agent.policy.stats_source import PAGE_REFRESH_S, RuntimeStatsSignals, queue_floor_for
from moescope.examples.moe_runtime.stats import RuntimeStats
from moescope.stats_page import (
    LAYOUT_NAME,
    PEAK_BUCKET_NS,
    PageBusy,
    PageSnapshot,
    StatsPageError,
    StatsPageReader,
    StatsPageWriter,
    busy_numpy,
    page_bytes,
    sweep_stale_pages,
)


def open_reader(writer: StatsPageWriter, **overrides: Any) -> StatsPageReader:
    want: dict[str, Any] = {"layers": writer.layers, "experts": writer.experts, "pid": os.getpid(),
                            "owner_uid": os.getuid()}
    want.update(overrides)
    return StatsPageReader.open(str(writer.path), **want)


def read(reader: StatsPageReader) -> PageSnapshot:
    snap = reader.read()
    assert snap is not None, "the page was mid-update on every try"
    return snap


@pytest.fixture
def writer(tmp_path: Path) -> Any:
    made = StatsPageWriter(layers=3, experts=5, directory=tmp_path)
    yield made
    made.close()


def write(writer: StatsPageWriter, version_key: object = None, **arrays: np.ndarray) -> None:
    """One update, as the runtime makes them: its arrays written between begin() and end()."""
    writer.begin()
    for name, values in arrays.items():
        getattr(writer, name)[...] = values
    writer.end(version_key)


def test_a_page_reads_back_what_was_written(writer: StatsPageWriter) -> None:
    rng = np.random.default_rng(7)
    queue, tokens = rng.integers(0, 90, (3, 5)), rng.integers(0, 10**12, (3, 5))
    entropy, penalty = rng.random(3) * 4, np.round(rng.random((3, 5)), 3)
    write(writer, ("a",), queue_depth=queue, tokens=tokens, entropy_bits=entropy)
    writer.publish_penalty(penalty)
    reader = open_reader(writer)
    try:
        snap = read(reader)
        assert snap.updates == 2 and snap.version == 1
        assert np.array_equal(snap.queue_depth, queue) and np.array_equal(snap.tokens, tokens)
        assert np.array_equal(snap.entropy_bits, entropy) and np.array_equal(snap.penalty, penalty)
        write(writer, ("a",), queue_depth=queue)
        writer.note_version(("a",))
        assert read(reader).version == 1 and read(reader).updates == 3  # the same key: the version stands
        write(writer, queue_depth=np.zeros((3, 5)))
        writer.note_version(("b",))
        after = read(reader)
        assert after.version == 2 and not after.queue_depth.any() and np.array_equal(after.tokens, tokens)
        assert np.array_equal(snap.queue_depth, queue)  # a snapshot keeps its values past the next read
        short = reader.read(routing=False)  # header, queues and penalties only
        assert short is not None and short.tokens.shape == (0, 5) and short.entropy_bits.shape == (0,)
        assert np.array_equal(short.penalty, penalty) and short.version == after.version
        writer.touch(("b",))
        assert read(reader).version == 3  # a command always moves it
    finally:
        reader.close()
    assert page_bytes(3, 5) == os.path.getsize(writer.path) == 64 + 40 * 15 + 8 * 3


@pytest.fixture
def clocked_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, int], StatsPageWriter,
                                                                                   StatsPageReader]]:
    """A 2 x 3 page and its reader, stats_page's clock at bucket 50 (the test moves clock["ns"])."""
    from moescope import stats_page

    clock = {"ns": 50 * PEAK_BUCKET_NS}
    monkeypatch.setattr(stats_page, "time", type("FakeTime", (), {"monotonic_ns": staticmethod(lambda: clock["ns"])}))
    page = StatsPageWriter(layers=2, experts=3, directory=tmp_path)
    reader = open_reader(page)
    yield clock, page, reader
    reader.close()
    page.close()


def test_an_unchanged_page_gives_its_snapshot_back(
        clocked_page: tuple[dict[str, int], StatsPageWriter, StatsPageReader]) -> None:
    # An idle runtime's page has no update between two 200 ms polls: the reader checks version and
    # updates (16 bytes) and hands the previous snapshot back, so the poller keeps what it made of it.
    # Never while a peak is held: a held peak falls to 0 as buckets pass with nothing written.
    clock, page, reader = clocked_page
    write(page, queue_depth=np.array([[0, 4, 0], [0, 0, 0]]))
    first = read(reader)
    assert read(reader) is first and reader.read(routing=True) is first  # no update: the same object
    assert reader.read(routing=False) is not first  # another part of the page: read anew
    write(page, queue_depth=np.zeros((2, 3)))
    second = read(reader)
    assert second is not first and not second.queue_depth.any() and first.queue_depth[0, 1] == 4
    page.begin()
    page.queue_peak[50 & 1, 1, 2] = 9  # a queue of 9 in bucket 50
    page.set_peak_bucket(50)
    page.end()
    held = read(reader)
    assert held.queue_peak[1, 2] == 9
    again = read(reader)
    assert again is not held and again.queue_peak[1, 2] == 9  # a held peak: read anew every time
    clock["ns"] += 2 * PEAK_BUCKET_NS  # two buckets on, nothing written: the peak is gone
    gone = read(reader)
    assert not gone.queue_peak.any() and read(reader) is gone
    page.touch()  # the version moves (an update too)
    moved = read(reader)
    assert moved is not gone and moved.version == gone.version + 1


def test_a_reader_survives_the_page_changing_under_it(writer: StatsPageWriter) -> None:
    reader = open_reader(writer)
    try:
        with open(writer.path, "r+b") as f:
            f.seek(24)
            f.write(struct.pack("<Q", 7))  # odd seq: a writer stopped mid-update
        assert reader.read() is None  # gives up for this period, no spin
        with open(writer.path, "r+b") as f:
            f.seek(24)
            f.write(struct.pack("<Q", 8))
            f.seek(16)
            f.write(struct.pack("<I", 4))  # the header says another shape now
        with pytest.raises(StatsPageError, match="header changed"):
            read(reader)
        os.truncate(writer.path, 100)  # cut short: a short read (a mapping would SIGBUS here)
        with pytest.raises(StatsPageError, match="cut short"):
            read(reader)
    finally:
        reader.close()
    with pytest.raises(StatsPageError, match="closed"):
        read(reader)


def test_bad_pages_are_refused_in_one_line(writer: StatsPageWriter, tmp_path: Path) -> None:
    def refused(path: Path | str, match: str, **overrides: Any) -> None:
        want: dict[str, Any] = {"layers": 3, "experts": 5, "pid": os.getpid(), "owner_uid": os.getuid()}
        want.update(overrides)
        with pytest.raises(StatsPageError, match=match) as info:
            StatsPageReader.open(str(path), **want)
        assert "\n" not in str(info.value)

    link = tmp_path / "link"
    link.symlink_to(writer.path)
    refused(link, "cannot open")  # never followed through a link
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")  # opened without blocking, then refused
    refused(writer.path, "owned by uid", owner_uid=os.getuid() + 1)
    refused(writer.path, "bytes, want", experts=6)
    refused(writer.path, "of pid", pid=os.getpid() + 1)
    refused(tmp_path / "absent", "cannot open")
    refused(writer.path, "byte cap", layers=10_000, experts=10_000)
    other = tmp_path / "not-a-page"
    other.write_bytes(b"\0" * page_bytes(3, 5))
    refused(other, "not a moescope-stats-page/2 page")


def test_pages_of_killed_writers_are_swept(tmp_path: Path) -> None:
    dead = tmp_path / "moescope-stats-999999999-abc"  # no such pid
    dead.write_bytes(b"x")
    mine = StatsPageWriter(layers=1, experts=1, directory=tmp_path)  # sweeps as it starts
    try:
        assert not dead.exists() and mine.path.exists()
        assert sweep_stale_pages(tmp_path) == 0  # a live writer's page stays
    finally:
        mine.close()
    assert not mine.path.exists()


def page_of(stats: dict[str, Any]) -> StatsPageReader:
    named = stats["stats_page"]
    assert named["layout"] == LAYOUT_NAME and named["bytes"] == page_bytes(2, 8)
    return StatsPageReader.open(named["path"], layers=2, experts=8, pid=stats["pid"], owner_uid=os.getuid())


def test_the_runtime_page_equals_its_stats(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    stats = rt.stats()
    reader = page_of(stats)
    try:
        version = read(reader).version
        for prompt in ("hello world", "mixture of experts"):
            rt.complete(prompt)
        rt.call("set_router_penalty", {"layer": 1, "expert": 2, "penalty": 0.3})
        stats, snap = rt.stats(), read(reader)
        for row in stats["layers"]:
            layer = row["layer"]
            assert snap.tokens[layer].tolist() == row["tokens"]
            assert snap.queue_depth[layer].tolist() == row["queue_depth"]
            assert snap.penalty[layer].tolist() == row["penalty"]
            assert snap.entropy_bits[layer] == row["entropy_bits"]
        assert snap.tokens.sum() > 0 and snap.penalty[1, 2] == 0.3
        assert snap.version == version  # steps and penalties leave the version alone
        rt.call("migrate_expert", {"layer": 0, "expert": 1, "device": "cpu"})
        assert read(reader).version > version  # a command that may move experts moves it
        path = Path(stats["stats_page"]["path"])
        rt.proc.send_signal(signal.SIGTERM)  # a clean exit removes the page
        rt.proc.wait(timeout=60)
        assert not path.exists()
    finally:
        reader.close()


def test_the_poller_reads_the_page_between_calls(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    now = {"t": 100.0}
    # through /proc/PID/root, as the agent opens it (a runtime in a container names its own path)
    source = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0, clock=lambda: now["t"], runtime_pid=rt.proc.pid)
    try:
        source()  # the first call names the page
        now["t"] = 100.2
        source()  # the version it read before the call: up to date from here
        assert source.page is not None and source.page_periods == 0
        assert source.page.path.startswith(f"/proc/{rt.proc.pid}/root/")
        for prompt in ("hello world", "mixture of experts", "zzzz"):
            rt.complete(prompt)
        rt.call("set_router_penalty", {"layer": 0, "expert": 5, "penalty": 0.3})
        now["t"] = 101.0
        from_page = source()
        assert source.page_periods == 1 and source.polls == 3
        # the same signals as a poller without the page, one call after the same baseline
        calls = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0, clock=lambda: now["t"], use_page=False)
        try:
            held = source.last_state
            assert held is not None
            by_call = RuntimeState.from_stats(rt.stats(), previous=None)
            assert held.penalty == {(0, 5): 0.3} == {k: v for k, v in by_call.penalty.items() if v}
            assert held.tokens == by_call.tokens and held.entropy_bits == by_call.entropy_bits
            # queue_depth is the last step's until the batcher's idle tick (every 0.5 s) clears it:
            # on a loaded machine that tick can fall between the page read and this call. Then the
            # call's queue_peak (the deepest of the last 200-400 ms) still holds what the page had.
            live = {k: v for k, v in by_call.queue_depth.items() if v}
            if live or not held.queue_depth:
                assert held.queue_depth == live
            else:
                assert all(by_call.queue_peak.get(k, 0) >= v for k, v in held.queue_depth.items()), \
                    (held.queue_depth, by_call.queue_peak)
        finally:
            calls.close()
        # penalised: reported so its rule can clear; and each queue the deepest of the latest one and
        # the peak held from the last 200-400 ms (the prompts' queues, as the runtime goes idle)
        assert (0, 5) in from_page.expert_queue_tokens
        assert from_page.expert_queue_tokens == {
            key: float(max(held.queue_depth.get(key, 0), held.queue_peak.get(key, 0)))
            for key in {(0, 5), *held.queue_depth, *held.queue_peak}}
        assert set(from_page.expert_load_gini) == {0, 1}
        assert all(0 <= g <= 1 for g in from_page.expert_load_gini.values())
        now["t"] = 101.0 + PAGE_REFRESH_S  # a refresh is due: the socket again
        source()
        assert source.page_periods == 1
        rt.call("offload_expert", {"layer": 1, "expert": 3})
        now["t"] += 0.2
        source()  # the version moved: the socket again, and the placement with it
        state = source.last_state
        assert source.page_periods == 1 and state is not None and state.offloaded_by_policy() == [(1, 3)]
        now["t"] += 0.2
        source()
        assert source.page_periods == 2
        for _ in range(2):  # idle past the peaks' 400 ms: a page with no update gives the same state
            now["t"] += 0.2
            time.sleep(0.25)
            idle = source()
        assert source.last_state is not None and not source.last_state.queue_peak
        assert source.page is not None
        idle_state, page_snapshot = source.last_state, source.page.read(routing=source.with_routing)
        now["t"] += 0.2
        again = source()
        assert source.last_state is idle_state and source.page_periods == 5
        assert again.expert_queue_tokens == idle.expert_queue_tokens
        assert again.expert_load_gini == idle.expert_load_gini
        assert page_snapshot is not None
        assert idle_state == idle_state.with_page(page_snapshot, routing=source.with_routing,
                                                  queue_floor=source.queue_floor)  # what it stands for
        rt.kill()  # SIGKILL: the page stays on disk, the connection shows the runtime gone
        now["t"] += 0.2
        gone = source()
        assert source.poll_errors == 1 and math.isnan(gone.device_memory_used_ratio) and source.page is None
    finally:
        source.close()


@pytest.mark.parametrize("page", [
    {"path": "/etc/passwd", "layout": LAYOUT_NAME, "bytes": 1},  # another owner, another size
    {"path": "/dev/zero", "layout": LAYOUT_NAME, "bytes": 1},  # not a regular file
    {"path": 7, "layout": LAYOUT_NAME},
    "a string",
    {"path": "/tmp/x", "layout": "moescope-stats-page/9"},
])
def test_a_bad_page_named_by_a_runtime_is_counted_and_the_socket_serves(
        start_runtime: StartRuntime, page: object) -> None:
    rt = start_runtime()
    def name_another_page(request: dict[str, Any], reply: dict[str, Any]) -> None:
        if reply.get("ok") and "stats_page" in reply.get("result", {}):
            reply["result"]["stats_page"] = page

    front = ControlProxy(rt.workdir / "front.sock", rt.socket_path, rewrite=name_another_page)
    now = {"t": 100.0}
    source = RuntimeStatsSignals(rt.workdir / "front.sock", timeout_s=10.0, clock=lambda: now["t"])
    source.with_routing = False
    try:
        for _ in range(4):
            source()
            now["t"] += 0.2
        assert source.page_errors == 1 and source.page is None  # tried once per connection
        assert source.page_periods == 0 and source.poll_errors == 0
        rt.call("set_router_penalty", {"layer": 1, "expert": 4, "penalty": 0.3})
        assert source().expert_queue_tokens == {(1, 4): 0.0}  # read over the socket
    finally:
        source.close()
        front.close()


def test_the_runtime_stats_write_the_page_as_they_change(tmp_path: Path) -> None:
    # A reader sees a layer's queues as soon as the layer routed, not at the step's end: a prefill's
    # queues are there while it runs (the queue rule missed every hotspot when the page was written
    # once a step). The stats' own arrays are the page's.
    placement = {"version": 0}
    stats = RuntimeStats(layers=2, experts=4)
    stats.record_routing(layer=1, demand=np.array([1, 0, 0, 2]), dropped=np.zeros(4, dtype=np.int64),
                         rerouted_in=np.zeros(4, dtype=np.int64), entropy_bits=1.5, capacity=4)
    page = StatsPageWriter(layers=2, experts=4, directory=tmp_path)
    stats.attach_page(page, version_key=lambda: placement["version"])
    reader = open_reader(page)
    try:
        assert read(reader).tokens[1].tolist() == [1, 0, 0, 2]  # what was counted before the page
        version = read(reader).version
        stats.record_routing(layer=0, demand=np.array([0, 70, 0, 3]), dropped=np.zeros(4, dtype=np.int64),
                             rerouted_in=np.zeros(4, dtype=np.int64), entropy_bits=0.25, capacity=4)
        mid_step = read(reader)
        assert mid_step.queue_depth.tolist() == [[0, 70, 0, 3], [1, 0, 0, 2]]
        assert mid_step.entropy_bits.tolist() == [0.25, 1.5] and mid_step.tokens[0].tolist() == [0, 70, 0, 3]
        stats.record_step(requests=1, prefill_tokens=4, decode_tokens=1)
        assert read(reader).version == version  # the placement did not move
        placement["version"] = 1  # (an on-demand load cached into a pool)
        stats.record_step(requests=1, prefill_tokens=0, decode_tokens=1)
        assert read(reader).version == version + 1
        stats.idle()
        assert not read(reader).queue_depth.any() and read(reader).tokens.sum() == 76
        assert stats.snapshot()["queue_depth"] == [[0] * 4, [0] * 4]
    finally:
        reader.close()
        page.close()


def test_a_queue_is_held_as_a_peak_for_200_to_400_ms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A prefill's queue lasts one step: the next decode step (or idle) overwrites queue_depth within
    # milliseconds, and a poller every 200 ms saw it by chance. The peak of each 200 ms bucket is
    # held for the bucket after it too: every 200 ms poll sees it, at most two in a row.
    from moescope import stats_page
    from moescope.examples.moe_runtime import stats as runtime_stats

    clock = {"ns": 10 * PEAK_BUCKET_NS + 150_000_000}  # 150 ms into bucket 10
    fake_time = type("FakeTime", (), {"monotonic_ns": staticmethod(lambda: clock["ns"])})
    monkeypatch.setattr(runtime_stats, "time", fake_time)
    monkeypatch.setattr(stats_page, "time", fake_time)

    def route(layer: int, demand: list[int], at_ms: int) -> None:
        clock["ns"] = at_ms * 1_000_000
        stats.record_routing(layer=layer, demand=np.array(demand), dropped=np.zeros(4, dtype=np.int64),
                             rerouted_in=np.zeros(4, dtype=np.int64), entropy_bits=1.0, capacity=8)

    def peak_at(at_ms: int) -> list[list[int]]:
        clock["ns"] = at_ms * 1_000_000
        got = read(reader).queue_peak.tolist()
        assert got == stats.snapshot()["queue_peak"]  # the page and a `stats` call agree
        return got

    stats = RuntimeStats(layers=2, experts=4)
    page = StatsPageWriter(layers=2, experts=4, directory=tmp_path)
    stats.attach_page(page, version_key=lambda: None)
    reader = open_reader(page)
    try:
        route(0, [0, 300, 0, 3], 2150)  # a prefill on expert 1 ...
        route(0, [0, 2, 0, 1], 2170)  # ... then a decode step
        assert read(reader).queue_depth[0].tolist() == [0, 2, 0, 1]
        assert peak_at(2190) == [[0, 300, 0, 3], [0, 0, 0, 0]]
        stats.idle()  # the runtime went idle: its queues are 0, the peak stands
        assert not read(reader).queue_depth.any()
        assert peak_at(2399) == [[0, 300, 0, 3], [0] * 4]  # the next bucket: still held
        assert peak_at(2400) == [[0] * 4, [0] * 4]  # two buckets on: gone, with nothing written
        route(1, [5, 0, 0, 0], 2210)  # bucket 11: the bucket-10 half stays
        assert peak_at(2220) == [[0, 300, 0, 3], [5, 0, 0, 0]]
        route(1, [0, 0, 7, 0], 2410)  # bucket 12 reuses bucket 10's half: cleared first
        assert peak_at(2420) == [[0] * 4, [5, 0, 7, 0]]
        route(0, [1, 1, 1, 1], 4000)  # bucket 20: a gap, both halves cleared
        assert peak_at(4010) == [[1, 1, 1, 1], [0] * 4]
        # the poller's state carries the non-zero peaks, as a narrowed `stats` reply does
        clock["ns"] = 4_010_000_000
        state = RuntimeState.from_stats({"protocol": "moescope-control/1", "config": {
            "layers": 2, "experts": 4, "devices": ["cpu"], "primary_device": "cpu"},
            "layers": [{"layer": 0, "queue_peak_sparse": [[0, 1], [3, 1]]}, {"layer": 1}],
            "precision": {"default": "fp32"}, "memory": {"devices": {}, "expert_bytes_fp32": 0}})
        assert state.with_page(read(reader), routing=False).queue_peak == {(0, e): 1 for e in range(4)}
        assert state.queue_peak == {(0, 0): 1, (0, 3): 1}
    finally:
        reader.close()
        page.close()


def test_queues_under_the_floor_the_rules_can_act_on_are_left_out(tmp_path: Path) -> None:
    # Under a production batch nearly every expert has some queue within 200-400 ms: the poller
    # keeps the ones a queue rule can act on (at or past the lowest fire / clear threshold).
    from moescope.agent.policy.config import load_policy
    from moescope.agent.policy.rules import RuleSpec

    defaults = load_policy().rules
    assert queue_floor_for(defaults) == 25.0  # expert_queue_soft_limit: fire > 50, clear < 25
    queue_rule = next(spec for spec in defaults if spec.signal == "expert_queue_tokens")
    below: RuleSpec = dataclasses.replace(queue_rule, name="starved", comparison="<", fire=1.0, clear=2.0)
    assert queue_floor_for([*defaults, below]) == 0.0  # a rule firing low: every queue counts
    assert queue_floor_for([dataclasses.replace(queue_rule, enabled=False)]) == 0.0

    stats = RuntimeStats(layers=2, experts=4)
    page = StatsPageWriter(layers=2, experts=4, directory=tmp_path)
    stats.attach_page(page, version_key=lambda: None)
    reader = open_reader(page)
    zeros = np.zeros(4, dtype=np.int64)
    try:
        stats.record_routing(layer=0, demand=np.array([3, 60, 24, 25]), dropped=zeros, rerouted_in=zeros,
                             entropy_bits=1.0, capacity=8)
        state = RuntimeState.from_stats({"protocol": "moescope-control/1", "config": {
            "layers": 2, "experts": 4, "devices": ["cpu"], "primary_device": "cpu"},
            "layers": [{"layer": 0}, {"layer": 1}], "precision": {"default": "fp32"},
            "memory": {"devices": {}, "expert_bytes_fp32": 0}})
        poller = RuntimeStatsSignals(tmp_path / "no-socket", timeout_s=1.0, queue_floor=25.0)
        # beside NVTX a page period reads the queues from the page's arrays, not from a state made of
        # them (RuntimeStatsSignals._read): a second poller that way must report the same every time
        arrays = RuntimeStatsSignals(tmp_path / "no-socket", timeout_s=1.0, queue_floor=25.0)

        def from_arrays(snapshot: PageSnapshot, now_s: float) -> dict[tuple[int, int], float]:
            busy = reader.read_busy(25.0)  # (the page as `snapshot` has it: nothing written since)
            assert busy is not None and (busy.version, busy.updates) == (snapshot.version, snapshot.updates)
            return arrays._queue(state, now_s, busy)

        snapshot = read(reader)
        seen = state.with_page(snapshot, routing=False, queue_floor=25.0)
        assert seen.queue_depth == {(0, 1): 60, (0, 3): 25} and seen.queue_peak == seen.queue_depth
        assert poller._queue(seen, 1.0) == {(0, 1): 60.0, (0, 3): 25.0} == from_arrays(snapshot, 1.0)
        # expert 1 falls to 10: still reported (sticky), as 0 (under the floor: under the clear threshold)
        stats.queue_peak[...] = 0
        stats.record_routing(layer=0, demand=np.array([0, 10, 0, 30]), dropped=zeros, rerouted_in=zeros,
                             entropy_bits=1.0, capacity=8)
        snapshot = read(reader)
        later = state.with_page(snapshot, routing=False, queue_floor=25.0)
        assert poller._queue(later, 2.0) == {(0, 1): 0.0, (0, 3): 30.0} == from_arrays(snapshot, 2.0)
        # a penalised expert is reported whatever its queue (layer 1, no queue); a peak alone past the
        # floor counts (layer 1 expert 0: its depth 0 now, 40 held from earlier in the bucket)
        page.publish_penalty(np.array([[0.0] * 4, [0.0, 0.0, 0.3, 0.0]]))
        stats.record_routing(layer=1, demand=np.array([40, 0, 0, 0]), dropped=zeros, rerouted_in=zeros,
                             entropy_bits=1.0, capacity=8)
        stats.record_routing(layer=1, demand=np.array([0, 0, 0, 0]), dropped=zeros, rerouted_in=zeros,
                             entropy_bits=1.0, capacity=8)
        snapshot = read(reader)
        assert snapshot.queue_depth[1, 0] == 0 and snapshot.queue_peak[1, 0] == 40
        third = state.with_page(snapshot, routing=False, queue_floor=25.0)
        assert poller._queue(third, 2.2) == {(0, 1): 0.0, (0, 3): 30.0, (1, 0): 40.0, (1, 2): 0.0}
        assert from_arrays(snapshot, 2.2) == poller._queue(third, 2.2)
        # the same over the socket, where the reply names every non-zero queue
        by_call = RuntimeState.from_stats({"protocol": "moescope-control/1", "config": {
            "layers": 2, "experts": 4, "devices": ["cpu"], "primary_device": "cpu"},
            "layers": [{"layer": 0, "queue_depth_sparse": [[1, 10], [3, 30]], "queue_peak_sparse": [[2, 7]]},
                       {"layer": 1}], "precision": {"default": "fp32"},
            "memory": {"devices": {}, "expert_bytes_fp32": 0}})
        assert poller._queue(by_call, 2.5) == {(0, 1): 0.0, (0, 3): 30.0, (1, 0): 0.0, (1, 2): 0.0}  # (sticky)
        # without a floor every queue above 0 is reported, as before
        every = RuntimeStatsSignals(tmp_path / "no-socket", timeout_s=1.0)._queue(
            state.with_page(read(reader), routing=False), 3.0)
        assert every == {(0, 1): 10.0, (0, 3): 30.0, (1, 0): 40.0, (1, 2): 0.0}
    finally:
        reader.close()
        page.close()


def test_a_runtime_without_its_page_is_read_over_the_socket(start_runtime: StartRuntime) -> None:
    rt = start_runtime("--no-stats-page")
    assert "stats_page" not in rt.stats()
    now = {"t": 100.0}
    source = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0, clock=lambda: now["t"], runtime_pid=rt.proc.pid)
    source.with_routing = False
    try:
        rt.call("set_router_penalty", {"layer": 0, "expert": 1, "penalty": 0.3})
        for _ in range(3):
            signals = source()
            now["t"] += 0.2
        assert source.page is None and source.page_periods == 0 and source.page_errors == 0
        assert signals.expert_queue_tokens == {(0, 1): 0.0} and source.poll_errors == 0
    finally:
        source.close()


def random_page(rng: np.random.Generator, layers: int, experts: int) -> bytearray:
    """A page copy (header left zero) with hostile values: negative and huge queues, NaN, -0.0 and
    infinite penalties, peaks in both halves."""
    n = layers * experts
    depth = rng.integers(-5, 80, n)
    depth[rng.random(n) < 0.01] = np.iinfo(np.int64).max
    penalty = np.where(rng.random(n) < 0.2, rng.random(n) - 0.3, 0.0)
    for special in (np.nan, -0.0, np.inf, -np.inf):
        penalty[rng.integers(0, n)] = special
    peaks = np.where(rng.random((2, n)) < 0.3, rng.integers(-3, 120, (2, n)), 0)
    body = np.concatenate([depth.astype("<i8").view(np.uint8), penalty.astype("<f8").view(np.uint8),
                           peaks.astype("<i8").ravel().view(np.uint8)])
    return bytearray(bytes(64) + body.tobytes())


def test_the_busy_experts_are_made_natively_as_numpy_makes_them() -> None:
    # Beside NVTX the policy reads a page's busy experts five times a second: one native pass over
    # the copy (moescope/_page_busy.c) instead of ~10 numpy calls. Same dict (and order), same list.
    from moescope import stats_page

    native = stats_page._native
    assert native is not None, "moescope._page_busy is not built (pip install -e .)"
    assert stats_page.busy_of_copy is native.busy
    rng = np.random.default_rng(11)
    for layers, experts in ((1, 1), (2, 3), (4, 16), (58, 256)):
        buf = random_page(rng, layers, experts)
        for written, now in ((40, 40), (41, 40), (39, 40), (38, 40), (0, 40), (2**64 - 1, 40)):
            for floor in (1e-9, 25.0, 50.5, 1e30):
                want = busy_numpy(buf, layers, experts, floor, written, now)
                got = native.busy(buf, layers, experts, floor, written, now)
                assert list(got[0].items()) == list(want[0].items()), (layers, experts, written, floor)
                assert got[1] == want[1] and got[2] is want[2]
                assert all(type(v) is float for v in got[0].values())
    # a copy too short for its shape, or no shape: refused, never read past
    with pytest.raises(ValueError, match="needs 96 bytes"):
        native.busy(bytearray(95), 1, 1, 1.0, 0, 0)
    with pytest.raises(ValueError, match="layers and experts"):
        native.busy(bytearray(4096), 0, 4, 1.0, 0, 0)
    with pytest.raises(ValueError, match="past any buffer"):
        native.busy(bytearray(4096), 2**31 - 1, 2**31 - 1, 1.0, 0, 0)
    with pytest.raises(TypeError):
        native.busy("not bytes", 1, 1, 1.0, 0, 0)  # type: ignore[arg-type]


@pytest.fixture(params=["native", "python"])
def busy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """read_busy as the agent runs it (one native call: moescope/_page_busy.c read_busy) and the
    Python path a checkout without the extension takes: every read_busy test runs on both."""
    from moescope import stats_page

    if request.param == "native":
        assert stats_page.read_busy_native is not None, "moescope._page_busy is not built (pip install -e .)"
    else:
        monkeypatch.setattr(stats_page, "read_busy_native", None)
    return str(request.param)


def test_busy_reads_follow_the_page(clocked_page: tuple[dict[str, int], StatsPageWriter, StatsPageReader],
                                    busy_path: str) -> None:
    # read_busy: the queued (level at or past the floor) and penalised experts of one update; the
    # same object again while the page has no update and holds no peak, as read() does
    clock, page, reader = clocked_page
    write(page, queue_depth=np.array([[0, 40, 0], [7, 0, 26]]))
    page.publish_penalty(np.array([[0.0, 0.0, 0.2], [0.0, 0.0, 0.0]]))
    busy = reader.read_busy(25.0)
    assert isinstance(busy, PageBusy) and busy.updates == 2 and not busy.peaks
    assert busy.queued == {(0, 1): 40.0, (1, 2): 26.0} and busy.penalised == [(0, 2)]
    assert reader.read_busy(25.0) is busy  # no update: the same object
    other = reader.read_busy(5.0)  # another floor: read anew
    assert other is not None and other is not busy and other.queued == {(0, 1): 40.0, (1, 0): 7.0, (1, 2): 26.0}
    assert read(reader).version == busy.version and reader.read_busy(5.0) is not other  # (read() in between)
    page.begin()
    page.queue_peak[50 & 1, 0, 0] = 90  # a queue of 90 held in bucket 50
    page.set_peak_bucket(50)
    page.end()
    held = reader.read_busy(25.0)
    assert held is not None and held.peaks and held.queued[(0, 0)] == 90.0
    assert reader.read_busy(25.0) is not held  # a held peak: read anew every time
    clock["ns"] += 2 * PEAK_BUCKET_NS  # two buckets on: the peak is gone
    gone = reader.read_busy(25.0)
    assert gone is not None and not gone.peaks and (0, 0) not in gone.queued
    assert reader.read_busy(25.0) is gone
    with open(page.path, "r+b") as f:
        f.seek(24)
        f.write(struct.pack("<QQQ", 2 * 10**6 + 1, gone.version, gone.updates + 1))  # stopped mid-update
    assert reader.read_busy(25.0) is None  # a changed page mid-update: nothing this period
    reader.close()
    with pytest.raises(StatsPageError, match="closed"):
        reader.read_busy(25.0)


def test_a_busy_read_survives_the_page_changing_under_it(writer: StatsPageWriter, busy_path: str) -> None:
    # the policy's own read of the page refuses a changed header and a truncated page in one line
    # (the poller then counts it and reads `stats` over the socket), and gives a period up while the
    # writer is stuck mid-update, whether the version check or the copy meets it
    reader = open_reader(writer)
    try:
        write(writer, queue_depth=np.full((3, 5), 60))
        busy = reader.read_busy(50.0)
        assert busy is not None and len(busy.queued) == 15 and reader.read_busy(50.0) is busy
        with open(writer.path, "r+b") as f:
            f.seek(24)
            f.write(struct.pack("<QQQ", 7, busy.version, busy.updates + 1))  # odd seq, an update under way
        assert reader.read_busy(50.0) is None and reader.read_busy(50.0) is None  # no spin, no stale copy
        with open(writer.path, "r+b") as f:
            f.seek(24)
            f.write(struct.pack("<Q", 8))
            f.seek(16)
            f.write(struct.pack("<I", 4))  # the header says another shape now
        with pytest.raises(StatsPageError, match="header changed") as info:
            reader.read_busy(50.0)
        assert "\n" not in str(info.value) and str(writer.path) in str(info.value)
        os.truncate(writer.path, 100)  # cut short: a short read (a mapping would SIGBUS here)
        with pytest.raises(StatsPageError, match=r"cut short \(100 of 544 bytes\)"):
            reader.read_busy(50.0)
        os.truncate(writer.path, 40)  # cut inside the version words, with a busy read held to check
        reader._last = (busy, 50.0)  # (as after an unchanged period: the version words are read first)
        with pytest.raises(StatsPageError, match=r"cut short \(8 of 16 header bytes\)"):
            reader.read_busy(50.0)
    finally:
        reader.close()
    with pytest.raises(StatsPageError, match="closed"):
        reader.read_busy(50.0)


def test_an_idle_page_gives_the_same_queue_signal_until_a_sticky_expert_expires(tmp_path: Path) -> None:
    # An idle runtime's page is the same PageBusy period after period: with nothing queued or
    # penalised in it, the queue signal (the sticky experts at 0.0) is the same object until the
    # first sticky one expires; a busy page is worked out every period (its experts' last-seen times move)
    page = StatsPageWriter(layers=1, experts=4, directory=tmp_path)
    reader = open_reader(page)
    state = RuntimeState.from_stats({"protocol": "moescope-control/1", "config": {
        "layers": 1, "experts": 4, "devices": ["cpu"], "primary_device": "cpu"},
        "layers": [{"layer": 0}], "precision": {"default": "fp32"}, "memory": {"devices": {}, "expert_bytes_fp32": 0}})
    poller = RuntimeStatsSignals(tmp_path / "no-socket", timeout_s=1.0, queue_floor=25.0, sticky_s=10.0)
    try:
        write(page, queue_depth=np.array([[30, 0, 40, 0]]))
        busy = reader.read_busy(25.0)
        assert busy is not None and reader.read_busy(25.0) is busy  # (unchanged: the same object)
        first = poller._queue(state, 1.0, busy)
        assert first == {(0, 0): 30.0, (0, 2): 40.0} and poller._queue(state, 1.2, busy) is not first
        write(page, queue_depth=np.array([[0, 0, 40, 0]]))  # expert 0 last busy at 1.2, expert 2 at 2.0
        page_2 = reader.read_busy(25.0)
        assert page_2 is not None and poller._queue(state, 2.0, page_2) == {(0, 0): 0.0, (0, 2): 40.0}
        write(page, queue_depth=np.zeros((1, 4)))
        idle = reader.read_busy(25.0)
        assert idle is not None and not idle.queued and reader.read_busy(25.0) is idle
        signal = poller._queue(state, 5.0, idle)
        assert signal == {(0, 0): 0.0, (0, 2): 0.0}
        assert poller._queue(state, 6.0, idle) is signal and poller._queue(state, 11.2, idle) is signal
        later = poller._queue(state, 11.21, idle)  # expert 0 last busy at 1.2: past 10 s sticky
        assert later is not signal and later == {(0, 2): 0.0}
        assert poller._queue(state, 12.0, idle) is later and poller._queue(state, 12.01, idle) == {}
        gone = poller._queue(state, 16.0, idle)
        assert gone == {} and poller._queue(state, 99.0, idle) is gone  # nothing sticky: stands for good
    finally:
        reader.close()
        page.close()
