"""GPU check: `agent start --no-collector.ingress` beside CUDA serving processes at a production
routing shape — the NVTX ring, NVML, the join, the OTLP-JSON trace files, /metrics and the policy
loop against the control socket — on

  runtime: the reference runtime (examples/moe_runtime) on CUDA, 48 layers x 128 experts, top-8;
  hf:      the transformers server (examples/hf_server) with a random-weight Qwen3-MoE of the same
           routing shape on CUDA, observed through moescope.instrument().

Each target is loaded with the runtime's load generator while the agent is attached, then checked:
every step the server ran while attached reached the agent (steps equal, 0 NVTX records lost), every
layer's routing health is in /metrics, per-expert token counts add up to tokens x top-k, NVML
reports the server's own GPU memory, and the step spans are in the trace files.

Why --no-collector.ingress: the ingress probe needs bcc and the running kernel's headers, which GPU
machines without a package registry lack; the probe and its join are tested on CPU machines
(tests/ingress, tests/e2e). `--kernel` keeps the probe (a GPU host with bcc and headers). Runs as root,
as `agent start` does.

    python tests/gpu/check_agent_cuda.py [--device cuda] [--target runtime --target hf] [--load-s 15]

Prints PASS/FAIL per check and a summary; exits 1 if anything failed. `--device cpu` is a dry run
(NVML checks are then skipped; the rest runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "gpu"))
sys.path.insert(0, str(REPO / "tests"))  # the e2e harness's own imports (otlp_receiver)

from check_gpu import Children, Control, Report, echo  # noqa: E402

from moescope.collectors.nvtx import injection_env  # noqa: E402
from moescope.examples.moe_runtime.launch import LaunchError, LineReader, launch, runtime_argv  # noqa: E402
from tests.e2e.harness import free_port, scrape, spans_from_otlp_json  # noqa: E402

SHAPE = {"layers": 48, "experts": 128, "top_k": 8}
ATTACH_WAIT_S = 20.0


def target_argv(kind: str, device: str, sock: str, width: int) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment (the runtime gets the injection variable, as from
    `agent nvtx-env`; the transformers server sets it itself in moescope.instrument())."""
    env = {k: v for k, v in os.environ.items() if k != "NVTX_INJECTION64_PATH"}
    if kind == "runtime":
        argv = runtime_argv("--device", device, "--port", "0", "--control-socket", sock,
                            "--layers", str(SHAPE["layers"]), "--experts", str(SHAPE["experts"]),
                            "--top-k", str(SHAPE["top_k"]), "--d-model", str(width), "--d-ff", str(2 * width),
                            "--max-batch-size", "32")
        env.update(injection_env())
    else:
        argv = [sys.executable, "-m", "moescope.examples.hf_server", "--arch", "qwen3_moe", "--tiny",
                "--layers", str(SHAPE["layers"]), "--experts", str(SHAPE["experts"]), "--top-k", str(SHAPE["top_k"]),
                "--hidden", str(width), "--device", device, "--port", "0", "--control-socket", sock,
                "--max-batch-size", "32"]
    return argv, env


def agent_argv(pid: int, state_dir: Path, metrics_port: int, *, control_socket: str | None,
               kernel: bool) -> list[str]:
    """`agent start --pid PID` with traces to files, /metrics, every expert's series, and the policy
    in dry run against the runtime's control socket (off for the transformers server)."""
    argv = [sys.executable, "-m", "moescope.agent", "start", "--pid", str(pid), "--state-dir", str(state_dir),
            "--metrics-port", str(metrics_port), "--metrics-experts", str(SHAPE["experts"]), "--interval", "0.5"]
    if not kernel:
        argv.append("--no-collector.ingress")
    argv += (["--dry-run", "--control-socket", control_socket, "--policy-audit", str(state_dir / "audit.jsonl"),
              "--policy-state-dir", str(state_dir / "policy")] if control_socket else ["--no-policy"])
    return argv


def runtime_steps(ctl: Control) -> int:
    return int(ctl.call("stats", fields=[])["result"]["counters"]["steps"])


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f}" if values else "none"


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            out.append((labels, float(m.group(2))))
    return out


