"""tests/e2e: make tests/otlp_receiver.py importable however pytest was started."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parent.parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
