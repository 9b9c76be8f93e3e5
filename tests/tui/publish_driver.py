"""Test driver: publishes changing snapshots through the real StatePublisher until SIGTERM.

Usage: python -m tests.tui.publish_driver STATE_DIR FIXTURE_JSON [INTERVAL_S]
Each snapshot is the fixture with seq = n, requests.rate_per_s = 1000 + n and taken_unix_s = now,
so a reader sees a value change between redraws. Prints "ready <path>" once the first is written.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from moescope.agent.state import PeriodicPublisher, Snapshot, StatePublisher, read_snapshot


def main(argv: list[str]) -> int:
    state_dir, fixture = Path(argv[0]), Path(argv[1])
    interval_s = float(argv[2]) if len(argv) > 2 else 0.1
    base = read_snapshot(fixture)
    pid = os.getpid()
    started_unix_s = time.time()
    counter = {"n": 0}

    def snapshot() -> Snapshot:
        counter["n"] += 1
        n = counter["n"]
        now_s = time.time()
        shift_s = now_s - base.taken_unix_s  # keep the recorded actions as recent as they were
        actions = [dataclasses.replace(a, at_unix_s=a.at_unix_s + shift_s) for a in base.policy.recent_actions]
        return dataclasses.replace(
            base,
            seq=n,
            taken_unix_s=now_s,
            policy=dataclasses.replace(base.policy, recent_actions=actions),
            publish_interval_s=interval_s,
            header=dataclasses.replace(base.header, agent_pid=pid, started_unix_s=started_unix_s),
            requests=dataclasses.replace(base.requests, rate_per_s=1000.0 + n),
        )

    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    publisher = StatePublisher(state_dir=state_dir, pid=pid)
    periodic = PeriodicPublisher(publisher, snapshot, interval_s=interval_s)
    periodic.start()
    deadline_s = time.monotonic() + 10.0
    while publisher.published == 0 and time.monotonic() < deadline_s:
        time.sleep(0.01)
    print(f"ready {publisher.path}", flush=True)
    stop.wait(120.0)  # bounded: a forgotten driver exits on its own
    periodic.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
