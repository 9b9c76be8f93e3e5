"""Fixtures for the NVTX capture tests: real producer processes loading the real injection library,
each with its own ring directory; every process started here is killed (its group) on teardown."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nvtx_helpers import PRODUCER, Producer, kill_group, producer_env


@pytest.fixture
def ring_dir() -> Iterator[Path]:
    """A private ring directory on tmpfs, where rings live in production (/dev/shm)."""
    path = Path(tempfile.mkdtemp(prefix="moescope-test-rings-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_producer(tmp_path: Path, ring_dir: Path) -> Iterator[Callable[..., Producer]]:
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, inject: bool = True, extra_env: dict[str, str] | None = None) -> Producer:
        log_path = tmp_path / f"producer-{len(started)}.json"
        env = producer_env(ring_dir, inject=inject)
        env.update(extra_env or {})
        proc = subprocess.Popen(
            [sys.executable, str(PRODUCER), "--log", str(log_path), *args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        started.append(proc)
        return Producer(proc=proc, log_path=log_path, ring_dir=ring_dir)

    try:
        yield start
    finally:
        for proc in started:
            kill_group(proc)


