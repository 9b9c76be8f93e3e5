"""`agent start --no-collector.ingress` where eBPF cannot be compiled (bcc made unimportable, as on
GPU machines without bcc or the kernel's headers): no probe loads, the launched runtime's steps still
reach /metrics and the trace files — each step its own trace, no request spans — and the summary
says kernel timing was off. Without the flag the same agent exits 4 with a hint that names it."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import time
from pathlib import Path

from moescope import errors
from tests.e2e.harness import (
    LAYERS,
    PYTHON,
    SERVER_KIND,
    WAIT_S,
    Proc,
    agent_argv,
    completion,
    free_port,
    get_stats,
    metric_samples,
    run_cli,
    runtime_argv,
    scrape,
    spans_from_otlp_json,
    wait_nvtx_attached,
    wait_runtime_ready,
)


def runtime_argv_on(port: int) -> list[str]:
    """The test runtime on a fixed port (the harness's asks for any free one)."""
    argv = runtime_argv()
    return [*argv[:argv.index("--port") + 1], str(port), *argv[argv.index("--port") + 2:]]


def no_bcc_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment with a `bcc` package first on the path that cannot be imported."""
    shadow = tmp_path / "shadow" / "bcc"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no libbcc here')\n")
    return os.environ | {"PYTHONPATH": str(shadow.parent)}


def test_without_kernel_timing_the_steps_are_traced_on_their_own(tmp_path: Path) -> None:
    state = tmp_path / "state"
    metrics_port = free_port()
    agent = Proc(agent_argv(state_dir=state, extra=[
        "--no-collector.ingress", "--no-policy", "--metrics-port", str(metrics_port), "--", *runtime_argv(),
    ]), env=no_bcc_env(tmp_path))
    try:
        port = wait_runtime_ready(agent)
        line = agent.wait_for_line(r"^agent: observing pid (\d+) .*without kernel timing", stream="err")
        wait_nvtx_attached(int(line[1]))
        before = int(get_stats(port)["counters"]["steps"])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        for n in (3, 1, 4):
            completion(conn, max_tokens=n, prompt=f"no kernel timing {n}")
        conn.close()
        ran = int(get_stats(port)["counters"]["steps"]) - before
        deadline = time.monotonic() + WAIT_S
        while True:  # the ring is drained within 500 ms; /metrics then counts every step
            seen = metric_samples(scrape(metrics_port), "moescope_steps_total").get("", 0.0)
            if seen >= ran or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        top = run_cli(["top", "--once", "--state-dir", str(state)])
        rc = agent.interrupt_and_wait()
    finally:
        agent.kill_group()
    assert ran > 0 and seen == ran, agent.text()
    assert rc == 0, agent.text()
    assert any(re.match(r"^agent: summary: kernel timing off \(--no-collector\.ingress\)", line)
               for line in agent.out), agent.text()
    assert not any("open connections seeded" in line or "network signals" in line for line in agent.err), agent.text()
    # the live view: the MoE panel from NVTX, no request numbers (N/A, not 0 req/s), no ingress probe
    assert top.returncode == 0, top
    lines = top.stdout.splitlines()
    assert re.search(r"MoE routing · 2 layers · E=8", top.stdout), top.stdout
    assert lines[1].startswith("probes ") and "nvtx" in lines[1] and "ingress" not in lines[1], top.stdout
    row = next(i for i, line in enumerate(lines) if "req/s" in line)
    assert lines[row + 1].count("N/A") == 6, top.stdout
    spans = spans_from_otlp_json(state / "traces")
    steps = [s for s in spans if s.name == "moe.step"]
    assert len(steps) == ran and not [s for s in spans if s.kind == SERVER_KIND]
    assert len({s.trace_id for s in steps}) == ran and all(s.parent_span_id is None for s in steps)
    layers = [s for s in spans if s.name == "moe.layer"]
    assert len(layers) == ran * LAYERS


def test_a_restarted_port_server_is_followed_without_kernel_timing(tmp_path: Path) -> None:
    """--port without the probe: the agent waits for the next server on the port and follows it with
    what it has (telemetry here: the servers run without the NVTX variable), claiming no probe."""
    port = free_port()
    env = no_bcc_env(tmp_path)
    first = Proc(runtime_argv_on(port), env=env)
    agent: Proc | None = None
    second: Proc | None = None
    try:
        wait_runtime_ready(first)
        agent = Proc(agent_argv(state_dir=tmp_path / "state", extra=[
            "--no-collector.ingress", "--no-policy", "--metrics-port", "0", "--port", str(port)]), env=env)
        agent.wait_for_line(rf"^agent: observing pid {first.pid} .*without kernel timing", stream="err")
        first.stop()
        agent.wait_for_line(rf"^agent: target pid {first.pid} .*exited; waiting for a process listening on port {port}",
                            stream="err")
        second = Proc(runtime_argv_on(port), env=env)
        line = agent.wait_for_line(rf"^agent: re-attached to pid {second.pid} .*$", stream="err")
        following = agent.wait_for_line(rf"^agent: following pid {second.pid}: .*$", stream="err")
        assert agent.interrupt_and_wait() == 0, agent.text()
    finally:
        for proc in (agent, second, first):
            if proc is not None:
                proc.kill_group()
    assert line[0].endswith("s after the previous target exited"), line[0]
    assert following[0] == f"agent: following pid {second.pid}: telemetry", following[0]


def test_bcc_missing_names_the_way_to_run_without_kernel_timing(tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "moescope.agent", "start", "--pid", str(os.getpid())],
        capture_output=True, text=True, timeout=WAIT_S, env=no_bcc_env(tmp_path),
    )
    assert done.returncode == errors.EXIT_BCC_MISSING, done
    assert done.stderr.startswith("agent: error: bcc is not importable (no libbcc here)"), done.stderr
    assert done.stderr.rstrip().endswith("or run with --no-collector.ingress for NVTX, telemetry and policy "
                                         "without kernel timing"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_records_need_kernel_timing(tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "moescope.agent", "start", "--no-collector.ingress", "--records", str(tmp_path / "r.jsonl"),
         "--pid", str(os.getpid())],
        capture_output=True, text=True, timeout=WAIT_S,
    )
    assert done.returncode == errors.EXIT_USAGE, done
    assert done.stderr.strip() == ("agent: error: --records writes the kernel-timed requests: it needs the ingress "
                                   "collector (drop --no-collector.ingress)"), done.stderr
