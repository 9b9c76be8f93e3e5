"""The ranks panel (one row per producer process) and the per-pid window behind it: rows, order,
"+K more", the straggler and exited marks, 80-column fit (step latencies of seconds whole), shown only with more
than one producer; the window's rates (by when the agent saw each step) and nearest-rank quantiles
against numbers worked out here; its pid bound."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from moescope.agent.outputs.windows import RankWindow
from moescope.agent.state import Rank, Ranks
from moescope.agent.tui.layout import Dashboard
from moescope.agent.tui.ranks import RanksPanel, slow_ranks

from .conftest import load_fixture, render

S = 1_000_000_000


def three_ranks() -> Ranks:
    return Ranks(window_s=10.0, max_ranks=64, ranks=[
        Rank(pid=4101, comm="python3", steps_per_s=25.0, step_p50_ms=3.21, step_p99_ms=4.87, tokens_per_s=1600.0,
             steps_total=250, nvtx_drops_total=0),
        Rank(pid=4102, comm="a-very-long-comm-name", steps_per_s=24.9, step_p50_ms=3.30, step_p99_ms=5.02,
             tokens_per_s=1593.6, steps_total=249, nvtx_drops_total=12),
        Rank(pid=4107, comm="python3", steps_per_s=9.5, step_p50_ms=9.80, step_p99_ms=31.4, tokens_per_s=608.0,
             steps_total=95, nvtx_drops_total=None),
    ])


def eight_ranks() -> Ranks:
    return Ranks(window_s=10.0, max_ranks=64, ranks=[
        Rank(pid=5000 + i, comm="rank", steps_per_s=25.0, step_p50_ms=3.0, step_p99_ms=4.0, tokens_per_s=1600.0,
             steps_total=250, nvtx_drops_total=0) for i in range(8)
    ])


def test_ranks_panel_golden(golden: Callable[[str, str], None]) -> None:
    for width in (80, 160):
        text = render(RanksPanel(three_ranks()), width=width)
        assert all(len(line) <= width for line in text.splitlines())
        golden(f"ranks-panel-{width}", text)


def test_ranks_panel_rows_sorted_and_cut_with_more_line() -> None:
    text = render(RanksPanel(eight_ranks(), height=7), width=80)  # border 2 + header 1: 4 rows left
    lines = text.splitlines()
    assert len(lines) == 7
    shown = [int(line.split()[1]) for line in lines if line.split()[1:2] and line.split()[1].isdigit()]
    assert shown == [5000, 5001, 5002]  # three ranks, then the "+K more" row
    assert "+5 more" in text
    summary = render(RanksPanel(three_ranks(), height=3), width=80).splitlines()
    assert len(summary) == 3
    assert "slowest pid 4107 9.5/s · worst p99 pid 4107 31.40 ms · drops 12" in summary[1]
    whole = render(RanksPanel(eight_ranks()), width=80)
    assert "more" not in whole and all(f"{5000 + i}" in whole for i in range(8))


def test_slow_rank_is_the_one_under_half_the_median_rate() -> None:
    assert slow_ranks(three_ranks().ranks) == {4107}  # median 24.9/s: 9.5 < 12.45
    assert slow_ranks(eight_ranks().ranks) == set()


def test_an_exited_rank_says_so_and_is_not_a_straggler() -> None:
    ranks = three_ranks()
    gone = dataclasses.replace(ranks.ranks[2], steps_per_s=0.4, exited=True)
    panel = dataclasses.replace(ranks, ranks=[*ranks.ranks[:2], gone])
    assert slow_ranks(panel.ranks) == set()  # its rate only runs down: not a straggler
    text = render(RanksPanel(panel), width=80, height=8)
    row = next(line for line in text.splitlines() if "4107" in line)
    assert "exited" in row and "0.4" not in row and "python3" in row
    assert "exited" not in next(line for line in text.splitlines() if "4101" in line)
    summary = render(RanksPanel(panel, height=3), width=80, height=3)
    assert "slowest pid 4102 24.9/s" in summary and "1 exited" in summary


def test_dashboard_shows_ranks_only_with_more_than_one_producer() -> None:
    base = load_fixture("gpu_busy")
    one = dataclasses.replace(base, ranks=Ranks(window_s=10.0, ranks=three_ranks().ranks[:1]))
    many = dataclasses.replace(base, ranks=eight_ranks())
    for width, height in ((80, 24), (80, 40), (160, 40)):
        text = render(Dashboard(one, now_unix_s=base.taken_unix_s, height=height), width=width, height=height)
        assert "Ranks ·" not in text
        text = render(Dashboard(many, now_unix_s=base.taken_unix_s, height=height), width=width, height=height)
        lines = text.splitlines()
        assert "Ranks · 8 producers" in text
        assert len(lines) <= height and all(len(line) <= width for line in lines)
    tall = render(Dashboard(many, now_unix_s=base.taken_unix_s, height=60), width=80, height=60)
    assert all(f"{5000 + i}" in tall for i in range(8)) and "more" not in tall.split("Ranks ·")[1].split("╰")[0]


def test_rank_window_rates_and_nearest_rank_quantiles() -> None:
    window = RankWindow(window_ns=10 * S)
    now = 100 * S
    window.add(pid=7, end_ns=now - 15 * S, duration_ms=1000.0, tokens=999)  # left the window: total only
    durations = [float(v) for v in range(100, 0, -1)]  # 100..1 ms, in a shuffled-enough order
    for i, d in enumerate(durations):
        window.add(pid=7, end_ns=now - 9 * S + i * (S // 20), duration_ms=d, tokens=64)
    window.add(pid=3, end_ns=now - S // 2, duration_ms=2.5, tokens=None)
    panel = window.panel(now)
    assert [r.pid for r in panel.ranks] == [3, 7]
    slow, busy = panel.ranks
    # nearest rank: p50 of 1..100 is the 50th value, p99 the 99th
    assert busy.step_p50_ms == 50.0 and busy.step_p99_ms == 99.0
    assert busy.steps_per_s == 100 / 10.0  # seen for 15 s: the whole 10 s window
    assert busy.tokens_per_s == 100 * 64 / 10.0
    assert busy.steps_total == 101
    assert slow.steps_per_s == 1.0  # seen for 0.5 s: rates over at least 1 s
    assert slow.step_p50_ms == slow.step_p99_ms == 2.5 and slow.tokens_per_s == 0.0
    assert busy.nvtx_drops_total is None
    assert window.panel(now, nvtx_drops={7: 4}).ranks[1].nvtx_drops_total == 4


def test_rank_window_counts_steps_by_when_the_agent_saw_them() -> None:
    """25 steps a second, each round (1 s apart, 10 ms past the second) bringing the steps that ended
    since the last: read half a second after a round, the rate is 25. Counted by their ends it read
    23.75 (the last half second's steps not yet seen): every rank ~5-8 % low in a user trial."""
    window = RankWindow(window_ns=10 * S)
    for i in range(30 * 25):
        end_ns = (i + 1) * (S // 25)
        round_ns = -(-end_ns // S) * S + S // 100  # the first round after the step ended
        window.add(pid=9, end_ns=end_ns, duration_ms=4.0, tokens=8, seen_ns=round_ns)
    (rank,) = window.panel(30 * S + S // 2).ranks
    assert rank.steps_per_s == 25.0 and rank.tokens_per_s == 200.0
    assert rank.steps_total == 750


def test_rank_window_bound_counts_untracked_and_frees_stale_pids() -> None:
    window = RankWindow(window_ns=10 * S, max_ranks=2, retention_ns=60 * S)
    window.add(pid=1, end_ns=1 * S, duration_ms=1.0, tokens=1)
    window.add(pid=2, end_ns=50 * S, duration_ms=1.0, tokens=1)
    window.add(pid=3, end_ns=55 * S, duration_ms=1.0, tokens=1)  # no free slot: pid 1 stepped 54 s ago
    assert window.untracked_steps == 1
    assert [r.pid for r in window.panel(55 * S).ranks] == [1, 2]
    window.add(pid=3, end_ns=62 * S, duration_ms=1.0, tokens=1)  # pid 1 silent for 61 s: its slot is free
    panel = window.panel(62 * S)
    assert [r.pid for r in panel.ranks] == [2, 3] and panel.untracked_steps == 1
    # at 112 s pid 2 is 62 s silent (gone); pid 3, 50 s silent, is out of the window but kept at 0 steps/s
    idle = window.panel(112 * S).ranks
    assert [r.pid for r in idle] == [3] and idle[0].steps_per_s == 0.0 and idle[0].step_p99_ms is None
    assert idle[0].steps_total == 1  # its first step came while no slot was free: untracked


def test_step_latencies_of_seconds_are_not_cut() -> None:
    """A CPU-only step of 12 s fits the 7-cell column (with two decimals it showed as `12345.…`)."""
    slow = Ranks(window_s=10.0, max_ranks=64, ranks=[
        dataclasses.replace(r, step_p50_ms=p50, step_p99_ms=12_345.67)
        for r, p50 in zip(three_ranks().ranks, (999.994, 12_345.0, 23_690.0), strict=True)
    ])
    text = render(RanksPanel(slow), width=80)
    assert not re.search(r"\d…", text), text
    assert text.count("12346") == 3 and "999.99" in text and "12345" in text and "23690" in text
