"""Fixtures for policy tests: the real reference runtime (examples/moe_runtime) as a subprocess."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from policy_helpers import REPO, RuntimeProc, StartRuntime

from moescope.examples.moe_runtime.launch import LaunchError, launch, runtime_argv
from moescope.stats_page import default_directory, sweep_stale_pages

# Small enough for 2 shared cores: 2 layers x 8 experts of 24 KiB (fp32) each.
SMALL_MODEL = ("--layers", "2", "--experts", "8", "--d-model", "32", "--d-ff", "64", "--n-heads", "2")
HF_TINY = ("--arch", "qwen3_moe", "--tiny", "--layers", "2", "--experts", "8", "--top-k", "2")


@pytest.fixture
def start_runtime() -> Iterator[StartRuntime]:
    """start_runtime(*extra_args) -> RuntimeProc; every runtime started is killed at teardown."""
    started: list[RuntimeProc] = []
    # A short directory: UNIX socket paths are limited to 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="mspol-"))

    def start(*extra: str, hf: bool = False) -> RuntimeProc:
        sock = workdir / f"rt{len(started)}.sock"
        if hf:  # the transformers server (examples/hf_server): same protocol, fewer capabilities
            cmd = [sys.executable, "-m", "moescope.examples.hf_server", *HF_TINY, "--port", "0",
                   "--threads", "1", "--control-socket", str(sock), *extra]
        else:
            cmd = runtime_argv("--port", "0", "--no-nvtx", "--threads", "1", "--control-socket", str(sock),
                               *SMALL_MODEL, *extra)
        err_path = workdir / f"rt{len(started)}.err"
        with err_path.open("w") as stderr:
            try:
                launched = launch(cmd, timeout_s=60, cwd=REPO, stderr=stderr)
            except LaunchError as exc:  # launch() already killed and reaped it
                pytest.fail(f"runtime not ready: {exc}: {err_path.read_text()[-2000:]}")
        rt = RuntimeProc(proc=launched.popen, socket_path=launched.banner.control_socket,
                         http_port=launched.banner.http_port, workdir=workdir)
        started.append(rt)
        return rt

    try:
        yield start
    finally:
        for rt in started:
            rt.kill()
        sweep_stale_pages(default_directory())  # the stats pages of the runtimes killed here
        shutil.rmtree(workdir, ignore_errors=True)
