"""Read the embedded trace store (OTLP-JSON lines) back: list traces, show one as a tree.

Lines that do not parse are skipped and counted (``TraceStore.bad_lines``), never fatal: a file
cut short by a crash still yields every complete line before the cut.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from moescope import errors
from moescope.agent.export.file_exporter import trace_files
from moescope.agent.export.otlp_json import line_to_request

KIND_NAMES = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes_dict(value.kvlist_value.values)
    return getattr(value, which)


def attributes_dict(items: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items if isinstance(kv, KeyValue)}


@dataclass(frozen=True, slots=True)
class StoredLink:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[StoredLink, ...]
    events: tuple[StoredEvent, ...]
    status_code: int
    status_message: str
    resource: dict[str, Any]
    scope: str

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, slots=True)
class TraceSummary:
    trace_id: str
    root_name: str
    start_ns: int
    duration_ns: int
    span_count: int


@dataclass(slots=True)
class TraceStore:
    """All spans under one traces directory, grouped by trace id."""

    directory: Path
    bad_lines: int = 0
    files: int = 0
    _traces: dict[str, list[StoredSpan]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def load(cls, directory: Path) -> TraceStore:
        if not directory.is_dir():
            raise errors.ConfigError(f"no trace directory {directory} (set --state-dir or $MOESCOPE_STATE_DIR)")
        store = cls(directory=directory)
        for path in trace_files(directory):
            store.files += 1
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if line.strip():
                            store._add_line(line)
            except OSError as exc:
                raise errors.SourceUnavailable(f"cannot read {path}: {exc.strerror}") from exc
        return store

    def _add_line(self, line: str) -> None:
        try:
            request = line_to_request(line)
        except ValueError:
            self.bad_lines += 1
            return
        for span in spans_of(request):
            self._traces[span.trace_id].append(span)

    def trace_ids(self) -> list[str]:
        return list(self._traces)

    def summaries(self) -> list[TraceSummary]:
        """Every trace, most recent start first."""
        out = [summarize(trace_id, spans) for trace_id, spans in self._traces.items()]
        out.sort(key=lambda s: (-s.start_ns, s.trace_id))
        return out

    def resolve(self, trace_id: str) -> str:
        """A full trace id from a full id or a unique prefix; ``UsageError`` otherwise."""
        wanted = trace_id.strip().lower()
        if wanted in self._traces:
            return wanted
        matches = [t for t in self._traces if t.startswith(wanted)] if len(wanted) >= 4 else []
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise errors.UsageError(f"trace id prefix {trace_id!r} matches {len(matches)} traces; give more digits")
        raise errors.UsageError(f"no trace {trace_id!r} in {self.directory}")

    def spans(self, trace_id: str) -> list[StoredSpan]:
        return list(self._traces.get(self.resolve(trace_id), ()))


def spans_of(request: Any) -> Iterator[StoredSpan]:
    for resource_spans in request.resource_spans:
        resource = attributes_dict(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                yield StoredSpan(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    name=span.name,
                    kind=int(span.kind),
                    start_ns=int(span.start_time_unix_nano),
                    end_ns=int(span.end_time_unix_nano),
                    attributes=attributes_dict(span.attributes),
                    links=tuple(
                        StoredLink(link.trace_id.hex(), link.span_id.hex(), attributes_dict(link.attributes))
                        for link in span.links
                    ),
                    events=tuple(
                        StoredEvent(e.name, int(e.time_unix_nano), attributes_dict(e.attributes)) for e in span.events
                    ),
                    status_code=int(span.status.code),
                    status_message=span.status.message,
                    resource=resource,
                    scope=scope,
                )


def roots_of(spans: list[StoredSpan]) -> list[StoredSpan]:
    """Spans with no parent, or whose parent is not stored (orphans), earliest first."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if not s.parent_span_id or s.parent_span_id not in ids]
    return sorted(roots, key=lambda s: (s.start_ns, s.name))


def summarize(trace_id: str, spans: list[StoredSpan]) -> TraceSummary:
    roots = roots_of(spans)
    true_roots = [s for s in roots if not s.parent_span_id] or roots
    start = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    return TraceSummary(
        trace_id=trace_id,
        root_name=true_roots[0].name,
        start_ns=start,
        duration_ns=end - start,
        span_count=len(spans),
    )


