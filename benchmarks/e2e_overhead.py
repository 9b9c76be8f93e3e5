"""End-to-end overhead: the reference MoE runtime under the load generator, agent off vs on with
every probe (DESIGN bars: <= 1 % serving throughput cost; agent <= 5 % of one core and <= 100 MB RSS;
issue 15: agent <= 0.5 ms of CPU per request).

Three arms, each a fresh runtime process, alternated round by round (order rotated every round so
machine drift hits every arm equally), medians compared:
  off    runtime started with the NVTX injection variable (`agent nvtx-env`), no agent
  on     the same runtime start, then `agent start --pid` with everything: kernel ingress probe,
         NVTX capture, host/NVML telemetry, traces to the OTLP-JSON file store, /metrics served
         (and scraped), policy engine in --dry-run (decides and audits, sends nothing)
  bare   runtime started without the injection variable, no agent: off vs bare is what the NVTX
         package's tool path costs even with no agent attached (reported apart from the agent)

Why a fresh runtime per run rather than attach/detach on one: the "bare" arm needs another
environment anyway, a detached agent leaves the injection library with its ring mapped, and a
long-lived server drifts (allocator, batching state); fresh processes make every run independent and
start-up (1-2 s) is outside the measured window. Each run: runtime ready -> (agent attached) ->
warm-up load -> measured closed-loop load for --duration-s -> agent SIGINT (its summary is kept).

Agent CPU is its threads' time on a CPU over the measured window, from their schedstat (ns; the
utime + stime of /proc/PID/stat are whole 10 ms ticks, ±10 % on the ~0.1 s an agent spends in a
round; those are used instead when a thread left within the window), as % of one core; its peak
RSS is VmHWM (bcc compiles in a child process, not counted), with VmRSS and its anon/file/shmem
split at the end of the window. Runtime CPU is its utime + stime (~13 s a round: ticks suffice, and
its per-connection threads come and go).
The agent's eBPF programs run in the kernel on the runtime's own syscalls, so their CPU is in the
runtime's, not the agent's: an on-round turns kernel.bpf_stats_enabled on for its measured window
(restored after) and reads their run time from the agent's program descriptors (/proc/PID/fdinfo),
reported as a share of the runtime's CPU beside the agent's own share.

    sudo .venv/bin/python -m benchmarks.e2e_overhead [--pairs 5] [--duration-s 15] [--quick]
    sudo .venv/bin/python -m benchmarks.e2e_overhead --soak [SECONDS]   # default 3600: flat RSS
    ... --agent-arg=--no-nvtx     # cost breakdown: an extra `agent start` flag for the on arm / soak
    ... --no-bare --pairs 12      # off/on only: more rounds of the agent's bars in the same time

Writes bench-results/e2e_overhead.json (or e2e_soak.json; *_breakdown_<args>.json with
--agent-arg). Each ratio of the bars comes with a 95 % bootstrap interval over the rounds and a
reading of it against its bar: met, missed, or unresolved (the rounds swing across the bar); the
host-CPU ratio also by its parts measured in the same windows (the agent's CPU and its eBPF
programs' over the runtime's), which the swing between rounds does not reach. Exit status: 0 all
bars met, 1 a bar missed (numbers still written), 2 bad options, 3 not root, 4 a run could not be
carried out (runtime or agent did not come up with every probe).
How to read the numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MIN_INTERVAL_RUNS,
    REPO,
    ABResult,
    Metrics,
    bpf_run_time_ns,
    bpf_stats_enabled,
    median_ratio_interval,
    write_result,
)
from moescope.agent.join import DEFAULT_STEP_RETENTION_NS
from moescope.collectors.nvtx import INJECTION_ENV, RING_DIR_ENV, injection_env
from moescope.examples.moe_runtime.launch import LaunchError, LineReader, launch, runtime_argv
from moescope.procfs import task_cpu

ARMS: tuple[str, ...] = ("off", "on", "bare")
BAR_THROUGHPUT_COST = 0.01
BAR_AGENT_CPU_PCT_OF_CORE = 5.0
BAR_AGENT_RSS_BYTES = 100_000_000
BAR_AGENT_CPU_MS_PER_REQUEST = 0.5  # issue 15: the per-record work a production shape multiplies
# Soak: RSS counts as flat when the fitted slope projects less than this growth over an hour.
BAR_SOAK_GROWTH_BYTES_PER_HOUR = 10_000_000
SOAK_SAMPLE_S = 10.0
STEP_RETENTION_S = DEFAULT_STEP_RETENTION_NS / 1e9
START_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
REQUESTS_METRIC = "moescope_request_duration_seconds_count"


class BenchError(RuntimeError):
    """A run could not be carried out as specified (a crash, not a missed bar)."""


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the comm (field 3 onward: index 0 is the state)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # comm may hold spaces; fields resume after ')'


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid`, in seconds (fields 14 and 15 of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def minor_faults(pid: int) -> int:
    """Minor page faults of the whole process so far, exited threads included (field 10 of
    /proc/PID/stat): each is a fresh page zeroed and mapped, ~1.5-4 µs on this VM."""
    return int(_stat_fields(pid)[7])


AgentCpu = tuple[float, float]  # (utime + stime in ticks' seconds, its threads' schedstat seconds)


def agent_cpu_now(pid: int) -> AgentCpu:
    """The agent's CPU two ways, for agent_cpu_since: cpu_s, and the sum of its live threads' time on a
    CPU from their schedstat (ns). An agent spends ~0.1 s of CPU in a 15 s round, which whole 10 ms
    ticks read to ±10 %."""
    return cpu_s(pid), sum(seconds for _, seconds in task_cpu(pid, precise=True).values())


def agent_cpu_since(before: AgentCpu, pid: int) -> float:
    """The agent's CPU since ``before`` in seconds: its threads' exact time, unless the ticks read more
    than two ticks above it (a thread exited in between and took its schedstat with it)."""
    ticks, exact = (now - then for now, then in zip(agent_cpu_now(pid), before, strict=True))
    return exact if ticks - exact <= 2.0 / CLK_TCK else ticks


def memory_bytes(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS and the RSS split (anon / file / shmem) from /proc/PID/status, in bytes."""
    wanted = {"VmHWM": "peak_rss_bytes", "VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes",
              "RssFile": "rss_file_bytes", "RssShmem": "rss_shmem_bytes"}
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            out[wanted[key]] = int(value.split()[0]) * 1024
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape_series(port: int, name: str) -> dict[str, float]:
    """The agent's sample ``name`` as Prometheus sees it (a GET of /metrics, like a scrape): each
    series' value by its label text (``{thread="main",part="nvtx"}``; "" for none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body = response.read().decode()
    series: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            labels, value = line[len(name):].rsplit(" ", 1)
            series[labels.strip()] = float(value)
    return series


def scrape_counter(port: int, name: str) -> float:
    """The agent's sample ``name`` (scrape_series), every series of it summed."""
    return sum(scrape_series(port, name).values())


