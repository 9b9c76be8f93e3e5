"""`agent report`: the table it prints equals one computed here, independently, from the exported
spans' attributes (the OTLP-JSON read with plain json). The spans are the agent's own: joined
requests with breakdowns made by agent/request_phases.py, through the trace output
(agent/outputs/traces.py) and the embedded store's exporter (build_tracing)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from phase_requests import MS, ModelRequest, model_request

from moescope.agent import cli, report_cmd
from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.export.file_exporter import trace_files
from moescope.agent.join import RequestJoined
from moescope.agent.outputs.traces import TraceOutput
from moescope.agent.request_phases import RequestBreakdown
from moescope.errors import EXIT_SOURCE_UNAVAILABLE, EXIT_USAGE, UsageError

REPO = Path(__file__).resolve().parents[2]
T0_NS = 1_790_000_000 * 1_000_000_000  # 2026-09-21T14:13:20Z: request times are Unix ns here
PHASES = ("receive", "queue", "prefill", "decode", "write")


def write_store(state_dir: Path, n: int, *, seed: int) -> list[RequestBreakdown]:
    """Joined requests through the agent's trace output into the embedded store (OTLP-JSON files)."""
    config = resolve_export_config(ExportFlags(state_dir=str(state_dir), file_max_bytes=64 * 1024), env={})
    tracing = build_tracing(config, resource_attributes={"service.name": "report-test"})
    traces = TraceOutput(tracing.factory, epoch_offset_ns=0)  # request times are Unix ns already
    rng = random.Random(seed)
    made = []
    t = T0_NS
    for i in range(n):
        shape = ModelRequest(
            receive_ms=rng.uniform(0.05, 3.0), queue_ms=rng.expovariate(1 / 15), prefill_ms=rng.uniform(10, 300),
            decode_steps=rng.randrange(0, 40), decode_step_ms=rng.uniform(4, 20), write_ms=rng.uniform(0.1, 4),
            load_ms_per_step=rng.choice([0.0, 0.3, 12.0]), routing_ms_per_step=rng.uniform(0, 0.8),
            input_tokens=rng.choice([None, rng.randrange(1, 900)]), streamed=rng.random() < 0.4,
        )
        record, b = model_request(shape, start_ns=t, fd=i + 3)
        batch = [RequestJoined(record=record, steps=(), first_claims=(), breakdown=b)]
        if i % 10 == 0:  # a request no step carried (/stats): a server span without the breakdown
            plain = record._replace(fd=10_000 + i, end_ns=record.start_ns + 2 * MS, first_response_ns=0)
            batch.append(RequestJoined(record=plain, steps=(), first_claims=()))
        traces.export(batch)
        made.append(b)
        t += int(rng.uniform(5, 120) * MS)
    stats = tracing.shutdown(timeout_s=60)
    assert stats.exported >= 6 * n and stats.dropped == 0  # server span and five phase spans each
    return made


# ---- the independent side: plain json over the files ----------------------------------------------


def plain_value(value: dict[str, Any]) -> Any:
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    return value.get("stringValue")


