"""The embedded default: no OTLP endpoint, so the agent writes OTLP-JSON lines under --state-dir and
`agent traces list|show` read them back. Same runtime, same checks as the gRPC test, plus the policy
engine left on (audit and state under the temp dir) so the whole agent runs as a user would start it.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from otlp_receiver import FlatSpan

from moescope.agent.policy.audit import OUTCOMES

from .harness import (
    WAIT_S,
    AgentSummary,
    Proc,
    Sent,
    TraceReport,
    agent_argv,
    check_requests,
    check_traces,
    completion,
    free_port,
    metric_samples,
    parse_summary,
    run_cli,
    run_loadgen,
    runtime_argv,
    scrape,
    spans_from_otlp_json,
    wait_nvtx_attached,
    wait_runtime_ready,
)

LOADGEN_REQUESTS = 16
LOADGEN_MAX_TOKENS = 2


@dataclass
class FileRun:
    rc: int
    state_dir: Path
    spans: list[FlatSpan]
    sent: list[Sent]
    summary: AgentSummary
    output: str
    scraped: str  # the agent's /metrics at the end of the load, before it stopped


@pytest.fixture(scope="module")
def file_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileRun]:
    tmp = tmp_path_factory.mktemp("filestore")
    metrics_port = free_port()
    agent = Proc(agent_argv(state_dir=tmp, extra=[
        "--metrics-port", str(metrics_port), "--policy-audit", str(tmp / "audit.jsonl"), "--policy-state-dir", str(tmp),
        "--span-detail", "expert",  # the full tree here; the gRPC test checks the default (layer)
        "--", *runtime_argv(),
    ]), env=_without_otlp_env())
    try:
        target_pid = int(agent.wait_for_line(r"^agent: tracing pid (\d+)", stream="err").group(1))
        agent.wait_for_line(r"^agent: traces: OTLP-JSON files under ", stream="err")
        port = wait_runtime_ready(agent)
        wait_nvtx_attached(target_pid)
        # moe.precision comes from the runtime's stats, read by the policy's poller and sent into
        # the join as a record: requests start once one has been (the source's event counter).
        agent.wait_for_line(r"policy: \d+ rules", stream="err")
        deadline = time.monotonic() + WAIT_S
        while metric_samples(scrape(metrics_port), "moescope_agent_events_total").get(
                '{source="runtime-stats"}', 0.0) < 1:
            assert time.monotonic() < deadline, "the runtime's stats never reached the agent's join"
            time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        try:
            sent = [completion(conn, max_tokens=n, prompt=f"file store {n}") for n in (1, 2, 3, 4)]
        finally:
            conn.close()
        run_loadgen(port, requests=LOADGEN_REQUESTS, concurrency=4, max_tokens=LOADGEN_MAX_TOKENS, out=tmp / "lg.json")
        scraped = scrape(metrics_port)
        rc = agent.interrupt_and_wait()
        yield FileRun(rc=rc, state_dir=tmp, spans=spans_from_otlp_json(tmp / "traces"), sent=sent,
                      summary=parse_summary(agent.out), output=agent.text(), scraped=scraped)
    finally:
        agent.kill_group()


def _without_otlp_env() -> dict[str, str]:
    """This test is about the default: an OTEL_EXPORTER_OTLP_* in the caller's environment must not leak in."""
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


@pytest.fixture(scope="module")
def file_report(file_run: FileRun) -> TraceReport:
    return check_traces(file_run.spans, span_detail="expert")


