"""End-to-end harness: the real agent, the reference runtime, the load generator and our own client.

Everything here starts real processes: ``agent start`` (eBPF ingress probe, NVTX ring, telemetry,
pipeline, exporters) in its own session so the test can kill its whole process group; the runtime it
launches (or one the test launches for a late attach); ``python -m moescope.examples.moe_runtime.loadgen``.
Waits are bounded and generous; nothing asserts on speed.

``check_traces`` holds the trace assertions shared by the OTLP gRPC and the embedded-file tests:
it works on ``otlp_receiver.FlatSpan``s, which the file test builds from the OTLP-JSON lines with
``spans_from_otlp_json`` (written here, independently of agent/export/store.py).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from otlp_receiver import FlatSpan

from moescope.collectors.nvtx import OFF_CONSUMER_ATTACHED, ring_path
from moescope.examples.moe_runtime.launch import READY_LINE, LaunchError, parse_banner
from moescope.examples.moe_runtime.launch import runtime_argv as launch_runtime_argv

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
WAIT_S = 90.0  # generous: bounds waits on a shared 2-core machine, never asserted on
SERVER_KIND = 2  # SPAN_KIND_SERVER in OTLP
# Small model: the tests are about joins and values, not size, and share 2 cores.
LAYERS = 2
EXPERTS = 8
TOP_K = 2
SMALL_MODEL = ["--d-model", "32", "--d-ff", "64", "--layers", str(LAYERS), "--experts", str(EXPERTS),
               "--top-k", str(TOP_K), "--n-heads", "2", "--max-seq", "256", "--threads", "1"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- processes
class Proc:
    """A process in its own session, stdout/stderr collected line by line on reader threads."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self, stream: Any, sink: list[str]) -> None:
        for line in stream:
            with self._cond:
                sink.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def out_lines(self) -> list[str]:
        with self._cond:
            return list(self.out)

    def text(self) -> str:
        with self._cond:
            return "\n".join(["--- stdout", *self.out, "--- stderr", *self.err])

    def wait_for_line(self, pattern: str, *, stream: str = "any", timeout_s: float = WAIT_S) -> re.Match[str]:
        """The first line matching ``pattern`` (AssertionError with the output if none comes)."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                lines = self.out if stream == "out" else self.err if stream == "err" else [*self.out, *self.err]
                for line in lines:
                    m = rx.search(line)
                    if m:
                        return m
                if self.popen.poll() is not None and all(not t.is_alive() for t in self._readers):
                    raise AssertionError(
                        f"{self.argv[:4]} exited {self.popen.returncode} before /{pattern}/:\n{self.text()}"
                    )
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line /{pattern}/ within {timeout_s} s:\n{self.text()}")
                self._cond.wait(min(left, 0.5))

    def interrupt_and_wait(self, *, timeout_s: float = WAIT_S) -> int:
        """SIGINT to the process itself (the agent then stops what it launched); its exit status."""
        self.popen.send_signal(signal.SIGINT)
        rc = self.popen.wait(timeout=timeout_s)
        for t in self._readers:
            t.join(timeout_s)
        return rc

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Cleanup: SIGINT (a runtime removes its NVTX ring file on a clean exit), then the group's SIGKILL."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()

    def kill_group(self) -> None:
        """Cleanup: SIGKILL the whole session (agent, launched runtime, helpers); idempotent."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


def agent_argv(*, state_dir: Path, extra: list[str]) -> list[str]:
    return [PYTHON, "-m", "moescope.agent", "start", "--state-dir", str(state_dir), "--interval", "0.25", *extra]


def runtime_argv() -> list[str]:
    return launch_runtime_argv("--port", "0", "--device", "cpu", *SMALL_MODEL, python=PYTHON)


def wait_runtime_ready(proc: Proc) -> int:
    """The runtime's HTTP port once it printed ``ready``, from its stdout or from the agent's (with
    ``agent start -- RUNTIME`` the agent launches it and it inherits the agent's stdout, so
    ``moescope.examples.moe_runtime.launch.launch`` cannot start it; ``parse_banner`` skips the agent's lines)."""
    proc.wait_for_line(rf"^{READY_LINE}$", stream="out")
    try:
        return parse_banner(proc.out_lines()).http_port
    except LaunchError as exc:
        raise AssertionError(f"{exc}:\n{proc.text()}") from None


