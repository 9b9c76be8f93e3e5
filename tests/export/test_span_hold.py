"""SpanFactory.hold / release and the processor's batch entry: spans a thread finishes while holding
reach the export queue together and in order, counted as one by one; other threads' spans are not
held; and a processor whose caller encodes once a round is not woken mid-round at every batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from test_encode_queued import PlainExporter as Names

from moescope.agent.export.processor import BoundedBatchSpanProcessor, Deadline, ExportStats
from moescope.agent.export.spans import SpanFactory

HOLD_MS = 3_600_000  # a schedule delay no test reaches: the worker wakes only when told to


class EncodingNames(Names):
    def encode(self, spans: Sequence[ReadableSpan]) -> list[str]:
        return [span.name for span in spans]

    def export_encoded(self, payload: list[str]) -> SpanExportResult:
        self.batches.append(list(payload))
        return SpanExportResult.SUCCESS


class CountingProcessor(SpanProcessor):
    """A BoundedBatchSpanProcessor behind a counter of its entries: one call per span, or one per batch
    (a wrapper: the processor may be compiled with mypyc, and a compiled class takes no Python subclass)."""

    def __init__(self, exporter: Names, *, max_queue_spans: int, max_batch_spans: int, schedule_delay_ms: int) -> None:
        self.inner = BoundedBatchSpanProcessor(exporter, max_queue_spans=max_queue_spans,
                                               max_batch_spans=max_batch_spans, schedule_delay_ms=schedule_delay_ms)
        self.single_calls = 0
        self.batch_calls = 0

    def on_end(self, span: ReadableSpan) -> None:
        self.single_calls += 1
        self.inner.on_end(span)

    def on_end_sampled(self, spans: Sequence[ReadableSpan]) -> None:
        self.batch_calls += 1
        self.inner.on_end_sampled(spans)

    def stats(self) -> ExportStats:
        return self.inner.stats()

    def shutdown_within(self, deadline: Deadline) -> ExportStats:
        return self.inner.shutdown_within(deadline)


def _factory(*processors: object) -> SpanFactory:
    provider = TracerProvider(sampler=ALWAYS_ON)
    for processor in processors:
        provider.add_span_processor(processor)  # type: ignore[arg-type]
    factory = SpanFactory(provider.get_tracer("test"))
    assert factory.direct
    return factory


def _all_names(exporter: Names) -> list[str]:
    return [name for batch in exporter.batches for name in batch]


def test_held_spans_reach_the_queue_together_in_order() -> None:
    exporter = Names()
    processor = CountingProcessor(exporter, max_queue_spans=100, max_batch_spans=100, schedule_delay_ms=HOLD_MS)
    factory = _factory(processor)
    assert factory.hold()
    assert not factory.hold()  # already holding: the first hold's release hands everything on
    root = factory.record("root", start_ns=1, end_ns=9)
    factory.record("phase", start_ns=2, end_ns=3, parent=root)
    factory.record_children("layer", parent=root, children=[(3, 4, {"moe.layer": 1}), (4, 5, {"moe.layer": 2})])
    assert processor.stats().accepted == 0  # held
    factory.release()
    assert (processor.single_calls, processor.batch_calls) == (0, 1)
    factory.record("after", start_ns=5, end_ns=6)  # no longer holding: one by one again
    assert processor.single_calls == 1
    factory.release()  # nothing held: nothing happens
    stats = processor.shutdown_within(Deadline(30))
    assert (stats.accepted, stats.exported, stats.dropped) == (5, 5, 0)
    assert _all_names(exporter) == ["root", "phase", "layer", "layer", "after"]


def test_another_threads_spans_are_not_held() -> None:
    exporter = Names()
    processor = CountingProcessor(exporter, max_queue_spans=100, max_batch_spans=100, schedule_delay_ms=HOLD_MS)
    factory = _factory(processor)
    assert factory.hold()
    factory.record("held", start_ns=1, end_ns=2)
    other = threading.Thread(target=lambda: factory.record("other", start_ns=3, end_ns=4))
    other.start()
    other.join(30)
    assert processor.stats().accepted == 1 and processor.single_calls == 1  # the other thread's, at once
    factory.release()
    stats = processor.shutdown_within(Deadline(30))
    assert stats.exported == 2 and _all_names(exporter) == ["other", "held"]


def test_with_several_processors_each_gets_every_held_span() -> None:
    ours, plain = Names(), Names()
    processor = CountingProcessor(ours, max_queue_spans=100, max_batch_spans=100, schedule_delay_ms=HOLD_MS)
    factory = _factory(processor, SimpleSpanProcessor(plain))
    assert factory.hold()
    factory.record("a", start_ns=1, end_ns=2)
    factory.record("b", start_ns=2, end_ns=3)
    factory.release()
    assert (processor.single_calls, processor.batch_calls) == (2, 0)  # through the SDK's fan-out
    assert _all_names(plain) == ["a", "b"]
    assert processor.shutdown_within(Deadline(30)).exported == 2 and _all_names(ours) == ["a", "b"]


def test_a_batch_past_the_queue_bound_is_dropped_and_counted() -> None:
    exporter = Names()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=4, max_batch_spans=100, schedule_delay_ms=HOLD_MS)
    factory = _factory(processor)
    factory.record("first", start_ns=1, end_ns=2)
    assert factory.hold()
    for i in range(5):
        factory.record(f"held{i}", start_ns=1, end_ns=2)
    factory.release()
    stats = processor.stats()
    assert (stats.accepted, stats.dropped_queue_full, stats.queued) == (4, 2, 4)
    stats = processor.shutdown_within(Deadline(30))
    assert stats.exported == 4 and _all_names(exporter) == ["first", "held0", "held1", "held2"]
    assert factory.hold()
    factory.record("late", start_ns=1, end_ns=2)
    factory.release()  # closed: counted as dropped at shutdown, as on_end counts it
    assert processor.stats().dropped_shutdown == 1


def _wait_for(predicate: object, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_full_batch_wakes_the_worker_until_a_caller_encodes() -> None:
    exporter = EncodingNames()
    processor = BoundedBatchSpanProcessor(exporter, max_queue_spans=40, max_batch_spans=4, schedule_delay_ms=HOLD_MS)
    factory = _factory(processor)
    for i in range(4):  # a batch: the worker wakes and exports it
        factory.record(f"a{i}", start_ns=1, end_ns=2)
    assert _wait_for(lambda: processor.stats().exported == 4)
    assert processor.encode_queued() == 0  # a caller that encodes (nothing queued yet)
    for i in range(8):  # two batches: no wake-up now, the caller encodes them at its round's end
        factory.record(f"b{i}", start_ns=1, end_ns=2)
    time.sleep(0.3)
    assert processor.stats().exported == 4 and processor.stats().queued == 8
    assert processor.encode_queued() == 8  # encoded: a batch or more of it wakes the worker
    assert _wait_for(lambda: processor.stats().exported == 12)
    assert factory.hold()
    for i in range(20):  # half the queue still wakes the worker (room to drain before drops)
        factory.record(f"c{i}", start_ns=1, end_ns=2)
    factory.release()
    assert _wait_for(lambda: processor.stats().exported == 32)
    stats = processor.shutdown_within(Deadline(30))
    assert (stats.accepted, stats.exported, stats.dropped) == (32, 32, 0)