def test_files_hold_every_request_and_step(bpf: None, file_run: FileRun, file_report: TraceReport) -> None:
    assert file_run.rc in (0, 130, -2), file_run.output
    check_requests(file_report, loadgen_requests=LOADGEN_REQUESTS, loadgen_max_tokens=LOADGEN_MAX_TOKENS,
                   sent=file_run.sent, stepless_expected=2)
    assert file_report.unjoined_steps == []
    s = file_run.summary
    assert s.drops == 0 and s.nvtx_drops == ["0"], file_run.output
    assert s.pipeline_requests == len(file_report.servers) and s.pipeline_joined == len(file_report.completions)
    # the policy engine (on in this run) traces each action it takes as its own root span
    policy = [x for x in file_run.spans if x.scope == "moescope.policy"]
    assert all(x.name.startswith("moe.policy.") and x.parent_span_id is None for x in policy)
    assert s.pipeline_spans == len(file_run.spans) - len(policy)
    e = s.export
    assert e["accepted"] == e["exported"] == len(file_run.spans), e
    assert e["failed"] == e["dropped_queue_full"] == e["dropped_shutdown"] == 0, e
    # what the agent cost, by thread: its own threads by their OS names (the main loop, the policy
    # poll, the file exporter), so `top -H` and this line say which part costs what
    assert {"main", "ms-policy", "ms-export-file"} <= set(s.threads), file_run.output
    assert s.threads["main"] > 0 and all(cpu >= 0 for cpu in s.threads.values())
    assert s.rounds > 0 and 0 <= s.early_rounds <= s.rounds
    # once the policy ran (every 200 ms), its thread made the main loop's peeks at the rings
    assert 0 < s.outside_peeks <= s.peeks, file_run.output
    # the policy read the runtime's queues from its stats page between control-socket calls, the
    # page opened through /proc/PID/root as the agent opens it (docs/control-protocol.md "Stats page")
    reads = re.search(r"^agent: runtime reads: (\d+), (\d+) of them from its stats page, (\d+) failed$",
                      file_run.output, re.M)
    assert reads is not None, file_run.output
    total, from_page, failed = map(int, reads.groups())
    assert failed == 0 and 0 < from_page < total, file_run.output
    # ... and no evaluation of the policy raised (one would be logged once and counted here)
    evaluations = re.search(r"^agent: policy: (\d+) audit records(?: \((.+)\))?, (\d+) evaluations failed$",
                            file_run.output, re.M)
    assert evaluations is not None and evaluations.group(3) == "0", file_run.output
    # the records by outcome ("40 ok, 6 timeout"): a refused or unanswered action shows at exit
    by_outcome = [part.split(" ", 1) for part in (evaluations.group(2) or "").split(", ") if part]
    assert sum(int(n) for n, _ in by_outcome) == int(evaluations.group(1)), file_run.output
    assert all(outcome in OUTCOMES for _, outcome in by_outcome), file_run.output
    # the NVTX parser's unplaced events, by reason, in /metrics as at exit (the scrape came before
    # the final drain, so it holds at most what the summary counts)
    unplaced = metric_samples(file_run.scraped, "moescope_nvtx_anomalies_total")
    assert {labels.split('"')[1] for labels in unplaced} == {"unknown_names", "malformed_payloads",
                                                            "malformed_categories", "misplaced", "orphans",
                                                            "pending_overflow"}, unplaced
    at_exit = re.findall(r"^agent: nvtx pid \d+: .*, anomalies (\d+)", file_run.output, re.M)
    assert at_exit and sum(unplaced.values()) <= sum(map(int, at_exit)), (unplaced, at_exit)
    print(f"\ne2e file store: {len(file_report.servers)} server spans ({len(file_report.completions)} joined, "
          f"{len(policy)} policy spans), {len(file_report.owner_steps)} owner steps, "
          f"{len(file_report.linked_steps)} step links, {len(file_run.spans)} spans")


def test_metrics_say_where_the_agents_cpu_goes_by_thread_and_by_part(bpf: None, file_run: FileRun) -> None:
    """moescope_agent_thread_cpu_seconds by the threads' OS names, and
    moescope_agent_work_cpu_seconds by part of the main loop (its sources and round hooks, named)
    and of the policy's wake-ups; a thread's parts never add up to more than the thread."""
    def by_labels(name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), value)
                for labels, value in metric_samples(file_run.scraped, name).items()]

    threads = {labels["thread"]: v for labels, v in by_labels("moescope_agent_thread_cpu_seconds_total")}
    assert {"main", "ms-policy", "ms-export-file"} <= set(threads), threads
    assert threads["main"] > 0 and threads["ms-policy"] > 0, threads
    work = by_labels("moescope_agent_work_cpu_seconds_total")
    main = {labels["part"]: v for labels, v in work if labels["thread"] == "main"}
    policy = {labels["part"]: v for labels, v in work if labels["thread"] == "policy"}
    # the sources by their names, the hooks by the names they were added with
    assert {"nvtx", "ingress", "requests", "encode-spans", "self-metrics", "pacing"} <= set(main), main
    assert main["nvtx"] > 0 and main["requests"] > 0, main
    assert set(policy) == {"wake", "signals", "evaluate", "peeks"}, policy
    assert policy["signals"] > 0 and policy["evaluate"] > 0, policy
    # thread time by part (CLOCK_THREAD_CPUTIME_ID) within the thread's own (schedstat, read after)
    slack_s = 0.05
    assert sum(main.values()) <= threads["main"] + slack_s, (main, threads)
    assert sum(policy.values()) <= threads["ms-policy"] + slack_s, (policy, threads)
    assert re.search(r"^agent: policy thread CPU: ", file_run.output, re.M), file_run.output


