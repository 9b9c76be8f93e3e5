"""The live state snapshot: JSON round trip, versioning, bad input, atomic publishing, discovery."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from moescope import errors
from moescope.agent.state import (
    SCHEMA_VERSION,
    Header,
    MoeLayer,
    PeriodicPublisher,
    SelfCostMeter,
    Snapshot,
    StatePublisher,
    StateReaders,
    bin_expert_shares,
    find_agents,
    from_dict,
    from_json,
    hottest_experts,
    read_snapshot,
    to_dict,
    to_json,
)

from .conftest import FIXTURE_NAMES, FIXTURES, load_fixture


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_round_trip(name: str) -> None:
    snapshot = load_fixture(name)
    assert from_json(to_json(snapshot)) == snapshot
    assert to_dict(snapshot)["version"] == SCHEMA_VERSION


def test_nan_and_inf_become_null_and_read_back_as_none() -> None:
    s = load_fixture("just_started")
    s = dataclasses.replace(s, requests=dataclasses.replace(s.requests, latency_p99_ms=math.nan, rate_per_s=math.inf))
    data = json.loads(to_json(s))
    assert data["requests"]["latency_p99_ms"] is None
    assert data["requests"]["rate_per_s"] is None
    back = from_dict(data)
    assert back.requests.latency_p99_ms is None and back.requests.rate_per_s is None


def test_nan_inside_a_list_of_floats_reads_back_as_nan() -> None:
    s = load_fixture("gpu_busy")
    layer = dataclasses.replace(s.moe.layers[0], expert_token_share=[0.5, math.nan, 0.5])
    s = dataclasses.replace(s, moe=dataclasses.replace(s.moe, layers=[layer]))
    data = json.loads(to_json(s))
    assert data["moe"]["layers"][0]["expert_token_share"] == [0.5, None, 0.5]
    shares = from_dict(data).moe.layers[0].expert_token_share
    assert shares[0] == 0.5 and math.isnan(shares[1]) and shares[2] == 0.5


def _data(name: str = "gpu_busy") -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_other_version_is_refused_with_one_line() -> None:
    data = _data()
    data["version"] = SCHEMA_VERSION + 1
    with pytest.raises(errors.SourceUnavailable) as exc:
        from_dict(data)
    assert "schema version" in str(exc.value) and "\n" not in str(exc.value)
    assert exc.value.exit_code == errors.EXIT_SOURCE_UNAVAILABLE


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d.__setitem__("seq", "12"), "state.seq"),
        (lambda d: d["policy"]["rules"][0].__setitem__("state", "exploded"), "state.policy.rules[0].state"),
        (
            lambda d: d["moe"]["layers"][2].__setitem__("expert_token_share", {"a": 1}),
            "state.moe.layers[2].expert_token_share",
        ),
        (lambda d: d.pop("header"), "missing 'header'"),
        (lambda d: d["header"].__setitem__("dry_run", 1), "state.header.dry_run"),
    ],
)
def test_bad_shape_names_the_field(mutate, where: str) -> None:
    data = _data()
    mutate(data)
    with pytest.raises(errors.SourceUnavailable) as exc:
        from_dict(data)
    assert where in str(exc.value)


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    data = _data()
    data["future_panel"] = {"x": 1}
    data["requests"]["p999_ms"] = 3.0
    assert from_dict(data) == load_fixture("gpu_busy")


def test_bin_expert_shares_small_and_binned() -> None:
    assert bin_expert_shares([1, 3]) == ([0.25, 0.75], 1)
    shares, per_bin = bin_expert_shares([1, 2, 3, 4, 5], max_bins=2)
    assert per_bin == 3
    assert shares == pytest.approx([6 / 15, 9 / 15])
    assert bin_expert_shares([0, 0, 0]) == ([], 1)
    counts = list(range(16384))
    shares, per_bin = bin_expert_shares(counts)
    assert per_bin == 64 and len(shares) == 256
    total = sum(counts)
    assert shares[255] == pytest.approx(sum(range(255 * 64, 16384)) / total)
    assert math.fsum(shares) == pytest.approx(1.0)


def test_hottest_experts_ties_lowest_id_first() -> None:
    hot = hottest_experts([5, 9, 9, 1], k=2)
    assert [(h.expert, h.share) for h in hot] == [(1, 9 / 24), (2, 9 / 24)]
    assert hottest_experts([0, 0]) == []


def test_entropy_norm_scales_by_log2_experts() -> None:
    layer = MoeLayer(layer=0, num_experts=16384, entropy_bits=8.4)
    assert layer.entropy_norm == pytest.approx(0.6)
    assert MoeLayer(layer=0, num_experts=1, entropy_bits=0.0).entropy_norm is None
    assert MoeLayer(layer=0, num_experts=8).entropy_norm is None


def test_publish_is_atomic_world_readable_and_close_removes(tmp_path: Path) -> None:
    old_umask = os.umask(0o077)  # the mode must not depend on the daemon's umask
    try:
        pub = StatePublisher(state_dir=tmp_path / "run", pid=4242)
    finally:
        os.umask(old_umask)
    base = load_fixture("host_large_model")  # the biggest fixture: the slowest to write
    stop = threading.Event()
    reads: list[int] = []
    failures: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            if pub.path.exists():
                try:
                    reads.append(read_snapshot(pub.path).seq)
                except errors.SourceUnavailable as exc:
                    failures.append(str(exc))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for seq in range(1, 61):
            pub.publish(dataclasses.replace(base, seq=seq))
    finally:
        stop.set()
        thread.join(10)
    assert failures == []
    assert reads, "the reader never saw the file"
    assert reads == sorted(reads)  # never goes backwards
    assert read_snapshot(pub.path).seq == 60
    assert pub.published == 60
    assert stat.S_IMODE(pub.path.stat().st_mode) == 0o644
    assert stat.S_IMODE(pub.state_dir.stat().st_mode) == 0o755
    assert sorted(p.name for p in pub.state_dir.iterdir()) == ["agent-4242.state.json"]  # no temp files left
    pub.close()
    assert not pub.path.exists()
    pub.close()  # idempotent


def test_publish_group_readable_mode(tmp_path: Path) -> None:
    pub = StatePublisher(state_dir=tmp_path, pid=1, mode=0o640, group=os.getgid())
    pub.publish(load_fixture("just_started"))
    st = pub.path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()


def test_find_agents_ignores_dead_pids_and_other_files(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    snapshot = load_fixture("just_started")
    StatePublisher(state_dir=tmp_path, pid=dead.pid).publish(snapshot)
    live = StatePublisher(state_dir=tmp_path, pid=os.getpid())
    live.publish(snapshot)
    (tmp_path / "agent-x.state.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    found = find_agents(tmp_path)
    assert [(a.pid, a.path) for a in found] == [(os.getpid(), live.path)]
    assert find_agents(tmp_path / "missing") == []


def test_periodic_publisher_counts_failures_and_never_raises(tmp_path: Path) -> None:
    base = load_fixture("just_started")
    calls = {"n": 0}
    published_after_failures = threading.Event()

    def get_snapshot() -> Snapshot:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("pipeline not ready")
        if calls["n"] >= 6:
            published_after_failures.set()
        return dataclasses.replace(base, seq=calls["n"])

    pub = StatePublisher(state_dir=tmp_path, pid=77)
    periodic = PeriodicPublisher(pub, get_snapshot, interval_s=0.01, watch_readers=False)  # (every interval)
    periodic.start()
    try:
        assert published_after_failures.wait(30)
    finally:
        periodic.stop()
    assert pub.failures == 3
    assert pub.published >= 2
    assert not pub.path.exists()  # stop() closes


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_state_readers_see_opens_of_the_state_file_only(tmp_path: Path) -> None:
    """A real inotify watch: the publisher's own writes (its temp file), other files and listing
    the dir are not readers; opening the state file is, for `seconds` after the open was read."""
    clock = _Clock()
    pub = StatePublisher(state_dir=tmp_path, pid=78)
    readers = StateReaders(tmp_path, pub.path.name, clock=clock)
    try:
        pub.publish(load_fixture("just_started"))
        (tmp_path / "other.json").write_text("{}")
        (tmp_path / "other.json").read_text()
        find_agents(tmp_path)
        assert not readers.opened_within(30.0) and readers.opens == 0
        read_snapshot(pub.path)
        clock.now_s += 1.0
        assert readers.opened_within(30.0) and readers.opens == 1  # seen when read, at that time
        clock.now_s += 31.0
        assert not readers.opened_within(30.0)
        for _ in range(3):  # (inotify folds identical events queued back to back into one)
            read_snapshot(pub.path)
        assert readers.opened_within(0.0) and readers.opens >= 2
    finally:
        readers.close()


def test_periodic_publisher_writes_every_interval_only_while_read(tmp_path: Path) -> None:
    clock = _Clock()
    base = load_fixture("just_started")
    pub = StatePublisher(state_dir=tmp_path, pid=79)
    periodic = PeriodicPublisher(pub, lambda: base, interval_s=1.0, idle_interval_s=10.0, reader_linger_s=30.0,
                                 clock=clock)
    assert periodic.readers is not None and periodic.watch_error is None

    def run(seconds: int) -> list[bool]:
        return run_periods(periodic, clock, seconds)

    try:
        # nobody reads: the first period writes, then one in ten, marked with the idle interval
        assert run(21) == [True] + [False] * 9 + [True] + [False] * 9 + [True]
        assert pub.published == 3 == periodic.idle_publishes
        assert not periodic.watched()  # (the agent's quiet rounds pace themselves by it: agent/observe.py)
        assert read_snapshot(pub.path).publish_interval_s == 10.0
        # a reader (agent top: a read a second): every period from the next one, at the interval
        wrote = []
        for _ in range(5):
            read_snapshot(pub.path)
            wrote += run(1)
        assert wrote == [True] * 5 and read_snapshot(pub.path).publish_interval_s == 1.0
        assert periodic.watched()
        # the reader left (its last read: the line above): every period until 30 s after it, then
        # one in ten again
        assert run(40) == [True] * 31 + [False] * 9
        assert not periodic.watched()
        assert run(10) == [True] + [False] * 9
        assert read_snapshot(pub.path).publish_interval_s == 10.0
    finally:
        periodic.stop()
    # unwatched: every period, as before
    unwatched = PeriodicPublisher(StatePublisher(state_dir=tmp_path, pid=80), lambda: base, interval_s=1.0,
                                  watch_readers=False, clock=clock)
    assert run_periods(unwatched, clock, 5) == [True] * 5 and unwatched.watched()  # (as if read: paced as live)
    unwatched.stop()


def test_the_publisher_thread_sleeps_while_unread_and_wakes_on_a_readers_open(tmp_path: Path) -> None:
    """Unread, the thread does not wake every interval (one publish, then asleep until the idle
    publish is due); a reader's open wakes it at once; stop() wakes it too."""
    import time

    pub = StatePublisher(state_dir=tmp_path, pid=81)
    periodic = PeriodicPublisher(pub, lambda: load_fixture("just_started"), interval_s=0.02, idle_interval_s=60.0,
                                 reader_linger_s=0.5)
    periodic.start()
    try:
        deadline = time.monotonic() + 10.0
        while pub.published == 0:
            assert time.monotonic() < deadline, "never published"
            time.sleep(0.01)
        time.sleep(0.4)  # 20 intervals
        assert pub.published == 1
        read_snapshot(pub.path)  # a reader arrives
        deadline = time.monotonic() + 10.0
        while pub.published < 3:  # woken at once, then every interval while it reads
            assert time.monotonic() < deadline, "a reader's open did not wake the publisher"
            time.sleep(0.01)
            read_snapshot(pub.path)
    finally:
        started = time.monotonic()
        periodic.stop(timeout_s=10.0)
    assert not periodic._thread.is_alive() and time.monotonic() - started < 5.0  # (not the 60 s idle wait)


