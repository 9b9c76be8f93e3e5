"""The LLM-serving view end to end: `agent start -- reference runtime` exporting over real OTLP gRPC,
the load generator streaming at low load (`--stream`, one client), and per request a comparison of
what the agent derived from outside the process with what the server and the client saw:

* the five phases sum to the kernel-measured duration (the server span's own start and end) and
  their child spans tile it;
* `gen_ai.usage.input_tokens` / `gen_ai.usage.output_tokens` equal the server's `usage` answer;
* the agent's TTFT (kernel: first request byte read -> first response byte, the first token in one
  write with the headers) and TPOT are within 5 % of the load generator's client-side numbers
  (loopback, one client: the two sides differ only by the loopback hop and the client's parsing),
  all but two requests (the client's own scheduling; the client runs at a raised priority) and
  the median within 2 %;
* the gen_ai_server_* histograms in /metrics count those requests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import FlatSpan, GrpcOtlpReceiver

from moescope.examples.moe_runtime.launch import runtime_argv as launch_runtime_argv

from .harness import (
    PYTHON,
    REPO,
    WAIT_S,
    Proc,
    agent_argv,
    free_port,
    metric_samples,
    scrape,
    wait_nvtx_attached,
    wait_runtime_ready,
)

REQUESTS = 12
MAX_TOKENS = 32  # enough tokens that TPOT is an average: one late event moves it by 1/31 of the delay
# A model (and prompts: the load generator's "long" scenario) big enough that TTFT and TPOT are
# tens of ms on a CPU: the loopback hop and a client's scheduling delay are then small beside them.
MODEL = ["--d-model", "128", "--d-ff", "256", "--layers", "4", "--experts", "8", "--top-k", "2", "--n-heads", "4",
         "--max-seq", "512", "--threads", "1"]
PHASES = ("receive", "queue", "prefill", "decode", "write")
PHASE_SPANS = ["receive", "queue wait", "prefill", "decode", "response write"]
TOLERANCE = 0.05  # the bar: agent TTFT/TPOT within 5 % of the client's
# Requests the client itself read late (its scheduling, not the agent's: the client's reading is
# always the later one, asserted below). CI runs the suite on two busy cores: one run saw two of 11
# requests read 3 and 5 ms late (5.2 % and 7.1 % of a ~55 ms TTFT).
MAX_CLIENT_OUTLIERS = 2
# The client reads on time only if it gets a CPU the moment its event arrives. At a raised nice level
# it still waited for the next scheduler tick now and then (a run of requests read ~4.2 ms late, one
# tick at HZ=250, beside the runtime's busy model thread: 3-4 outliers in ~1 run of 6, on an idle
# machine too): as root (CI) it runs SCHED_FIFO, which preempts at once; else it says nice can't.
CLIENT_FIFO_PRIORITY = 10
CLIENT_NICE = -10
# The median: the client's side carries the loopback hop, its wake-up and its parsing, one-sided and
# ~0.5 ms of a ~55 ms TTFT on a quiet machine (1.06 % in that loaded CI run): 2 %, well inside 5 %
MEDIAN_TOLERANCE = 0.02


def client_priority() -> list[str]:
    """The command prefix that runs the load generator at the priority it reads on time with."""
    if os.geteuid() == 0 and shutil.which("chrt"):
        return ["chrt", "--fifo", str(CLIENT_FIFO_PRIORITY)]
    return ["nice", "-n", str(CLIENT_NICE)]


@dataclass
class StreamRun:
    spans: list[FlatSpan]
    loadgen: dict[str, Any]
    metrics_text: str
    output: str


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamRun]:
    tmp = tmp_path_factory.mktemp("llm_view")
    metrics_port = free_port()
    with GrpcOtlpReceiver() as rx:
        agent = Proc(agent_argv(state_dir=tmp, extra=[
            # the policy in dry run: its stats poller is what reads the runtime's model name
            "--metrics-port", str(metrics_port), "--dry-run", "--policy-audit", str(tmp / "audit.jsonl"),
            "--policy-state-dir", str(tmp), "--otlp-endpoint", rx.endpoint, "--otlp-insecure",
            "--", *launch_runtime_argv("--port", "0", "--device", "cpu", *MODEL, python=PYTHON),
        ]))
        try:
            port = wait_runtime_ready(agent)
            target_pid = int(agent.wait_for_line(r"^agent: tracing pid (\d+)", stream="err").group(1))
            wait_nvtx_attached(target_pid)
            wait_policy_ran(metrics_port)
            out = tmp / "loadgen.json"
            done = subprocess.run(
                # chrt / coreutils nice (no preexec_fn: this process runs gRPC threads); nice as not
                # root says it cannot and runs the client at the default priority
                [*client_priority(), PYTHON, "-m", "moescope.examples.moe_runtime.loadgen",
                 "--url", f"http://127.0.0.1:{port}", "--requests", str(REQUESTS), "--concurrency", "1",
                 "--scenario", "long", "--max-tokens", str(MAX_TOKENS), "--seed", "3", "--stream",
                 "--json-out", str(out)],
                cwd=REPO, capture_output=True, text=True, timeout=WAIT_S * 2, check=False,
            )
            assert done.returncode == 0, done.stderr
            loadgen: dict[str, Any] = json.loads(out.read_text())
            assert loadgen["ok"] == REQUESTS and loadgen["failures"] == 0, loadgen
            # the gen_ai_* histograms count a request when its record has been joined (a tick after
            # it ended): wait until every streamed request is in
            text = ""
            end = time.monotonic() + WAIT_S
            while time.monotonic() < end:
                try:
                    text = scrape(metrics_port)
                except OSError:
                    time.sleep(0.25)
                    continue
                if sum(metric_samples(text, "gen_ai_server_request_duration_seconds_count").values()) >= REQUESTS:
                    break
                time.sleep(0.25)
            agent.interrupt_and_wait()
            dump = os.environ.get("MOESCOPE_E2E_DUMP")  # debugging aid: the per-request comparison
            if dump:
                Path(dump).write_text(json.dumps({"loadgen": loadgen, "servers": [
                    dataclasses.asdict(s) for s in rx.spans() if s.name == "http.server.request"]}, default=repr))
            yield StreamRun(spans=rx.spans(), loadgen=loadgen, metrics_text=text, output=agent.text())
        finally:
            agent.kill_group()


def wait_policy_ran(metrics_port: int) -> None:
    """Until the policy has evaluated once: by then it has read the runtime's stats (its model)."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        try:
            if metric_samples(scrape(metrics_port), "moescope_policy_rule_signal"):
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError("the policy never evaluated (no moescope_policy_rule_signal sample)")


