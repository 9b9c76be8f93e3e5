"""Each panel and the whole screen, rendered from recorded snapshots at 80 and 160 columns,
compared with golden files (MOESCOPE_UPDATE_GOLDEN=1 rewrites them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from rich.console import RenderableType

from moescope.agent.state import Snapshot
from moescope.agent.tui.devices import DevicesPanel
from moescope.agent.tui.header import HeaderBar
from moescope.agent.tui.layout import Dashboard
from moescope.agent.tui.moe import MoePanel
from moescope.agent.tui.policy import PolicyPanel
from moescope.agent.tui.requests import RequestsPanel
from moescope.agent.tui.self_cost import SelfCostText

from .conftest import FIXTURE_NAMES, load_fixture, render

WIDTHS = (80, 160)
SCREEN_HEIGHTS = {80: 24, 160: 40}


def _header(s: Snapshot) -> RenderableType:
    return HeaderBar(
        s.header,
        s.self_cost,
        taken_unix_s=s.taken_unix_s,
        now_unix_s=s.taken_unix_s,
        seq=s.seq,
        publish_interval_s=s.publish_interval_s,
    )


PANELS: dict[str, Callable[[Snapshot], RenderableType]] = {
    "header": _header,
    "self_cost": lambda s: SelfCostText(s.self_cost),
    "requests": lambda s: RequestsPanel(s.requests),
    "moe": lambda s: MoePanel(s.moe),
    "moe_10rows": lambda s: MoePanel(s.moe, height=10),
    "devices": lambda s: DevicesPanel(s.devices),
    "policy": lambda s: PolicyPanel(s.policy, taken_unix_s=s.taken_unix_s),
    "policy_8rows": lambda s: PolicyPanel(s.policy, taken_unix_s=s.taken_unix_s, height=8),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("panel", sorted(PANELS))
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_panel_golden(fixture: str, panel: str, width: int, golden: Callable[[str, str], None]) -> None:
    snapshot = load_fixture(fixture)
    text = render(PANELS[panel](snapshot), width=width)
    assert all(len(line) <= width for line in text.splitlines())
    golden(f"{fixture}-{panel}-{width}", text)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_screen_golden(fixture: str, width: int, golden: Callable[[str, str], None]) -> None:
    snapshot = load_fixture(fixture)
    height = SCREEN_HEIGHTS[width]
    text = render(Dashboard(snapshot, now_unix_s=snapshot.taken_unix_s, height=height), width=width, height=height)
    lines = text.splitlines()
    assert len(lines) <= height
    assert all(len(line) <= width for line in lines)
    golden(f"{fixture}-screen-{width}x{height}", text)


def test_policy_side_by_side_golden(golden: Callable[[str, str], None]) -> None:
    snapshot = load_fixture("gpu_busy")
    text = render(Dashboard(snapshot, now_unix_s=snapshot.taken_unix_s, height=30), width=200, height=30)
    golden("gpu_busy-screen-200x30", text)
