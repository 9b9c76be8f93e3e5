"""The main loop's period: longer while its sources find little, the base again at the first busy
round, with a clock the test drives (no timing is asserted: the periods are the loop's own choice)."""

from __future__ import annotations

import pytest

from moescope.agent.daemon import IDLE_PERIOD_FACTOR, QUIET_EVENTS, Daemon
from moescope.collectors.registry import SourceHealth

BASE_NS = 50_000_000


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


def periods_after(counts: list[int | None], *, sources: int = 1) -> list[int]:
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


def test_quiet_rounds_lengthen_the_period_up_to_the_cap_and_a_busy_one_resets_it() -> None:
    cap = BASE_NS * IDLE_PERIOD_FACTOR
    busy = QUIET_EVENTS + 1
    assert periods_after([0, 0, 0, 0, busy, 3, busy]) == [
        2 * BASE_NS, cap, cap, cap, BASE_NS, 2 * BASE_NS, BASE_NS,
    ]


def test_busy_is_what_all_sources_handled_together() -> None:
    # Two sources each under the mark, together over it: busy.
    assert periods_after([QUIET_EVENTS + 2], sources=2) == [BASE_NS]
    assert periods_after([QUIET_EVENTS]) == [2 * BASE_NS]  # at the mark is still quiet


def test_a_source_returning_none_counts_as_nothing_handled_not_as_a_failure() -> None:
    daemon = Daemon(period_ns=BASE_NS)
    daemon.add_source(ScriptedSource([None]))
    daemon.tick()
    assert daemon.poll_errors == 0 and daemon.last_handled == 0


def test_an_idle_period_below_the_base_is_refused() -> None:
    with pytest.raises(ValueError, match="idle_period_ns"):
        Daemon(period_ns=BASE_NS, idle_period_ns=BASE_NS - 1)
    assert Daemon(period_ns=BASE_NS, idle_period_ns=BASE_NS).idle_period_ns == BASE_NS  # fixed period