def matched(run: StreamRun) -> list[tuple[dict[str, Any], FlatSpan]]:
    """Each streamed answer with its server span: one client connection, so its request key is one
    fd, and its requests in send order are that fd's model requests in start order."""
    answers = sorted(run.loadgen["per_request"], key=lambda a: a["sent_ns"])
    assert len(answers) == REQUESTS
    keys = {a["request_key"] for a in answers}
    assert len(keys) == 1, keys
    servers = sorted(
        (s for s in run.spans if s.name == "http.server.request" and s.attributes["moe.request.key"] in keys
         and s.attributes["moe.request.steps"] > 0),
        key=lambda s: s.start_ns,
    )
    assert len(servers) == REQUESTS, [s.attributes for s in servers]
    return list(zip(answers, servers, strict=True))


def test_phases_sum_to_the_kernel_duration(bpf: None, stream_run: StreamRun) -> None:
    children: dict[str, list[FlatSpan]] = {}
    for s in stream_run.spans:
        if s.parent_span_id:
            children.setdefault(s.parent_span_id, []).append(s)
    for _, server in matched(stream_run):
        a = server.attributes
        duration_ms = (server.end_ns - server.start_ns) / 1e6
        phases_ms = [a[f"moe.request.phase.{p}_ms"] for p in PHASES]
        assert all(v >= 0 for v in phases_ms), phases_ms
        assert sum(phases_ms) == pytest.approx(duration_ms, abs=1e-6)  # ms floats of integer ns
        kids = sorted((k for k in children.get(server.span_id, []) if k.name in PHASE_SPANS),
                      key=lambda k: (k.start_ns, PHASE_SPANS.index(k.name)))
        assert [k.name for k in kids] == PHASE_SPANS
        edges = [server.start_ns] + [k.end_ns for k in kids]
        assert [k.start_ns for k in kids] == edges[:-1] and edges[-1] == server.end_ns
        # a streamed answer: the first token left while the request was still decoding
        assert a["moe.request.ttft_source"] == "wire"
        assert a["moe.request.phase.prefill_ms"] > 0


