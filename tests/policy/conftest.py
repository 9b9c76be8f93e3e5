"""Fixtures for policy tests: the real reference runtime (examples/moe_runtime) as a subprocess."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from policy_helpers import REPO, RuntimeProc, StartRuntime

# Small enough for 2 shared cores: 2 layers x 8 experts of 24 KiB (fp32) each.
SMALL_MODEL = ("--layers", "2", "--experts", "8", "--d-model", "32", "--d-ff", "64", "--n-heads", "2")


@pytest.fixture
def start_runtime() -> Iterator[StartRuntime]:
    """start_runtime(*extra_args) -> RuntimeProc; every runtime started is killed at teardown."""
    started: list[RuntimeProc] = []
    # A short directory: UNIX socket paths are limited to 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="mspol-"))

    def start(*extra: str) -> RuntimeProc:
        sock = workdir / f"rt{len(started)}.sock"
        cmd = [sys.executable, "-m", "examples.moe_runtime", "--port", "0", "--no-nvtx", "--threads", "1",
               "--control-socket", str(sock), *SMALL_MODEL, *extra]
        stderr = (workdir / f"rt{len(started)}.err").open("w")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)
        stderr.close()
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        rt = RuntimeProc(proc=proc, socket_path="", http_port=0, workdir=workdir)
        started.append(rt)
        while True:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                pytest.fail("runtime printed nothing for 60 s")
            if line is None:
                err = (workdir / f"rt{len(started) - 1}.err").read_text()
                pytest.fail(f"runtime exited before ready: {err[-2000:]}")
            if line.startswith("control socket: "):
                rt.socket_path = line.removeprefix("control socket: ")
            elif line.startswith("http port: "):
                rt.http_port = int(line.removeprefix("http port: "))
            elif line == "ready":
                return rt

    try:
        yield start
    finally:
        for rt in started:
            rt.kill()
        shutil.rmtree(workdir, ignore_errors=True)
