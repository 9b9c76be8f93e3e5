"""Live view of a running agent, read-only: finds the agent's state file (under the state dir,
default /run/moescope, or MOESCOPE_STATE_DIR) and redraws it full-screen. Needs no privilege
beyond reading that file. Keys: q quits (Ctrl-C too)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from rich.console import Console

from moescope import errors
from moescope.agent.state import (
    STATE_FILE_RE,
    Snapshot,
    find_agents,
    read_snapshot,
    state_dir_default,
)
from moescope.agent.tui.app import DEFAULT_INTERVAL_S, run_live
from moescope.agent.tui.layout import Dashboard
from moescope.procfs import pid_exists


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between redraws (default {DEFAULT_INTERVAL_S}: 4 Hz)",
    )
    parser.add_argument("--state", type=Path, metavar="FILE", help="read this state file instead of looking for agents")
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="where agents publish state (default $MOESCOPE_STATE_DIR or /run/moescope)",
    )
    parser.add_argument("--pid", type=int, metavar="PID", help="the agent to show when several are running")
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one frame to stdout and exit (the default when stdout is not a terminal)",
    )


class StateFollower:
    """get_snapshot for run_live: rereads the state file; says so when the agent has gone."""

    def __init__(self, path: Path, *, agent_pid: int | None) -> None:
        self.path = path
        self.agent_pid = agent_pid

    def __call__(self) -> Snapshot:
        if self.agent_pid is not None and not pid_exists(self.agent_pid):
            raise errors.SourceUnavailable(f"agent {self.agent_pid} has exited; showing its last data")
        return read_snapshot(self.path)


def resolve_state_file(*, state: Path | None, state_dir: Path | None, pid: int | None) -> tuple[Path, int | None]:
    if state is not None:
        m = STATE_FILE_RE.match(state.name)
        return state, int(m.group(1)) if m else None
    directory = state_dir if state_dir is not None else state_dir_default()
    agents = find_agents(directory)
    if pid is not None:
        agents = [a for a in agents if a.pid == pid]
        if not agents:
            raise errors.SourceUnavailable(f"no running agent with pid {pid} publishes state in {directory}")
    if not agents:
        raise errors.SourceUnavailable(
            f"no running agent found in {directory} (start one with `agent start`, or pass --state FILE)"
        )
    if len(agents) > 1:
        others = ", ".join(str(a.pid) for a in agents[1:])
        print(
            f"agent: note: showing agent {agents[0].pid}; also running: {others} (choose with --pid)", file=sys.stderr
        )
    return agents[0].path, agents[0].pid


FRESH_AFTER_S = 1.0  # a snapshot older than this may be an idle write: wait for the one our open asks for
FRESH_WAIT_S = 2.0  # at most this long (the publisher writes within milliseconds of a reader's open)


def fresh_snapshot(path: Path, snapshot: Snapshot, *, wait_s: float = FRESH_WAIT_S) -> Snapshot:
    """The agent writes its state every 30 s while nobody reads it, and at once when someone opens
    the file (agent/state.py, PeriodicPublisher): a snapshot older than a second is followed by the
    fresh one our open asked for, within `wait_s`; an agent that writes none by then (an old agent,
    one with no inotify) is shown as read, its age on screen."""
    if time.time() - snapshot.taken_unix_s <= FRESH_AFTER_S:
        return snapshot
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            newer = read_snapshot(path)
        except errors.SourceUnavailable:  # mid-replace, or the agent just exited: keep what we have
            continue
        if newer.seq != snapshot.seq or newer.taken_unix_s > snapshot.taken_unix_s:
            return newer
    return snapshot


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # run_live restores the terminal on its way out


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise errors.UsageError("--interval must be > 0")
    path, agent_pid = resolve_state_file(state=args.state, state_dir=args.state_dir, pid=args.pid)
    first = read_snapshot(path)  # fail fast (exit 9) before taking over the screen
    if agent_pid is not None and pid_exists(agent_pid):  # a running agent's file (not a saved snapshot)
        first = fresh_snapshot(path, first)
    if args.once or not sys.stdout.isatty():  # a pipe or file gets one frame, not a redraw loop
        console = Console()
        console.print(Dashboard(first, now_unix_s=time.time(), fit_height=console.is_terminal))
        return 0
    follower = StateFollower(path, agent_pid=agent_pid if agent_pid is not None else first.header.agent_pid)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run_live(follower, args.interval)
    finally:
        signal.signal(signal.SIGTERM, previous)
