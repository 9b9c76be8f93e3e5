"""Late attach: a runtime started on its own with `env $(agent nvtx-env)`, serving before any agent
exists; then `agent start --pid PID` exporting over OTLP gRPC. A keep-alive connection opened before
the attach is seeded by the probe and keeps being traced; traces still join to their steps.
"""

from __future__ import annotations

import http.client
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from otlp_receiver import FlatSpan, GrpcOtlpReceiver

from .harness import (
    WAIT_S,
    AgentSummary,
    Proc,
    Sent,
    agent_argv,
    check_requests,
    check_traces,
    completion,
    parse_summary,
    run_cli,
    run_loadgen,
    runtime_argv,
    wait_nvtx_attached,
    wait_runtime_ready,
)

LOADGEN_REQUESTS = 12
LOADGEN_MAX_TOKENS = 2


@dataclass
class LateRun:
    rc: int
    target_pid: int
    seeded: int
    spans: list[FlatSpan]
    before: list[Sent]
    after: list[Sent]
    summary: AgentSummary
    output: str


def _nvtx_env() -> dict[str, str]:
    done = run_cli(["nvtx-env"])
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    for item in done.stdout.split():
        key, _, value = item.partition("=")
        assert key and value, done.stdout
        env[key] = value
    return env


@pytest.fixture(scope="module")
def late_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LateRun]:
    tmp = tmp_path_factory.mktemp("late")
    runtime = Proc(runtime_argv(), env=_nvtx_env())
    agent: Proc | None = None
    conn: http.client.HTTPConnection | None = None
    try:
        port = wait_runtime_ready(runtime)
        # served before any agent: invisible to it, and the connection stays open across the attach
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        before = [completion(conn, max_tokens=2, prompt="before the agent") for _ in range(2)]
        with GrpcOtlpReceiver() as rx:
            agent = Proc(agent_argv(state_dir=tmp, extra=[
                "--pid", str(runtime.pid), "--metrics-port", "0", "--no-policy",
                "--otlp-endpoint", rx.endpoint, "--otlp-insecure",
            ]))
            m = agent.wait_for_line(
                rf"^agent: tracing pid {runtime.pid} .*; (\d+) open connections seeded", stream="err"
            )
            wait_nvtx_attached(runtime.pid)
            after = [completion(conn, max_tokens=n, prompt=f"after attach {n}") for n in (3, 1, 2)]
            run_loadgen(
                port, requests=LOADGEN_REQUESTS, concurrency=3, max_tokens=LOADGEN_MAX_TOKENS, out=tmp / "lg.json"
            )
            rc = agent.interrupt_and_wait()
            yield LateRun(rc=rc, target_pid=runtime.pid, seeded=int(m.group(1)), spans=rx.spans(), before=before,
                          after=after, summary=parse_summary(agent.out), output=agent.text())
    finally:
        if conn is not None:
            conn.close()
        if agent is not None:
            agent.kill_group()
        runtime.stop()


def test_late_attach_traces_join(bpf: None, late_run: LateRun) -> None:
    assert late_run.rc == 0, late_run.output  # the target is still running: a plain stop
    assert late_run.seeded >= 1  # our keep-alive connection, open before the attach
    report = check_traces(late_run.spans)
    # requests served before the attach are not invented; every one after it is traced and joined
    check_requests(report, loadgen_requests=LOADGEN_REQUESTS, loadgen_max_tokens=LOADGEN_MAX_TOKENS,
                   sent=late_run.after, stepless_expected=2)
    assert report.unjoined_steps == []
    seeded = [s for s in report.completions if s.attributes["network.peer.port"] == late_run.after[0].local_port]
    assert len(seeded) == len(late_run.after)
    assert {s.attributes["moe.connection.generation"] for s in seeded} == {0}  # 0 = open at attach
    assert all(s.attributes["process.pid"] == late_run.target_pid for s in report.servers)
    s = late_run.summary
    assert s.drops == 0 and s.nvtx_drops == ["0"], late_run.output
    assert s.pipeline_requests == len(report.servers) and s.pipeline_unjoined == 0
    e = s.export
    assert e["accepted"] == e["exported"] == len(late_run.spans), e
    assert e["failed"] == e["dropped_queue_full"] == e["dropped_shutdown"] == 0, e
    print(f"\ne2e late attach: {len(report.servers)} server spans ({len(report.completions)} joined), "
          f"{len(report.owner_steps)} owner steps, {len(report.linked_steps)} step links, {len(late_run.spans)} spans, "
          f"{late_run.seeded} connections seeded")
