"""Spend a set amount of the calling thread's CPU: a part whose counted CPU a test checks."""

from __future__ import annotations

import time


def burn_thread_cpu(cpu_ns: int) -> None:
    """Spin until this thread has used ``cpu_ns`` more of CPU (thread time; bounded by it)."""
    end = time.thread_time_ns() + cpu_ns
    while time.thread_time_ns() < end:
        pass
