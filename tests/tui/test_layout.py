"""Layout and panel logic: sizes from 80×24 up, narrow vs wide, N/A, healthy bands, heat-map
maths (computed independently here), and run_live in a real pseudo-terminal."""

from __future__ import annotations

import dataclasses
import math
import os
import termios
import threading
import time
from typing import Any

import pytest
from rich.console import Console
from rich.screen import Screen
from rich.text import Text

from moescope import errors
from moescope.agent.state import HotExpert, MoeLayer, Snapshot
from moescope.agent.tui import fmt
from moescope.agent.tui.app import run_live
from moescope.agent.tui.columns import GAP, Column, FittedTable, ellipsize_words, fit
from moescope.agent.tui.layout import WIDE_MIN_COLUMNS, Dashboard, share_rows
from moescope.agent.tui.moe import heat_cells, heat_text
from moescope.agent.tui.policy import RULE_NAME_MIN, cut_name, name_floor
from moescope.agent.tui.requests import RequestsPanel

from .conftest import FIXTURE_NAMES, load_fixture, render

SIZES = [(80, 24), (100, 30), (119, 24), (120, 30), (160, 40), (240, 60), (80, 60), (200, 20)]


@pytest.mark.parametrize(("width", "height"), SIZES)
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_screen_fills_exactly_and_never_overflows(fixture: str, width: int, height: int) -> None:
    s = load_fixture(fixture)
    # As Live(screen=True) renders it: Screen passes the terminal height down.
    text = render(Screen(Dashboard(s, now_unix_s=s.taken_unix_s)), width=width, height=height)
    lines = text.split("\n")
    assert len(lines) == height
    assert all(len(line) == width for line in lines)
    # every panel made it onto the screen, bottom border included
    assert "Requests" in text and "MoE routing" in text and "Devices" in text and "Policy" in text
    assert lines[-1].strip() == "" or lines[-1].rstrip().endswith("╯")
    assert sum(line.count("╰") for line in lines) == 4  # four boxed panels, none cut off


def test_narrow_stacks_wide_puts_requests_beside_devices() -> None:
    s = load_fixture("gpu_busy")
    narrow = render(Dashboard(s, now_unix_s=s.taken_unix_s, height=40), width=WIDE_MIN_COLUMNS - 1, height=40)
    wide = render(Dashboard(s, now_unix_s=s.taken_unix_s, height=40), width=WIDE_MIN_COLUMNS, height=40)
    assert not any("Requests" in line and "Devices" in line for line in narrow.splitlines())
    assert any("Requests" in line and "Devices" in line for line in wide.splitlines())


def test_missing_values_show_na() -> None:
    s = load_fixture("just_started")
    text = render(RequestsPanel(s.requests), width=80)
    values_row = text.splitlines()[2]
    assert values_row.split("│")[1].split() == ["N/A"] * 6
    nan_requests = dataclasses.replace(s.requests, rate_per_s=math.nan, latency_p50_ms=12.0)
    row = render(RequestsPanel(nan_requests), width=80).splitlines()[2].split("│")[1].split()
    assert row[:3] == ["N/A", "12.0", "ms"]


def test_bands_follow_design_numbers() -> None:
    # 8.2–8.7 bits at E=16384 (log2 E = 14); router_collapse below 7.5 bits; Gini 0.08–0.12, monopoly > 0.15
    def norm(bits: float) -> float:
        return bits / 14.0

    assert fmt.judge_entropy_norm(norm(8.2)).marker == "✓"
    assert fmt.judge_entropy_norm(norm(8.7)).marker == "✓"
    assert fmt.judge_entropy_norm(norm(8.1)).marker == "↓"
    assert fmt.judge_entropy_norm(norm(8.8)).marker == "↑"
    assert fmt.judge_entropy_norm(norm(7.4)).marker == "!"
    assert fmt.judge_entropy_norm(None).marker == " "
    assert [fmt.judge_gini(g).marker for g in (0.05, 0.08, 0.1, 0.12, 0.13, 0.16)] == ["↓", "✓", "✓", "✓", "↑", "!"]
    assert fmt.judge_gini(0.16).style == fmt.STYLE_BAD and fmt.judge_gini(0.1).style == fmt.STYLE_OK
    assert fmt.judge_gini(math.nan).marker == " "


