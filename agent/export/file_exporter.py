"""The embedded default: OTLP-JSON lines in size-bounded, rotated files under the state directory.

Files are ``traces-NNNNNN.jsonl`` (increasing sequence numbers). A file is closed once the next
line would take it past ``max_file_bytes``; at most ``files_keep`` files are kept, the oldest
deleted first, so the directory never holds more than ``files_keep x max_file_bytes``. A batch
whose line would not fit in one file is split in halves until it fits; a single span too large for
a file is dropped and counted (``spans_too_large``). Write errors are logged and returned as
FAILURE, never raised. A restarted agent starts a new file after the highest existing number.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from moescope import errors
from moescope.agent.export.otlp_json import line_chunks, spans_to_bytes

log = logging.getLogger(__name__)

FILE_PATTERN = re.compile(r"^traces-(\d{6,})\.jsonl$")


def trace_files(directory: Path) -> list[Path]:
    """The directory's trace files, oldest first (by sequence number)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    numbered = [(int(m.group(1)), name) for name in names if (m := FILE_PATTERN.match(name))]
    return [directory / name for _, name in sorted(numbered)]


def ensure_directory(directory: Path) -> None:
    """Create the trace directory (0700: traces carry peer addresses); typed error if we cannot."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        message = f"cannot create trace directory {directory}: {exc.strerror}"
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise errors.NotPermitted(message + " (use --state-dir or $MOESCOPE_STATE_DIR)") from exc
        raise errors.ConfigError(message) from exc


class OtlpJsonFileExporter(SpanExporter):
    """Writes each batch as one OTLP-JSON line; rotates and bounds the files."""

    # spans already written as OTLP/JSON text (spans.EncodedSpan) are written as they are
    # (BoundedBatchSpanProcessor.takes_encoded_json, SpanFactory.takes_encoded)
    takes_encoded_json = True

    def __init__(self, directory: Path, *, max_file_bytes: int, files_keep: int) -> None:
        if max_file_bytes < 1 or files_keep < 1:
            raise ValueError("max_file_bytes and files_keep must be >= 1")
        self.directory = Path(directory)
        self.max_file_bytes = max_file_bytes
        self.files_keep = files_keep
        self.spans_written = 0
        self.spans_too_large = 0
        self.files_deleted = 0
        self.write_errors = 0
        self._lock = threading.Lock()
        self._file: Path | None = None
        self._size = 0
        self._shutdown = False
        ensure_directory(self.directory)
        existing = trace_files(self.directory)
        newest = FILE_PATTERN.match(existing[-1].name) if existing else None  # trace_files() lists only matches
        self._seq = int(newest.group(1)) if newest else 0

    def _lines(self, spans: Sequence[ReadableSpan]) -> list[tuple[bytes, int]]:
        """Encoded lines with their span counts: a batch in lines of up to ~LINE_TARGET_BYTES
        (otlp_json.line_chunks: no line is a fresh mapping to fault in), each line one OTLP/JSON
        request; a run too large for one file is split further."""
        return [line for run in line_chunks(spans) for line in self._run_lines(run)]

    def _run_lines(self, spans: Sequence[ReadableSpan]) -> list[tuple[bytes, int]]:
        # Direct SDK span -> OTLP/JSON mapping: the text the protobuf route (encode_spans +
        # json_format) gives, without building protobuf messages (the agent's largest CPU cost).
        data = spans_to_bytes(spans)
        if len(data) <= self.max_file_bytes:
            return [(data, len(spans))]
        if len(spans) == 1:
            self.spans_too_large += 1
            log.warning(
                "trace file: one span encodes to %d bytes > file limit %d: dropped", len(data), self.max_file_bytes
            )
            return []
        half = len(spans) // 2
        return self._run_lines(spans[:half]) + self._run_lines(spans[half:])

    def _rotate(self) -> None:
        self._seq += 1
        self._file = self.directory / f"traces-{self._seq:06d}.jsonl"
        self._size = 0
        files = trace_files(self.directory)
        # Keep files_keep files including the new one about to be created.
        for old in files[: max(len(files) - (self.files_keep - 1), 0)]:
            try:
                old.unlink()
                self.files_deleted += 1
            except FileNotFoundError:
                pass

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            lines = self._lines(spans)
        except (OSError, ValueError) as exc:
            self.write_errors += 1
            log.warning("trace file %s: write failed: %s", self._file, exc)
            return SpanExportResult.FAILURE
        return self.export_encoded(lines)

    def encode(self, spans: Sequence[ReadableSpan]) -> list[tuple[bytes, int]]:
        """The lines ``export`` would write for ``spans`` (processor.EncodingExporter: the span
        processor has the thread that made the spans encode them, the worker writes them)."""
        return self._lines(spans) if spans else []

    def export_encoded(self, lines: list[tuple[bytes, int]]) -> SpanExportResult:
        """Write lines ``encode`` made."""
        if self._shutdown:
            return SpanExportResult.FAILURE
        try:
            with self._lock:
                f = None  # the file is opened once for the lines that go to it (a batch is a few lines)
                try:
                    for data, count in lines:
                        if self._file is None or self._size + len(data) > self.max_file_bytes:
                            if f is not None:
                                f.close()
                                f = None
                            self._rotate()
                        assert self._file is not None
                        if f is None:
                            f = open(self._file, "ab")  # noqa: SIM115 (closed in finally: rotation reopens)
                        f.write(data)
                        self._size += len(data)
                        self.spans_written += count
                finally:
                    if f is not None:
                        f.close()
        except (OSError, ValueError) as exc:
            self.write_errors += 1
            log.warning("trace file %s: write failed: %s", self._file, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS  # spans too large for a file are counted in spans_too_large

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # every export is written and closed before it returns

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        self._shutdown = True
