"""A batch span processor whose queue is bounded and whose every drop is counted.

The SDK's BatchSpanProcessor drops silently (a log line) when its queue is full. This one keeps the
same shape — ``on_end`` only appends to a bounded queue, one worker thread exports batches — and
accounts for every span exactly once:

    accepted = exported + failed + dropped_shutdown + queued (+ in flight)
    offered  = accepted + dropped_queue_full

Exporter errors (a FAILURE result or an exception) are logged with rate limiting and counted,
never raised into the caller. The worker exports with instrumentation suppressed, and the agent
installs no gRPC/HTTP instrumentation, so its own export is never traced.

Encoding where the spans were made: an exporter whose CPU part can be split from its I/O (an
``EncodingExporter``: ``encode(spans)``, then ``export_encoded(payload)``; the OTLP-JSON file
exporter and the OTLP/gRPC one, agent/export/otlp_proto.py) lets the thread that made the spans
encode them (``encode_queued``: the agent's main loop, once a round, right after the round made
them) and leaves the worker only the write or the send. Measured on the reference load
(docs/benchmarks.md "Encoding on the main loop"): the worker, waking up to a second later onto spans
no longer in cache and contending with the main loop for the GIL, spent 9-12 us a span in a replay
where the same batches cost 5-6 alone; beside the runtime the agent's CPU fell ~7 %. The worker
still encodes whatever is queued when it wakes (spans another thread ended since the last round,
or a caller that never calls encode_queued): nothing depends on the main loop calling it. Encoded
payloads count as queued until written; an encoding error fails its spans (counted, logged).
Once a caller encodes, a full batch no longer wakes the worker (half the queue does): at the
reference load a 2 s round makes ~700-1400 spans, and the wake at every 512 had the worker take
the rest of the round's spans and encode them itself, cold, beside the main loop — 2.15 of the
agent's ~21 ms/s on its export thread, 0.31 after (docs/benchmarks.md "The export worker woken once
a round").

Once a caller encodes, the worker also stops polling: the caller's encoding wakes it when it made
something and the last wake is a schedule delay old (so a busy caller, a round every 50 ms, wakes it
at most once a delay), and its own timer is CALLER_IDLE_WAIT_S. Spans another thread ends between
the caller's calls are encoded by the next call and written then. A wake that finds the stats as
the last one published them publishes nothing. Beside an idle runtime the worker woke every second
to find nothing and republish the same numbers: ~0.3 ms of CPU a wake on the VMs here
(docs/benchmarks.md "A slower VM; fewer idle wake-ups").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, Context, attach, detach, set_value
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from moescope.procfs import name_thread

log = logging.getLogger(__name__)

_ERROR_LOG_INTERVAL_NS = 10_000_000_000  # at most one export-error line per 10 s per processor
# The worker's own timer once a caller encodes (encode_queued wakes it when there is work): a
# fallback, never the way spans are written while the caller runs.
CALLER_IDLE_WAIT_S = 10.0


class EncodingExporter(Protocol):
    """An exporter whose work splits into encoding (CPU, any thread) and export (I/O, the worker)."""

    def encode(self, spans: Sequence[ReadableSpan]) -> Any: ...

    def export_encoded(self, payload: Any) -> SpanExportResult: ...


def _as_encoding(exporter: SpanExporter) -> EncodingExporter | None:
    """The exporter as an EncodingExporter where it has both methods (a duck check: the agent's hot
    path is compiled with mypyc, which has no runtime-checkable protocols)."""
    if callable(getattr(exporter, "encode", None)) and callable(getattr(exporter, "export_encoded", None)):
        return cast(EncodingExporter, exporter)
    return None


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
        # encoded payloads (encode_queued) waiting for the worker, with their span counts
        self._encoder: EncodingExporter | None = _as_encoding(exporter)
        # an exporter that writes OTLP/JSON text takes spans already written as text
        # (spans.EncodedSpan, SpanFactory.takes_encoded): its `takes_encoded_json`
        self.takes_encoded_json = bool(getattr(exporter, "takes_encoded_json", False))
        self._encoded: deque[tuple[Any, int]] = deque()
        self._encoded_spans = 0  # spans in _encoded
        self._encoding = 0  # spans taken by encode_queued, not yet in _encoded
        # The queue length whose reaching wakes the worker: a batch, until a caller encodes
        # (encode_queued), then half the queue. A thread that encodes what it made once a round
        # (the agent's main loop) would otherwise have the worker woken mid-round at every batch
        # to encode the rest itself, cold and contending for the GIL (docs/benchmarks.md "The export
        # worker woken once a round"); half the queue still leaves it room to drain before drops.
        self._wake_at = self._max_batch
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
        self._caller_encodes = False  # encode_queued was called: the worker's timer is CALLER_IDLE_WAIT_S
        self._next_wake_s = 0.0  # before it, a caller's encoding leaves the worker to its timer
        self._published: ExportStats | None = None  # what _publish last handed on_stats
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
            if len(self._queue) + self._encoded_spans + self._encoding >= self._max_queue:
                self._dropped_full += 1
                return
            self._queue.append(span)
            self._accepted += 1
            wake = len(self._queue) == self._wake_at  # (reaching it: the worker drains all it finds)
        if wake:
            self._wake.set()

    def on_end_sampled(self, spans: Sequence[ReadableSpan]) -> None:
        """``on_end`` for several finished spans at once, each known sampled (SpanFactory's, made
        under the ALWAYS_ON sampler): one lock for them all. Past the queue bound the rest are
        dropped and counted, as ``on_end`` drops them one by one."""
        with self._lock:
            if self._closing:
                self._dropped_shutdown += len(spans)
                return
            queue = self._queue
            before = len(queue)
            room = self._max_queue - before - self._encoded_spans - self._encoding
            if room < len(spans):
                self._dropped_full += len(spans) - max(room, 0)
                spans = spans[:max(room, 0)]
            queue.extend(spans)
            self._accepted += len(spans)
            wake = before < self._wake_at <= len(queue)
        if wake:
            self._wake.set()

    def encode_queued(self) -> int:
        """Encode what is queued now on the calling thread (the exporter's ``encode``), for the
        worker to export on its next wake; returns the spans encoded. Nothing when the exporter
        cannot split its work or the processor is closing. Never raises: a batch whose encoding
        fails is counted failed and logged (rate-limited), as a failed export is."""
        encoder = self._encoder
        if encoder is None:
            return 0
        with self._lock:
            self._wake_at = max(self._max_batch, self._max_queue // 2)  # a caller encodes: see __init__
            self._caller_encodes = True
            if self._closing:
                return 0
            spans = list(self._queue)
            self._queue.clear()
            self._encoding = len(spans)
            # nothing new: payloads an earlier call left wake the worker once their delay is up
            idle_wake = not spans and self._worker_due()
        if not spans:
            if idle_wake:
                self._wake.set()
            return 0
        made: list[tuple[Any, int]] = []
        failed = failed_batches = 0
        error = ""
        step = self._max_batch
        for at in range(0, len(spans), step):
            batch = spans[at:at + step]
            try:
                made.append((encoder.encode(batch), len(batch)))
            except Exception as exc:  # noqa: BLE001 - exporter errors are logged, never raised
                failed += len(batch)
                failed_batches += 1
                error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._encoding = 0
            self._encoded.extend(made)
            self._encoded_spans += len(spans) - failed
            self._failed += failed
            self._failed_batches += failed_batches
            # a full batch, or anything waiting once the last wake is a schedule delay old
            # (or spans failed: the worker publishes the count)
            wake = self._encoded_spans >= self._max_batch or failed > 0 or self._worker_due()
        if failed:
            self._log_failure(failed, error)
        if wake:
            self._wake.set()
        return len(spans) - failed

    def _worker_due(self) -> bool:
        """Encoded payloads wait and the worker's last wake is a schedule delay old (under the lock)."""
        return self._encoded_spans > 0 and time.monotonic() >= self._next_wake_s

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
                self._dropped_shutdown += len(self._queue) + self._encoded_spans
                self._queue.clear()
                self._encoded.clear()
                self._encoded_spans = 0
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
    def _take_work(self) -> tuple[Any, int, bool] | None:
        """The next thing to export: an encoded payload first (older spans), else a batch of
        queued spans; (what, spans, encoded). None when both are empty."""
        with self._lock:
            if self._encoded:
                payload, n = self._encoded.popleft()
                self._encoded_spans -= n
                self._in_flight = n
                return payload, n, True
            if not self._queue:
                return None
            n = min(self._max_batch, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            self._in_flight = n
            return batch, n, False

    def _run(self) -> None:
        name_thread(f"ms-export-{self.name}")
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))  # the agent never traces itself
        try:
            while True:
                # (once a caller encodes, its calls wake this thread: the timer is a fallback)
                self._wake.wait(max(self._delay_s, CALLER_IDLE_WAIT_S) if self._caller_encodes else self._delay_s)
                self._wake.clear()
                self._next_wake_s = time.monotonic() + self._delay_s
                with self._lock:
                    closing = self._closing
                    flushes, self._flush_requests = self._flush_requests, []
                # Every wake (timer, full batch, flush, close) drains the queue in batches.
                while not self._abort:
                    work = self._take_work()
                    if work is None:
                        break
                    what, n, encoded = work
                    if encoded:
                        self._export_encoded(what, n)
                    else:
                        self._export(what)
                for done in flushes:
                    done.set()
                self._publish()
                if closing:
                    return
        finally:
            detach(token)

    def _export(self, batch: list[ReadableSpan]) -> None:
        self._export_call(self.exporter.export, batch, len(batch))

    def _export_encoded(self, payload: Any, n: int) -> None:
        assert self._encoder is not None
        self._export_call(self._encoder.export_encoded, payload, n)

    def _export_call(self, export: Callable[[Any], SpanExportResult], what: Any, n: int) -> None:
        error = ""
        try:
            ok = export(what) is SpanExportResult.SUCCESS
        except Exception as exc:  # noqa: BLE001 - exporter errors are logged, never raised
            ok = False
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._in_flight = 0
            self._batches += 1
            if ok:
                self._exported += n
            else:
                self._failed += n
                self._failed_batches += 1
        if not ok:
            self._log_failure(n, error)

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
                stats = self.stats()
                if stats == self._published:
                    return  # (a wake that found nothing: the same numbers again)
                self._published = stats
                self._on_stats(stats)
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
                queued=len(self._queue) + self._encoding + self._encoded_spans + self._in_flight,
                batches=self._batches,
                failed_batches=self._failed_batches,
            )