def wait_nvtx_attached(pid: int, *, timeout_s: float = WAIT_S) -> None:
    """Wait until an agent is attached to pid's NVTX ring (the header's consumer_attached word).

    The runtime's NVTX calls are dropped by the injection library while no agent is attached, and
    the agent attaches on its next drain after the ring appears: traffic sent before that has steps
    no agent ever saw, so the tests start their load only after this."""
    path = ring_path(pid)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with open(path, "rb") as f:
                header = f.read(OFF_CONSUMER_ATTACHED + 4)
            if len(header) == OFF_CONSUMER_ATTACHED + 4 and struct.unpack_from("<I", header, OFF_CONSUMER_ATTACHED)[0]:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no agent attached to {path} within {timeout_s} s")


def run_cli(args: list[str], *, timeout_s: float = WAIT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "moescope.agent", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def run_loadgen(port: int, *, requests: int, concurrency: int, max_tokens: int, out: Path) -> dict[str, Any]:
    done = subprocess.run(
        [PYTHON, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}", "--requests",
         str(requests), "--concurrency", str(concurrency), "--max-tokens", str(max_tokens), "--seed", "7",
         "--json-out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=WAIT_S * 2, check=False,
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(out.read_text())
    assert summary["ok"] == requests and summary["failures"] == 0, summary
    return summary


# ---------------------------------------------------------------------------- our own client
@dataclass
class Sent:
    """One completion our client sent: the connection's local port identifies its server span."""

    local_port: int
    max_tokens: int
    completion_tokens: int
    steps: int
    request_key: int


@dataclass
class Trickle:
    """Sequential completions on one keep-alive connection until stopped (varied max_tokens), so
    the agent sees requests while the test scrapes /metrics and runs `agent top`."""

    port: int
    sent: list[Sent] = field(default_factory=list)
    stats_gets: int = 0
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Trickle:
        self._thread = threading.Thread(target=self._run, name="trickle", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        try:
            i = 0
            while not self._stop.is_set() and i < 500:  # bounded
                sent = completion(conn, max_tokens=1 + i % 4, prompt=f"trickle request {i}")
                self.sent.append(sent)
                i += 1
                self._stop.wait(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread by stop()
            self.error = exc
        finally:
            conn.close()

    def cancel(self) -> None:
        """Cleanup path: ask the thread to stop without waiting (it ends after its current request)."""
        self._stop.set()

    def stop(self) -> list[Sent]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "trickle client did not stop"
        if self.error is not None:
            raise AssertionError(f"trickle client failed: {self.error!r}")
        return self.sent


def completion(conn: http.client.HTTPConnection, *, max_tokens: int, prompt: str) -> Sent:
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read())
    assert response.status == 200, payload
    assert conn.sock is not None
    return Sent(
        local_port=int(conn.sock.getsockname()[1]),
        max_tokens=max_tokens,
        completion_tokens=int(payload["usage"]["completion_tokens"]),
        steps=int(payload["timing"]["steps"]),
        request_key=int(payload["request_key"]),
    )


def get_stats(port: int) -> dict[str, Any]:
    """GET /stats (one more request the agent sees: callers count it)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=WAIT_S) as response:
        return dict(json.loads(response.read()))


# ---------------------------------------------------------------------------- agent output
@dataclass(frozen=True)
class AgentSummary:
    requests: int
    unanswered: int
    drops: int
    pipeline_requests: int
    pipeline_joined: int
    pipeline_steps: int
    pipeline_unjoined: int
    pipeline_spans: int
    nvtx_drops: list[str]
    export: dict[str, int]
    threads: dict[str, float]  # CPU seconds by thread name ("agent: CPU by thread:")
    rounds: int  # the main loop's rounds, and those a filling ring brought forward ("agent: main loop:")
    early_rounds: int
    peeks: int  # the looks at the rings between rounds, and those the policy thread made for the loop
    outside_peeks: int


def parse_summary(stdout_lines: list[str]) -> AgentSummary:
    text = "\n".join(stdout_lines)
    m = re.search(r"agent: summary: (\d+) requests \((\d+) unanswered\).*, drops (\d+) \(", text)
    p = re.search(
        r"agent: pipeline: (\d+) requests \((\d+) joined to steps\), (\d+) steps \((\d+) unjoined\), (\d+) spans", text
    )
    e = re.search(r"agent: export: (.*)$", text, re.M)
    t = re.search(r"agent: CPU by thread: (.*)$", text, re.M)
    r = re.search(r"agent: main loop: (\d+) rounds \((\d+) brought forward by a filling ring\), "
                  r"(\d+) peeks \((\d+) by another thread\)$", text, re.M)
    assert m and p and e and t and r, f"summary lines missing:\n{text}"
    threads = {name: float(cpu) for name, cpu in re.findall(r"(\S+) (\d+\.\d+) s", t.group(1))}
    export = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", e.group(1))}
    nvtx = re.findall(r"agent: nvtx pid \d+: \d+ records, drops (\S+?),", text)
    return AgentSummary(
        requests=int(m.group(1)), unanswered=int(m.group(2)), drops=int(m.group(3)),
        pipeline_requests=int(p.group(1)), pipeline_joined=int(p.group(2)), pipeline_steps=int(p.group(3)),
        pipeline_unjoined=int(p.group(4)), pipeline_spans=int(p.group(5)), nvtx_drops=nvtx, export=export,
        threads=threads, rounds=int(r.group(1)), early_rounds=int(r.group(2)), peeks=int(r.group(3)),
        outside_peeks=int(r.group(4)),
    )


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S) as response:
        return str(response.read().decode())


def metric_samples(text: str, name: str) -> dict[str, float]:
    """``{label-string: value}`` of every sample of ``name`` (exact family/sample name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


# ---------------------------------------------------------------------------- OTLP-JSON files
def _json_value(value: dict[str, Any]) -> Any:
    """One OTLP-JSON AnyValue (a one-key object; an empty object is an unset value)."""
    if not value:
        return None
    kind, v = next(iter(value.items()))
    if kind == "stringValue":
        return v
    if kind == "boolValue":
        return bool(v)
    if kind == "intValue":
        return int(v)  # proto3 JSON writes int64 as a string
    if kind == "doubleValue":
        return float(v)  # numbers, or the strings "NaN"/"Infinity"/"-Infinity" of proto3 JSON
    if kind == "arrayValue":
        return [_json_value(x) for x in v.get("values", [])]
    if kind == "kvlistValue":
        return {kv["key"]: _json_value(kv.get("value", {})) for kv in v.get("values", [])}
    return None


def _json_attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _json_value(kv.get("value", {})) for kv in items or []}


def spans_from_otlp_json(trace_dir: Path) -> list[FlatSpan]:
    """Every span in the OTLP-JSON lines files under ``trace_dir`` (one ExportTraceServiceRequest a line)."""
    out: list[FlatSpan] = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            for rs in json.loads(line).get("resourceSpans", []):
                resource = _json_attrs(rs.get("resource", {}).get("attributes"))
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        out.append(
                            FlatSpan(
                                name=s["name"],
                                trace_id=s["traceId"],
                                span_id=s["spanId"],
                                parent_span_id=s.get("parentSpanId") or None,
                                kind=int(s.get("kind", 0)),
                                start_ns=int(s["startTimeUnixNano"]),
                                end_ns=int(s["endTimeUnixNano"]),
                                attributes=_json_attrs(s.get("attributes")),
                                links=[
                                    (lk["traceId"], lk["spanId"], _json_attrs(lk.get("attributes")))
                                    for lk in s.get("links", [])
                                ],
                                events=[
                                    (e["name"], int(e["timeUnixNano"]), _json_attrs(e.get("attributes")))
                                    for e in s.get("events", [])
                                ],
                                status_code=int(s.get("status", {}).get("code", 0)),
                                resource=resource,
                                scope=ss.get("scope", {}).get("name", ""),
                            )
                        )
    return out


# ---------------------------------------------------------------------------- independent routing math
def expected_layer_health(
    tokens: list[int], dropped: list[int], router_entropy_bits: float, experts: int
) -> dict[str, float]:
    """Routing health from first principles (pairwise Gini, population CV), not agent/routing_health.py."""
    c = np.asarray(tokens, dtype=np.float64)
    assert c.shape == (experts,), (tokens, experts)
    n = float(c.sum())
    p = c / n
    nz = p[p > 0]
    h = float(-(nz * np.log2(nz)).sum())
    pairwise = float(np.abs(c[:, None] - c[None, :]).sum())
    mu = n / experts
    return {
        "moe.expert_load.entropy_bits": h,
        "moe.expert_load.entropy_normalized": h / math.log2(experts),
        "moe.expert_load.gini": pairwise / (2.0 * experts * n),
        "moe.expert_load.max_share": float(c.max()) / n,
        "moe.expert_load.cv": float(np.sqrt(((c - mu) ** 2).mean())) / mu,
        "moe.tokens.routed": n,
        "moe.tokens.dropped": float(sum(dropped)),
        "moe.tokens.drop_fraction": float(sum(dropped)) / n,
        "moe.router.entropy_normalized": router_entropy_bits / math.log2(experts),
    }


# ---------------------------------------------------------------------------- trace checks
@dataclass
class TraceReport:
    servers: list[FlatSpan]
    completions: list[FlatSpan]  # server spans that reached >= 1 step
    stepless: list[FlatSpan]  # server spans with no step (GET /stats, ...)
    owner_steps: list[FlatSpan]
    linked_steps: list[FlatSpan]  # (a step owner span, once per request whose phase span links to it)
    unjoined_steps: list[FlatSpan]
    layers_checked: int
    steps_of: dict[str, list[FlatSpan]]  # server span id -> its step spans (owned or linked), by start


def check_traces(spans: list[FlatSpan], *, layers: int = LAYERS, experts: int = EXPERTS, top_k: int = TOP_K,
                 span_detail: str = "layer") -> TraceReport:
    """Every structural and value assertion that holds for any run of the reference runtime.
    span_detail: the agent's --span-detail ("layer": router/FFN facts are moe.layer.* attributes of
    childless layer spans; "expert": they are moe.router / moe.expert.ffn child spans)."""
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans), "duplicate span ids"
    children: dict[str, list[FlatSpan]] = defaultdict(list)
    roots_per_trace: Counter[str] = Counter()
    for s in spans:
        if s.parent_span_id is None:
            roots_per_trace[s.trace_id] += 1
        else:
            # no orphans: every parent was received, in the same trace
            parent = by_id.get(s.parent_span_id)
            assert parent is not None, f"orphan span {s.name} {s.span_id}: parent {s.parent_span_id} never received"
            assert parent.trace_id == s.trace_id, f"{s.name} {s.span_id} has a parent in another trace"
            children[s.parent_span_id].append(s)
        for trace_id, span_id, _ in s.links:
            target = by_id.get(span_id)
            assert target is not None and target.trace_id == trace_id, f"{s.name} {s.span_id} links to a missing span"
    assert all(n == 1 for n in roots_per_trace.values()), "a trace with several roots"
    assert {s.trace_id for s in spans} == set(roots_per_trace), "a trace without a root"

    servers = [s for s in spans if s.kind == SERVER_KIND]
    assert all(s.name == "http.server.request" and s.parent_span_id is None for s in servers)
    owner_steps: list[FlatSpan] = []
    linked_steps: list[FlatSpan] = []
    unjoined: list[FlatSpan] = []
    steps_of: dict[str, list[FlatSpan]] = {}
    claims: Counter[str] = Counter()  # owner step span id -> requests that reach it
    for server in servers:
        key = server.attributes["moe.request.key"]
        kids = children[server.span_id]
        owned = [k for k in kids if k.name == "moe.step"]
        phase_names = ["receive", "queue wait", "prefill", "decode", "response write"]
        assert {k.name for k in kids} <= {"moe.step", *phase_names}, {k.name for k in kids}
        # a request that steps carried has its five phase spans, tiling its server span in order
        phases = sorted((k for k in kids if k.name in phase_names),
                        key=lambda k: (k.start_ns, phase_names.index(k.name)))
        # the steps other traces own: links from the prefill / decode spans to the owners' step spans
        linked: list[FlatSpan] = []
        unlinked = 0
        for phase in phases:
            assert not phase.links or phase.name in ("prefill", "decode"), phase.name
            unlinked += phase.attributes.get("moe.phase.steps_unlinked", 0)
            for _, span_id, attributes in phase.links:
                owner = by_id[span_id]
                assert attributes == {"moe.link": "step.owner"}, attributes
                assert owner.name == "moe.step" and owner.trace_id != server.trace_id
                assert phase.start_ns <= owner.end_ns and owner.start_ns <= phase.end_ns, "a link out of its phase"
                linked.append(owner)
        steps = sorted(owned + linked, key=lambda k: k.start_ns)
        assert server.attributes["moe.request.steps"] == len(steps) + unlinked, "moe.request.steps != its steps"
        assert [k.name for k in phases] == (phase_names if steps else [])
        if phases:
            edges = [server.start_ns] + [k.end_ns for k in phases]
            assert [k.start_ns for k in phases] == edges[:-1] and edges[-1] == server.end_ns
        steps_of[server.span_id] = steps
        for step in steps:
            # the step carried this request's key and ran inside its kernel-timed interval
            assert key in step.attributes["moe.step.requests"], (key, step.attributes["moe.step.requests"])
            assert server.start_ns <= step.start_ns <= server.end_ns
            assert step.attributes["process.pid"] == server.attributes["process.pid"]
            claims[step.span_id] += 1
        owner_steps += owned
        linked_steps += linked
    for s in spans:
        if s.name == "moe.step" and s.parent_span_id is None:
            unjoined.append(s)
            assert s.attributes.get("moe.step.unjoined") is True
    # each owner step is reached by exactly the requests of its batch (no request here has more steps
    # than a phase span links to)
    for step in owner_steps:
        assert (
            claims[step.span_id] == step.attributes["moe.step.batch_size"] == len(step.attributes["moe.step.requests"])
        )

    layers_checked = 0
    for step in owner_steps + unjoined:
        layer_spans = sorted((k for k in children[step.span_id]), key=lambda k: k.attributes["moe.layer"])
        assert [k.name for k in layer_spans] == ["moe.layer"] * layers, [k.name for k in layer_spans]
        assert [k.attributes["moe.layer"] for k in layer_spans] == list(range(layers))
        assert step.attributes["moe.step.layers"] == layers
        step_tokens = step.attributes["moe.step.tokens"]
        weights: list[int] = []
        ginis: list[float] = []
        shares: list[float] = []
        router_bits: list[float] = []
        drops: list[int] = []
        for layer in layer_spans:
            layers_checked += 1
            a = layer.attributes
            kids = children[layer.span_id]
            assert a["moe.layer.experts"] == experts
            tokens, dropped = a["moe.expert.tokens"], a["moe.expert.dropped"]
            # top-k routing: every token of the step makes k routing decisions in every layer
            assert sum(tokens) == top_k * step_tokens, (tokens, step_tokens)
            assert a["moe.tokens.routed"] == sum(tokens) and a["moe.tokens.dropped"] == sum(dropped)
            layer_ms = (layer.end_ns - layer.start_ns) / 1e6
            kept = {e: tokens[e] - dropped[e] for e in range(experts) if tokens[e] - dropped[e] > 0}
            if span_detail == "expert":
                routers = [k for k in kids if k.name == "moe.router"]
                ffns = [k for k in kids if k.name == "moe.expert.ffn"]
                fused = [k for k in kids if k.name == "moe.experts"]  # moe/v2 (the runtime's default)
                assert len(routers) == 1 and (ffns or len(fused) == 1), [k.name for k in kids]
                assert all(step.start_ns <= k.start_ns and k.end_ns <= step.end_ns for k in kids)
                router = routers[0].attributes
                assert router["moe.router.entropy_bits"] == a["moe.router.entropy_bits"]
                assert router["moe.tokens.routed"] == sum(tokens) and router["moe.tokens.dropped"] == sum(dropped)
                if ffns:
                    ran = {f.attributes["moe.expert"]: f.attributes["moe.expert.ffn.tokens"] for f in ffns}
                    assert len(ran) == len(ffns)
                else:
                    x = fused[0].attributes
                    assert x["moe.experts.tokens"] == sum(kept.values())
                    ran = {e: kept[e] for e, us in enumerate(x["moe.layer.experts.time_us"]) if us > 0}
            else:
                assert kids == [], [k.name for k in kids]
                assert 0.0 <= a["moe.layer.router.duration_ms"] <= layer_ms
                if "moe.layer.ffn.experts" in a:  # moe/v1: a range per expert, folded into arrays
                    ffn_experts, ffn_ms = a["moe.layer.ffn.experts"], a["moe.layer.ffn.duration_ms"]
                    ran = dict(zip(ffn_experts, a["moe.layer.ffn.tokens"], strict=True))
                    assert len(ran) == len(ffn_experts) == len(ffn_ms)
                    assert all(0.0 <= ms <= layer_ms for ms in ffn_ms), (ffn_ms, layer_ms)
                else:  # moe/v2: one range for all experts, and each expert's time
                    assert 0.0 <= a["moe.layer.experts.duration_ms"] <= layer_ms
                    assert a["moe.layer.experts.tokens"] == sum(kept.values())
                    time_us = a["moe.layer.experts.time_us"]
                    assert len(time_us) == experts and sum(time_us) / 1e3 <= a["moe.layer.experts.duration_ms"]
                    ran = {e: kept[e] for e, us in enumerate(time_us) if us > 0}
            # the experts that ran are exactly those that kept tokens, each on its kept tokens
            assert ran == kept
            want = expected_layer_health(tokens, dropped, a["moe.router.entropy_bits"], experts)
            for name, value in want.items():
                assert math.isclose(a[name], value, rel_tol=1e-9, abs_tol=1e-12), (name, a[name], value)
            assert 0.0 <= a["moe.router.entropy_bits"] <= math.log2(experts) + 1e-9
            weights.append(sum(tokens))
            ginis.append(want["moe.expert_load.gini"])
            shares.append(want["moe.expert_load.max_share"])
            router_bits.append(a["moe.router.entropy_bits"])
            drops.append(sum(dropped))
        # per step: token-weighted mean of the layers' Gini, and the worst layer
        w = np.asarray(weights, dtype=np.float64)
        assert math.isclose(
            step.attributes["moe.expert_load.gini"], float((w * np.asarray(ginis)).sum() / w.sum()), rel_tol=1e-9
        )
        assert math.isclose(step.attributes["moe.expert_load.gini_max"], max(ginis), rel_tol=1e-9)
        assert math.isclose(step.attributes["moe.expert_load.max_share"], max(shares), rel_tol=1e-9)
        assert math.isclose(
            step.attributes["moe.router.entropy_bits"],
            float((w * np.asarray(router_bits)).sum() / w.sum()),
            rel_tol=1e-9,
        )
        assert math.isclose(
            step.attributes["moe.tokens.drop_fraction"], sum(drops) / float(w.sum()), rel_tol=1e-9, abs_tol=1e-12
        )
    completions = [s for s in servers if steps_of[s.span_id]]
    stepless = [s for s in servers if not steps_of[s.span_id]]
    return TraceReport(servers=servers, completions=completions, stepless=stepless, owner_steps=owner_steps,
                       linked_steps=linked_steps, unjoined_steps=unjoined, layers_checked=layers_checked,
                       steps_of=steps_of)


def check_requests(report: TraceReport, *, loadgen_requests: int, loadgen_max_tokens: int, sent: list[Sent],
                   stepless_expected: int) -> None:
    """One server span per client request; each request's steps match what the runtime told the client."""
    assert len(report.completions) == loadgen_requests + len(sent), (
        len(report.completions),
        loadgen_requests,
        len(sent),
    )
    assert len(report.stepless) == stepless_expected, [s.attributes for s in report.stepless]
    # every request came over TCP from a peer: the agent's own /stats polls on the runtime's UNIX
    # control socket are not requests (the probe ignores UNIX-domain connections)
    assert all(s.attributes.get("network.peer.address") == "127.0.0.1" for s in report.servers)
    assert all(s.attributes["http.response.size"] > 0 for s in report.servers)
    # our client's requests: one connection each time, so its local port + order identify the span
    mine: dict[int, list[FlatSpan]] = defaultdict(list)
    for s in sorted(report.completions, key=lambda s: s.start_ns):
        mine[s.attributes["network.peer.port"]].append(s)
    sent_by_port: dict[int, list[Sent]] = defaultdict(list)
    for x in sent:
        sent_by_port[x.local_port].append(x)
    matched: set[str] = set()
    for port, xs in sent_by_port.items():
        spans = mine[port]
        assert len(spans) == len(xs), (port, len(spans), len(xs))
        for x, span in zip(xs, spans, strict=True):
            assert span.attributes["moe.request.key"] == x.request_key
            # the runtime's own count of steps for this request == steps reachable from its trace
            assert len(report.steps_of[span.span_id]) == x.steps == x.completion_tokens == x.max_tokens
            matched.add(span.span_id)
    for s in report.completions:
        if s.span_id not in matched:  # a load-generator request: fixed max_tokens, one token per step
            got = len(report.steps_of[s.span_id])
            assert got == loadgen_max_tokens, (
                f"a request reached {got} of its {loadgen_max_tokens} steps: {s.attributes}"
            )
