"""Where the time went, after the fact: the per-phase table of the model requests in a window, read
back from the traces (the server spans' moe.request.* and gen_ai.usage.* attributes).

  agent report                               every model request in the trace store
  agent report --since 10m                   the last ten minutes
  agent report --since 2026-12-01T15:00:00Z --until 2026-12-01T15:30:00Z
  agent report --file traces.jsonl --json    an OTLP-JSON file (the store's or a Collector's), as JSON

Prints, in the seed's shape: phase | p50 ms | p99 ms | share of total, for receive, queue, prefill,
decode and write (their shares add up to 100 %: they split each request's kernel-measured duration),
the request as a whole, and "of which" inference (prefill + decode), expert load and routing; then
TTFT and TPOT p50/p99, input and output tokens (and per second over the window) and the number of
requests. p50/p99 are nearest-rank over the requests (moescope/latency.py: the ceil(q*n)-th
smallest value), the definition `agent top` and the policy use; share = the phase's sum over the
requests / the sum of their durations.

A request counts when its last byte (the server span's end) falls in [--since, --until). Times are
ISO-8601 (2026-12-01T15:00:00Z; without a zone: UTC) or an age before now (90s, 10m, 1.5h, 2d).
Only server spans with the breakdown count (requests that a moe.step carried). Reads the embedded
store STATE_DIR/traces (--state-dir, else $MOESCOPE_STATE_DIR, else /var/lib/moescope), or --store
DIR (a traces directory), or --file FILE (repeatable).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moescope import errors
from moescope.agent.export.config import TRACES_SUBDIR, add_state_dir_argument, default_traces_dir
from moescope.agent.export.otlp_json import line_to_request
from moescope.agent.export.store import StoredSpan, TraceStore, spans_of
from moescope.agent.phase_table import OF_WHICH, PHASE_LABELS, Phases, RequestPhases, summarize
from moescope.agent.request_phases import PHASES

SERVER_KIND = 2  # OTLP SpanKind SERVER
PHASE_ATTR = "moe.request.phase.{}_ms"
AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
AGE_UNITS_NS = {"ms": 1_000_000, "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
                "d": 86_400_000_000_000}
TIME_HELP = "ISO-8601 (2026-12-01T15:00:00Z; no zone = UTC) or an age before now (90s, 10m, 1.5h, 2d)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", metavar="T", help=f"first request end to count: {TIME_HELP}")
    parser.add_argument("--until", metavar="T",
                        help="count requests that ended before T (default: now with --since, else no limit)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--file", metavar="FILE", action="append", type=Path,
                       help="an OTLP-JSON traces file (one ExportTraceServiceRequest per line); repeatable")
    where.add_argument("--store", metavar="DIR", type=Path, help="a trace store directory (traces-*.jsonl files)")
    add_state_dir_argument(where)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def parse_time(text: str, *, now_ns: int, option: str) -> int:
    """Unix ns of an ISO-8601 time or of an age before ``now_ns``; UsageError (one line) otherwise."""
    if text.strip() == "now":
        return now_ns
    age = AGE_RE.match(text)
    if age:
        return now_ns - round(float(age.group(1)) * AGE_UNITS_NS[age.group(2)])
    try:
        stamp = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise errors.UsageError(f"{option} {text!r}: not a time ({TIME_HELP})") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    whole = int(stamp.replace(microsecond=0).timestamp())  # integer seconds: no float rounding
    return whole * 1_000_000_000 + stamp.microsecond * 1000


def format_time(t_ns: int) -> str:
    stamp = dt.datetime.fromtimestamp(t_ns // 1_000_000_000, tz=dt.UTC)
    frac = t_ns % 1_000_000_000 // 1_000_000
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + (f".{frac:03d}Z" if frac else "Z")


@dataclass(slots=True)
class Loaded:
    """The spans read, with what could not be read."""

    spans: list[StoredSpan]
    source: str
    bad_lines: int = 0


def read_files(paths: Iterable[Path]) -> Loaded:
    spans: list[StoredSpan] = []
    bad = 0
    names = []
    for path in paths:
        names.append(str(path))
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            raise errors.SourceUnavailable(f"no such traces file: {path}") from None
        except IsADirectoryError:
            raise errors.UsageError(f"{path} is a directory (use --store DIR for a trace store)") from None
        except OSError as exc:
            raise errors.SourceUnavailable(f"cannot read {path}: {exc.strerror}") from None
        file_spans, file_bad = _parse_text(text)
        spans.extend(file_spans)
        bad += file_bad
    return Loaded(spans=spans, source=", ".join(names), bad_lines=bad)


def _parse_text(text: str) -> tuple[list[StoredSpan], int]:
    """One request per line (the store's and the Collector's form); else the whole text as one."""
    spans: list[StoredSpan] = []
    bad = 0
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines:
        try:
            spans.extend(spans_of(line_to_request(line)))
        except ValueError:
            bad += 1
    if bad == len(lines) and lines:  # maybe one pretty-printed request
        try:
            return list(spans_of(line_to_request(text))), 0
        except ValueError:
            pass
    return spans, bad


def read_store(directory: Path) -> Loaded:
    store = TraceStore.load(directory)
    spans = [span for trace_id in store.trace_ids() for span in store.spans(trace_id)]
    return Loaded(spans=spans, source=f"{directory} ({store.files} files)", bad_lines=store.bad_lines)


def _number(attrs: Mapping[str, Any], key: str) -> float | None:
    value = attrs.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def request_phases(span: StoredSpan) -> RequestPhases | None:
    """A server span's breakdown, or None when it carries none (not a model request, or malformed)."""
    attrs = span.attributes
    parts = [_number(attrs, PHASE_ATTR.format(p)) for p in PHASES]
    ttft = _number(attrs, "moe.request.ttft_ms")
    if any(v is None for v in parts) or ttft is None:
        return None
    phase_ms = [float(v or 0.0) for v in parts]
    phase_ms += [phase_ms[2] + phase_ms[3], _number(attrs, "moe.request.expert_load_ms") or 0.0,
                 _number(attrs, "moe.request.routing_ms") or 0.0]
    input_tokens = attrs.get("gen_ai.usage.input_tokens")
    output_tokens = attrs.get("gen_ai.usage.output_tokens")
    return RequestPhases(
        end_ns=span.end_ns,
        duration_ms=span.duration_ns / 1e6,
        phase_ms=tuple(phase_ms),
        ttft_ms=ttft,
        ttft_source=str(attrs.get("moe.request.ttft_source", "step")),
        tpot_ms=_number(attrs, "moe.request.tpot_ms"),
        input_tokens=input_tokens if isinstance(input_tokens, int) and not isinstance(input_tokens, bool) else None,
        output_tokens=output_tokens if isinstance(output_tokens, int) and not isinstance(output_tokens, bool) else 0,
    )