def scrape_requests(port: int) -> float:
    """The agent's request counter (every series of REQUESTS_METRIC)."""
    return scrape_counter(port, REQUESTS_METRIC)


def stop_group(proc: subprocess.Popen[str], *, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
    """Signal the child's process group, then SIGKILL it if it has not exited in time."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass


@dataclass
class Runtime:
    """One reference-runtime process, started and ready."""

    proc: subprocess.Popen[str]
    stdout: LineReader
    port: int
    control_socket: Path
    nvtx_line: str


def start_runtime(workdir: Path, *, inject: bool, name: str) -> Runtime:
    env = {k: v for k, v in os.environ.items() if k != INJECTION_ENV}
    env[RING_DIR_ENV] = str((workdir / "rings").resolve())  # a tmpfs folder (see main)
    if inject:
        env.update(injection_env())
    control_socket = workdir / f"{name}.sock"
    try:
        launched = launch(runtime_argv("--port", "0", "--control-socket", str(control_socket)),
                          timeout_s=START_TIMEOUT_S, env=env, cwd=REPO, stderr=subprocess.DEVNULL)
    except LaunchError as exc:  # launch() already killed and reaped it
        raise BenchError(f"runtime {name}: {exc}") from None
    expected = "active" if inject else "inactive"
    if not launched.banner.nvtx.startswith(expected):
        stop_group(launched.popen)
        raise BenchError(f"runtime {name}: expected 'nvtx: {expected}', got {launched.banner.nvtx_line!r}")
    return Runtime(proc=launched.popen, stdout=launched.stdout, port=launched.banner.http_port,
                   control_socket=control_socket, nvtx_line=launched.banner.nvtx_line)


@dataclass
class Agent:
    """`agent start --pid` with every probe and exporter on; policy in dry-run."""

    proc: subprocess.Popen[str]
    err: LineReader
    out: LineReader
    metrics_port: int
    notes: list[str] = field(default_factory=list)


def agent_start_args(runtime: Runtime, state_dir: Path, metrics_port: int) -> list[str]:
    """`agent start` with every probe and exporter on, policy in --dry-run (the on arm's agent)."""
    return ["start", "--pid", str(runtime.proc.pid), "--state-dir", str(state_dir), "--metrics-port", str(metrics_port),
            "--dry-run", "--control-socket", str(runtime.control_socket),
            "--policy-audit", str(state_dir / "policy-audit.jsonl"), "--policy-state-dir", str(state_dir)]


def start_agent(runtime: Runtime, workdir: Path, *, name: str, extra_args: tuple[str, ...] = ()) -> Agent:
    state_dir = workdir / f"{name}-state"
    state_dir.mkdir()
    metrics_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moescope.agent", *agent_start_args(runtime, state_dir, metrics_port), *extra_args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    # Every line kept: the notes and the summary are read from them.
    agent = Agent(proc=proc, err=LineReader(proc.stderr, keep_lines=None),
                  out=LineReader(proc.stdout, keep_lines=None), metrics_port=metrics_port)
    try:
        agent.err.wait_for("agent: tracing ", timeout_s=START_TIMEOUT_S)
        agent.err.wait_for("agent: policy", timeout_s=START_TIMEOUT_S)  # the last note: all observers attached
    except LaunchError as exc:
        stop_group(proc, sig=signal.SIGKILL)
        raise BenchError(f"agent: {exc}") from None
    except BaseException:
        stop_group(proc, sig=signal.SIGKILL)
        raise
    agent.err.drain()
    agent.out.drain()
    agent.notes = [line for line in agent.err.lines() if line.startswith("agent: ")]
    off = [n for n in agent.notes if any(word in n for word in ("NVTX off", "policy off", "policy waiting"))]
    if extra_args:  # a cost breakdown switches parts off on purpose
        off = []
    if off:
        stop_group(proc, sig=signal.SIGKILL)
        raise BenchError(f"agent came up without every probe: {off}")
    return agent


def stop_agent(agent: Agent) -> list[str]:
    """SIGINT (the agent flushes and prints its summary); returns its summary lines."""
    stop_group(agent.proc, sig=signal.SIGINT, timeout_s=60.0)
    agent.out.join(10.0)
    agent.err.join(10.0)
    return [line for line in agent.out.lines() if line.startswith("agent: ")]


def run_loadgen(port: int, *, duration_s: float, concurrency: int, out: Path | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}",
           "--scenario", "balanced", "--concurrency", str(concurrency), "--duration-s", str(duration_s)]
    if out is not None:
        cmd += ["--json-out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=duration_s + 300)
    if done.returncode != 0:
        raise BenchError(f"loadgen exited {done.returncode}: {done.stderr.strip()[-400:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@dataclass
class Settings:
    duration_s: float
    warmup_s: float
    concurrency: int
    agent_args: tuple[str, ...] = ()


def finite(interval: tuple[float, float]) -> list[float] | None:
    """An interval for the JSON: None where there is none (fewer than two rounds an arm)."""
    return None if any(math.isnan(end) for end in interval) else list(interval)


def shown(interval: tuple[float, float], reading: str) -> str:
    if any(math.isnan(end) for end in interval):
        return f"no interval under {MIN_INTERVAL_RUNS} rounds an arm ({reading})"
    return f"95 % interval over the rounds {interval[0]:.3f}-{interval[1]:.3f} ({reading})"


def resolved(interval: tuple[float, float], bar: float, *, upper_is_worse: bool) -> str:
    """What a ratio's interval says of its bar: "met" / "missed" when the whole interval is on one
    side, "unresolved" when it straddles the bar (the rounds swing more than the cost being read)."""
    low, high = interval
    if math.isnan(low) or math.isnan(high):
        return "unresolved"
    met, missed = (high <= bar, low > bar) if upper_is_worse else (low >= bar, high < bar)
    return "met" if met else "missed" if missed else "unresolved"


def one_run(arm: str, *, index: int, workdir: Path, settings: Settings, extra: dict[str, Any]) -> Metrics:
    """One fresh runtime, (agent), warm-up, measured window. Returns the run's numbers."""
    name = f"{arm}{index}"
    runtime = start_runtime(workdir, inject=arm != "bare", name=name)
    agent: Agent | None = None
    try:
        if arm == "on":
            agent = start_agent(runtime, workdir, name=name, extra_args=settings.agent_args)
        run_loadgen(runtime.port, duration_s=settings.warmup_s, concurrency=settings.concurrency, out=None)
        # The agent's eBPF programs run in the kernel on the runtime's syscalls (their CPU is the
        # runtime's): the kernel's own accounting, on for the measured window of an on-round only.
        with bpf_stats_enabled() if agent else contextlib.nullcontext(False) as kernel_stats:
            # The benchmark's own scrape before the CPU readings: rendering /metrics costs the agent
            # ~7 ms (~0.03 ms a request of a 15 s round), the benchmark's probe, not the load's cost.
            seen0 = scrape_requests(agent.metrics_port) if agent else 0.0
            rt_cpu0 = cpu_s(runtime.proc.pid)
            agent_cpu0 = agent_cpu_now(agent.proc.pid) if agent else (0.0, 0.0)
            bpf_ns0 = bpf_run_time_ns(agent.proc.pid) if agent else 0
            t0 = time.monotonic()
            load = run_loadgen(runtime.port, duration_s=settings.duration_s, concurrency=settings.concurrency,
                               out=workdir / f"{name}-loadgen.json")
            window_s = time.monotonic() - t0
            rt_cpu = cpu_s(runtime.proc.pid) - rt_cpu0
            bpf_s = (bpf_run_time_ns(agent.proc.pid) - bpf_ns0) / 1e9 if agent else 0.0
        ok = max(1, int(load["requests"]) - int(load["failures"]))
        metrics: Metrics = {
            "throughput_rps": float(load["throughput_rps"]),
            "p50_ms": float(load["latency_ms"]["p50"]),
            "p99_ms": float(load["latency_ms"]["p99"]),
            "requests": float(load["requests"]),
            "failures": float(load["failures"]),
            "runtime_cpu_pct_of_core": 100.0 * rt_cpu / window_s,
            "runtime_cpu_ms_per_request": 1000.0 * rt_cpu / ok,
            "runtime_peak_rss_bytes": float(memory_bytes(runtime.proc.pid)["peak_rss_bytes"]),
            # batching: a change here (not the agent) would move CPU per request, so it is recorded
            "requests_per_step": float(load["requests"]) / max(1, int(load.get("server", {}).get("steps", 0))),
        }
        if agent is not None:
            agent_cpu = agent_cpu_since(agent_cpu0, agent.proc.pid)
            metrics["agent_cpu_pct_of_core"] = 100.0 * agent_cpu / window_s
            metrics["agent_cpu_ms_per_request"] = 1000.0 * agent_cpu / ok
            metrics["agent_requests_seen"] = scrape_requests(agent.metrics_port) - seen0
            if kernel_stats:
                metrics["agent_bpf_kernel_ms_per_request"] = 1000.0 * bpf_s / ok
            metrics.update({f"agent_{k}": float(v) for k, v in memory_bytes(agent.proc.pid).items()})
            extra.setdefault("agent_summaries", []).append(stop_agent(agent))
            extra.setdefault("agent_notes", agent.notes)
            agent = None
        return metrics
    finally:
        if agent is not None:
            stop_group(agent.proc, sig=signal.SIGKILL)
        stop_group(runtime.proc)


def fmt_run(metrics: Metrics) -> str:
    text = (f"{metrics['throughput_rps']:.2f} req/s, p99 {metrics['p99_ms']:.0f} ms, "
            f"runtime {metrics['runtime_cpu_pct_of_core']:.0f} % core, failures {metrics['failures']:.0f}")
    text += (f", {metrics['runtime_cpu_ms_per_request']:.1f} CPU ms/request, "
             f"{metrics['requests_per_step']:.2f} requests/step")
    if "agent_cpu_pct_of_core" in metrics:
        text += (f"; agent {metrics['agent_cpu_pct_of_core']:.1f} % core, peak RSS "
                 f"{metrics['agent_peak_rss_bytes'] / 1e6:.0f} MB (now {metrics['agent_rss_bytes'] / 1e6:.0f}), "
                 f"saw {metrics['agent_requests_seen']:.0f} requests")
    return text


def overhead(args: argparse.Namespace, workdir: Path) -> int:
    settings = Settings(duration_s=args.duration_s, warmup_s=args.warmup_s, concurrency=args.concurrency,
                        agent_args=tuple(args.agent_arg or ()))
    arms = ARMS if not args.no_bare else ("off", "on")
    runs: dict[str, list[Metrics]] = {arm: [] for arm in arms}
    extra: dict[str, Any] = {}
    for r in range(args.pairs):
        order = arms[r % len(arms):] + arms[: r % len(arms)]  # rotate: no arm always first or always after another
        for arm in order:
            metrics = one_run(arm, index=r, workdir=workdir, settings=settings, extra=extra)
            runs[arm].append(metrics)
            print(f"e2e_overhead: round {r + 1}/{args.pairs} {arm:4s}: {fmt_run(metrics)}", flush=True)

    def ratioable(arm: str) -> list[Metrics]:  # counts that are usually 0 have no ratio
        return [{k: v for k, v in run.items() if k != "failures"} for run in runs[arm]]

    agent_on = ABResult(a=ratioable("off"), b=ratioable("on"))
    nvtx_idle = ABResult(a=ratioable("bare"), b=ratioable("off")) if "bare" in runs else None
    on = runs["on"]
    throughput_ratio = agent_on.ratio("throughput_rps")
    throughput_cost = 1.0 - throughput_ratio
    agent_cpu = statistics.median(run["agent_cpu_pct_of_core"] for run in on)
    agent_ms = statistics.median(run["agent_cpu_ms_per_request"] for run in on)
    # Contention on this shared machine swings throughput by +-30 % run to run; CPU per request does
    # not swing with it. Host CPU per request with the agent (runtime + agent) over without it is the
    # throughput a CPU-bound server would lose, the noise-robust reading of the same bar.
    cpu_per_request_ratio = (
        statistics.median(run["runtime_cpu_ms_per_request"] + run["agent_cpu_ms_per_request"] for run in on)
        / statistics.median(run["runtime_cpu_ms_per_request"] for run in runs["off"])
    )
    cpu_cost = cpu_per_request_ratio - 1.0
    # How far the rounds' swing lets either ratio be read: 95 % bootstrap intervals over the rounds.
    # The bars are judged on the medians (as stated); an interval straddling 1.01 says that this
    # run's rounds cannot tell a met bar from a missed one, whatever the median reads.
    cpu_interval = median_ratio_interval(
        [run["runtime_cpu_ms_per_request"] for run in runs["off"]],
        [run["runtime_cpu_ms_per_request"] + run["agent_cpu_ms_per_request"] for run in on])
    throughput_interval = median_ratio_interval([run["throughput_rps"] for run in runs["off"]],
                                                [run["throughput_rps"] for run in on])
    cpu_reading = resolved(cpu_interval, 1.0 + BAR_THROUGHPUT_COST, upper_is_worse=True)
    throughput_reading = resolved(throughput_interval, 1.0 - BAR_THROUGHPUT_COST, upper_is_worse=False)
    # The agent's CPU over the runtime's in the same window, per on-round: the agent's own part of
    # that ratio, free of the VM's swing between rounds (both processes see the same window). What
    # the ratio adds beyond it is the runtime's own change while observed (the injection library
    # writing its ring, ~35 ns an NVTX event; the kernel probes on its syscalls) plus that swing.
    agent_share = statistics.median(
        run["agent_cpu_ms_per_request"] / run["runtime_cpu_ms_per_request"] for run in on
        if run["runtime_cpu_ms_per_request"] > 0)
    # ... of which the eBPF programs' own run time in the kernel (bpf_stats), over the runtime's CPU
    kernel_share = None
    if all("agent_bpf_kernel_ms_per_request" in run for run in on):
        kernel_share = statistics.median(
            run["agent_bpf_kernel_ms_per_request"] / run["runtime_cpu_ms_per_request"] for run in on
            if run["runtime_cpu_ms_per_request"] > 0)
    # The ratio by its parts measured in the same windows: 1 + the agent's CPU + its eBPF programs'
    # (which run in the runtime's CPU), over the runtime's, per on-round. Free of the swing between
    # rounds that the direct ratio carries; it leaves out what is not measured in-window: the
    # injection library's ring writes (~70 ns an NVTX record, benchmarks/nvtx_overhead.py) and any
    # effect of the agent's threads on the runtime's caches.
    by_parts = [1.0 + (run["agent_cpu_ms_per_request"] + run.get("agent_bpf_kernel_ms_per_request", 0.0))
                / run["runtime_cpu_ms_per_request"] for run in on if run["runtime_cpu_ms_per_request"] > 0]
    cpu_by_parts = statistics.median(by_parts) if by_parts else math.nan
    agent_peak = statistics.median(run["agent_peak_rss_bytes"] for run in on)
    agent_rss = statistics.median(run["agent_rss_bytes"] for run in on)
    failures = sum(run["failures"] for arm in arms for run in runs[arm])
    bars = {
        "throughput_cost_le_1pct": throughput_cost <= BAR_THROUGHPUT_COST,
        "cpu_per_request_cost_le_1pct": cpu_cost <= BAR_THROUGHPUT_COST,
        "agent_cpu_le_5pct_of_core": agent_cpu <= BAR_AGENT_CPU_PCT_OF_CORE,
        "agent_cpu_le_0_5ms_per_request": agent_ms <= BAR_AGENT_CPU_MS_PER_REQUEST,
        "agent_peak_rss_le_100MB": agent_peak <= BAR_AGENT_RSS_BYTES,
        "zero_failed_requests": failures == 0,
    }
    bar_met = all(bars.values())
    slug = re.sub(r"[^A-Za-z0-9]+", "-", " ".join(settings.agent_args)).strip("-")
    path = write_result(f"e2e_overhead_breakdown_{slug}" if slug else "e2e_overhead", {
        "command": "python -m benchmarks.e2e_overhead " + " ".join(args.argv),
        "what": "reference runtime under closed-loop balanced load: agent off vs on (every probe), "
                "and off vs bare (no NVTX injection variable)",
        "pairs": args.pairs,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "concurrency": args.concurrency,
        "agent_extra_args": list(settings.agent_args),
        "runs": runs,
        "agent_on": agent_on.to_dict(),
        "nvtx_idle": nvtx_idle.to_dict() if nvtx_idle else None,
        "throughput_ratio_on_over_off": throughput_ratio,
        "throughput_cost": throughput_cost,
        "host_cpu_per_request_ratio_on_over_off": cpu_per_request_ratio,
        "host_cpu_per_request_cost": cpu_cost,
        "host_cpu_per_request_ratio_interval_95": finite(cpu_interval),
        "host_cpu_per_request_bar_reading": cpu_reading,
        "host_cpu_per_request_ratio_by_parts": cpu_by_parts if by_parts else None,
        "host_cpu_per_request_ratio_by_parts_range": [min(by_parts), max(by_parts)] if by_parts else None,
        "throughput_ratio_interval_95": finite(throughput_interval),
        "throughput_bar_reading": throughput_reading,
        "agent_share_of_runtime_cpu_same_window": agent_share,
        "agent_bpf_kernel_share_of_runtime_cpu_same_window": kernel_share,
        "p99_ratio_on_over_off": agent_on.ratio("p99_ms"),
        "p50_ratio_on_over_off": agent_on.ratio("p50_ms"),
        "runtime_cpu_ratio_on_over_off": agent_on.ratio("runtime_cpu_pct_of_core"),
        "throughput_ratio_off_over_bare": nvtx_idle.ratio("throughput_rps") if nvtx_idle else None,
        "p99_ratio_off_over_bare": nvtx_idle.ratio("p99_ms") if nvtx_idle else None,
        "agent_cpu_pct_of_core": agent_cpu,
        "agent_cpu_ms_per_request": agent_ms,
        "agent_peak_rss_bytes": agent_peak,
        "agent_rss_bytes": agent_rss,
        "agent_rss_split_bytes": {k: statistics.median(run[f"agent_{k}"] for run in on)
                                  for k in ("rss_anon_bytes", "rss_file_bytes", "rss_shmem_bytes")},
        "agent_requests_seen_over_loadgen": statistics.median(
            run["agent_requests_seen"] / run["requests"] for run in on if run["requests"]),
        "failed_requests": failures,
        "agent_summaries": extra.get("agent_summaries", []),
        "agent_notes": extra.get("agent_notes", []),
        "bars": bars,
        "bar_values": {"throughput_cost": BAR_THROUGHPUT_COST, "agent_cpu_pct_of_core": BAR_AGENT_CPU_PCT_OF_CORE,
                       "agent_cpu_ms_per_request": BAR_AGENT_CPU_MS_PER_REQUEST,
                       "agent_peak_rss_bytes": BAR_AGENT_RSS_BYTES},
        "bar_met": bar_met,
        "pass": bar_met,
    })

    def med(arm: str, metric: str) -> float:
        return statistics.median(run[metric] for run in runs[arm])

    print(f"e2e_overhead: medians of {args.pairs} rounds x {args.duration_s:g} s, concurrency {args.concurrency}:")
    for arm in arms:
        print(f"  {arm:4s} {med(arm, 'throughput_rps'):.2f} req/s, p50 {med(arm, 'p50_ms'):.0f} ms, "
              f"p99 {med(arm, 'p99_ms'):.0f} ms, runtime CPU {med(arm, 'runtime_cpu_pct_of_core'):.0f} % of a core")
    print(f"  agent on/off: throughput ratio {throughput_ratio:.4f} (cost {100 * throughput_cost:+.2f} %, bar 1 %), "
          f"p99 ratio {agent_on.ratio('p99_ms'):.3f}; {shown(throughput_interval, throughput_reading)}")
    print(f"  host CPU per request (runtime + agent) on/off: {cpu_per_request_ratio:.3f} "
          f"(cost {100 * cpu_cost:+.1f} %, bar 1 %): runtime {med('off', 'runtime_cpu_ms_per_request'):.1f} -> "
          f"{med('on', 'runtime_cpu_ms_per_request'):.1f} ms, agent {med('on', 'agent_cpu_ms_per_request'):.2f} ms; "
          f"{shown(cpu_interval, cpu_reading)}")
    print(f"  the agent's part of it, against the runtime in the same windows: {100 * agent_share:.2f} % "
          f"(median of the on rounds; the rest of the ratio is the runtime's own change and the VM's swing)")
    if kernel_share is not None:
        print(f"  the agent's eBPF programs in the kernel, on the runtime's syscalls (bpf_stats, in the runtime's "
              f"CPU): {100 * kernel_share:.3f} % of the runtime's CPU, "
              f"{1000 * statistics.median(run['agent_bpf_kernel_ms_per_request'] for run in on):.1f} µs a request")
    if by_parts:
        print(f"  host CPU per request on/off by its parts in the same windows (1 + agent + its eBPF, over the "
              f"runtime): {cpu_by_parts:.4f}, rounds {min(by_parts):.4f}-{max(by_parts):.4f} (ring writes and cache "
              f"effects on the runtime not in it)")
    if nvtx_idle:
        print(f"  NVTX injection idle (off/bare): throughput ratio {nvtx_idle.ratio('throughput_rps'):.4f}, "
              f"p99 ratio {nvtx_idle.ratio('p99_ms'):.3f}")
    print(f"  agent: {agent_cpu:.1f} % of one core (bar 5), {agent_ms:.2f} ms CPU per request (bar "
          f"{BAR_AGENT_CPU_MS_PER_REQUEST:g}), peak RSS {agent_peak / 1e6:.0f} MB "
          f"(bar 100), RSS at end {agent_rss / 1e6:.0f} MB; failed requests {failures:.0f}")
    print("  bars: " + ", ".join(f"{k}={'PASS' if v else 'MISS'}" for k, v in bars.items()) + f" -> {path}")
    return 0 if bar_met else 1


def fit_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (units of y per unit of x); 0 with fewer than 2 points."""
    if len(points) < 2:
        return 0.0
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx else 0.0


def soak(args: argparse.Namespace, workdir: Path) -> int:
    seconds = float(args.soak)
    runtime = start_runtime(workdir, inject=True, name="soak")
    agent: Agent | None = None
    load: subprocess.Popen[str] | None = None
    samples: list[dict[str, float]] = []
    try:
        agent = start_agent(runtime, workdir, name="soak", extra_args=tuple(args.agent_arg or ()))
        load = subprocess.Popen(
            [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{runtime.port}",
             "--scenario", "balanced", "--concurrency", str(args.concurrency), "--duration-s", str(seconds),
             "--json-out", str(workdir / "soak-loadgen.json")],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        t0 = time.monotonic()
        cpu0 = cpu_s(agent.proc.pid)
        while True:
            now = time.monotonic() - t0
            mem = memory_bytes(agent.proc.pid)
            samples.append({"t_s": now, "agent_cpu_s": cpu_s(agent.proc.pid) - cpu0,
                            **{f"agent_{k}": float(v) for k, v in mem.items()},
                            "runtime_rss_bytes": float(memory_bytes(runtime.proc.pid)["rss_bytes"])})
            print(f"e2e_soak: t {now:5.0f} s agent RSS {mem['rss_bytes'] / 1e6:.1f} MB "
                  f"(anon {mem['rss_anon_bytes'] / 1e6:.1f}), peak {mem['peak_rss_bytes'] / 1e6:.1f} MB", flush=True)
            if load.poll() is not None or now >= seconds:
                break
            time.sleep(SOAK_SAMPLE_S - (time.monotonic() - t0) % SOAK_SAMPLE_S)
        load.wait(timeout=300)
        summary = stop_agent(agent)
        agent = None
    finally:
        if load is not None:
            stop_group(load)
        if agent is not None:
            stop_group(agent.proc, sig=signal.SIGKILL)
        stop_group(runtime.proc)
    load_result = json.loads((workdir / "soak-loadgen.json").read_text())
    # The pipeline buffers finished steps for DEFAULT_STEP_RETENTION_NS (waiting for their requests'
    # kernel records), so RSS rises until that buffer is full: the slope is fitted after it.
    settle_s = STEP_RETENTION_S + 30.0 if seconds >= 2 * (STEP_RETENTION_S + 30.0) else seconds / 2
    steady = [s for s in samples if s["t_s"] >= settle_s]
    slope_rss = fit_slope([(s["t_s"], s["agent_rss_bytes"]) for s in steady])
    slope_anon = fit_slope([(s["t_s"], s["agent_rss_anon_bytes"]) for s in steady])
    slope_runtime = fit_slope([(s["t_s"], s["runtime_rss_bytes"]) for s in steady])
    growth_per_hour = slope_rss * 3600
    elapsed = samples[-1]["t_s"] if samples else 0.0
    peak = max(s["agent_peak_rss_bytes"] for s in samples)
    agent_cpu = 100.0 * samples[-1]["agent_cpu_s"] / elapsed if elapsed else 0.0
    bars = {
        "rss_flat": growth_per_hour <= BAR_SOAK_GROWTH_BYTES_PER_HOUR,
        "agent_peak_rss_le_100MB": peak <= BAR_AGENT_RSS_BYTES,
        "agent_cpu_le_5pct_of_core": agent_cpu <= BAR_AGENT_CPU_PCT_OF_CORE,
        "zero_failed_requests": int(load_result["failures"]) == 0,
    }
    bar_met = all(bars.values())
    slug = re.sub(r"[^A-Za-z0-9]+", "-", " ".join(args.agent_arg or ())).strip("-")
    path = write_result(f"e2e_soak_breakdown_{slug}" if slug else "e2e_soak", {
        "command": "python -m benchmarks.e2e_overhead " + " ".join(args.argv),
        "soak_s": seconds,
        "sample_s": SOAK_SAMPLE_S,
        "settle_s": settle_s,
        "concurrency": args.concurrency,
        "agent_extra_args": list(args.agent_arg or ()),
        "samples": samples,
        "agent_rss_slope_bytes_per_s": slope_rss,
        "agent_rss_anon_slope_bytes_per_s": slope_anon,
        "runtime_rss_slope_bytes_per_s": slope_runtime,
        "agent_rss_growth_bytes_per_hour": growth_per_hour,
        "agent_peak_rss_bytes": peak,
        "agent_cpu_pct_of_core": agent_cpu,
        "loadgen": load_result,
        "agent_summary": summary,
        "bars": bars,
        "bar_values": {"rss_growth_bytes_per_hour": BAR_SOAK_GROWTH_BYTES_PER_HOUR,
                       "agent_peak_rss_bytes": BAR_AGENT_RSS_BYTES},
        "bar_met": bar_met,
        "pass": bar_met,
    })
    if settle_s < STEP_RETENTION_S:
        print(f"e2e_soak: note: shorter than 2 x (step retention {STEP_RETENTION_S:.0f} s + 30 s): the slope "
              "still includes the pipeline's step buffer filling up", flush=True)
    print(
        f"e2e_soak: {elapsed:.0f} s, {len(samples)} samples (slope fitted from t >= {settle_s:.0f} s), "
        f"{load_result['requests']} requests "
        f"({load_result['failures']} failed): agent RSS slope {slope_rss / 1e3 * 60:+.1f} kB/min "
        f"(anon {slope_anon / 1e3 * 60:+.1f} kB/min) = {growth_per_hour / 1e6:+.1f} MB/hour (bar 10), "
        f"peak {peak / 1e6:.0f} MB, CPU {agent_cpu:.1f} % of a core; runtime RSS slope "
        f"{slope_runtime / 1e3 * 60:+.1f} kB/min"
    )
    print("  bars: " + ", ".join(f"{k}={'PASS' if v else 'MISS'}" for k, v in bars.items()) + f" -> {path}")
    return 0 if bar_met else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5,
                        help="rounds of off/on/bare runs (off/on with --no-bare; >= 5 for a result)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured load per run")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured load before each measured run")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop load generator clients")
    parser.add_argument("--agent-arg", action="append", metavar="ARG",
                        help="extra `agent start` argument for the on arm or the soak (repeatable), for a "
                        "cost breakdown, e.g. --agent-arg=--no-nvtx; results then go to "
                        "e2e_overhead_breakdown_<args>.json / e2e_soak_breakdown_<args>.json")
    parser.add_argument("--no-bare", action="store_true",
                        help="run the off and on arms only (no `bare` arm: what the idle NVTX injection "
                        "costs is not read): the same time buys half again as many rounds of the agent's "
                        "bars, e.g. --no-bare --pairs 12")
    parser.add_argument("--quick", action="store_true", help="smoke: 2 rounds x 5 s, 1 s warm-up")
    parser.add_argument("--soak", type=float, nargs="?", const=3600.0, metavar="SECONDS",
                        help="instead: one run with the agent on for SECONDS (default 3600), agent RSS "
                        f"sampled every {SOAK_SAMPLE_S:.0f} s, slope reported")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.pairs, args.duration_s, args.warmup_s = 2, 5.0, 1.0
    if args.pairs < 1 or not args.duration_s > 0 or args.warmup_s < 0 or args.concurrency < 1:
        print("e2e_overhead: --pairs and --concurrency must be >= 1, --duration-s > 0, --warmup-s >= 0",
              file=sys.stderr)
        return 2
    if args.soak is not None and not args.soak >= SOAK_SAMPLE_S:
        print(f"e2e_overhead: --soak must be at least {SOAK_SAMPLE_S:.0f} s", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("e2e_overhead: needs root (the agent loads eBPF)", file=sys.stderr)
        return 3
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # NVTX rings live on tmpfs, as in production
    with tempfile.TemporaryDirectory(prefix="moescope-e2e-") as tmp, \
            tempfile.TemporaryDirectory(prefix="moescope-e2e-rings-", dir=shm) as rings:
        workdir = Path(tmp)  # sockets, trace files, audit: on disk, as deployed
        (workdir / "rings").symlink_to(rings)
        try:
            return soak(args, workdir) if args.soak is not None else overhead(args, workdir)
        except BenchError as exc:
            print(f"e2e_overhead: {exc}", file=sys.stderr)
            return 4


if __name__ == "__main__":
    sys.exit(main())
