"""A transformers MoE server (`python -m moescope.examples.hf_server --arch qwen3_moe --tiny`), started
on its own with no environment wrapper (`moescope.instrument()` sets NVTX_INJECTION64_PATH before the
first NVTX call), is attached later by `agent start --pid PID` (which finds the injection library in
/proc/PID/maps: the variable set in-process is not in /proc/PID/environ); the requests it serves join
their steps in the traces exported over OTLP gRPC, with the routing the server itself reports on
/stats."""

from __future__ import annotations

import http.client
import os
from collections import defaultdict

from otlp_receiver import FlatSpan, GrpcOtlpReceiver

from tests.e2e.harness import (
    PYTHON,
    WAIT_S,
    Proc,
    Sent,
    agent_argv,
    completion,
    get_stats,
    parse_summary,
    wait_nvtx_attached,
    wait_runtime_ready,
)

LAYERS, EXPERTS, TOP_K = 2, 8, 2
SERVER_KIND = 2


def hf_server_argv() -> list[str]:
    return [PYTHON, "-m", "moescope.examples.hf_server", "--arch", "qwen3_moe", "--tiny", "--layers", str(LAYERS),
            "--experts", str(EXPERTS), "--top-k", str(TOP_K), "--port", "0", "--threads", "1"]


def plain_env() -> dict[str, str]:
    """The test's environment with no NVTX tool and no OTel settings: what a server started by hand has."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "NVTX_INJECTION64_PATH"}


def test_hf_server_late_attach_traces_join(bpf: None, tmp_path: object) -> None:
    server = Proc(hf_server_argv(), env=plain_env())
    agent: Proc | None = None
    conn: http.client.HTTPConnection | None = None
    try:
        port = wait_runtime_ready(server)
        assert "nvtx: active" in server.out_lines(), server.text()
        # (stderr is read by its own thread: the line may land after stdout's `ready`; CI once asserted first)
        server.wait_for_line(r"NVTX_INJECTION64_PATH set by moescope\.instrument\(\)", stream="err")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        completion(conn, max_tokens=1, prompt="before any agent")  # invisible: no agent yet
        with GrpcOtlpReceiver() as rx:
            agent = Proc(agent_argv(state_dir=tmp_path, extra=[  # type: ignore[arg-type]
                "--pid", str(server.pid), "--metrics-port", "0", "--no-policy",
                "--otlp-endpoint", rx.endpoint, "--otlp-insecure",
            ]))
            agent.wait_for_line(rf"^agent: tracing pid {server.pid} ", stream="err")
            wait_nvtx_attached(server.pid)
            sent: list[Sent] = [completion(conn, max_tokens=n, prompt=f"after attach {n}") for n in (3, 1, 2)]
            stats = get_stats(port)
            rc = agent.interrupt_and_wait()
            spans = rx.spans()
        assert rc == 0, agent.text()
    finally:
        if conn is not None:
            conn.close()
        if agent is not None:
            agent.kill_group()
        server.stop()
    summary = parse_summary(agent.out)
    assert summary.nvtx_drops == ["0"], agent.text()
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[FlatSpan]] = defaultdict(list)
    for s in spans:
        if s.parent_span_id is not None:
            assert s.parent_span_id in by_id, f"orphan {s.name}"
            children[s.parent_span_id].append(s)
    servers = sorted((s for s in spans if s.kind == SERVER_KIND), key=lambda s: s.start_ns)
    completions = [s for s in servers if any(k.name == "moe.step" for k in children[s.span_id])]
    assert len(completions) == len(sent)  # the request before the attach is not invented
    for want, span in zip(sent, completions, strict=True):
        assert span.attributes["moe.request.key"] == want.request_key
        steps = sorted((k for k in children[span.span_id] if k.name == "moe.step"), key=lambda k: k.start_ns)
        assert len(steps) == want.steps == want.max_tokens == span.attributes["moe.request.steps"]
        for step in steps:
            assert want.request_key in step.attributes["moe.step.requests"]
            assert span.start_ns <= step.start_ns <= span.end_ns
            owner = step  # one request at a time: each owns every step that carried it
            layers = sorted((k for k in children[owner.span_id] if k.name == "moe.layer"),
                            key=lambda k: k.attributes["moe.layer"])
            assert [k.attributes["moe.layer"] for k in layers] == list(range(LAYERS))
            for layer in layers:
                assert layer.attributes["moe.layer.experts"] == EXPERTS
                assert sum(layer.attributes["moe.expert.tokens"]) == TOP_K * owner.attributes["moe.step.tokens"]
                assert 0.0 < layer.attributes["moe.router.entropy_bits"] <= 3.0
    # the last step the agent saw is the one /stats calls the most recent, layer by layer
    last = max((s for s in spans if s.name == "moe.step"), key=lambda s: s.start_ns)
    last_layers = sorted((k for k in children[last.span_id] if k.name == "moe.layer"),
                         key=lambda k: k.attributes["moe.layer"])
    assert [k.attributes["moe.expert.tokens"] for k in last_layers] == [
        layer["last_step_tokens"] for layer in stats["layers"]]