def check_target(kind: str, report: Report, children: Children, args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f"moescope-agent-{kind}-"))
    sock = str(tmp / "control.sock")
    argv, env = target_argv(kind, args.device, sock, args.width)
    label = f"{kind} on {args.device}"
    started = time.monotonic()
    try:
        launched = launch(argv, timeout_s=300, env=env, cwd=REPO, on_line=echo(kind))
    except LaunchError as exc:
        report.check(False, f"{label}: starts", str(exc)[-300:])
        return
    children.procs.append(launched.popen)
    pid, port = launched.popen.pid, launched.banner.http_port
    report.check(True, f"{label}: starts ({SHAPE['layers']} layers x {SHAPE['experts']} experts, top-{SHAPE['top_k']})",
                 f"pid {pid}, port {port}, {time.monotonic() - started:.1f} s")
    ctl = Control(sock)
    metrics_port = free_port()
    state = tmp / "state"
    agent = children.start(agent_argv(pid, state, metrics_port, control_socket=sock if kind == "runtime" else None,
                                      kernel=args.kernel),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert agent.stdout is not None
    out = LineReader(agent.stdout, on_line=echo("agent"), keep_lines=None)
    load_out = tmp / "load.json"
    try:
        try:
            out.wait_for(re.compile(rf"^agent: nvtx: attached to the ring of pid {pid}$"), timeout_s=ATTACH_WAIT_S)
            attached = True
        except LaunchError:
            attached = False
        if not report.check(attached, f"{label}: agent attached to the NVTX ring"):
            return
        steps_before = runtime_steps(ctl)
        load = children.start(
            [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}",
             "--scenario", "balanced", "--concurrency", "16", "--duration-s", str(args.load_s),
             "--json-out", str(load_out)],
            stdout=subprocess.DEVNULL,
        )
        load.wait(timeout=args.load_s + 180)
        steps_ran = runtime_steps(ctl) - steps_before
        summary = json.loads(load_out.read_text()) if load_out.exists() else {}
        report.check(load.returncode == 0 and summary.get("failures") == 0 and summary.get("requests", 0) > 0,
                     f"{label}: load served, 0 failed requests",
                     f"{summary.get('requests')} requests, {summary.get('failures')} failed, "
                     f"{summary.get('throughput_rps', '?')} req/s, latency {summary.get('latency_ms')}")
        deadline = time.monotonic() + 10.0
        while True:  # the ring is drained within 500 ms of a step; /metrics counts it then
            text = scrape(metrics_port)
            agent_steps = sum(v for _, v in metric_samples(text, "moescope_steps_total"))
            if agent_steps >= steps_ran or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    finally:
        ctl.close()
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)  #: the agent drains, exports, prints its summary
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
        out.join(30)
    lines = out.lines()
    report.check(agent.returncode == 0, f"{label}: agent exits 0 after SIGINT", f"exit {agent.returncode}")
    for line in lines:
        if line.startswith(("agent: summary:", "agent: pipeline:", "agent: nvtx pid", "agent: export:")):
            report.add("INFO", f"{label}: agent", line[len("agent: "):])
    nvtx = next((line for line in lines if line.startswith(f"agent: nvtx pid {pid}:")), "")
    report.check(", drops 0," in nvtx, f"{label}: 0 NVTX records lost", nvtx)
    report.check(steps_ran > 0 and agent_steps == steps_ran, f"{label}: every step reached the agent",
                 f"server ran {steps_ran} steps while attached, /metrics counted {agent_steps:.0f}")
    gini = metric_samples(text, "moescope_expert_load_gini")
    entropy = metric_samples(text, "moescope_router_entropy_normalized")
    gini_values, entropy_values = [v for _, v in gini], [v for _, v in entropy]
    report.check(len({d.get("layer") for d, _ in gini}) == SHAPE["layers"] and len(entropy) == SHAPE["layers"],
                 f"{label}: routing health for every layer in /metrics",
                 f"{len(gini)} Gini gauges, {len(entropy)} entropy gauges; Gini {_span(gini_values)}, "
                 f"normalised entropy {_span(entropy_values)}")
    routed = sum(v for _, v in metric_samples(text, "moescope_expert_tokens_total"))
    step_tokens = sum(v for _, v in metric_samples(text, "moescope_step_tokens_total"))
    expected = step_tokens * SHAPE["layers"] * SHAPE["top_k"]
    report.check(step_tokens > 0 and routed == expected, f"{label}: expert tokens = step tokens x layers x top-k",
                 f"{routed:.0f} routed, {step_tokens:.0f} step tokens -> {expected:.0f}")
    if args.device.startswith("cuda"):
        held = [v for labels, v in metric_samples(text, "moescope_target_memory_bytes")
                if labels.get("device") != "host"]
        report.check(any(v > 0 for v in held), f"{label}: NVML: the server's own GPU memory",
                     f"{[f'{v / (1 << 20):.0f} MiB' for v in held]}")
        used = metric_samples(text, "moescope_device_memory_used_bytes")
        report.add("INFO", f"{label}: device memory",
                   ", ".join(f"{d.get('device')}: {v / (1 << 30):.1f} GiB" for d, v in used))
        links = metric_samples(text, "moescope_nvlink_transmit_bytes_total")
        report.add("INFO", f"{label}: NVLink series", f"{len(links)} (one per active link; none without NVLink)")
    if kind == "runtime":
        report.check(any(line.startswith("agent: policy: ") and "dry-run" in line for line in lines),
                     f"{label}: policy loop on the control socket (dry run)",
                     next((line for line in lines if line.startswith("agent: policy")), "no policy line"))
    spans = Counter(span.name for span in spans_from_otlp_json(state / "traces"))
    report.check(spans.get("moe.step", 0) > 0, f"{label}: step spans in the OTLP-JSON trace files",
                 json.dumps(dict(sorted(spans.items(), key=lambda kv: -kv[1])[:8])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the servers' torch device (cpu: a dry run)")
    parser.add_argument("--target", action="append", choices=("runtime", "hf"), help="default: both")
    parser.add_argument("--load-s", type=float, default=15.0, help="load generator duration per target")
    parser.add_argument("--width", type=int, default=128, help="model width (routing shape is fixed)")
    parser.add_argument("--kernel", action="store_true",
                        help="keep the eBPF ingress probe (a host with bcc and the kernel's headers)")
    args = parser.parse_args(argv)
    report = Report()
    children = Children()
    started = time.monotonic()
    for kind in args.target or ["runtime", "hf"]:
        print(f"== agent beside the {kind} server", flush=True)
        try:
            check_target(kind, report, children, args)
        except Exception as exc:  # the summary must still print; the failure is counted
            report.add("FAIL", f"{kind}: check script", f"{type(exc).__name__}: {exc}")
        finally:
            children.stop_all()
            children.procs.clear()
    return report.summary(started)


if __name__ == "__main__":
    sys.exit(main())