def test_expert_spans_carry_the_precision_the_runtime_reports(bpf: None, file_run: FileRun) -> None:
    """moe.precision comes from the runtime's control-socket stats (read by the policy's poller, sent
    through the join as a record): every expert-compute span of this run (moe/v2: one moe.experts per
    layer), all after the first poll, says fp32."""
    computed = [x for x in file_run.spans if x.name in ("moe.experts", "moe.expert.ffn")]
    assert computed
    assert {x.attributes.get("moe.precision") for x in computed} == {"fp32"}


def test_traces_list_matches_the_files(bpf: None, file_run: FileRun) -> None:
    done = run_cli(["traces", "list", "--state-dir", str(file_run.state_dir), "--limit", "0", "--json"])
    assert done.returncode == 0, done.stderr
    listed = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    per_trace = Counter(s.trace_id for s in file_run.spans)
    assert {t["trace_id"]: t["spans"] for t in listed} == dict(per_trace)
    roots = {s.trace_id: s.name for s in file_run.spans if s.parent_span_id is None}
    assert all(t["root"] == roots[t["trace_id"]] for t in listed)
    starts = [t["start_ns"] for t in listed]
    assert starts == sorted(starts, reverse=True)  # newest first


def test_traces_show_a_request_with_its_steps(bpf: None, file_run: FileRun, file_report: TraceReport) -> None:
    # our 4-token request: its trace has the server span and 4 steps reachable from it
    mine = [s for s in file_report.completions if s.attributes["network.peer.port"] == file_run.sent[-1].local_port]
    server = max(mine, key=lambda s: s.start_ns)
    steps = file_report.steps_of[server.span_id]
    assert len(steps) == 4
    prefix = server.trace_id[:8]  # a unique prefix works too
    done = run_cli(["traces", "show", prefix, "--state-dir", str(file_run.state_dir), "--json"])
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["trace_id"] == server.trace_id
    by_id = {s["span_id"]: s for s in shown["spans"]}
    assert by_id[server.span_id]["name"] == "http.server.request" and by_id[server.span_id]["kind"] == "SERVER"
    owned = [step for step in steps if step.trace_id == server.trace_id]
    for step in owned:  # the steps it owns are its children; the others are its phase spans' links
        assert by_id[step.span_id]["parent_span_id"] == server.span_id
        assert by_id[step.span_id]["name"] == "moe.step"
    linked = {(s.trace_id, s.span_id) for s in steps if s.trace_id != server.trace_id}
    shown_links = {(link["trace_id"], link["span_id"]) for s in shown["spans"] for link in s["links"]}
    assert shown_links == linked
    assert len(shown["spans"]) == sum(1 for s in file_run.spans if s.trace_id == server.trace_id)

    text = run_cli(["traces", "show", server.trace_id, "--state-dir", str(file_run.state_dir)])
    assert text.returncode == 0, text.stderr
    assert f"trace {server.trace_id}" in text.stdout
    for name in ("http.server.request [SERVER]", "queue wait", "prefill", "decode"):
        assert name in text.stdout, text.stdout
    # a step it owns shows its layers; a step another trace owns is a link to that owner
    if owned:
        assert "moe.step" in text.stdout
        assert "moe.layer" in text.stdout and "moe.router" in text.stdout and "moe.experts" in text.stdout
    if linked:
        assert 'moe.link="step.owner"' in text.stdout


def test_traces_show_unknown_id_is_a_one_line_error(bpf: None, file_run: FileRun) -> None:
    done = run_cli(["traces", "show", "ffffffffffffffffffffffffffffffff", "--state-dir", str(file_run.state_dir)])
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