def test_tokens_equal_the_servers_usage(bpf: None, stream_run: StreamRun) -> None:
    for answer, server in matched(stream_run):
        a = server.attributes
        assert a["moe.request.output_tokens_reported"] is True
        assert a["gen_ai.usage.input_tokens"] == answer["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == answer["completion_tokens"]
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "moescope-reference-moe"


def test_ttft_and_tpot_agree_with_the_client(bpf: None, stream_run: StreamRun) -> None:
    rows = []
    for answer, server in matched(stream_run):
        a = server.attributes
        # the client's numbers from its own unrounded CLOCK_MONOTONIC times (loadgen's definitions)
        client_ttft = (answer["first_token_ns"] - answer["sent_ns"]) / 1e6
        events = answer["token_events"]
        client_tpot = (answer["last_token_ns"] - answer["first_token_ns"]) / 1e6 / (events - 1) if events > 1 else None
        rows.append((client_ttft, a["moe.request.ttft_ms"], client_tpot, a.get("moe.request.tpot_ms")))
    detail = "\n".join(f"client ttft {c:.3f} agent {g:.3f} | client tpot {ct} agent {gt}" for c, g, ct, gt in rows)
    for client_ttft, agent_ttft, _, _ in rows:
        # the client's TTFT spans the agent's (it sends before the server reads and reads after the
        # server writes): only the hop and the client's own parsing lie between them
        assert agent_ttft <= client_ttft, detail
    # From the second answer on: the load generator may read its first answer cold (seen once: its
    # first event read 33 ms after the kernel saw it written, against at most 5 ms for the others).
    # Of those, two may miss by the client's own scheduling (CI once saw a client read its first
    # event 16 ms after the kernel saw it written, on a machine with two busy loops beside the
    # test): the client's side is the noisy one. The median must still agree to well within 5 %
    # (MEDIAN_TOLERANCE).
    ttft_errors, tpot_errors = [], []
    for client_ttft, agent_ttft, client_tpot, agent_tpot in rows[1:]:
        assert client_tpot is not None and agent_tpot is not None, detail
        ttft_errors.append(abs(agent_ttft - client_ttft) / client_ttft)
        tpot_errors.append(abs(agent_tpot - client_tpot) / client_tpot)
    for errors in (ttft_errors, tpot_errors):
        assert sum(error > TOLERANCE for error in errors) <= MAX_CLIENT_OUTLIERS, detail
        assert statistics.median(errors) <= MEDIAN_TOLERANCE, detail


def test_gen_ai_metrics_count_the_requests(bpf: None, stream_run: StreamRun) -> None:
    text = stream_run.metrics_text
    labels = '{gen_ai_operation_name="text_completion",gen_ai_request_model="moescope-reference-moe"}'
    for name in ("gen_ai_server_request_duration_seconds", "gen_ai_server_time_to_first_token_seconds",
                 "gen_ai_server_time_per_output_token_seconds"):
        assert metric_samples(text, f"{name}_count").get(labels) == REQUESTS, (name, text)
    output = sum(answer["completion_tokens"] for answer in stream_run.loadgen["per_request"])
    assert metric_samples(text, "moescope_request_tokens_total").get('{direction="output"}') == output
    prompt = sum(answer["prompt_tokens"] for answer in stream_run.loadgen["per_request"])
    assert metric_samples(text, "moescope_request_tokens_total").get('{direction="input"}') == prompt


def test_agent_ran_cleanly(bpf: None, stream_run: StreamRun) -> None:
    assert "Traceback" not in stream_run.output, stream_run.output