def test_heat_cells_against_hand_computed_ratios() -> None:
    # 8 experts, shares per expert; ratio = share / (1/8)
    shares = [0.05, 0.05, 0.1, 0.1, 0.2, 0.3, 0.1, 0.1]
    layer = MoeLayer(layer=0, num_experts=8, expert_token_share=shares)
    assert heat_cells(layer, 8) == pytest.approx([0.4, 0.4, 0.8, 0.8, 1.6, 2.4, 0.8, 0.8])
    # 3 cells: groups of ceil(8/3) = 3 experts, hottest wins
    assert heat_cells(layer, 3) == pytest.approx([0.8, 2.4, 0.8])
    assert str(heat_text(heat_cells(layer, 8), 10)) == "░░▒▒▓▓▒▒  "
    # binned snapshot: 16 experts in 4 bins of 4; expert 13 alone carries 40 % (6.4× uniform)
    binned = MoeLayer(
        layer=1,
        num_experts=16,
        experts_per_bin=4,
        expert_token_share=[0.2, 0.2, 0.1, 0.5],
        hot_experts=[HotExpert(expert=13, share=0.4)],
    )
    assert heat_cells(binned, 4) == pytest.approx([0.8, 0.8, 0.4, 6.4])
    assert str(heat_text(heat_cells(binned, 4), 4)) == "▒▒░█"
    assert str(heat_text([], 5)) == "N/A  "
    assert str(heat_text([math.nan, 1.0], 3)) == "?▒ "


def test_share_rows() -> None:
    assert share_rows(10, [3, 3, 3], [4, 10, 4]) == [4, 3, 3]
    assert share_rows(20, [3, 5, 5], [4, 12, 6]) == [4, 10, 6]
    assert share_rows(100, [3, 5, 5], [4, 12, 6]) == [4, 12, 6]
    assert share_rows(5, [3, 5, 5], [4, 12, 6]) == [3, 5, 5]  # too small: minimums, screen crops


def test_stale_and_error_status_in_header() -> None:
    s = load_fixture("gpu_busy")
    fresh = render(Dashboard(s, now_unix_s=s.taken_unix_s + 0.5, height=24), width=80, height=24)
    stale = render(Dashboard(s, now_unix_s=s.taken_unix_s + 75, height=24), width=80, height=24)
    gone = render(
        Dashboard(s, now_unix_s=s.taken_unix_s, error="agent 4242 has exited", height=24), width=80, height=24
    )
    assert "STALE" not in fresh and "STALE 1m15s" in stale.splitlines()[1]
    assert "⚠ agent 4242 has exited" in gone.splitlines()[1]
    assert "Requests" in gone  # last data stays on screen


def test_run_live_in_a_pty_quits_on_q_and_restores_termios() -> None:
    """run_live as `agent start --tui` calls it: in-process, a real terminal (pty), keys from it."""
    master, slave = os.openpty()
    try:
        before = termios.tcgetattr(slave)
        out = open(slave, "w", encoding="utf-8", closefd=False)
        stdin = open(slave, encoding="utf-8", closefd=False)
        console = Console(file=out, force_terminal=True, width=100, height=30, color_system="standard")
        base = load_fixture("gpu_busy")
        calls: list[int] = []
        three_calls = threading.Event()

        def get_snapshot() -> Snapshot:
            calls.append(1)
            if len(calls) == 2:
                raise errors.SourceUnavailable("state file vanished")  # shown, not fatal
            if len(calls) >= 3:
                three_calls.set()
            return dataclasses.replace(base, seq=len(calls))

        screen = bytearray()
        stop_draining = threading.Event()

        def drain() -> None:  # the "terminal" side: read what the view draws, then press q
            pressed = False
            while not stop_draining.is_set():
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    return
                screen.extend(chunk)
                if not pressed and three_calls.is_set():
                    os.write(master, b"q")
                    pressed = True

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        rc = run_live(get_snapshot, 0.02, console=console, stdin=stdin)
        assert rc == 0
        assert len(calls) >= 3
        after = termios.tcgetattr(slave)
        assert after[3] == before[3]  # lflag (ICANON, ECHO) restored
        deadline = time.monotonic() + 10
        while b"\x1b[?1049l" not in screen and time.monotonic() < deadline:
            time.sleep(0.01)
        text = screen.decode("utf-8", errors="replace")
        assert "\x1b[?1049h" in text and "\x1b[?1049l" in text  # entered and left the alternate screen
        assert "state file vanished" in text
        assert "MoE routing" in text
        stop_draining.set()
    finally:
        os.close(slave)
        os.close(master)


