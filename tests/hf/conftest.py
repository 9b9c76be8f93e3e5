"""tests/hf: the NVTX test helpers (tests/nvtx) and the e2e harness (tests.e2e.harness) importable
however pytest was started; a private ring directory per test."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
for path in (REPO, REPO / "tests", REPO / "tests" / "nvtx"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture
def ring_dir() -> Iterator[Path]:
    """A private ring directory on tmpfs, where rings live in production (/dev/shm)."""
    path = Path(tempfile.mkdtemp(prefix="moescope-hf-rings-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
