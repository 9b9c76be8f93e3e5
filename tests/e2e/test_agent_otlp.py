"""`agent start -- runtime` exporting over real OTLP gRPC to an in-test receiver, under real load.

One run (module fixture) of: the in-test TraceService receiver; `agent start --otlp-endpoint ...
--metrics-port P -- python -m moescope.examples.moe_runtime --port 0 <small model>`; our own keep-alive
client sending varied-length completions the whole time (so the live view has a request rate while
we look); the load generator (fixed request count, concurrency 4); a /metrics scrape and `agent top
--once` during the run; SIGINT to the agent. Each test then checks one property of what came back.
MOESCOPE_E2E_DUMP=FILE writes every received span (and the agent's output) as JSON lines, for debugging.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from otlp_receiver import FlatSpan, GrpcOtlpReceiver

from .harness import (
    LAYERS,
    WAIT_S,
    AgentSummary,
    Proc,
    Sent,
    TraceReport,
    Trickle,
    agent_argv,
    check_requests,
    check_traces,
    free_port,
    get_stats,
    metric_samples,
    parse_summary,
    run_cli,
    run_loadgen,
    runtime_argv,
    scrape,
    wait_nvtx_attached,
    wait_runtime_ready,
)

LOADGEN_REQUESTS = 40
LOADGEN_CONCURRENCY = 4
LOADGEN_MAX_TOKENS = 3


@dataclass
class GrpcRun:
    rc: int
    agent_pid: int
    target_pid: int
    spans: list[FlatSpan]
    sent: list[Sent]
    stepless_expected: int
    runtime_steps: int
    summary: AgentSummary
    metrics_text: str
    requests_so_far: int
    top_text: str
    top_rate_per_s: float | None
    output: str


def _top_rate(text: str) -> float | None:
    """The req/s value of `agent top --once`'s requests panel (None when N/A)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "req/s" in line and i + 1 < len(lines):
            value = lines[i + 1].strip("│ ").split()[0]
            try:
                return float(value)
            except ValueError:
                return None
    return None


@pytest.fixture(scope="module")
def grpc_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcRun]:
    tmp = tmp_path_factory.mktemp("grpc")
    metrics_port = free_port()
    with GrpcOtlpReceiver() as rx:
        agent = Proc(agent_argv(state_dir=tmp, extra=[
            "--metrics-port", str(metrics_port), "--no-policy", "--otlp-endpoint", rx.endpoint, "--otlp-insecure",
            "--", *runtime_argv(),
        ]))
        trickle: Trickle | None = None
        try:
            agent.wait_for_line(r"^agent: tracing pid (\d+)", stream="err")
            port = wait_runtime_ready(agent)
            target_pid = int(agent.wait_for_line(r"^agent: tracing pid (\d+)", stream="err").group(1))
            wait_nvtx_attached(target_pid)
            trickle = Trickle(port).start()
            run_loadgen(port, requests=LOADGEN_REQUESTS, concurrency=LOADGEN_CONCURRENCY,
                        max_tokens=LOADGEN_MAX_TOKENS, out=tmp / "loadgen.json")
            # The live view while requests still flow: retried until the state file shows a rate (bounded).
            top_text, rate = "", None
            end = time.monotonic() + WAIT_S
            while time.monotonic() < end:
                done = run_cli(["top", "--once", "--state-dir", str(tmp)])
                assert done.returncode == 0, done.stderr
                top_text, rate = done.stdout, _top_rate(done.stdout)
                if rate is not None and rate > 0:
                    break
                time.sleep(0.5)
            sent = trickle.stop()
            trickle = None
            stats = get_stats(port)  # after every completion: the runtime's own step counter
            stepless_expected = 2 + 1  # the load generator's two GET /stats, and ours
            expected = LOADGEN_REQUESTS + len(sent) + stepless_expected
            # /metrics counts a request when its kernel record reaches the pipeline: wait for all of them
            end = time.monotonic() + WAIT_S
            text, seen = "", -1.0
            while time.monotonic() < end:
                try:
                    text = scrape(metrics_port)
                except OSError as exc:  # not serving (yet): said in the failure below if it never does
                    text = f"scrape failed: {exc}"
                    time.sleep(0.25)
                    continue
                seen = metric_samples(text, "moescope_requests_total").get("", -1.0)
                if seen >= expected:
                    break
                time.sleep(0.25)
            rc = agent.interrupt_and_wait()
            dump = os.environ.get("MOESCOPE_E2E_DUMP")  # debugging aid: every received span as JSON lines
            if dump:
                with open(dump, "w", encoding="utf-8") as f:
                    for span in rx.spans():
                        f.write(json.dumps(dataclasses.asdict(span), default=repr) + "\n")
                    f.write(json.dumps({"sent": [dataclasses.asdict(x) for x in sent], "output": agent.text()}) + "\n")
            yield GrpcRun(
                rc=rc, agent_pid=agent.pid, target_pid=target_pid, spans=rx.spans(), sent=sent,
                stepless_expected=stepless_expected, runtime_steps=int(stats["counters"]["steps"]),
                summary=parse_summary(agent.out), metrics_text=text, requests_so_far=expected,
                top_text=top_text, top_rate_per_s=rate, output=agent.text(),
            )
        finally:
            if trickle is not None:
                trickle.cancel()
            agent.kill_group()