@dataclass(slots=True)
class Report:
    table: Phases
    since_ns: int | None
    until_ns: int | None
    source: str
    models: list[str]
    server_spans: int  # server spans in the window, model requests or not
    bad_lines: int


def model_spans(spans: Iterable[StoredSpan], *, since_ns: int | None, until_ns: int | None) -> Iterator[StoredSpan]:
    for span in spans:
        if span.kind != SERVER_KIND:
            continue
        if since_ns is not None and span.end_ns < since_ns:
            continue
        if until_ns is not None and span.end_ns >= until_ns:
            continue
        yield span


def build_report(loaded: Loaded, *, since_ns: int | None, until_ns: int | None) -> Report:
    """The table over the window; SourceUnavailable (one line) when no model request is in it."""
    servers = list(model_spans(loaded.spans, since_ns=since_ns, until_ns=until_ns))
    pairs = [(s, r) for s in servers if (r := request_phases(s)) is not None]
    if not pairs:
        window = f"between {_bound(since_ns)} and {_bound(until_ns)}" if since_ns or until_ns else "at all"
        raise errors.SourceUnavailable(
            f"no model requests (server spans with moe.request.phase.* attributes) {window} in {loaded.source}: "
            f"{len(servers)} server spans, {len(loaded.spans)} spans read"
            + (f", {loaded.bad_lines} unreadable lines" if loaded.bad_lines else "")
        )
    first = since_ns if since_ns is not None else min(s.start_ns for s, _ in pairs)
    last = until_ns if until_ns is not None else max(s.end_ns for s, _ in pairs)
    models = sorted({str(s.attributes["gen_ai.request.model"]) for s, _ in pairs
                     if "gen_ai.request.model" in s.attributes})
    return Report(
        table=summarize((r for _, r in pairs), window_s=(last - first) / 1e9 if last > first else None),
        since_ns=since_ns,
        until_ns=until_ns,
        source=loaded.source,
        models=models,
        server_spans=len(servers),
        bad_lines=loaded.bad_lines,
    )


def _bound(t_ns: int | None) -> str:
    return "the start" if t_ns is None else format_time(t_ns)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f} %"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _rate(value: float | None) -> str:
    return "" if value is None else f" ({value:,.1f}/s)"


