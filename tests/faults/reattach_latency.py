"""Measure how long `agent start --port` takes to re-attach to a restarted server (a script, not a
test: the fault test checks that re-attach happens; this one says how fast).

    sudo .venv/bin/python tests/faults/reattach_latency.py [--restarts 5]

A plain listener stands in for the server, so the moment of listen() is known exactly. The time
counted runs from its listen() to the agent's `re-attached` line, and the result goes to
bench-results/reattach-latency.json. The bar (docs/reliability.md) is 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.faults.harness import AGENT, free_port, kill_group  # noqa: E402

LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
    "print(time.monotonic_ns(), flush=True)\n"
    "time.sleep(600)\n"
)
WAIT_S = 30.0


def start_listener(port: int) -> tuple[subprocess.Popen[str], int]:
    popen = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert popen.stdout is not None
    return popen, int(popen.stdout.readline())


def wait_count(path: Path, text: str, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while path.read_text().count(text) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {text!r} x{count} in {path}")
        time.sleep(0.002)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--json-out", default=str(REPO / "bench-results" / "reattach-latency.json"))
    args = parser.parse_args()
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="moescope-reattach-"))
    stderr_path = tmp / "agent.stderr"
    server, _ = start_listener(port)
    with open(stderr_path, "wb") as stderr:
        agent = subprocess.Popen(
            [str(AGENT), "start", "--port", str(port), "--no-policy", "--no-nvtx", "--metrics-port", "0",
             "--state-dir", str(tmp / "state")],
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
        )
    latencies_s: list[float] = []
    try:
        wait_count(stderr_path, "agent: tracing", 1)
        for i in range(1, args.restarts + 1):
            kill_group(server)
            wait_count(stderr_path, "waiting for a process listening", i)
            time.sleep(0.3)  # the server is down a while, as a restart would be
            server, listen_ns = start_listener(port)
            wait_count(stderr_path, "re-attached to", i)
            latencies_s.append((time.monotonic_ns() - listen_ns) / 1e9)
    finally:
        kill_group(server)
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)
        try:
            agent.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            kill_group(agent)
        shutil.rmtree(tmp, ignore_errors=True)
    max_s, bar_s = round(max(latencies_s), 4), 2.0
    result = {
        "what": "listen() of a restarted server -> agent's re-attached line (agent start --port)",
        "restarts": len(latencies_s),
        "latency_s": [round(x, 4) for x in latencies_s],
        "median_s": round(statistics.median(latencies_s), 4),
        "max_s": max_s,
        "bar_s": bar_s,
    }
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0 if max_s <= bar_s else 1


if __name__ == "__main__":
    sys.exit(main())
