"""The main loop's period: longer while its sources find little, the base again at the first busy
round; between quiet rounds, peeks at the sources' backlogs bring a round forward. The clock is one
the test drives (no timing is asserted: the periods and the rounds run are the loop's own choice)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from moescope.agent.daemon import (
    DEFAULT_IDLE_PERIOD_NS,
    LIVE_IDLE_PERIOD_MAX_NS,
    OUTSIDE_PEEK_MAX_NS,
    PEEK_PERIOD_NS,
    QUIET_EVENTS_PER_S,
    STOP_DURATION,
    Daemon,
    live_idle_period_ns,
)
from moescope.collectors.registry import SourceHealth

BASE_NS = 50_000_000
ONE_S = 1_000_000_000  # the timelines below: a 1 s cap (a live view's; without one it is 4 s)


class ScriptedSource:
    """A source whose polls return the scripted counts, then 0."""

    name = "scripted"

    def __init__(self, counts: list[int | None]) -> None:
        self._counts = list(counts)

    def poll(self, now_ns: int) -> int:
        return self._counts.pop(0) if self._counts else 0  # type: ignore[return-value]  # None: a lax source

    def stats(self) -> dict[str, int]:
        return {}

    def health(self) -> SourceHealth:
        return SourceHealth()

    def close(self) -> None:
        return None


def periods_after(counts: Sequence[int | None], *, sources: int = 1) -> list[int]:
    """The period chosen after each round, the rounds' sources returning `counts` (split evenly)."""
    daemon = Daemon(period_ns=BASE_NS)
    scripts = [ScriptedSource([c if c is None else c // sources for c in counts]) for _ in range(sources)]
    for source in scripts:
        daemon.add_source(source)
    chosen = []
    for _ in counts:
        daemon.tick()
        chosen.append(daemon.next_period_ns())
    return chosen


def busy_at(period_ns: int) -> int:
    """The fewest events that make a round run at `period_ns` busy."""
    return QUIET_EVENTS_PER_S * period_ns // 1_000_000_000 + 1


def test_quiet_rounds_lengthen_the_period_up_to_the_cap_and_a_busy_one_resets_it() -> None:
    cap = DEFAULT_IDLE_PERIOD_NS
    assert cap == 4_000_000_000
    doubling = [BASE_NS * 2 ** i for i in range(1, 7)]  # 100, 200, 400, 800, 1600, 3200 ms, then the 4 s cap
    assert periods_after([0] * 8) == [*doubling, cap, cap]
    # busy is a rate: at the 4 s cap, what would be busy at the 50 ms base is quiet
    assert periods_after([0] * 7 + [busy_at(BASE_NS), busy_at(cap), 3, busy_at(2 * BASE_NS)]) == [
        *doubling, cap, cap, BASE_NS, 2 * BASE_NS, BASE_NS,
    ]


def test_a_live_view_shortens_the_cap_at_once_and_its_going_lengthens_it() -> None:
    daemon = Daemon(period_ns=BASE_NS)
    daemon.add_source(ScriptedSource([]))
    for _ in range(8):
        daemon.tick()
        daemon.next_period_ns()
    assert daemon.current_period_ns == DEFAULT_IDLE_PERIOD_NS
    live = live_idle_period_ns(0.25)  # --tui's refresh
    assert live == 250_000_000 and live_idle_period_ns(1.0) == LIVE_IDLE_PERIOD_MAX_NS
    assert live_idle_period_ns(5.0) == LIVE_IDLE_PERIOD_MAX_NS and live_idle_period_ns(0.001) == BASE_NS
    daemon.set_idle_period(live)
    assert daemon.current_period_ns == live  # the next round comes at the view's period, not 4 s later
    daemon.tick()
    assert daemon.next_period_ns() == live
    daemon.set_idle_period(DEFAULT_IDLE_PERIOD_NS)  # the view went: quiet rounds lengthen again
    daemon.tick()
    assert daemon.next_period_ns() == 2 * live
    daemon.set_idle_period(1)  # never under the base period
    assert daemon.idle_period_ns == BASE_NS


def test_busy_is_what_all_sources_handled_together() -> None:
    # Two sources each under the mark, together over it: busy.
    mark = busy_at(BASE_NS) - 1
    assert periods_after([mark + 2], sources=2) == [BASE_NS]
    assert periods_after([mark]) == [2 * BASE_NS]  # at the mark is still quiet


class Clock:
    """Monotonic ns that moves only when the loop waits (its wake event's wait is patched)."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


class BackloggedSource(ScriptedSource):
    """Quiet polls; its backlog check answers from a script of (from_ns, answer) and is counted."""

    def __init__(self, clock: Clock, *, backlog_from_ns: int | None, fail: bool = False) -> None:
        super().__init__([])
        self.clock = clock
        self.backlog_from_ns = backlog_from_ns
        self.fail = fail
        self.checks: list[int] = []
        self.polls: list[int] = []

    def poll(self, now_ns: int) -> int:
        self.polls.append(now_ns)
        if self.backlog_from_ns is not None and now_ns >= self.backlog_from_ns:
            self.backlog_from_ns = None  # drained: quiet again
        return 0

    def backlogged(self) -> bool:
        self.checks.append(self.clock.now_ns)
        if self.fail:
            raise OSError("the ring went away")
        return self.backlog_from_ns is not None and self.clock.now_ns >= self.backlog_from_ns


def run_for(daemon: Daemon, clock: Clock, duration_ns: int, *, outside_every_ns: int = 0,
            outside_until_ns: int | None = None) -> str:
    """Run the loop on the test's clock; with `outside_every_ns`, another thread's peeks (the
    policy's) land every that often while the loop sleeps, until `outside_until_ns` where that
    thread stops and hands the peeks back."""
    next_outside = [outside_every_ns]
    if outside_every_ns:
        assert daemon.lend_peeks(outside_every_ns)

    def wait(timeout_s: float | None = None) -> bool:
        assert timeout_s is not None  # the loop never waits without a bound
        end_ns = clock.now_ns + max(1, round(timeout_s * 1e9))
        while next_outside[0] and next_outside[0] <= end_ns:
            clock.now_ns, next_outside[0] = next_outside[0], next_outside[0] + outside_every_ns
            if outside_until_ns is not None and clock.now_ns >= outside_until_ns:
                next_outside[0] = 0
                daemon.take_back_peeks()
                if daemon._wake.is_set():  # the hand-back cuts the loop's wait short
                    return True
                break
            if daemon.outside_peek():
                return True
        clock.now_ns = end_ns
        return False

    daemon._wake.wait = wait  # type: ignore[method-assign,assignment]  # the loop's only sleep
    return daemon.run(duration_ns=duration_ns)


def test_a_quiet_loop_peeks_between_rounds_and_a_backlog_brings_the_round_forward() -> None:
    clock = Clock()
    daemon = Daemon(period_ns=BASE_NS, idle_period_ns=ONE_S, clock=clock)
    # rounds at 0, 100, 300, 700, 1500 ms (periods 100, 200, 400, 800), then 1 s apart; at 2.6 s
    # the source fills: the next peek (every 150 ms after a round) sees it, before 2.5 s + 1 s.
    source = BackloggedSource(clock, backlog_from_ns=2_600_000_000)
    daemon.add_source(source)
    assert run_for(daemon, clock, 4_000_000_000) == STOP_DURATION
    early = [t for t in source.polls if 2_600_000_000 <= t < 3_500_000_000]
    assert early and early[0] - 2_600_000_000 <= PEEK_PERIOD_NS  # at the first peek past the fill
    assert daemon.early_rounds == 1 and daemon.peeks == len(source.checks) > 0
    # what `agent start` says of it at exit
    assert daemon.rounds_line() == (f"{daemon.ticks} rounds (1 brought forward by a filling ring), "
                                    f"{daemon.peeks} peeks (0 by another thread)")
    looks = sorted(source.checks + source.polls)  # never longer than a peek period without a look
    assert max(b - a for a, b in zip(looks, looks[1:])) <= PEEK_PERIOD_NS
    # with the peeks the rounds themselves stay rare: ~1 s apart once quiet
    quiet = [t for t in source.polls if t < 2_600_000_000]
    assert quiet == [0, 100_000_000, 300_000_000, 700_000_000, 1_500_000_000, 2_500_000_000]


def test_a_failing_backlog_check_is_counted_and_never_stops_the_loop() -> None:
    clock = Clock()
    daemon = Daemon(period_ns=BASE_NS, idle_period_ns=ONE_S, clock=clock)
    source = BackloggedSource(clock, backlog_from_ns=None, fail=True)
    daemon.add_source(source)
    assert run_for(daemon, clock, 3_000_000_000) == STOP_DURATION
    assert daemon.poll_errors == len(source.checks) > 0 and daemon.early_rounds == 0
    assert len(source.polls) >= 6  # the rounds went on at their own pace


def test_sources_without_a_backlog_check_are_never_peeked_at() -> None:
    clock = Clock()
    daemon = Daemon(period_ns=BASE_NS, idle_period_ns=ONE_S, clock=clock)
    daemon.add_source(ScriptedSource([]))
    run_for(daemon, clock, 3_000_000_000)
    assert daemon.peeks == 0 and daemon.ticks == 7  # 0, .1, .3, .7, 1.5, 2.5, and the one past 3 s


def test_a_source_returning_none_counts_as_nothing_handled_not_as_a_failure() -> None:
    daemon = Daemon(period_ns=BASE_NS)
    daemon.add_source(ScriptedSource([None]))
    daemon.tick()
    assert daemon.poll_errors == 0 and daemon.last_handled == 0


def test_an_idle_period_below_the_base_is_refused() -> None:
    with pytest.raises(ValueError, match="idle_period_ns"):
        Daemon(period_ns=BASE_NS, idle_period_ns=BASE_NS - 1)
    assert Daemon(period_ns=BASE_NS, idle_period_ns=BASE_NS).idle_period_ns == BASE_NS  # fixed period
    with pytest.raises(ValueError, match="peek_period_ns"):
        Daemon(period_ns=BASE_NS, peek_period_ns=0)


def test_a_thread_lending_its_wake_ups_makes_the_peeks_and_the_loop_sleeps_until_its_rounds() -> None:
    clock = Clock()
    daemon = Daemon(period_ns=BASE_NS, idle_period_ns=ONE_S, clock=clock)
    source = BackloggedSource(clock, backlog_from_ns=2_650_000_000)
    daemon.add_source(source)
    policy_period_ns = 200_000_000
    assert run_for(daemon, clock, 4_000_000_000, outside_every_ns=policy_period_ns) == STOP_DURATION
    # every look at the ring between rounds was the other thread's, on its own period
    assert daemon.peeks == daemon.outside_peeks == len(source.checks) > 0
    assert all(t % policy_period_ns == 0 for t in source.checks)
    # the quiet rounds kept their pace; the fill at 2.65 s was seen by the 2.8 s peek and drained then
    assert [t for t in source.polls if t < 2_650_000_000] == [0, 100_000_000, 300_000_000, 700_000_000,
                                                             1_500_000_000, 2_500_000_000]
    assert 2_800_000_000 in source.polls and daemon.early_rounds == 1
    assert daemon.rounds_line().endswith(f"{daemon.peeks} peeks ({daemon.peeks} by another thread)")


def test_peeks_handed_back_are_the_loops_own_again_at_once() -> None:
    clock = Clock()
    daemon = Daemon(period_ns=BASE_NS, idle_period_ns=ONE_S, clock=clock)
    source = BackloggedSource(clock, backlog_from_ns=None)
    daemon.add_source(source)
    run_for(daemon, clock, 4_000_000_000, outside_every_ns=200_000_000, outside_until_ns=2_000_000_000)
    outside, own = daemon.outside_peeks, daemon.peeks - daemon.outside_peeks
    assert outside == 9 and own > 0  # 0.2 .. 1.8 s by the other thread, then the loop's own
    # from the hand-back at 2 s (the loop asleep until its 2.5 s round) never a peek period without a look
    looks = sorted([2_000_000_000, *(t for t in source.checks + source.polls if t > 2_000_000_000)])
    assert max(b - a for a, b in zip(looks, looks[1:])) <= PEEK_PERIOD_NS


def test_a_lender_slower_than_the_rings_allow_is_refused() -> None:
    daemon = Daemon(period_ns=BASE_NS)
    assert not daemon.lend_peeks(OUTSIDE_PEEK_MAX_NS + 1) and not daemon.lend_peeks(0)
    assert daemon.lend_peeks(OUTSIDE_PEEK_MAX_NS)


def test_an_outside_peek_during_a_round_reads_nothing_and_never_waits() -> None:
    clock = Clock()
    daemon = Daemon(period_ns=BASE_NS, idle_period_ns=ONE_S, clock=clock)
    source = BackloggedSource(clock, backlog_from_ns=0)
    daemon.add_source(source)
    assert daemon.lend_peeks(200_000_000)
    seen: list[bool] = []
    def hook(now_ns: int) -> None:
        seen.append(daemon.outside_peek())

    daemon.add_tick_hook(hook)
    daemon.tick()  # the hook runs inside the round: the rings may be changing under it
    assert seen == [False] and source.checks == [] and daemon.outside_peeks == 0
    source.backlog_from_ns = 0  # (the round drained it) filling again
    assert daemon.outside_peek() and source.checks == [0]  # between rounds: read, and the loop woken
    assert daemon._wake.is_set()


def test_stop_wakes_a_loop_asleep_until_its_round() -> None:
    import threading
    import time

    daemon = Daemon(period_ns=60_000_000_000, idle_period_ns=60_000_000_000)  # a minute between rounds
    daemon.add_source(BackloggedSource(Clock(), backlog_from_ns=None))
    assert daemon.lend_peeks(200_000_000)  # no own peeks: one long wait per round
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(daemon.run()))
    thread.start()
    while daemon.ticks == 0:
        time.sleep(0.01)
    daemon.stop()
    thread.join(10.0)
    assert not thread.is_alive() and result == ["signal"]


def test_the_agent_paces_its_quiet_rounds_by_whether_a_live_view_reads(tmp_path: Path) -> None:
    """Observers._pace_rounds, every round: the live interval while `agent top` reads the state file
    (or --tui runs in-process), the 4 s default while nobody does."""
    from moescope.agent import state as st
    from moescope.agent.observe import Observers

    publisher = st.PeriodicPublisher(st.StatePublisher(state_dir=tmp_path, pid=91), lambda: None,  # type: ignore[arg-type,return-value]
                                     interval_s=0.25, reader_linger_s=30.0)
    assert publisher.readers is not None
    obs = SimpleNamespace(publisher=None, live_view=False, daemon=Daemon(period_ns=BASE_NS),
                          args=SimpleNamespace(interval=0.25), policy=None, telemetry=None, _round_caps=[])
    obs._watched = lambda: Observers._watched(obs)  # type: ignore[arg-type]
    obs.pace_rounds = lambda: Observers.pace_rounds(obs)  # type: ignore[arg-type]
    obs._pace_host = lambda **kw: Observers._pace_host(obs, **kw)  # type: ignore[arg-type]  # (no sampler here)
    try:
        Observers._pace_rounds(obs, 0)  # type: ignore[arg-type]  # no state file at all: nobody can watch
        assert obs.daemon.idle_period_ns == DEFAULT_IDLE_PERIOD_NS
        obs.publisher = publisher
        Observers._pace_rounds(obs, 0)  # type: ignore[arg-type]
        assert obs.daemon.idle_period_ns == DEFAULT_IDLE_PERIOD_NS
        publisher.publisher.path.write_text("{}")
        publisher.publisher.path.open().close()  # a reader's open, as `agent top` makes at each refresh
        publisher.readers.opened_within(30.0)  # (what the publisher's thread does on waking)
        Observers._pace_rounds(obs, 0)  # type: ignore[arg-type]
        assert obs.daemon.idle_period_ns == 250_000_000
        obs.publisher, obs.live_view = None, True  # --tui: the view in this process
        Observers._pace_rounds(obs, 0)  # type: ignore[arg-type]
        assert obs.daemon.idle_period_ns == 250_000_000
        obs.daemon.quiet_period_ns = 100_000_000  # --quiet-drain-s under the live interval: kept
        Observers._pace_rounds(obs, 0)  # type: ignore[arg-type]
        assert obs.daemon.idle_period_ns == 100_000_000
        obs.live_view = False
        obs.daemon.quiet_period_ns = 8_000_000_000
        Observers._pace_rounds(obs, 0)  # type: ignore[arg-type]
        assert obs.daemon.idle_period_ns == 8_000_000_000
    finally:
        publisher.stop()


def test_a_port_waiting_for_its_successor_caps_the_quiet_period_at_its_rescan() -> None:
    """`agent start --port`: once the port's target exits, the quiet loop's rounds come at the
    rescan period (the re-attach bar is 2 s; quiet rounds are up to 4 s apart otherwise), from the
    very next round; the cap goes when nothing waits."""
    import subprocess
    import sys

    from moescope.agent.observe import Observers
    from moescope.agent.start import PORT_RESCAN_NS, TargetFollower
    from moescope.agent.targets import Target

    daemon = Daemon(period_ns=BASE_NS)
    obs = SimpleNamespace(publisher=None, live_view=False, daemon=daemon, args=SimpleNamespace(interval=1.0),
                          policy=None, telemetry=None, _round_caps=[], detach=lambda pid: None)
    obs._watched = lambda: Observers._watched(obs)  # type: ignore[arg-type]
    obs.pace_rounds = lambda: Observers.pace_rounds(obs)  # type: ignore[arg-type]
    obs.add_round_cap = lambda cap: Observers.add_round_cap(obs, cap)  # type: ignore[arg-type]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    target = Target(pid=gone.pid, start_ticks=0, name="server", popen=gone, port=1)
    follower = TargetFollower(None, obs, targets=[target], follow_ports=True)  # type: ignore[arg-type]
    obs.pace_rounds()
    assert daemon.idle_period_ns == DEFAULT_IDLE_PERIOD_NS and follower.round_cap() is None
    for _ in range(8):  # a quiet loop at its 4 s cap
        daemon.tick()
        daemon.next_period_ns()
    assert daemon.current_period_ns == DEFAULT_IDLE_PERIOD_NS
    assert follower.tick(10 * ONE_S) is None  # the target is seen gone: port 1 waits (no process listens there)
    assert follower.waiting == {1: 10 * ONE_S}
    assert daemon.idle_period_ns == PORT_RESCAN_NS == follower.round_cap()
    assert daemon.next_period_ns() == PORT_RESCAN_NS  # the round after this one, not 4 s later
    obs.pace_rounds()  # the next round's pacing keeps it
    assert daemon.idle_period_ns == PORT_RESCAN_NS
    follower.waiting.clear()  # (re-attached)
    obs.pace_rounds()
    assert daemon.idle_period_ns == DEFAULT_IDLE_PERIOD_NS