@pytest.fixture(scope="module")
def report(grpc_run: GrpcRun) -> TraceReport:
    return check_traces(grpc_run.spans)


def test_agent_stops_cleanly_on_sigint(bpf: None, grpc_run: GrpcRun) -> None:
    # the launched runtime is stopped by the agent on SIGINT: its status (0 or 130/-2 for SIGINT)
    assert grpc_run.rc in (0, 130, -2), grpc_run.output
    assert "Traceback" not in grpc_run.output, grpc_run.output


def test_one_server_span_per_client_request(bpf: None, grpc_run: GrpcRun, report: TraceReport) -> None:
    check_requests(report, loadgen_requests=LOADGEN_REQUESTS, loadgen_max_tokens=LOADGEN_MAX_TOKENS,
                   sent=grpc_run.sent, stepless_expected=grpc_run.stepless_expected)
    assert len(report.servers) == grpc_run.requests_so_far
    assert len(grpc_run.sent) >= 1
    # the requests with no step are exactly the GET /stats ones: small request, no body
    assert all(s.attributes["http.request.size"] < 200 for s in report.stepless)


def test_every_trace_reaches_its_steps_and_every_step_is_served(
    bpf: None, grpc_run: GrpcRun, report: TraceReport
) -> None:
    assert report.unjoined_steps == [], [s.attributes for s in report.unjoined_steps]
    # every step the runtime ran is in exactly one owner subtree
    assert len(report.owner_steps) == grpc_run.runtime_steps
    assert sum(len(v) for v in report.steps_of.values()) == len(report.owner_steps) + len(report.linked_steps)
    # at concurrency 4 some steps were shared by several requests: phase spans link to their owners
    assert report.linked_steps


def test_every_layer_carries_router_and_ffn_facts(bpf: None, grpc_run: GrpcRun, report: TraceReport) -> None:
    # --span-detail layer (the default): check_traces asserted, for each of the L moe.layer spans of
    # every step, no child spans and moe.layer.ffn.* / moe.layer.router.* attributes matching the
    # routing (the experts that kept tokens ran, on exactly those tokens)
    assert report.layers_checked == LAYERS * (len(report.owner_steps) + len(report.unjoined_steps)) > 0
    assert not any(s.name in ("moe.router", "moe.expert.ffn", "moe.expert.load") for s in grpc_run.spans)


def test_agent_summary_matches_what_was_received(bpf: None, grpc_run: GrpcRun, report: TraceReport) -> None:
    s = grpc_run.summary
    assert s.drops == 0 and s.unanswered == 0, grpc_run.output
    assert s.requests == s.pipeline_requests == len(report.servers)
    assert s.pipeline_joined == len(report.completions)
    assert s.pipeline_steps == len(report.owner_steps) and s.pipeline_unjoined == 0
    assert s.pipeline_spans == len(grpc_run.spans)
    assert s.nvtx_drops == ["0"], grpc_run.output
    e = s.export
    assert e["accepted"] == e["exported"] == len(grpc_run.spans), e
    assert e["failed"] == e["dropped_queue_full"] == e["dropped_shutdown"] == e["failed_batches"] == 0, e


def test_resource_names_the_target_process(bpf: None, grpc_run: GrpcRun) -> None:
    resources = {tuple(sorted((k, str(v)) for k, v in s.resource.items())) for s in grpc_run.spans}
    assert len(resources) == 1
    resource = grpc_run.spans[0].resource
    assert resource.get("host.name")
    assert all(s.attributes.get("process.pid") in (None, grpc_run.target_pid) for s in grpc_run.spans)


def test_metrics_scrape_during_the_run(bpf: None, grpc_run: GrpcRun) -> None:
    text = grpc_run.metrics_text
    assert metric_samples(text, "moescope_requests_total") == {"": float(grpc_run.requests_so_far)}
    gini = metric_samples(text, "moescope_expert_load_gini")
    assert set(gini) == {f'{{layer="{i}"}}' for i in range(LAYERS)}, gini
    assert all(0.0 <= v <= 1.0 for v in gini.values())


def test_top_once_shows_the_target_and_a_request_rate(bpf: None, grpc_run: GrpcRun) -> None:
    assert re.search(rf"target {grpc_run.target_pid}\b", grpc_run.top_text), grpc_run.top_text
    assert grpc_run.top_rate_per_s is not None and grpc_run.top_rate_per_s > 0, grpc_run.top_text


def test_numbers_for_the_log(bpf: None, grpc_run: GrpcRun, report: TraceReport) -> None:
    """Not a check of its own: prints what the run measured (visible with -s) and that it had load."""
    print(
        f"\ne2e grpc: {len(report.servers)} server spans ({len(report.completions)} joined, {len(report.stepless)} "
        f"without steps), {len(report.owner_steps)} owner steps, {len(report.linked_steps)} step links, "
        f"{report.layers_checked} layers checked, {len(grpc_run.spans)} spans, trickle {len(grpc_run.sent)} requests, "
        f"top rate {grpc_run.top_rate_per_s}/s; export {grpc_run.summary.export}"
    )
    assert len(report.completions) >= LOADGEN_REQUESTS
