"""Helpers for the telemetry tests: build and drive the fake libnvidia-ml.so.1 (fake_nvml.c); child processes.

The fake is loaded into the test process under the soname libnvidia-ml.so.1, so pynvml's own
dlopen("libnvidia-ml.so.1") resolves to it: the production code path runs unchanged down to the C ABI.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pynvml
import pytest

HERE = Path(__file__).resolve().parent
FAKE_SOURCE = HERE / "fake_nvml.c"
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1


def build_fake_nvml(out_dir: Path, *, old_driver: bool = False) -> Path:
    """Compile the fake into out_dir/libnvidia-ml.so.1 and return its path."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed to build the fake NVML library (apt-get install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "libnvidia-ml.so.1"
    cmd = [gcc, "-Wall", "-Wextra", "-Werror", "-O1", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1"]
    if old_driver:
        cmd.append("-DFAKE_OLD_DRIVER")
    cmd += ["-o", str(target), str(FAKE_SOURCE)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.fail(f"building the fake NVML failed:\n{result.stderr}")
    return target


class FakeNvml:
    """Typed handle on the fake library's control functions."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        u, i, ull, ll = ctypes.c_uint, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_longlong
        signatures: dict[str, list[type]] = {
            "fakeNvmlReset": [u],
            "fakeNvmlSetInitResult": [i],
            "fakeNvmlSetClockUs": [ll],
            "fakeNvmlSetLost": [u, i],
            "fakeNvmlSetMemory": [u, ull, ull, ull],
            "fakeNvmlSetUtilization": [u, i, u, u],
            "fakeNvmlSetLinks": [u, u, i],
            "fakeNvmlSetLink": [u, u, i, ull, ull],
            "fakeNvmlSetPcie": [u, i, ull, ull, u, u],
            "fakeNvmlAddProcess": [u, i, u, ull],
            "fakeNvmlClearProcesses": [u],
            "fakeNvmlSetProcessListsSupported": [u, i],
        }
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        for name in ("fakeNvmlInitCalls", "fakeNvmlFieldValueCalls", "fakeNvmlPcieThroughputCalls"):
            getattr(lib, name).restype = u

    def reset(self, gpu_count: int) -> None:
        self.lib.fakeNvmlReset(gpu_count)

    def set_init_result(self, code: int) -> None:
        self.lib.fakeNvmlSetInitResult(code)

    def set_clock_us(self, us: int) -> None:
        self.lib.fakeNvmlSetClockUs(us)

    def set_lost(self, gpu: int, lost: bool = True) -> None:
        self.lib.fakeNvmlSetLost(gpu, int(lost))

    def set_memory(self, gpu: int, *, total: int, reserved: int, used: int) -> None:
        self.lib.fakeNvmlSetMemory(gpu, total, reserved, used)

    def set_utilization(self, gpu: int, *, supported: bool = True, gpu_percent: int = 0, mem_percent: int = 0) -> None:
        self.lib.fakeNvmlSetUtilization(gpu, int(supported), gpu_percent, mem_percent)

    def set_links(self, gpu: int, links: int, *, value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG) -> None:
        self.lib.fakeNvmlSetLinks(gpu, links, value_type)

    def set_link(self, gpu: int, link: int, *, supported: bool = True, tx_kib: int = 0, rx_kib: int = 0) -> None:
        self.lib.fakeNvmlSetLink(gpu, link, int(supported), tx_kib, rx_kib)

    def set_pcie(
        self, gpu: int, *, counters: bool, tx_bytes: int = 0, rx_bytes: int = 0, tx_kbps: int = 0, rx_kbps: int = 0
    ) -> None:
        self.lib.fakeNvmlSetPcie(gpu, int(counters), tx_bytes, rx_bytes, tx_kbps, rx_kbps)

    def add_process(self, gpu: int, pid: int, used_bytes: int, *, graphics: bool = False) -> None:
        self.lib.fakeNvmlAddProcess(gpu, int(graphics), pid, used_bytes)

    def clear_processes(self, gpu: int) -> None:
        self.lib.fakeNvmlClearProcesses(gpu)

    def set_process_lists_supported(self, gpu: int, supported: bool) -> None:
        self.lib.fakeNvmlSetProcessListsSupported(gpu, int(supported))

    @property
    def init_calls(self) -> int:
        return int(self.lib.fakeNvmlInitCalls())

    @property
    def field_value_calls(self) -> int:
        return int(self.lib.fakeNvmlFieldValueCalls())

    @property
    def pcie_throughput_calls(self) -> int:
        return int(self.lib.fakeNvmlPcieThroughputCalls())


def kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


# A child that allocates on request: "alloc MiB" touches that many MiB, "spawn" starts a grandchild.
CHILD_PROGRAM = r"""
import subprocess, sys
held = []
kids = []
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "alloc":
        held.append(bytearray(b"\x01") * (int(arg) * 1024 * 1024))
        print("ok", flush=True)
    elif cmd == "spawn":
        kids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        print(kids[-1].pid, flush=True)
    elif cmd == "exit":
        break
"""


class Child:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


