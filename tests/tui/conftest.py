"""Shared helpers for the TUI tests: recorded snapshots, fixed-width rendering, golden files.

Golden files live in tests/tui/golden/; regenerate them after an intended change with
MOESCOPE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/tui -q   (then review the diff).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console, RenderableType

from moescope.agent.state import Snapshot, read_snapshot

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"
GOLDEN = HERE / "golden"
FIXTURE_NAMES = ("gpu_busy", "host_large_model", "just_started")
UPDATE = os.environ.get("MOESCOPE_UPDATE_GOLDEN") == "1"


def load_fixture(name: str) -> Snapshot:
    return read_snapshot(FIXTURES / f"{name}.json")


def render(renderable: RenderableType, *, width: int, height: int | None = None) -> str:
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        height=height if height is not None else 25,
        force_terminal=False,
        color_system=None,
        legacy_windows=False,
    )
    console.print(renderable)
    return buffer.getvalue()


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"golden file {path} missing: run with MOESCOPE_UPDATE_GOLDEN=1 and review it"
    expected = path.read_text()
    assert text == expected, f"render differs from {path} (MOESCOPE_UPDATE_GOLDEN=1 to accept):\n{text}"


@pytest.fixture
def golden() -> Callable[[str, str], None]:
    return check_golden
