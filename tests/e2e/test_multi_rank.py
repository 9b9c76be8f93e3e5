"""Several producer processes at once, as expert-parallel ranks: three real moe/v2 producers
(benchmarks/moe_scale_producer.py, the PyPI `nvtx` package and the real injection library, each its
own ring) under one real `agent start --pid A --pid B --pid C`. Each pid's
moescope_rank_steps_total in /metrics equals the steps that producer says it emitted, the aggregate
moescope_steps_total is their sum, and the state file's ranks panel lists the three pids with the
same counts; a rank that exits keeps its row, named and marked exited. Waits are bounded and
generous; nothing asserts on speed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moescope.agent.state import Snapshot, find_agents, read_snapshot
from moescope.collectors.nvtx import INJECTION_ENV, RING_DIR_ENV, injection_env

from .harness import PYTHON, REPO, WAIT_S, Proc, agent_argv, free_port

PRODUCER = REPO / "benchmarks" / "moe_scale_producer.py"
RANKS = 3
SHAPE = ["--layers", "4", "--experts", "16", "--top-k", "2", "--convention", "v2-step", "--tokens", "16"]
STEPS_PER_S = "20"
DURATION_S = "2"


class Producer:
    """One rank: started, ready (ring made), told to step, its result line, told to exit."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def line(self) -> dict[str, object]:
        assert self.popen.stdout is not None
        text = self.popen.stdout.readline()  # the producer writes each line whole, then waits on stdin
        assert text.startswith("{"), f"producer {self.pid}: {text!r} (exit {self.popen.poll()})"
        doc: dict[str, object] = json.loads(text)
        return doc

    def tell(self, text: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text)
        self.popen.stdin.flush()

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def ring_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="moescope-ranks-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rank_steps(port: int) -> dict[str, float]:
    """moescope_rank_steps_total per pid, and "all" for moescope_steps_total."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "moescope_rank_steps_total":
                out[sample.labels["pid"]] = sample.value
            elif sample.name == "moescope_steps_total":
                out["all"] = sample.value
    return out


def latest_snapshot(state_dir: Path, agent_pid: int) -> Snapshot | None:
    for found in find_agents(state_dir):
        if found.pid == agent_pid:
            return read_snapshot(found.path)
    return None


def test_three_ranks_counted_per_pid_in_metrics_and_the_ranks_panel(
    bpf: None, tmp_path: Path, ring_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != INJECTION_ENV}
    env[RING_DIR_ENV] = str(ring_dir)
    env.update(injection_env())
    producers: list[Producer] = []
    agent: Proc | None = None
    try:
        for rank in range(RANKS):
            producers.append(Producer([PYTHON, str(PRODUCER), *SHAPE, "--steps-per-s", STEPS_PER_S,
                                       "--duration-s", DURATION_S, "--seed", str(rank)], env))
        for p in producers:
            ready = p.line()
            assert ready["ready"] is True and ready["pid"] == p.pid and ready["tool"], ready
        port = free_port()
        agent = Proc(agent_argv(state_dir=tmp_path, extra=[
            *[a for p in producers for a in ("--pid", str(p.pid))],
            "--no-policy", "--no-telemetry", "--metrics-port", str(port), "--duration", str(WAIT_S * 2)]))
        for p in producers:  # the library records nothing until an agent attaches to its ring
            agent.wait_for_line(rf"nvtx: attached to the ring of pid {p.pid}$", stream="err")
        for p in producers:
            p.tell("go\n")
        emitted = {}
        for p in producers:
            result = p.line()
            steps = result["steps_emitted"]
            assert isinstance(steps, int) and steps > 0, result
            emitted[str(p.pid)] = steps
        want = {**emitted, "all": sum(emitted.values())}
        # the producers stay alive (waiting on stdin): the agent drains every ring meanwhile
        got: dict[str, float] = {}
        snapshot: Snapshot | None = None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            got = rank_steps(port)
            snapshot = latest_snapshot(tmp_path, agent.pid)
            in_panel = {} if snapshot is None else {str(r.pid): r.steps_total for r in snapshot.ranks.ranks}
            if got == want and in_panel == emitted:
                break
            time.sleep(0.25)
        assert got == want, f"per-pid steps in /metrics {got}, producers emitted {want}\n{agent.text()}"
        assert snapshot is not None
        ranks = snapshot.ranks.ranks
        assert [r.pid for r in ranks] == sorted(p.pid for p in producers)  # one row per pid, sorted by pid
        assert {str(r.pid): r.steps_total for r in ranks} == emitted
        for r in ranks:
            assert r.nvtx_drops_total == 0, r  # each ring's own drop counters, read per pid
            assert r.step_p50_ms is not None and r.step_p99_ms is not None and r.step_p50_ms <= r.step_p99_ms
            assert r.tokens_per_s is not None and r.tokens_per_s > 0
            assert not r.exited and r.comm, r
        gone = producers[0]  # one rank exits: its row stays, named and marked, the others unmarked
        gone.tell("exit\n")
        assert gone.popen.wait(timeout=WAIT_S) == 0
        agent.wait_for_line(rf"agent: target pid {gone.pid} \(.*\) exited", stream="err")
        marked: dict[int, bool] = {}
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            snapshot = latest_snapshot(tmp_path, agent.pid)
            marked = {} if snapshot is None else {r.pid: r.exited for r in snapshot.ranks.ranks}
            if marked.get(gone.pid):
                break
            time.sleep(0.25)
        assert marked == {p.pid: p is gone for p in producers}, marked
        assert snapshot is not None
        assert {r.pid: r.comm for r in snapshot.ranks.ranks}[gone.pid] == ranks[0].comm
        assert agent.interrupt_and_wait() == 0, agent.text()
        for p in producers[1:]:
            p.tell("exit\n")
            assert p.popen.wait(timeout=WAIT_S) == 0
    finally:
        if agent is not None:
            agent.kill_group()
        for p in producers:
            p.kill()
