"""The agent's threads carry OS names (/proc/self/task/TID/comm), so `top -H -p <agent>` and the
agent's "CPU by thread" line say which part costs what: the policy poll, a span exporter, a
sampled collector, the state file. Each is started for real here and read back from /proc."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from moescope.agent import state as st
from moescope.agent.export.processor import BoundedBatchSpanProcessor
from moescope.agent.policy.engine import PolicyLoop
from moescope.agent.start import cpu_by_thread_line
from moescope.procfs import task_cpu

WAIT_S = 10.0


def _names_of(threads: list[threading.Thread]) -> dict[str, str]:
    """{Python name: OS name} once every thread has named itself (or WAIT_S passed)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        tasks = task_cpu(os.getpid())
        names = {t.name: tasks[t.native_id][0] for t in threads if t.native_id in tasks}
        if all(name.startswith("ms-") for name in names.values()) and len(names) == len(threads):
            return names
        if time.monotonic() > deadline:
            return names
        time.sleep(0.01)


class _Exporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class _Engine:
    evaluations = 0

    def evaluate(self, signals: object) -> None:
        self.evaluations += 1


def test_the_policy_loop_an_exporter_and_the_state_file_name_their_threads(tmp_path: Path) -> None:
    processor = BoundedBatchSpanProcessor(_Exporter(), max_queue_spans=8, max_batch_spans=4, schedule_delay_ms=50,
                                          name="file")
    loop = PolicyLoop(_Engine(), lambda: None, period_s=0.05)  # a stand-in engine (PolicyLoop's Evaluator)
    state = st.StatePublisher(state_dir=tmp_path)
    now = time.time()
    snapshot = st.Snapshot(header=st.Header(agent_pid=os.getpid(), started_unix_s=now), taken_unix_s=now)
    publisher = st.PeriodicPublisher(state, lambda: snapshot, interval_s=0.05)
    loop.start()
    publisher.start()
    try:
        threads = [processor._worker, loop._loop_thread, publisher._thread]
        assert _names_of(threads) == {"moescope-export-file": "ms-export-file", "moescope-policy-loop": "ms-policy",
                                      "moescope-state": "ms-state"}
        deadline = time.monotonic() + WAIT_S
        while state.published == 0:  # the named thread is the one doing the work
            assert time.monotonic() < deadline, "the state file was never published"
            time.sleep(0.01)
    finally:
        loop.stop()
        publisher.stop()
        processor.shutdown()


def test_the_cpu_by_thread_line_is_largest_first() -> None:
    threads = {"main": 1.234, "ms-policy": 0.25, "ms-state": 0.0, "ms-export-file": 0.5, "ms-host": 0.0}
    assert cpu_by_thread_line(threads) == (
        "main 1.23 s, ms-export-file 0.50 s, ms-policy 0.25 s, ms-host 0.00 s, ms-state 0.00 s")
    assert cpu_by_thread_line({}) == ""
