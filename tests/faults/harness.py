"""Real processes for the fault tests: the reference MoE runtime (NVTX injection on), the load
generator, the `agent start` console script with its output in files (so a test can read it while
it runs and a full pipe never blocks it), an OTLP/gRPC receiver, and small /proc readers.

Every wait is bounded by WAIT_S and only bounds the wait; nothing here asserts speed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moescope.collectors.nvtx import injection_env
from moescope.examples.moe_runtime.launch import Banner, LaunchError, launch, runtime_argv

REPO = Path(__file__).resolve().parents[2]
AGENT = Path(sys.executable).parent / "agent"
WAIT_S = 60.0  # generous: only bounds waiting, never asserted on
# Small model: the tests are about the agent's behaviour, and share 2 cores with other work.
SMALL_MODEL = ("--d-model", "64", "--d-ff", "128", "--layers", "2", "--experts", "8", "--n-heads", "2",
               "--threads", "1", "--max-wait-ms", "2")


def wait_until(check: Callable[[], bool], *, what: str, timeout_s: float = WAIT_S, period_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(period_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(popen: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    """Signal the process group the test started (start_new_session), then reap it (bounded)."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            pass
    try:
        popen.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(timeout=15)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@dataclass
class Runtime:
    """`python -m moescope.examples.moe_runtime` in its own session, NVTX injection on."""

    popen: subprocess.Popen[str]
    banner: Banner

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        return self.banner.http_port

    @property
    def control_socket(self) -> str:
        return self.banner.control_socket

    def stop(self, sig: int = signal.SIGKILL) -> None:
        kill_group(self.popen, sig)
        if sig == signal.SIGKILL:  # a killed runtime leaves its socket file behind
            try:
                os.unlink(self.control_socket)
            except OSError:
                pass


def start_runtime(*, port: int = 0, extra: tuple[str, ...] = ()) -> Runtime:
    try:
        launched = launch(runtime_argv("--port", str(port), *SMALL_MODEL, *extra), timeout_s=WAIT_S * 2,
                          env={**os.environ, **injection_env()}, cwd=REPO, stderr=subprocess.DEVNULL)
    except LaunchError as exc:  # launch() already killed and reaped it
        raise AssertionError(f"runtime did not become ready: {exc}") from None
    return Runtime(popen=launched.popen, banner=launched.banner)


@dataclass
class Load:
    """The load generator in the background; `result()` waits for its JSON summary."""

    popen: subprocess.Popen[str]
    out: Path

    def result(self, *, timeout_s: float = WAIT_S * 2) -> dict[str, Any]:
        self.popen.wait(timeout=timeout_s)
        summary: dict[str, Any] = json.loads(self.out.read_text())
        return summary


def start_load(port: int, out: Path, *, duration_s: float, concurrency: int = 4) -> Load:
    popen = subprocess.Popen(
        [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}",
         "--concurrency", str(concurrency), "--duration-s", str(duration_s), "--max-tokens", "2",
         "--timeout-s", "30", "--json-out", str(out)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    return Load(popen=popen, out=out)


def run_load(port: int, out: Path, *, duration_s: float, concurrency: int = 4) -> dict[str, Any]:
    load = start_load(port, out, duration_s=duration_s, concurrency=concurrency)
    try:
        return load.result()
    finally:
        kill_group(load.popen)


@dataclass
class Agent:
    """`agent start ARGS` with stdout and stderr in files."""

    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    metrics_port: int
    records_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def wait_stderr(self, text: str, *, timeout_s: float = WAIT_S) -> str:
        """Wait until `text` appears on stderr (or the agent exits); returns the line holding it."""

        def seen() -> bool:
            return text in self.stderr() or self.popen.poll() is not None

        wait_until(seen, what=f"agent stderr to say {text!r}", timeout_s=timeout_s)
        for line in self.stderr().splitlines():
            if text in line:
                return line
        raise AssertionError(f"agent exited ({self.popen.returncode}) without saying {text!r}:\n{self.stderr()}")

    def records(self) -> list[dict[str, Any]]:
        if not self.records_path.exists():
            return []
        return [json.loads(line) for line in self.records_path.read_text().splitlines() if line.endswith("}")]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return str(response.read().decode())

    def stop(self, sig: int = signal.SIGINT, *, timeout_s: float = WAIT_S) -> int:
        """Ask it to stop; returns its exit status (SIGKILL after timeout_s: that fails the caller)."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(self.popen)
            raise AssertionError(f"agent did not stop within {timeout_s:.0f} s of signal {sig}") from None


def start_agent(tmp: Path, *args: str, state_dir: Path | None = None) -> Agent:
    """`agent start` with every file it writes under `tmp`; returns once it printed its attach
    line (or exited)."""
    metrics_port = free_port()
    records = tmp / "records.jsonl"
    out, err = tmp / "agent.stdout", tmp / "agent.stderr"
    argv = [
        str(AGENT), "start", *args,
        "--records", str(records),
        "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1",
        "--state-dir", str(state_dir if state_dir is not None else tmp / "state"),
        "--policy-audit", str(tmp / "audit.jsonl"), "--policy-state-dir", str(tmp),
        "--interval", "0.25",
    ]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        popen = subprocess.Popen(argv, stdout=stdout, stderr=stderr, start_new_session=True, cwd=REPO)
    agent = Agent(popen=popen, stdout_path=out, stderr_path=err, metrics_port=metrics_port, records_path=records)
    try:
        agent.wait_stderr("agent: tracing")
    except BaseException:
        kill_group(popen)
        raise
    return agent


class Lab:
    """Starts runtimes, agents and load generators; `close()` kills whatever is still running."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._procs: list[subprocess.Popen[Any]] = []
        self._runtimes: list[Runtime] = []

    def runtime(self, *, port: int = 0, extra: tuple[str, ...] = ()) -> Runtime:
        rt = start_runtime(port=port, extra=extra)
        self._runtimes.append(rt)
        return rt

    def agent(self, *args: str, state_dir: Path | None = None) -> Agent:
        agent = start_agent(self.tmp, *args, state_dir=state_dir)
        self._procs.append(agent.popen)
        return agent

    def load(self, port: int, name: str, *, duration_s: float, concurrency: int = 4) -> Load:
        load = start_load(port, self.tmp / f"{name}.json", duration_s=duration_s, concurrency=concurrency)
        self._procs.append(load.popen)
        return load

    def close(self) -> None:
        for popen in self._procs:
            kill_group(popen)
        for rt in self._runtimes:
            rt.stop()