def test_run_live_rejects_bad_interval() -> None:
    with pytest.raises(errors.UsageError):
        run_live(lambda: load_fixture("just_started"), 0.0)


def test_formatting_helpers() -> None:
    assert [fmt.duration(v) for v in (None, math.nan, 0.4, 75, 3723, 2 * 86400 + 3 * 3600 + 5)] == [
        "N/A",
        "N/A",
        "0s",
        "1m15s",
        "1h02m03s",
        "2d03h",
    ]
    assert [fmt.count(v) for v in (None, 0, 950, 1520, 412_000, 96_000_000, 2.5)] == [
        "N/A",
        "0",
        "950",
        "1.5k",
        "412.0k",
        "96.0M",
        "2.5",
    ]
    assert fmt.gib(int(139.8 * 2**30)) == "139.8" and fmt.gib(None) == "N/A"
    assert fmt.bar(0.5, 4) == "██░░" and fmt.bar(None, 5) == " N/A " and fmt.bar(1.7, 2) == "██"
    assert fmt.num(math.inf, ".1f") == "inf" and fmt.num(3, "d") == "3"
    # three significant digits with the unit; seconds from 999.5 ms, so a column never holds `8858.2`
    latencies = (None, math.nan, 0.0, 0.8, 9.996, 48.0, 212.5, 999.4, 999.6, 8858.2, 12_034.0, 99_960.0, 4_321_000.0)
    assert [fmt.latency(v) for v in latencies] == [
        "N/A", "N/A", "0.00 ms", "0.80 ms", "10.0 ms", "48.0 ms", "212 ms", "999 ms", "1.00 s", "8.86 s", "12.0 s",
        "100 s", "4321 s",
    ]
    assert max(len(fmt.latency(10.0**k * 9.999)) for k in range(-2, 8)) <= 7 and fmt.latency(math.inf) == "inf ms"


def test_title_parts_are_dropped_whole() -> None:
    parts = [("", "Requests · kernel"), (" · ", "10 s window"), (" · ", "overflow 0.0/s")]
    assert fmt.fit_parts(parts, 100).plain == "Requests · kernel · 10 s window · overflow 0.0/s"
    assert fmt.fit_parts(parts, 42).plain == "Requests · kernel · 10 s window"  # not `… · overflow`
    assert fmt.fit_parts(parts, 5).plain == "Requests · kernel"  # the first part whatever its width
    assert fmt.panel_title(parts, 48).plain == fmt.fit_parts(parts, 48 - fmt.PANEL_TITLE_MARGIN).plain
    # counted when asked: parts left out make room for their count
    assert fmt.fit_parts(parts, 100, more_sep=" · ").plain == "Requests · kernel · 10 s window · overflow 0.0/s"
    assert fmt.fit_parts(parts, 42, more_sep=" · ").plain == "Requests · kernel · 10 s window · +1 more"
    assert fmt.fit_parts(parts, 40, more_sep=" · ").plain == "Requests · kernel · +2 more"
    assert fmt.fit_parts(parts, 5, more_sep=" · ").plain == "Requests · kernel · +2 more"


def test_rule_names_are_cut_before_their_target() -> None:
    name = Text("expert_queue_soft_limit[57,190]")
    assert cut_name(name, 40).plain == name.plain
    assert cut_name(name, 20).plain == "expert_queu…[57,190]"
    assert cut_name(Text("expert_queue_soft_limit"), 12).plain == "expert_queu…"
    assert name_floor(["expert_queue_soft_limit[57,190]", "slo_latency"]) == RULE_NAME_MIN + 1 + len("[57,190]")


