"""A batch span processor whose queue is bounded and whose every drop is counted.

The SDK's BatchSpanProcessor drops silently (a log line) when its queue is full. This one keeps the
same shape — ``on_end`` only appends to a bounded queue, one worker thread exports batches — and
accounts for every span exactly once:

    accepted = exported + failed + dropped_shutdown + queued (+ in flight)
    offered  = accepted + dropped_queue_full

Exporter errors (a FAILURE result or an exception) are logged with rate limiting and counted,
never raised into the caller. The worker exports with instrumentation suppressed, and the agent
installs no gRPC/HTTP instrumentation, so its own export is never traced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, Context, attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from moescope.procfs import name_thread

log = logging.getLogger(__name__)

_ERROR_LOG_INTERVAL_NS = 10_000_000_000  # at most one export-error line per 10 s per processor


@dataclass(frozen=True, slots=True)
class ExportStats:
    """A snapshot of the processor's counters (all in spans except ``batches``)."""

    accepted: int
    exported: int
    failed: int
    dropped_queue_full: int
    dropped_shutdown: int
    queued: int
    batches: int
    failed_batches: int

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_shutdown


class Deadline:
    """One deadline shared by every step of a shutdown: each step gets what is left."""

    def __init__(self, timeout_s: float) -> None:
        self._end = time.monotonic() + max(timeout_s, 0.0)

    def remaining_s(self) -> float:
        return max(self._end - time.monotonic(), 0.0)

    def expired(self) -> bool:
        return self.remaining_s() <= 0.0


class BoundedBatchSpanProcessor(SpanProcessor):
    """Bounded queue + one export thread; counts accepted/exported/failed/dropped spans."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_spans: int,
        max_batch_spans: int,
        schedule_delay_ms: int,
        on_stats: Callable[[ExportStats], None] | None = None,
        name: str = "otlp",
    ) -> None:
        if max_queue_spans < 1 or max_batch_spans < 1 or schedule_delay_ms <= 0:
            raise ValueError("queue and batch sizes must be >= 1 and the delay > 0")
        self.exporter = exporter
        self.name = name
        self._max_queue = max_queue_spans
        self._max_batch = min(max_batch_spans, max_queue_spans)
        self._delay_s = schedule_delay_ms / 1000.0
        self._on_stats = on_stats
        self._queue: deque[ReadableSpan] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._flush_requests: list[threading.Event] = []
        self._closing = False
        self._abort = False
        self._accepted = 0
        self._exported = 0
        self._failed = 0
        self._dropped_full = 0
        self._dropped_shutdown = 0
        self._batches = 0
        self._failed_batches = 0
        self._in_flight = 0
        self._last_error_log_ns = 0
        self._worker = threading.Thread(target=self._run, name=f"moescope-export-{name}", daemon=True)
        self._worker.start()

    # --- SpanProcessor -----------------------------------------------------------------------
    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._lock:
            if self._closing:
                self._dropped_shutdown += 1
                return
            if len(self._queue) >= self._max_queue:
                self._dropped_full += 1
                return
            self._queue.append(span)
            self._accepted += 1
            wake = len(self._queue) >= self._max_batch
        if wake:
            self._wake.set()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export everything queued now; True if done within the timeout."""
        done = threading.Event()
        with self._lock:
            if self._closing:
                return False
            self._flush_requests.append(done)
        self._wake.set()
        return done.wait(timeout_millis / 1000.0)

    def shutdown(self) -> None:
        self.shutdown_within(Deadline(5.0))

    def shutdown_within(self, deadline: Deadline) -> ExportStats:
        """Stop accepting, export what is queued until ``deadline``, then shut the exporter down.

        Spans still queued when the deadline passes are counted as ``dropped_shutdown``.
        """
        with self._lock:
            already = self._closing
            self._closing = True
        if not already:
            self._wake.set()
            self._worker.join(deadline.remaining_s())
            if self._worker.is_alive():
                # Still exporting: abort the exporter's retries so the deadline holds.
                self._abort = True
                self._shutdown_exporter(deadline)
                self._worker.join(min(deadline.remaining_s(), 1.0) + 0.5)
            else:
                self._shutdown_exporter(deadline)
            with self._lock:
                self._dropped_shutdown += len(self._queue)
                self._queue.clear()
            self._publish()
        return self.stats()

    def _shutdown_exporter(self, deadline: Deadline) -> None:
        try:
            try:
                timeout_ms = deadline.remaining_s() * 1000
                self.exporter.shutdown(timeout_millis=timeout_ms)  # type: ignore[call-arg]  # OTLP's take it; the base's not
            except TypeError:  # exporters whose shutdown() takes no timeout
                self.exporter.shutdown()
        except Exception as exc:  # noqa: BLE001 - exporter errors are logged, never raised
            log.warning("trace exporter %s: shutdown failed: %s", self.name, exc)

    # --- worker ------------------------------------------------------------------------------
    def _take_batch(self) -> list[ReadableSpan]:
        with self._lock:
            n = min(self._max_batch, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            self._in_flight = n
        return batch

    def _run(self) -> None:
        name_thread(f"ms-export-{self.name}")
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))  # the agent never traces itself
        try:
            while True:
                self._wake.wait(self._delay_s)
                self._wake.clear()
                with self._lock:
                    closing = self._closing
                    flushes, self._flush_requests = self._flush_requests, []
                # Every wake (timer, full batch, flush, close) drains the queue in batches.
                while not self._abort:
                    with self._lock:
                        if not self._queue:
                            break
                    self._export(self._take_batch())
                for done in flushes:
                    done.set()
                self._publish()
                if closing:
                    return
        finally:
            detach(token)

    def _export(self, batch: list[ReadableSpan]) -> None:
        error = ""
        try:
            ok = self.exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception as exc:  # noqa: BLE001 - exporter errors are logged, never raised
            ok = False
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._in_flight = 0
            self._batches += 1
            if ok:
                self._exported += len(batch)
            else:
                self._failed += len(batch)
                self._failed_batches += 1
        if not ok:
            self._log_failure(len(batch), error)

    def _log_failure(self, n: int, error: str) -> None:
        now = time.monotonic_ns()
        if now - self._last_error_log_ns >= _ERROR_LOG_INTERVAL_NS:
            self._last_error_log_ns = now
            log.warning(
                "trace exporter %s: failed to export %d spans%s (counted in moescope_export_spans{outcome=\"failed\"})",
                self.name, n, f": {error}" if error else "",
            )

    def _publish(self) -> None:
        if self._on_stats is not None:
            try:
                self._on_stats(self.stats())
            except Exception as exc:  # noqa: BLE001 - a metrics hook must not stop export
                log.warning("export stats hook failed: %s", exc)

    def stats(self) -> ExportStats:
        with self._lock:
            return ExportStats(
                accepted=self._accepted,
                exported=self._exported,
                failed=self._failed,
                dropped_queue_full=self._dropped_full,
                dropped_shutdown=self._dropped_shutdown,
                queued=len(self._queue) + self._in_flight,
                batches=self._batches,
                failed_batches=self._failed_batches,
            )
