"""BoundedBatchSpanProcessor.encode_queued: spans encoded on the thread that made them, written by
the worker; every span still counted exactly once (accepted = exported + failed + dropped + queued)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from sample_trace import emit_sample

from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.export.file_exporter import OtlpJsonFileExporter, trace_files
from moescope.agent.export.processor import BoundedBatchSpanProcessor, Deadline, _as_encoding
from moescope.agent.export.spans import SpanFactory

HOLD_MS = 3_600_000  # a schedule delay no test reaches: the worker wakes only when told to


class RecordingExporter(SpanExporter):
    """Encodes to the span names and the encoding thread; records what reached the worker."""

    def __init__(self, *, fail_encode: bool = False) -> None:
        self.fail_encode = fail_encode
        self.encoded_on: list[str] = []
        self.exported: list[tuple[str, list[str]]] = []  # ("encoded" | "spans", names)
        self.gate = threading.Event()
        self.gate.set()

    def encode(self, spans: Sequence[ReadableSpan]) -> list[str]:
        if self.fail_encode:
            raise ValueError("cannot encode")
        self.encoded_on.append(threading.current_thread().name)
        return [span.name for span in spans]

    def export_encoded(self, payload: list[str]) -> SpanExportResult:
        self.gate.wait(30)
        self.exported.append(("encoded", list(payload)))
        return SpanExportResult.SUCCESS

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.gate.wait(30)
        self.exported.append(("spans", [span.name for span in spans]))
        return SpanExportResult.SUCCESS


class PlainExporter(SpanExporter):
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches.append([span.name for span in spans])
        return SpanExportResult.SUCCESS


def _tracer(processor: BoundedBatchSpanProcessor) -> SpanFactory:
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(processor)
    return SpanFactory(provider.get_tracer("test"))


def _spans(factory: SpanFactory, names: Sequence[str]) -> None:
    for i, name in enumerate(names):
        factory.record(name, start_ns=1_000 + i, end_ns=2_000 + i)


def _accounted(stats: Any) -> int:
    return stats.exported + stats.failed + stats.dropped_shutdown + stats.queued


def test_the_file_exporter_is_an_encoding_exporter(tmp_path: Path) -> None:
    exporter = OtlpJsonFileExporter(tmp_path, max_file_bytes=1 << 20, files_keep=2)
    assert _as_encoding(exporter) is exporter
    assert _as_encoding(PlainExporter()) is None


def test_encoded_on_the_caller_and_written_by_the_worker() -> None:
    exporter = RecordingExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=3, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    exporter.gate.clear()  # the worker, once woken, holds the first payload until the gate opens
    _spans(factory, ["a", "b", "c", "d", "e"])
    assert processor.stats().queued == 5
    assert processor.encode_queued() == 5
    # two payloads of at most max_batch spans each, encoded here; queued until the worker writes them
    assert exporter.encoded_on == [threading.current_thread().name] * 2
    assert processor.stats().queued == 5 and exporter.exported == []
    exporter.gate.set()
    assert processor.force_flush(30_000)
    assert exporter.exported == [("encoded", ["a", "b", "c"]), ("encoded", ["d", "e"])]
    stats = processor.shutdown_within(Deadline(30))
    assert (stats.accepted, stats.exported, stats.queued, stats.failed) == (5, 5, 0, 0)
    assert processor.encode_queued() == 0  # closed: nothing taken


def test_encoded_payloads_go_before_spans_queued_after_them() -> None:
    exporter = RecordingExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=10, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    _spans(factory, ["old1", "old2"])
    processor.encode_queued()
    _spans(factory, ["new1"])  # ended after the round: the worker encodes it itself
    assert processor.force_flush(30_000)
    assert exporter.exported == [("encoded", ["old1", "old2"]), ("spans", ["new1"])]
    assert processor.shutdown_within(Deadline(30)).exported == 3


def test_an_exporter_that_cannot_encode_keeps_its_spans_for_the_worker() -> None:
    exporter = PlainExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=10, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    _spans(factory, ["a", "b"])
    assert processor.encode_queued() == 0
    assert processor.stats().queued == 2
    assert processor.shutdown_within(Deadline(30)).exported == 2
    assert exporter.batches == [["a", "b"]]


def test_an_encoding_error_fails_its_spans_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    exporter = RecordingExporter(fail_encode=True)
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=2, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    _spans(factory, ["a", "b", "c"])
    with caplog.at_level(logging.WARNING):
        assert processor.encode_queued() == 0  # never raises
    stats = processor.stats()
    assert (stats.failed, stats.failed_batches, stats.queued) == (3, 2, 0)
    assert "failed to export 3 spans: ValueError: cannot encode" in caplog.text
    stats = processor.shutdown_within(Deadline(30))
    assert stats.accepted == _accounted(stats) == 3 and exporter.exported == []


def test_encoded_spans_count_against_the_queue_bound() -> None:
    exporter = RecordingExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=4, max_batch_spans=10, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    _spans(factory, ["a", "b", "c"])
    processor.encode_queued()  # 3 encoded, not written yet
    _spans(factory, ["d", "e"])  # room for one more
    stats = processor.stats()
    assert (stats.accepted, stats.dropped_queue_full, stats.queued) == (4, 1, 4)
    stats = processor.shutdown_within(Deadline(30))
    assert (stats.exported, stats.dropped_queue_full) == (4, 1)
    assert exporter.exported == [("encoded", ["a", "b", "c"]), ("spans", ["d"])]


def test_encoded_payloads_not_written_by_the_deadline_are_dropped_at_shutdown() -> None:
    exporter = RecordingExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=2, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    exporter.gate.clear()  # the first write blocks
    _spans(factory, ["a", "b", "c", "d", "e"])
    processor.encode_queued()  # 3 payloads (2 + 2 + 1); the first is handed to the worker
    assert processor.stats().queued == 5
    try:
        stats = processor.shutdown_within(Deadline(0.5))
    finally:
        exporter.gate.set()
    # the two payloads behind the one in flight were dropped and counted; the one in flight is queued
    assert (stats.accepted, stats.dropped_shutdown, stats.exported, stats.queued) == (5, 3, 0, 2)
    assert stats.accepted == _accounted(stats)


def _same_ids(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``lines`` with every trace and span id replaced by its order of first appearance (a run's
    ids are random)."""
    seen: dict[str, str] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (seen.setdefault(v, f"id{len(seen)}") if k in ("traceId", "spanId", "parentSpanId")
                        and isinstance(v, str) and v else walk(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return [walk(line) for line in lines]


def test_the_files_hold_the_same_spans_either_way(tmp_path: Path) -> None:
    lines: dict[str, list[dict[str, Any]]] = {}
    for mode in ("worker", "caller"):
        config = resolve_export_config(ExportFlags(state_dir=str(tmp_path / mode)), env={})
        tracing = build_tracing(config, resource_attributes={"service.name": "enc"})
        emit_sample(tracing.factory)
        if mode == "caller":
            assert tracing.processor.encode_queued() > 0
        stats = tracing.shutdown(timeout_s=30)
        assert stats.exported == stats.accepted > 0
        lines[mode] = [json.loads(line) for f in trace_files(tmp_path / mode / "traces")
                       for line in f.read_text().splitlines()]
    assert lines["caller"] and _same_ids(lines["caller"]) == _same_ids(lines["worker"])


def _until(condition: Any, timeout_s: float = 30.0) -> bool:
    """Poll `condition` every 10 ms for up to timeout_s (bounded)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        threading.Event().wait(0.01)
    return bool(condition())


def test_a_caller_that_encodes_wakes_the_worker_at_most_once_a_delay() -> None:
    # Once a caller encodes, the worker stops polling: the caller's call wakes it when the last wake
    # is a schedule delay old. The first call finds it never woken; the second, within the hour's
    # delay, leaves its payload queued until something else wakes the worker (here a flush).
    exporter = RecordingExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=10, schedule_delay_ms=HOLD_MS)
    factory = _tracer(processor)
    _spans(factory, ["a"])
    assert processor.encode_queued() == 1
    assert _until(lambda: exporter.exported == [("encoded", ["a"])]), exporter.exported  # woken by the call
    _spans(factory, ["b"])
    assert processor.encode_queued() == 1
    threading.Event().wait(0.3)  # (the worker, were it woken, would write b at once)
    assert exporter.exported == [("encoded", ["a"])] and processor.stats().queued == 1
    assert processor.force_flush(30_000)
    assert exporter.exported == [("encoded", ["a"]), ("encoded", ["b"])]
    assert processor.shutdown_within(Deadline(30)).exported == 2


def test_a_call_with_nothing_new_wakes_the_worker_for_what_an_earlier_call_left() -> None:
    exporter = RecordingExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=10, schedule_delay_ms=50)
    factory = _tracer(processor)
    _spans(factory, ["a"])
    processor.encode_queued()
    assert _until(lambda: len(exporter.exported) == 1)  # woken: its delay is now 50 ms off
    _spans(factory, ["b"])
    processor.encode_queued()  # (within 50 ms of that wake, or not: either way b is encoded and waits)
    threading.Event().wait(0.1)  # the delay is up; the worker's own timer is CALLER_IDLE_WAIT_S
    processor.encode_queued()  # nothing new: b, left by the last call, wakes the worker now
    assert _until(lambda: exporter.exported == [("encoded", ["a"]), ("encoded", ["b"])]), exporter.exported
    assert processor.shutdown_within(Deadline(30)).exported == 2


def test_a_wake_that_finds_the_same_numbers_publishes_nothing() -> None:
    published: list[Any] = []
    exporter = PlainExporter()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=100, max_batch_spans=10, schedule_delay_ms=10,
                                          on_stats=published.append)
    factory = _tracer(processor)
    _spans(factory, ["a"])
    assert _until(lambda: any(stats.exported == 1 for stats in published))
    seen = len(published)
    threading.Event().wait(0.3)  # ~30 wakes of a worker polling every 10 ms, each finding nothing
    assert len(published) == seen
    _spans(factory, ["b"])  # a change is published again
    assert _until(lambda: published[-1].exported == 2)
    assert processor.shutdown_within(Deadline(30)).exported == 2
