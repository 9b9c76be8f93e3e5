"""The live loop: rich Live on the alternate screen, redrawn once per tick (auto refresh off, so
no flicker), keys read in cbreak mode with select(); `q` or Ctrl-C quits, the terminal is
restored in `finally` whatever happens."""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live

from moescope import errors
from moescope.agent.state import Snapshot
from moescope.agent.tui.layout import Dashboard

DEFAULT_INTERVAL_S = 0.25
QUIT_KEYS = frozenset("qQ")


class KeyReader:
    """Single keys from a terminal in cbreak mode (no echo, no line buffering, Ctrl-C still
    interrupts). On a non-terminal stdin it only waits."""

    def __init__(self, stream: TextIO | None) -> None:
        self.fd: int | None = None
        if stream is not None:
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):
                fd = -1
            if fd >= 0 and os.isatty(fd):
                self.fd = fd
        self._saved: list[Any] | None = None

    def __enter__(self) -> KeyReader:
        if self.fd is not None:
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd, termios.TCSANOW)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def restore(self) -> None:
        if self.fd is not None and self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def read(self, timeout_s: float) -> str:
        """Keys typed within `timeout_s` ('' when none)."""
        timeout_s = max(0.0, timeout_s)
        if self.fd is None:
            time.sleep(timeout_s)
            return ""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return ""
        data = os.read(self.fd, 64)
        return data.decode(errors="replace")


def run_live(
    get_snapshot: Callable[[], Snapshot],
    interval_s: float = DEFAULT_INTERVAL_S,
    *,
    console: Console | None = None,
    stdin: TextIO | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """Show snapshots from `get_snapshot` full-screen until `q` or Ctrl-C; returns 0.

    `get_snapshot` may raise a MoescopeError: the last good snapshot stays on screen with the error
    in the header, and the loop keeps trying. Any other exception ends the view (terminal restored)
    and propagates. `should_stop` (checked every tick) ends the view from the outside, e.g. when the
    agent running it in-process has stopped.
    """
    if interval_s <= 0:
        raise errors.UsageError("--interval must be > 0")
    console = console if console is not None else Console()
    keys = KeyReader(stdin if stdin is not None else sys.stdin)
    snapshot: Snapshot | None = None
    try:
        with (
            keys,
            Live(
                console=console,
                screen=True,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            ) as live,
        ):
            next_tick_s = time.monotonic()
            while True:
                error: str | None = None
                try:
                    snapshot = get_snapshot()
                except errors.MoescopeError as exc:
                    error = str(exc)
                live.update(Dashboard(snapshot, now_unix_s=time.time(), error=error), refresh=True)
                next_tick_s += interval_s
                now_s = time.monotonic()
                if next_tick_s < now_s:  # fell behind (suspended, slow render): don't catch up in a burst
                    next_tick_s = now_s
                if should_stop is not None and should_stop():
                    return 0
                while True:
                    pressed = keys.read(next_tick_s - time.monotonic())
                    if QUIT_KEYS.intersection(pressed):
                        return 0
                    if time.monotonic() >= next_tick_s:
                        break
    except KeyboardInterrupt:
        return 0
