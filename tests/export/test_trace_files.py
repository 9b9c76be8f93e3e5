"""The embedded store: bounded rotation, read-back, and `agent traces list|show` as a real subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from opentelemetry.trace import SpanKind
from sample_trace import T0_NS, emit_sample

from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.export.file_exporter import OtlpJsonFileExporter, trace_files
from moescope.agent.export.store import TraceStore

REPO = Path(__file__).resolve().parents[2]


def agent_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "moescope.agent", *argv],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_rotation_keeps_files_and_bytes_bounded(tmp_path: Path) -> None:
    config = resolve_export_config(
        ExportFlags(state_dir=str(tmp_path), file_max_bytes=4096, files_keep=3), env={}
    )
    config = dataclasses.replace(config, batch_spans=1)  # one line per span: rotation at span granularity
    tracing = build_tracing(config, resource_attributes={"service.name": "rot"})
    n = 200
    for i in range(n):
        tracing.factory.record("work", start_ns=T0_NS + i, end_ns=T0_NS + i + 5, attributes={"i": i, "pad": "x" * 100})
    stats = tracing.shutdown(timeout_s=60)
    assert stats.exported == n and stats.dropped == 0
    files = trace_files(tmp_path / "traces")
    assert len(files) == 3
    assert all(f.stat().st_size <= 4096 for f in files)
    exporter = tracing.exporter
    assert isinstance(exporter, OtlpJsonFileExporter)
    assert exporter.files_deleted > 0
    # What is kept is the newest spans, contiguous up to the last one written.
    store = TraceStore.load(tmp_path / "traces")
    kept = sorted(s.attributes["i"] for t in store.trace_ids() for s in store.spans(t))
    assert kept == list(range(n - len(kept), n)) and len(kept) < n
    # A restarted exporter continues after the highest file number.
    again = build_tracing(config)
    again.factory.record("after-restart", start_ns=T0_NS, end_ns=T0_NS + 1)
    again.shutdown(timeout_s=30)
    newest = trace_files(tmp_path / "traces")[-1]
    assert int(newest.stem.split("-")[1]) == int(files[-1].stem.split("-")[1]) + 1
    assert "after-restart" in newest.read_text()


def test_lines_are_otlp_json_with_hex_ids(tmp_path: Path) -> None:
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={}))
    ctx, _ = emit_sample(tracing.factory)
    tracing.shutdown(timeout_s=30)
    lines = [line for f in trace_files(tmp_path / "traces") for line in f.read_text().splitlines()]
    assert lines
    spans = [
        span
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    by_name = {s["name"]: s for s in spans}
    step = by_name["moe.step"]
    assert step["traceId"] == format(ctx["A"].trace_id, "032x")
    assert step["spanId"] == format(ctx["step"].span_id, "016x")
    assert step["parentSpanId"] == format(ctx["A"].span_id, "016x")
    assert step["links"][0]["spanId"] == format(ctx["B"].span_id, "016x")
    assert by_name["POST /generate"]["kind"] == 2  # enums as integers (OTLP/JSON)
    assert step["startTimeUnixNano"] == str(T0_NS + 2_000_000)


def test_cli_list_and_show(tmp_path: Path) -> None:
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={}),
                            resource_attributes={"service.name": "moe-target"})
    ctx, _ = emit_sample(tracing.factory)
    tracing.factory.record("GET /health", start_ns=T0_NS - 5_000_000, end_ns=T0_NS - 4_000_000, kind=SpanKind.SERVER)
    tracing.shutdown(timeout_s=30)
    a, b = format(ctx["A"].trace_id, "032x"), format(ctx["B"].trace_id, "032x")

    listed = agent_cli("traces", "list", "--state-dir", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    rows = listed.stdout.splitlines()
    assert rows[0].split()[:3] == ["TRACE", "ID", "START"]
    assert [r.split()[0] for r in rows[1:3]] == [b, a]  # newest first
    assert rows[1].split()[2:] == ["7.499", "ms", "1", "POST", "/generate", "B"]
    assert rows[2].split()[2:] == ["7.000", "ms", "5", "POST", "/generate"]
    assert rows[2].split()[1] == "2025-11-29T07:06:40.000000Z"
    assert len(rows) == 4 and rows[3].endswith("GET /health")

    limited = agent_cli("traces", "list", "--limit", "1", "--json", env={"MOESCOPE_STATE_DIR": str(tmp_path)})
    assert limited.returncode == 0, limited.stderr
    assert [json.loads(x) for x in limited.stdout.splitlines()] == [
        {"trace_id": b, "root": "POST /generate B", "start_ns": T0_NS + 1_000, "duration_ns": 7_499_000, "spans": 1}
    ]

    shown = agent_cli("traces", "show", a[:10], "--state-dir", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    sid = {k: format(v.span_id, "016x") for k, v in ctx.items()}
    expected = f"""\
trace {a}  5 spans  7.000 ms  start 2025-11-29T07:06:40.000000Z
└─ POST /generate [SERVER] 7.000 ms @+0.000 ms  span={sid['A']}
   ├─ queue wait [INTERNAL] 2.000 ms @+0.000 ms  span={sid['queue']}
   └─ moe.step [INTERNAL] 4.000 ms @+2.000 ms  span={sid['step']}
      │  moe.device="cpu"
      │  moe.expert.tokens=[10, 0, 14, 0]
      │  moe.flags=[true, false]
      │  moe.requests=[7, 8]
      │  moe.step.gini=0.125
      │  moe.step.gini_max=0.25
      │  moe.step.tokens=24
      │  link -> trace={b} span={sid['B']} moe.link="batched request"
      └─ moe.layer [INTERNAL] 2.900 ms @+2.100 ms  span={sid['layer']}
         │  moe.layer=0
         └─ moe.router [INTERNAL] 0.300 ms @+2.100 ms  span={sid['router']}
               moe.layer=0
               moe.router.entropy_bits=1.75
               event moe.expert.dropped @+2.300 ms moe.expert=2 moe.tokens=3
"""
    lines = shown.stdout.splitlines()
    assert lines[1].startswith("resource: ") and 'service.name="moe-target"' in lines[1]
    # The server span's own attributes follow its line; compare the tree lines exactly.
    got = [line for i, line in enumerate(lines) if i != 1 and not line.startswith("   │  ")]
    assert got == expected.splitlines()
    server_attrs = [line for line in shown.stdout.splitlines() if line.startswith("   │  ")]
    assert server_attrs == [
        '   │  http.request.body.size=321', '   │  http.response.body.size=4567', '   │  moe.request.key=7',
        '   │  network.peer.address="127.0.0.1"', '   │  network.peer.port=50123',
    ]

    as_json = agent_cli("traces", "show", a, "--json", "--state-dir", str(tmp_path))
    data = json.loads(as_json.stdout)
    assert data["trace_id"] == a and [s["name"] for s in data["spans"]][:2] == ["POST /generate", "queue wait"]


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    missing = agent_cli("traces", "list", "--state-dir", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "no trace directory" in missing.stderr
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "traces-000001.jsonl").write_text('{"resourceSpans": []}\nnot json\n')
    unknown = agent_cli("traces", "show", "abcdef01", "--state-dir", str(tmp_path))
    assert unknown.returncode == 2 and "no trace 'abcdef01'" in unknown.stderr
    assert "skipped 1 unreadable lines" in unknown.stderr