def run_periods(periodic: PeriodicPublisher, clock: _Clock, seconds: int) -> list[bool]:
    """One period a second, as the publisher's thread runs them: which ones wrote."""
    wrote = []
    for _ in range(seconds):
        wrote.append(periodic.publish_once())
        clock.now_s += 1.0
    return wrote


def test_read_snapshot_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(errors.SourceUnavailable, match="not found"):
        read_snapshot(tmp_path / "agent-1.state.json")
    bad = tmp_path / "agent-2.state.json"
    bad.write_text('{"version": 1, "header": ')
    with pytest.raises(errors.SourceUnavailable) as exc:
        read_snapshot(bad)
    assert str(bad) in str(exc.value) and "not JSON" in str(exc.value) and "\n" not in str(exc.value)


def test_header_defaults_are_empty_not_shared() -> None:
    a = Header(agent_pid=1, started_unix_s=0.0)
    b = Header(agent_pid=2, started_unix_s=0.0)
    assert a.targets == [] and a.targets is not b.targets


def test_self_cost_meter_cpu_and_rss() -> None:
    import time

    wall_start_s = time.monotonic()
    meter = SelfCostMeter()
    cpu_start_s = sum(os.times()[:2])
    while sum(os.times()[:2]) - cpu_start_s < 0.3:  # burn 0.3 s of CPU
        pass
    ballast = bytearray(64 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page so it is resident
    cost = meter.sample()
    wall_s = time.monotonic() - wall_start_s
    assert cost.cpu_pct is not None and cost.cpu_pct >= 0.3 / wall_s * 100 * 0.99
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    vm_rss_bytes = int(status["VmRSS"].split()[0]) * 1024
    assert cost.rss_bytes is not None and cost.rss_bytes >= 64 * 2**20
    assert abs(cost.rss_bytes - vm_rss_bytes) < 8 * 2**20
    del ballast
