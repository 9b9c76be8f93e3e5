"""tests/export: make tests/otlp_receiver.py importable however pytest was started; the served
Metrics fixture of the /metrics tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent.parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture
def served() -> Iterator[tuple[object, int]]:
    """A Metrics (version 9.9.9) served on a free port: (metrics, port); stopped after the test."""
    from moescope.agent import metrics as m

    metrics = m.Metrics(version="9.9.9")
    server = m.MetricsServer(metrics, port=0)
    port = server.start()
    try:
        yield metrics, port
    finally:
        server.stop()