def render_text(report: Report) -> str:
    t = report.table
    until = "the end" if report.until_ns is None else format_time(report.until_ns)
    window = f"{_bound(report.since_ns)} → {until}"
    models = f" · model {', '.join(report.models)}" if report.models else ""
    lines = [f"where the time goes · {t.requests:,} model requests · {window}{models}", ""]
    width = 22
    lines.append(f"{'phase':<{width}}{'p50 ms':>10}{'p99 ms':>10}{'share of total':>16}")
    labels = {**PHASE_LABELS, "inference": "inference (pre+dec)", "expert_load": "expert load"}
    for row in t.rows:
        if row.phase == OF_WHICH[0]:
            lines.append(f"{'request (total)':<{width}}{_ms(t.duration_p50_ms):>10}{_ms(t.duration_p99_ms):>10}"
                         f"{'100.0 %':>16}")
            lines.append(" of which")
        indent = "  " if row.phase in OF_WHICH else ""
        lines.append(f"{indent + labels[row.phase]:<{width}}{_ms(row.p50_ms):>10}{_ms(row.p99_ms):>10}"
                     f"{_pct(row.share):>16}")
    lines.append("")
    streamed = f"; on the wire for {t.ttft_wire:,} streamed" if t.ttft_wire else ""
    lines.append(f"{'TTFT':<{width}}{_ms(t.ttft_p50_ms):>10}{_ms(t.ttft_p99_ms):>10}"
                 f"   ms, from the first request byte{streamed}")
    lines.append(f"{'TPOT':<{width}}{_ms(t.tpot_p50_ms):>10}{_ms(t.tpot_p99_ms):>10}"
                 f"   ms, {t.tpot_requests:,} requests with 2+ output tokens")
    lines.append(f"tokens in {_count(t.input_tokens)}{_rate(t.input_tokens_per_s)} · "
                 f"out {_count(t.output_tokens)}{_rate(t.output_tokens_per_s)} · requests {t.requests:,}")
    note = f" · {report.bad_lines} unreadable lines skipped" if report.bad_lines else ""
    lines.append(f"source {report.source}{note}")
    return "\n".join(lines) + "\n"


def report_json(report: Report) -> dict[str, Any]:
    t = report.table
    return {
        "since": None if report.since_ns is None else format_time(report.since_ns),
        "until": None if report.until_ns is None else format_time(report.until_ns),
        "since_unix_ns": report.since_ns,
        "until_unix_ns": report.until_ns,
        "window_s": t.window_s,
        "requests": t.requests,
        "models": report.models,
        "phases": [{"phase": r.phase, "of_which": r.phase in OF_WHICH, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms,
                    "share": r.share} for r in t.rows],
        "request": {"p50_ms": t.duration_p50_ms, "p99_ms": t.duration_p99_ms},
        "ttft": {"p50_ms": t.ttft_p50_ms, "p99_ms": t.ttft_p99_ms, "wire": t.ttft_wire,
                 "step": t.requests - t.ttft_wire},
        "tpot": {"p50_ms": t.tpot_p50_ms, "p99_ms": t.tpot_p99_ms, "requests": t.tpot_requests},
        "tokens": {"input": t.input_tokens, "output": t.output_tokens, "input_per_s": t.input_tokens_per_s,
                   "output_per_s": t.output_tokens_per_s},
        "source": report.source,
        "server_spans": report.server_spans,
        "bad_lines": report.bad_lines,
        "quantile": "nearest-rank",
    }


def load(args: argparse.Namespace) -> Loaded:
    if args.file:
        return read_files(args.file)
    if args.store is not None:
        return read_store(args.store)
    if args.state_dir:
        return read_store(Path(args.state_dir) / TRACES_SUBDIR)
    return read_store(default_traces_dir(os.environ))


def run(args: argparse.Namespace, *, now_ns: int | None = None) -> int:
    now = time.time_ns() if now_ns is None else now_ns
    since = None if args.since is None else parse_time(args.since, now_ns=now, option="--since")
    until = None if args.until is None else parse_time(args.until, now_ns=now, option="--until")
    if since is not None and until is None:
        until = now  # "the last 10 minutes": tokens per second over all of them
    if since is not None and until is not None and since >= until:
        raise errors.UsageError(f"--since {format_time(since)} is not before --until {format_time(until)}")
    report = build_report(load(args), since_ns=since, until_ns=until)
    if args.json:
        print(json.dumps(report_json(report), indent=2))
    else:
        sys.stdout.write(render_text(report))
    if report.bad_lines:
        print(f"agent: warning: skipped {report.bad_lines} unreadable lines", file=sys.stderr)
    return 0

