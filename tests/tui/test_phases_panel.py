"""The "where the time goes" panel: rendered from the live phase window over real breakdowns
(agent/request_phases.py), its numbers read back from the text and compared with the window's;
golden files at 80 and 160 columns; the summary line when short; "no model requests yet"; and the
whole screen with it from 80x24 up."""

from __future__ import annotations

import io
import random
import re
from collections.abc import Callable
from dataclasses import replace

import pytest
from phase_requests import MS, ModelRequest, joined
from rich.console import Console
from rich.screen import Screen

from moescope.agent import state as st
from moescope.agent.outputs.windows import WindowsOutput
from moescope.agent.phase_table import PHASE_LABELS, Phases
from moescope.agent.tui import fmt
from moescope.agent.tui.layout import Dashboard
from moescope.agent.tui.phases import FULL_ROWS, SUMMARY_ROWS, PhasesPanel, ms, share_text

from .conftest import load_fixture, render

SIZES = [(80, 24), (100, 30), (120, 30), (160, 40), (240, 60), (80, 60), (200, 20)]


class Clock:
    def __init__(self) -> None:
        self.now_ns = 7_000_000 * MS

    def __call__(self) -> int:
        return self.now_ns


def window_table(*, seed: int = 3, n: int = 150, slow_gpu: bool = False) -> Phases:
    rng = random.Random(seed)
    clock = Clock()
    windows = WindowsOutput(clock=clock)
    for i in range(n):
        shape = ModelRequest(queue_ms=rng.expovariate(1 / 20), prefill_ms=rng.uniform(20, 200),
                             decode_steps=rng.randrange(0, 60 if slow_gpu else 30),
                             decode_step_ms=rng.uniform(5, 15), input_tokens=rng.randrange(1, 300),
                             streamed=i % 3 == 0)
        event = joined(shape, start_ns=clock.now_ns, fd=i + 3)
        clock.now_ns = event.record.end_ns - 200 * MS  # requests overlap
        windows.export([event])
    clock.now_ns += 200 * MS
    return windows.phases_panel()


def cells(text: str) -> dict[str, list[str]]:
    """Each half-row's cells by label: {label: [p50, p99, share?]}."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines()[2:-1]:
        inner = line.strip("│ ")
        for half in inner.split(" │ "):
            words = half.split()
            numeric = [i for i, w in enumerate(words) if w[0].isdigit() or w == "N/A"]
            if numeric:
                out[" ".join(words[: numeric[0]])] = words[numeric[0]:]
    return out


@pytest.mark.parametrize("width", [80, 160])
def test_panel_shows_the_windows_numbers(width: int, golden: Callable[[str, str], None]) -> None:
    table = window_table()
    text = render(PhasesPanel(table), width=width)
    lines = text.splitlines()
    assert len(lines) == FULL_ROWS and all(len(line) <= width for line in lines)
    assert lines[0].startswith(f"╭─ Where the time goes · 10 s window · {table.requests} model requests "
                               f"({table.ttft_wire} streamed)")
    got = cells(text)
    for row in table.rows:
        want = [ms(row.p50_ms), ms(row.p99_ms), share_text(row.share)]
        assert got[PHASE_LABELS[row.phase]] == want, row.phase
    assert got["request"] == [ms(table.duration_p50_ms), ms(table.duration_p99_ms), "100%"]
    assert got["TTFT"] == [ms(table.ttft_p50_ms), ms(table.ttft_p99_ms)]
    assert got["TPOT"] == [ms(table.tpot_p50_ms), ms(table.tpot_p99_ms)]
    assert lines[-1].rstrip("─╯ ").endswith(f"out {fmt.count(table.output_tokens_per_s)}")
    golden(f"phases-panel-{width}", text)


def test_p99_over_the_rules_threshold_is_marked_bad() -> None:
    table = window_table(slow_gpu=True)
    inference, prefill = table.row("inference"), table.row("prefill")
    assert inference is not None and inference.p99_ms is not None and inference.p99_ms > 430.0
    assert prefill is not None and prefill.p99_ms is not None and prefill.p99_ms < 430.0
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system="standard")
    console.print(PhasesPanel(table))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    bold_red = re.escape("\x1b[1;31m") + " *{}" + re.escape("\x1b[0m")
    assert re.search(bold_red.format(re.escape(ms(inference.p99_ms))), text)  # fp16_fallback would fire
    assert not re.search(bold_red.format(re.escape(ms(prefill.p99_ms))), text)


def test_empty_and_short() -> None:
    text = render(PhasesPanel(Phases(window_s=10.0)), width=80)
    assert "no model requests yet" in text and len(text.splitlines()) == SUMMARY_ROWS
    table = window_table()
    short = render(PhasesPanel(table, height=SUMMARY_ROWS), width=80).splitlines()
    assert len(short) == SUMMARY_ROWS
    inference = table.row("inference")
    assert inference is not None
    assert short[1].startswith(f"│ inference p99 {ms(inference.p99_ms)} ms ({share_text(inference.share)})  "
                               f"TTFT p99 {ms(table.ttft_p99_ms)} ms")


@pytest.mark.parametrize("width", [60, 80, 100])
def test_the_one_line_summary_leaves_parts_out_whole(width: int) -> None:
    """A trial at 80x24 read `out 38.4…` (seconds-long CPU requests): no number is cut."""
    import dataclasses

    table = dataclasses.replace(window_table(), ttft_p99_ms=12_345.6, tpot_p99_ms=1_234.5, output_tokens_per_s=38_400.0)
    line = render(PhasesPanel(table, height=SUMMARY_ROWS), width=width).splitlines()[1]
    assert "…" not in line and line.startswith("│ inference p99 "), line
    for part in ("TTFT p99 12346 ms", "TPOT p99 1234 ms", "out 38.4k tok/s"):
        assert part in line or part.split()[0] not in line, line  # whole, or not there at all


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_screen_with_the_panel_fills_exactly(width: int, height: int) -> None:
    base = load_fixture("gpu_busy")
    s = replace(base, phases=window_table())
    text = render(Screen(Dashboard(s, now_unix_s=s.taken_unix_s)), width=width, height=height)
    lines = text.split("\n")
    assert len(lines) == height and all(len(line) == width for line in lines)
    for title in ("Requests", "Where the time goes", "MoE routing", "Devices", "Policy"):
        assert title in text, title
    assert sum(line.count("╰") for line in lines) == 5  # five boxed panels, none cut off
    full = any(line.startswith("│ phase ") or "│ phase " in line for line in lines)
    assert full == (height >= 30), (width, height)  # the table where there is room, else its summary


def test_no_panel_for_a_snapshot_without_phases() -> None:
    s = load_fixture("gpu_busy")
    assert "Where the time goes" not in render(Dashboard(s, now_unix_s=s.taken_unix_s, height=40), width=160)


def test_state_decoder_takes_the_table() -> None:
    """The table as agent/state.py writes and reads its dataclasses (JSON, NaN as null)."""
    table = window_table()
    tree = st._to_tree(table)
    assert st._decode_dataclass(Phases, tree, "state.phases") == table
