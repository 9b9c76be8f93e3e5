"""Fixtures for the fault tests: a `lab` that starts real processes and stops every one of them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Lab


@pytest.fixture
def lab(bpf: None, tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.close()