def test_fitted_columns_give_up_room_in_rank_order() -> None:
    def col(header: str, cell: str, **kw: Any) -> Column:
        return Column(header, [Text(cell)], **kw)

    columns = [
        col("rule", "expert_queue_soft_limit[3,17]", rank=2, shrink_to=19, cut=cut_name),
        col("took", "955 ms", justify="right", rank=3, droppable=True),
        col("detail", "set_router_penalty L3 E17 0.3", rank=1, shrink_to=10, droppable=True, cut=ellipsize_words),
    ]
    natural = 29 + 6 + 29 + 2 * GAP
    assert [w for _, w in fit(columns, natural)] == [29, 6, 29]
    assert [w for _, w in fit(columns, natural - 4)] == [29, 6, 25]  # free text cut first
    assert [c.header for c, _ in fit(columns, 29 + 6 + 9 + 2 * GAP)] == ["rule", "took"]  # under its floor: dropped
    assert [w for _, w in fit(columns, 24 + 6 + GAP)] == [24, 6]  # then the name, down to its floor
    assert [c.header for c, _ in fit(columns, 20)] == ["rule"]  # then the number goes whole, never cut
    table = render(FittedTable(columns), width=24 + 6 + GAP)
    assert "expert_queue_soft…[3,17]  955 ms" in table
    assert ellipsize_words(Text("set_router_penalty L3 E201 0.3"), 29).plain == "set_router_penalty L3 E201 …"


@pytest.mark.parametrize("width", [60, 80, 100, 120])
def test_the_sources_line_leaves_out_a_source_rather_than_cut_its_drops(width: int) -> None:
    from moescope.agent.state import Header, SourceStats
    from moescope.agent.tui.header import HeaderBar

    sources = [SourceStats("nvtx", 687.9, 0), SourceStats("host", 1.0, 0), SourceStats("ingress", 18.8, 0),
               SourceStats("netsig", 1.0, 12345)]
    header = Header(agent_pid=1, started_unix_s=0.0, probes_attached=["ingress", "netsig", "nvtx", "host"],
                    sources=sources)
    bar = HeaderBar(header, None, taken_unix_s=10.0, now_unix_s=10.0)
    line = render(bar, width=width).splitlines()[1].rstrip()
    assert "…" not in line, line
    assert line.startswith("probes 4") and "drop" in line, line
    shown = [part for part in line.split("│")[1:]]
    more = 0
    if shown and shown[-1].strip().endswith(" more"):  # the sources left out, counted
        more = int(shown.pop().strip().removeprefix("+").removesuffix(" more"))
    assert len(shown) + more == len(sources), line
    assert all(part.strip().split()[-2] == "drop" for part in shown), line  # each source whole
    assert ("netsig 1/s drop 12.3k" in line) == (width >= 120), line  # (100 cells with its separator)


@pytest.mark.parametrize("width", [80, 100, 160])  # (the screens are laid out from 80 columns)
def test_the_header_keeps_the_uptime_whole_and_counts_targets_it_leaves_out(width: int) -> None:
    """A user trial at 80 columns in dry-run read `up 1m0…`: the targets and probes took the room."""
    from moescope.agent.state import Header, Target
    from moescope.agent.tui.header import HeaderBar

    targets = [Target(pid=14541 + i, comm="python") for i in range(8)]
    header = Header(agent_pid=14525, started_unix_s=0.0, targets=targets, dry_run=True,
                    probes_attached=["ingress", "netsig", "nvtx", "telemetry"])
    line = render(HeaderBar(header, None, taken_unix_s=65.0, now_unix_s=65.0), width=width).splitlines()[0]
    assert "…" not in line and "up 1m05s" in line and "DRY-RUN" in line, line
    shown = [part for part in line.split("up ")[0].split() if part.isdigit()]
    more = int(line.split("+")[1].split(" more")[0]) if " more" in line else 0
    assert len(shown) + more == len(targets), line


def test_a_memory_pool_under_a_gib_is_shown_in_mib() -> None:
    """The transformers server's ~1 MiB expert pool read `0.0/0.0 GiB 80%`."""
    from moescope.agent.state import HostBudget
    from moescope.agent.tui.devices import host_line

    small = render(host_line(HostBudget(source="runtime", used_bytes=880_000, total_bytes=1_100_000), 100), width=100)
    assert " 0.8/1.0 MiB  80%" in small, small
    big = render(host_line(HostBudget(source="cgroup", used_bytes=3 * 2**30, total_bytes=24 * 2**30), 100), width=100)
    assert "  3.0/24.0 GiB  12%" in big, big