def format_time_ns(t_ns: int) -> str:
    stamp = dt.datetime.fromtimestamp(t_ns // 1_000_000_000, tz=dt.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + f".{t_ns % 1_000_000_000 // 1000:06d}Z"


def format_ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list) and len(value) > 16:
        return "[" + ", ".join(_value_text(v) for v in value[:16]) + f", ... ({len(value)} values)]"
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


def render_list(summaries: list[TraceSummary]) -> str:
    header = f"{'TRACE ID':32}  {'START (UTC)':27}  {'DURATION':>12}  {'SPANS':>5}  ROOT"
    lines = [header]
    for s in summaries:
        lines.append(
            f"{s.trace_id:32}  {format_time_ns(s.start_ns):27}  {format_ms(s.duration_ns):>12}  "
            f"{s.span_count:>5}  {s.root_name}"
        )
    return "\n".join(lines) + "\n"


def render_tree(trace_id: str, spans: list[StoredSpan]) -> str:
    """A trace as an indented tree: span, kind, duration, offset from the trace start, attributes."""
    summary = summarize(trace_id, spans)
    children: dict[str, list[StoredSpan]] = defaultdict(list)
    for span in spans:
        children[span.parent_span_id].append(span)
    for kids in children.values():
        kids.sort(key=lambda s: (s.start_ns, s.name, s.span_id))
    lines = [
        f"trace {trace_id}  {summary.span_count} spans  {format_ms(summary.duration_ns)}  "
        f"start {format_time_ns(summary.start_ns)}"
    ]
    resource = spans[0].resource if spans else {}
    if resource:
        lines.append("resource: " + "  ".join(f"{k}={_value_text(v)}" for k, v in sorted(resource.items())))

    def emit(span: StoredSpan, prefix: str, last: bool, orphan: bool) -> None:
        branch = "└─ " if last else "├─ "
        status = "" if span.status_code == 0 else f"  status={STATUS_NAMES.get(span.status_code, span.status_code)}"
        if span.status_message:
            status += f" ({span.status_message})"
        note = f"  (parent {span.parent_span_id} not stored)" if orphan else ""
        lines.append(
            f"{prefix}{branch}{span.name} [{KIND_NAMES.get(span.kind, span.kind)}] {format_ms(span.duration_ns)} "
            f"@+{format_ms(span.start_ns - summary.start_ns)}  span={span.span_id}{status}{note}"
        )
        inner = prefix + ("   " if last else "│  ")
        kids = children.get(span.span_id, [])
        detail = inner + ("│  " if kids else "   ")
        for key, value in sorted(span.attributes.items()):
            lines.append(f"{detail}{key}={_value_text(value)}")
        for link in span.links:
            attrs = "".join(f" {k}={_value_text(v)}" for k, v in sorted(link.attributes.items()))
            lines.append(f"{detail}link -> trace={link.trace_id} span={link.span_id}{attrs}")
        for event in span.events:
            attrs = "".join(f" {k}={_value_text(v)}" for k, v in sorted(event.attributes.items()))
            lines.append(f"{detail}event {event.name} @+{format_ms(event.time_ns - summary.start_ns)}{attrs}")
        for i, kid in enumerate(kids):
            emit(kid, inner, i == len(kids) - 1, False)

    roots = roots_of(spans)
    for i, root in enumerate(roots):
        emit(root, "", i == len(roots) - 1, bool(root.parent_span_id))
    return "\n".join(lines) + "\n"


def trace_as_json(trace_id: str, spans: list[StoredSpan]) -> dict[str, Any]:
    """Machine-readable form of one trace (``agent traces show --json``)."""
    return {
        "trace_id": trace_id,
        "spans": [
            {
                "span_id": s.span_id,
                "parent_span_id": s.parent_span_id,
                "name": s.name,
                "kind": KIND_NAMES.get(s.kind, str(s.kind)),
                "start_ns": s.start_ns,
                "end_ns": s.end_ns,
                "attributes": s.attributes,
                "links": [{"trace_id": link.trace_id, "span_id": link.span_id, "attributes": link.attributes}
                          for link in s.links],
                "events": [{"name": e.name, "time_ns": e.time_ns, "attributes": e.attributes} for e in s.events],
                "status": STATUS_NAMES.get(s.status_code, str(s.status_code)),
                "resource": s.resource,
            }
            for s in sorted(spans, key=lambda s: (s.start_ns, s.span_id))
        ],
    }
