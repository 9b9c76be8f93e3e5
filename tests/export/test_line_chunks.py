"""A batch of spans is written as trace-file lines of at most ~LINE_TARGET_BYTES (each line is one
bytes object: one past the agent's mmap threshold is a fresh mapping, faulted in page by page as it
is written), every span exactly once, in order, each line a whole OTLP/JSON request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from moescope.agent.export.file_exporter import OtlpJsonFileExporter, trace_files
from moescope.agent.export.otlp_json import LINE_TARGET_BYTES, SPAN_TEXT_GUESS_BYTES, line_chunks
from moescope.agent.export.spans import EncodedSpan

RESOURCE = Resource.create({"service.name": "chunks"})
SCOPE = InstrumentationScope("moescope")
ENVELOPE_BYTES = 1024  # a line's resource and scope around its spans (far less in fact)


def encoded(i: int, size: int) -> Any:
    """A span already written as text, of about ``size`` bytes (its name padded); the exporters
    take it where they take a ReadableSpan (typed Any here, as the processor hands it on)."""
    head = f'{{"traceId":"{i + 1:032x}","spanId":"{i + 1:016x}","name":"s{i}-'
    pad = "x" * max(0, size - len(head) - 2)
    return EncodedSpan((head + pad + '"}').encode(), RESOURCE, SCOPE)


def names(line: bytes) -> list[str]:
    request = json.loads(line)
    (resource,) = request["resourceSpans"]
    (scope,) = resource["scopeSpans"]
    assert {"key": "service.name", "value": {"stringValue": "chunks"}} in resource["resource"]["attributes"]
    return [span["name"].split("-")[0] for span in scope["spans"]]


def test_runs_fill_up_to_the_target_in_order() -> None:
    spans = [encoded(i, 1000) for i in range(10)]
    runs = line_chunks(spans, target_bytes=3000)
    assert [len(run) for run in runs] == [3, 3, 3, 1]
    assert [span for run in runs for span in run] == spans
    assert line_chunks(spans, target_bytes=10_000) == [spans]  # all of it fits: the sequence itself
    big = [encoded(0, 500), encoded(1, 5000), encoded(2, 500)]
    assert [len(run) for run in line_chunks(big, target_bytes=3000)] == [1, 1, 1]  # a big span alone
    assert line_chunks([], target_bytes=3000) == [[]]


def test_spans_not_yet_text_count_a_guess() -> None:
    class Plain:  # (anything not an EncodedSpan: its size is SPAN_TEXT_GUESS_BYTES)
        pass

    spans = [Plain() for _ in range(5)]
    runs = line_chunks(spans, target_bytes=2 * SPAN_TEXT_GUESS_BYTES)  # type: ignore[arg-type]  # (not spans)
    assert [len(run) for run in runs] == [2, 2, 1]


def test_a_batch_past_the_target_is_written_as_several_whole_lines(tmp_path: Path) -> None:
    spans = [encoded(i, 9000) for i in range(60)]  # ~540 KB of span text
    exporter = OtlpJsonFileExporter(tmp_path, max_file_bytes=64 << 20, files_keep=2)
    lines = exporter.encode(spans)
    assert len(lines) == 3
    assert all(len(data) <= LINE_TARGET_BYTES + ENVELOPE_BYTES for data, _ in lines)
    assert sum(count for _, count in lines) == 60
    assert [name for data, _ in lines for name in names(data)] == [f"s{i}" for i in range(60)]
    exporter.export_encoded(lines)
    assert exporter.spans_written == 60
    (written,) = trace_files(tmp_path)
    assert written.read_bytes() == b"".join(data for data, _ in lines)


def test_lines_rotate_across_files_and_none_is_lost(tmp_path: Path) -> None:
    spans = [encoded(i, 9000) for i in range(60)]
    exporter = OtlpJsonFileExporter(tmp_path, max_file_bytes=200_000, files_keep=10)
    exporter.export(spans)
    files = trace_files(tmp_path)
    assert len(files) >= 3 and all(f.stat().st_size <= 200_000 for f in files)
    got = [name for f in files for line in f.read_bytes().splitlines() for name in names(line)]
    assert got == [f"s{i}" for i in range(60)] and exporter.spans_written == 60
