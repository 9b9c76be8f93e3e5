"""`agent start --nvtx-records FILE -- python producer.py`: the agent itself (not the collector in
the test) captures every NVTX event of a real 8-thread, 3-domain producer it launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from test_nvtx_capture import expected_from_log

from moescope.collectors.nvtx import KIND_PUSH, KIND_START

AGENT = Path(sys.executable).with_name("agent")
PRODUCER = Path(__file__).with_name("producer.py")
WAIT_S = 120


def test_agent_start_captures_every_event_of_a_launched_producer(bpf: None, tmp_path: Path) -> None:
    records = tmp_path / "nvtx.jsonl"
    log = tmp_path / "producer.json"
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "MOESCOPE_NVTX_DIR")}
    agent = subprocess.Popen(
        [str(AGENT), "start", "--nvtx-records", str(records), "--state-dir", str(tmp_path), "--metrics-port", "0",
         "--no-policy", "--no-telemetry", "--",
         sys.executable, str(PRODUCER), "--mode", "exact", "--threads", "8", "--rounds", "30", "--log", str(log)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        assert agent.stdout is not None and agent.stdin is not None
        assert agent.stdout.readline().strip() == "ready"  # the producer's own line (it shares stdout)
        assert agent.stderr is not None
        # The library records nothing until an agent attaches (that is what makes it free when idle).
        for _ in range(50):
            line = agent.stderr.readline()
            if not line or "nvtx: attached to the ring of pid" in line:
                break
        assert "nvtx: attached" in line, line
        agent.stdin.write("go\n")  # the launched producer reads the agent's stdin
        agent.stdin.flush()
        out, err = agent.communicate(timeout=WAIT_S)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, 9)
            agent.wait()
    assert agent.returncode == 0, err  # `-- CMD`: the command's own exit status
    assert "nvtx pid" in out and "drops 0" in out, out

    exp_ranges, exp_marks = expected_from_log(json.loads(log.read_text())["events"])
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    got_ranges = [r for r in lines if r["type"] == "range"]
    got_marks = [m for m in lines if m["type"] == "mark"]
    kinds = {"push": KIND_PUSH, "start": KIND_START}

    def range_key(r: dict[str, Any], *, name: str, kind: int) -> tuple[Any, ...]:
        return (kind, r["tid"], r["domain"], r[name], json.dumps(r["payload"]), str(r["category"]))

    want = Counter(range_key(r, name="message", kind=r["kind"]) for r in exp_ranges)
    got = Counter(range_key(r, name="name", kind=kinds[r["kind"]]) for r in got_ranges)
    assert got == want
    want_m = Counter(
        (m["tid"], m["domain"], m["message"], json.dumps(m["payload"]), str(m["category"])) for m in exp_marks
    )
    got_m = Counter((m["tid"], m["domain"], m["name"], json.dumps(m["payload"]), str(m["category"])) for m in got_marks)
    assert got_m == want_m
    assert len({r["tid"] for r in got_ranges}) >= 8
    for r in got_ranges:  # the library's stamps lie inside the producer's own brackets (checked per key above)
        assert r["start_ns"] <= r["end_ns"]
