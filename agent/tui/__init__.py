"""Rich live view of one agent: panels (one module each), the adaptive layout, and the Live loop.

`Dashboard` renders a `moescope.agent.state.Snapshot` to any console size; `run_live` runs it full-screen.
"""

from __future__ import annotations

from moescope.agent.tui.app import run_live
from moescope.agent.tui.layout import Dashboard

__all__ = ["Dashboard", "run_live"]
