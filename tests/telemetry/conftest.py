"""Fixtures for the telemetry tests: the fake NVML library (built once per session) and child processes."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from telemetry_helpers import CHILD_PROGRAM, Child, FakeNvml, build_fake_nvml, kill_group


@pytest.fixture(scope="session")
def fake_nvml_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture(scope="session")
def old_driver_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml-old"), old_driver=True)


@pytest.fixture
def fake_nvml(fake_nvml_library: Path) -> Iterator[FakeNvml]:
    lib = ctypes.CDLL(str(fake_nvml_library), mode=ctypes.RTLD_GLOBAL)
    loaded = pynvml.nvmlLib
    if loaded is not None and not hasattr(loaded, "fakeNvmlReset"):
        pytest.fail("a real libnvidia-ml is already loaded in this test process; run the telemetry tests on their own")
    fake = FakeNvml(lib)
    fake.reset(0)
    try:
        yield fake
    finally:
        # Leave "no driver" behind, so anything later in this process sees no fake GPUs.
        fake.reset(0)
        fake.set_init_result(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


@pytest.fixture
def child() -> Iterator[Child]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_PROGRAM],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, killed whole at the end
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield Child(proc)
    finally:
        kill_group(proc)