def server_spans(files: list[Path]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    for path in files:
        for line in path.read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        if span.get("kind") == 2:
                            attrs = {a["key"]: plain_value(a["value"]) for a in span.get("attributes", [])}
                            yield int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"]), attrs


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def expected_table(files: list[Path], since_ns: int, until_ns: int) -> dict[str, Any]:
    reqs = [(s, e, a) for s, e, a in server_spans(files)
            if "moe.request.phase.prefill_ms" in a and since_ns <= e < until_ns]
    total_ms = sum((e - s) / 1e6 for s, e, _ in reqs)
    columns: dict[str, list[float]] = {p: [a[f"moe.request.phase.{p}_ms"] for _, _, a in reqs] for p in PHASES}
    columns["inference"] = [a["moe.request.phase.prefill_ms"] + a["moe.request.phase.decode_ms"] for _, _, a in reqs]
    columns["expert_load"] = [a["moe.request.expert_load_ms"] for _, _, a in reqs]
    columns["routing"] = [a["moe.request.routing_ms"] for _, _, a in reqs]
    tpot = [a["moe.request.tpot_ms"] for _, _, a in reqs if "moe.request.tpot_ms" in a]
    ttft = [a["moe.request.ttft_ms"] for _, _, a in reqs]
    inputs = [a["gen_ai.usage.input_tokens"] for _, _, a in reqs if "gen_ai.usage.input_tokens" in a]
    return {
        "requests": len(reqs),
        "rows": {p: (nearest_rank(v, 0.5), nearest_rank(v, 0.99), sum(v) / total_ms) for p, v in columns.items()},
        "request": (nearest_rank([(e - s) / 1e6 for s, e, _ in reqs], 0.5),
                    nearest_rank([(e - s) / 1e6 for s, e, _ in reqs], 0.99)),
        "ttft": (nearest_rank(ttft, 0.5), nearest_rank(ttft, 0.99)),
        "tpot": (nearest_rank(tpot, 0.5), nearest_rank(tpot, 0.99), len(tpot)),
        "wire": sum(1 for _, _, a in reqs if a["moe.request.ttft_source"] == "wire"),
        "input": sum(inputs),
        "output": sum(a["gen_ai.usage.output_tokens"] for _, _, a in reqs),
        "window_s": (until_ns - since_ns) / 1e9,
    }


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["report", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("state")
    write_store(state, 600, seed=5)
    return state / "traces"


def test_report_json_equals_the_table_from_the_spans(store: Path) -> None:
    files = trace_files(store)
    assert len(files) > 1  # rotated: the report reads every file
    since, until = T0_NS + 20_000 * MS, T0_NS + 200_000 * MS
    code, out, err = run_cli("--store", str(store), "--since", report_cmd.format_time(since),
                             "--until", report_cmd.format_time(until), "--json")
    assert code == 0 and err == ""
    got = json.loads(out)
    want = expected_table(files, since, until)
    assert 50 < want["requests"] < 600 and got["requests"] == want["requests"]
    assert [r["phase"] for r in got["phases"]] == [*PHASES, "inference", "expert_load", "routing"]
    for row in got["phases"]:
        p50, p99, share = want["rows"][row["phase"]]
        assert (row["p50_ms"], row["p99_ms"]) == (p50, p99), row["phase"]
        assert row["share"] == pytest.approx(share, rel=1e-12), row["phase"]
    assert sum(r["share"] for r in got["phases"][:5]) == pytest.approx(1.0, rel=1e-9)
    assert (got["request"]["p50_ms"], got["request"]["p99_ms"]) == want["request"]
    assert (got["ttft"]["p50_ms"], got["ttft"]["p99_ms"]) == want["ttft"]
    assert got["ttft"]["wire"] == want["wire"] and got["ttft"]["step"] == want["requests"] - want["wire"]
    assert (got["tpot"]["p50_ms"], got["tpot"]["p99_ms"], got["tpot"]["requests"]) == want["tpot"]
    assert (got["tokens"]["input"], got["tokens"]["output"]) == (want["input"], want["output"])
    assert got["tokens"]["output_per_s"] == pytest.approx(want["output"] / want["window_s"])
    assert got["window_s"] == want["window_s"] and got["models"] == ["moe-tiny"]
    assert got["server_spans"] > got["requests"]  # the /stats-like spans were read and left out


def test_report_text_is_the_seeds_table(store: Path) -> None:
    files = trace_files(store)
    code, out, _ = run_cli("--store", str(store))
    assert code == 0
    want = expected_table(files, 0, 1 << 63)
    lines = out.splitlines()
    assert lines[0].startswith(f"where the time goes · {want['requests']:,} model requests · the start → the end")
    header = lines[2].split()
    assert header == ["phase", "p50", "ms", "p99", "ms", "share", "of", "total"]
    rows = {}
    for line in lines[3:]:
        if not line.strip():
            break
        cells = line.rsplit(None, 4)
        if len(cells) == 5 and cells[-1] == "%":
            rows[cells[0].strip()] = (float(cells[1]), float(cells[2]), float(cells[3]))
    labels = {"receive": "receive", "queue": "queue", "prefill": "prefill", "decode": "decode", "write": "write",
              "inference": "inference (pre+dec)", "expert_load": "expert load", "routing": "routing"}
    for phase, label in labels.items():
        p50, p99, share = want["rows"][phase]
        assert rows[label] == (round(p50, 2), round(p99, 2), round(share * 100, 1)), phase
    assert rows["request (total)"][:2] == (round(want["request"][0], 2), round(want["request"][1], 2))
    ttft = next(line for line in lines if line.startswith("TTFT")).split()
    assert (float(ttft[1]), float(ttft[2])) == (round(want["ttft"][0], 2), round(want["ttft"][1], 2))
    tokens = next(line for line in lines if line.startswith("tokens"))
    assert f"in {want['input']:,}" in tokens and f"out {want['output']:,}" in tokens
    assert f"requests {want['requests']:,}" in tokens


def test_report_reads_an_otlp_json_file_and_runs_as_a_command(store: Path) -> None:
    one = trace_files(store)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-m", "moescope.agent", "report", "--file", str(one), "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    want = expected_table([one], 0, 1 << 63)
    assert got["requests"] == want["requests"] > 0
    assert got["phases"][2]["p99_ms"] == want["rows"]["prefill"][1]


def test_errors_are_one_line_and_not_zero(store: Path, tmp_path: Path) -> None:
    code, out, err = run_cli("--file", str(tmp_path / "none.jsonl"))
    assert code == EXIT_SOURCE_UNAVAILABLE and out == ""
    assert err == f"agent: error: no such traces file: {tmp_path / 'none.jsonl'}\n"
    code, _, err = run_cli("--store", str(store), "--since", "2020-01-01T00:00:00Z", "--until", "2020-01-02T00:00:00Z")
    assert code == EXIT_SOURCE_UNAVAILABLE
    assert err.startswith("agent: error: no model requests (server spans with moe.request.phase.* attributes) "
                          "between 2020-01-01T00:00:00Z and 2020-01-02T00:00:00Z in ") and err.count("\n") == 1
    code, _, err = run_cli("--store", str(store), "--since", "yesterday")
    assert code == EXIT_USAGE and err.startswith("agent: error: --since 'yesterday': not a time (ISO-8601")
    code, _, err = run_cli("--store", str(store), "--since", "1h", "--until", "2h")
    assert code == EXIT_USAGE and "is not before --until" in err
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n{}\n")
    code, _, err = run_cli("--file", str(garbage))
    assert code == EXIT_SOURCE_UNAVAILABLE and "no model requests" in err and "1 unreadable lines" in err


def test_times_iso_and_relative() -> None:
    now = T0_NS + 123_456_789
    assert report_cmd.parse_time("10m", now_ns=now, option="--since") == now - 600 * 1_000_000_000
    assert report_cmd.parse_time("1.5h", now_ns=now, option="--since") == now - 5_400 * 1_000_000_000
    assert report_cmd.parse_time("250ms", now_ns=now, option="--since") == now - 250 * MS
    assert report_cmd.parse_time("now", now_ns=now, option="--until") == now
    assert report_cmd.parse_time("2026-09-21T14:13:20Z", now_ns=now, option="--since") == T0_NS
    assert report_cmd.parse_time("2026-09-21T14:13:20", now_ns=now, option="--since") == T0_NS  # no zone: UTC
    assert report_cmd.parse_time("2026-09-21T16:13:20.5+02:00", now_ns=now, option="--since") == T0_NS + 500 * MS
    assert report_cmd.format_time(T0_NS + 500 * MS) == "2026-09-21T14:13:20.500Z"
    with pytest.raises(UsageError, match="--until '10 parsecs': not a time"):
        report_cmd.parse_time("10 parsecs", now_ns=now, option="--until")
