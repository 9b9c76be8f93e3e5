"""Streamed completions (`"stream": true`, server-sent events) from real server processes on
loopback, read off raw sockets so the wire format itself is checked: status and headers with the
first token in one write, chunked framing, one event per token, the final event's usage and key,
`[DONE]`, the zero chunk, keep-alive after it; a client that goes away or never reads; the
`moe.step.requests` vector the same requests make, captured through the real injection library."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import pathlib
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import NvtxBatch, NvtxCollector, injection_library_path
from moescope.examples.moe_runtime.server import IncrementalText
from moescope.examples.moe_runtime.tokenizer import ByteTokenizer
from tests.runtime.conftest import REPO, SMALL_MODEL, RunningServer, _read_banner, _stop

PROMPT = "stream me, s'il vous plaît"
WAIT_S = 60.0  # bounds every socket read and poll loop (never a timing assertion)


class Wire:
    """A raw HTTP/1.1 client connection that keeps what each recv() returned."""

    def __init__(self, port: int, *, rcvbuf_bytes: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf_bytes is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)  # before connect
        self.sock.settimeout(WAIT_S)
        self.sock.connect(("127.0.0.1", port))
        self.buffer = b""
        self.recvs: list[bytes] = []

    def send(self, body: dict[str, Any] | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(data), data))

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        assert data, "the server closed the connection"
        self.recvs.append(data)
        self.buffer += data

    def line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def head(self) -> tuple[int, dict[str, str]]:
        status = int(self.line().split(b" ")[1])
        headers: dict[str, str] = {}
        while line := self.line():
            name, value = line.decode("latin-1").split(":", 1)
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def chunks(self) -> list[bytes]:
        """The chunked body, chunk by chunk, up to and including the zero chunk's end."""
        out: list[bytes] = []
        while True:
            size = int(self.line(), 16)
            if size == 0:
                assert self.line() == b""  # no trailers, then the end
                return out
            out.append(self.exact(size))
            assert self.exact(2) == b"\r\n"

    def json_answer(self) -> tuple[int, dict[str, Any]]:
        status, headers = self.head()
        assert "transfer-encoding" not in headers
        return status, json.loads(self.exact(int(headers["content-length"])))

    def close(self, *, reset: bool = False) -> None:
        if reset:  # RST instead of FIN: the server's next write fails at once
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


@dataclasses.dataclass
class Stream:
    headers: dict[str, str]
    events: list[dict[str, Any]]  # the token events, in order
    first_write: bytes  # what the first recv() returned

    @property
    def final(self) -> dict[str, Any]:
        return self.events[-1]

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e["tokens"]]

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events)


def read_stream(wire: Wire) -> Stream:
    first = len(wire.recvs)
    status, headers = wire.head()
    assert status == 200, status
    chunks = wire.chunks()
    # one event per chunk; the last is [DONE]
    assert chunks[-1] == b"data: [DONE]\n\n"
    events = []
    for chunk in chunks[:-1]:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1, chunk
        events.append(json.loads(chunk[len(b"data: "):]))
    return Stream(headers=headers, events=events, first_write=wire.recvs[first])


def stats(server: RunningServer) -> dict[str, Any]:
    status, body = server.get("/stats")
    assert status == 200
    return body


def wait_for_counter(server: RunningServer, name: str, at_least: int) -> dict[str, Any]:
    """Polls /stats until counters[name] >= at_least (bounded; not a timing assertion)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        body = stats(server)
        if body["counters"][name] >= at_least or time.monotonic() > deadline:
            return body
        time.sleep(0.02)


def check_stream_against_plain(server: RunningServer, *, max_tokens: int) -> None:
    """The streamed answer equals the plain one for the same prompt (greedy: deterministic), the
    wire format is as documented, and the connection serves on after the stream."""
    before = stats(server)
    model = before["model"]
    status, plain = server.post({"prompt": PROMPT, "max_tokens": max_tokens})
    assert status == 200
    wire = Wire(server.port)
    try:
        wire.send({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True})
        stream = read_stream(wire)
        h = stream.headers
        assert h["content-type"] == "text/event-stream" and h["transfer-encoding"] == "chunked"
        assert "content-length" not in h
        # status line, headers and the first token's event left in one write (one recv here)
        assert stream.first_write.startswith(b"HTTP/1.1 200 OK\r\n")
        body = stream.first_write.split(b"\r\n\r\n", 1)[1]
        size_line, rest = body.split(b"\r\n", 1)
        assert len(rest) >= int(size_line, 16) and rest.startswith(b"data: {")

        assert len(stream.events) == max_tokens == plain["usage"]["completion_tokens"]
        assert stream.tokens == plain["tokens"] and stream.text == plain["text"]
        for i, event in enumerate(stream.events):
            assert event["object"] == "text_completion" and event["model"] == model
            assert event["id"] == stream.events[0]["id"] and len(event["tokens"]) == 1
            choice = event["choices"][0]
            assert choice["index"] == 0 and isinstance(choice["text"], str)
            last = i == len(stream.events) - 1
            assert choice["finish_reason"] == ("length" if last else None)
            assert ("usage" in event) == last and ("request_key" in event) == last
        assert stream.final["usage"] == plain["usage"]

        # keep-alive: the same connection answers a plain request, then streams again
        wire.send({"prompt": PROMPT, "max_tokens": max_tokens})
        status, again = wire.json_answer()
        assert status == 200 and again["tokens"] == plain["tokens"]
        assert again["request_key"] == stream.final["request_key"]  # the same connection: the same fd
        wire.send({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True})
        assert read_stream(wire).tokens == plain["tokens"]
    finally:
        wire.close()
    counters = stats(server)["counters"]
    assert counters["streams"] - before["counters"]["streams"] == 2
    assert counters["stream_disconnects"] == before["counters"]["stream_disconnects"]


def test_stream_equals_the_plain_answer_and_keeps_the_connection(
        start_server: Callable[..., RunningServer]) -> None:
    server = start_server()
    assert stats(server)["model"] == "moescope-reference-moe"
    check_stream_against_plain(server, max_tokens=7)


def test_one_token_stream_is_final_at_once(start_server: Callable[..., RunningServer]) -> None:
    server = start_server()
    wire = Wire(server.port)
    try:
        wire.send({"prompt": "x", "max_tokens": 1, "stream": True})
        stream = read_stream(wire)
    finally:
        wire.close()
    assert len(stream.events) == 1 and stream.final["choices"][0]["finish_reason"] == "length"
    assert stream.final["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


def test_stream_field_is_validated(start_server: Callable[..., RunningServer]) -> None:
    server = start_server()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        for value in ("yes", 1, 0, None, [True], {"on": True}):
            status, body = server.post({"prompt": "x", "max_tokens": 2, "stream": value}, conn=conn)
            assert status == 400, value
            assert body["error"]["message"] == "'stream' must be a boolean (true or false)"
        status, body = server.post({"prompt": "x", "max_tokens": 2, "stream": False, "n": 2}, conn=conn)
        assert status == 400 and "unknown field(s) ['n']" in body["error"]["message"]
        assert "'stream'" in body["error"]["message"]  # the accepted list names it
        status, body = server.post({"prompt": "x", "max_tokens": 2, "stream": False}, conn=conn)
        assert status == 200 and len(body["tokens"]) == 2  # stream: false is the plain answer
    finally:
        conn.close()
    assert stats(server)["counters"]["streams"] == 0


def test_client_gone_mid_stream_is_counted_and_the_server_serves_on(
        start_server: Callable[..., RunningServer]) -> None:
    server = start_server()
    wire = Wire(server.port)
    wire.send({"prompt": PROMPT, "max_tokens": 250, "stream": True})
    status, _headers = wire.head()
    assert status == 200
    wire.line()  # the size of the first token's chunk: the stream has begun
    wire.close(reset=True)
    after = wait_for_counter(server, "requests_cancelled", 1)
    counters = after["counters"]
    assert counters["stream_disconnects"] == 1 and counters["requests_cancelled"] == 1
    assert counters["requests_completed"] == 0 and counters["requests_failed"] == 0
    # the request left the batch: far fewer steps than its 250 tokens would have taken
    assert counters["steps"] < 250
    assert after["queue"] == {"requests_waiting": 0, "requests_running": 0}
    check_stream_against_plain(server, max_tokens=4)  # streams and plain answers as before
    assert stats(server)["counters"]["stream_disconnects"] == 1


def test_a_client_that_reads_late_holds_nothing_and_loses_nothing(
        start_server: Callable[..., RunningServer]) -> None:
    """A stream whose client reads nothing until the engine is done with it: the engine finishes
    the request (it only appends tokens and notifies; the handler thread does the writing) and
    serves another meanwhile; read late, the stream is whole. (Loopback send buffers grow to
    hold the ~65 kB here, so this does not show the handler blocked in write.)"""
    server = start_server()
    slow = Wire(server.port, rcvbuf_bytes=2048)
    try:
        slow.send({"prompt": PROMPT, "max_tokens": 250, "stream": True})  # ~250 events of ~260 B
        after = wait_for_counter(server, "requests_completed", 1)
        assert after["counters"]["requests_completed"] == 1 and slow.recvs == []
        status, body = server.post({"prompt": "meanwhile", "max_tokens": 3})
        assert status == 200 and len(body["tokens"]) == 3
        stream = read_stream(slow)  # now read it all: nothing was lost
        assert len(stream.events) == 250 and stream.final["usage"]["completion_tokens"] == 250
    finally:
        slow.close()


def test_incremental_text_joins_to_the_whole_decode() -> None:
    """Per-token pieces of UTF-8 split over byte tokens, special and unknown ids, invalid bytes."""
    tokenizer = ByteTokenizer(vocab=512)
    rng = random.Random(7)
    for _ in range(500):
        text = "".join(rng.choice(("a", " ", "é", "€", "😀", "\n")) for _ in range(rng.randint(1, 12)))
        ids = tokenizer.encode(text)[1:]
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice((256, 257, 300, 0xFF, 0x80, 0xC3)))
        pieces = IncrementalText(tokenizer)
        out = [pieces.piece(ids, i + 1, final=i == len(ids) - 1) for i in range(len(ids))]
        assert "".join(out) == tokenizer.decode(ids), ids
    # a character split over bytes is held back, then handed out whole
    pieces = IncrementalText(tokenizer)
    euro = list("€".encode())
    assert [pieces.piece(euro, i + 1, final=False) for i in range(3)] == ["", "", "€"]


# ----- the transformers server streams through the same front end


@pytest.fixture
def hf_server() -> Iterator[RunningServer]:
    ring_dir = tempfile.mkdtemp(prefix="moe-hf-stream-")
    cmd = [sys.executable, "-m", "moescope.examples.hf_server", "--arch", "qwen3_moe", "--tiny", "--layers", "2",
           "--port", "0", "--control-socket", os.path.join(ring_dir, "c.sock"), "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        banner = _read_banner(proc, timeout_s=120)
        yield RunningServer(proc=proc, port=int(banner["http port"]), socket_path=banner["control socket"],
                            banner=banner)
    finally:
        _stop(proc)
        for name in os.listdir(ring_dir):
            os.unlink(os.path.join(ring_dir, name))
        os.rmdir(ring_dir)


def test_transformers_server_streams_the_same_way(hf_server: RunningServer) -> None:
    assert stats(hf_server)["model"] == "tiny-qwen3_moe"
    check_stream_against_plain(hf_server, max_tokens=5)


# ----- moe.step.requests on the wire


@dataclasses.dataclass
class CapturedVectors:
    """A collector sink: keeps each `moe.step.requests` vector with its parent uid and time, and
    each moe.step / moe.layer range, then hands the batch on to the convention parser."""

    parser: MoeConventionParser
    vectors: list[tuple[int, int, np.ndarray | None]] = dataclasses.field(default_factory=list)
    steps: dict[int, int] = dataclasses.field(default_factory=dict)  # step uid -> start ns
    first_layer_ns: dict[int, int] = dataclasses.field(default_factory=dict)  # step uid -> first layer start

    def __call__(self, batch: NvtxBatch) -> None:
        names = batch.mark_names()
        rows = np.flatnonzero(names == "moe.step.requests")
        arrays = batch.mark_arrays(rows)
        for row, array in zip(rows.tolist(), arrays):
            mark = batch.marks[row]
            self.vectors.append((int(mark["parent_uid"]), int(mark["ts_ns"]), array))
        range_names = batch.range_names()
        for r, name in zip(batch.ranges, range_names):
            if name == "moe.step":
                self.steps[int(r["uid"])] = int(r["start_ns"])
            elif name == "moe.layer":
                parent = int(r["parent_uid"])
                self.first_layer_ns[parent] = min(self.first_layer_ns.get(parent, 1 << 64), int(r["start_ns"]))
        self.parser(batch)


def test_step_requests_vector_carries_each_requests_tokens() -> None:
    ring_dir = tempfile.mkdtemp(prefix="moe-rt-stream-nvtx-")
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(injection_library_path()), MOESCOPE_NVTX_DIR=ring_dir)
    cmd = [sys.executable, "-m", "moescope.examples.moe_runtime", "--port", "0", "--control-socket",
           os.path.join(ring_dir, "c.sock"), *SMALL_MODEL, "--max-wait-ms", "300"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    collector = None
    try:
        banner = _read_banner(proc, timeout_s=90)
        assert banner["nvtx"] == "active"
        port = int(banner["http port"])
        parsed_steps: list[StepEvent] = []
        capture = CapturedVectors(parser=MoeConventionParser(sink=parsed_steps.extend))
        collector = NvtxCollector(proc.pid, sink=capture, directory=pathlib.Path(ring_dir))
        # two concurrent requests (batched together by max_wait_ms), one streamed, one plain,
        # different prompt lengths and max_tokens; then a third alone
        streamed, plain = Wire(port), Wire(port)
        answers: dict[int, dict[str, int]] = {}
        try:
            streamed.send({"prompt": "a streamed prompt", "max_tokens": 5, "stream": True})
            plain.send({"prompt": "the plain one, longer", "max_tokens": 3})
            stream = read_stream(streamed)
            answers[stream.final["request_key"]] = stream.final["usage"]
            status, body = plain.json_answer()
            assert status == 200
            answers[body["request_key"]] = body["usage"]
        finally:
            streamed.close()
            plain.close()
        assert len(answers) == 2
        total_steps = 5  # both prefill together, then 2 steps of both, 2 of the streamed one alone
        deadline = time.monotonic() + WAIT_S
        while len(capture.vectors) < total_steps or len(parsed_steps) < total_steps:
            assert time.monotonic() < deadline, (len(capture.vectors), collector.stats())
            collector.poll(time.monotonic_ns())
            time.sleep(0.02)
        assert len(capture.vectors) == total_steps

        seen: dict[int, list[tuple[int, int]]] = {}  # key -> (input, output) per step, in order
        for parent, at_ns, vector in sorted(capture.vectors, key=lambda v: v[1]):
            assert vector is not None and vector.dtype == np.int64 and len(vector) % 3 == 0
            assert parent in capture.steps  # inside a moe.step ...
            assert capture.steps[parent] <= at_ns < capture.first_layer_ns[parent]  # ... before its first layer
            r = len(vector) // 3
            for key, n_in, n_out in zip(*(vector[i * r:(i + 1) * r].tolist() for i in range(3))):
                seen.setdefault(key, []).append((n_in, n_out))
        assert set(seen) == set(answers)
        for key, usage in answers.items():
            per_step = seen[key]
            assert per_step[0] == (usage["prompt_tokens"], 1)  # the prefill step: the whole prompt
            assert all(step == (0, 1) for step in per_step[1:])  # then one token per decode step
            assert sum(i for i, _ in per_step) == usage["prompt_tokens"]
            assert sum(o for _, o in per_step) == len(per_step) == usage["completion_tokens"]

        # what the agent reads: the parser's per-step request tokens and keys say the same
        by_key: dict[int, list[tuple[int, int]]] = {}
        for step in sorted(parsed_steps, key=lambda s: s.start_ns):
            assert step.request_tokens is not None and set(step.request_tokens) == set(step.requests)
            for key, tokens in step.request_tokens.items():
                by_key.setdefault(key, []).append(tokens)
        assert by_key == seen
        parser_stats = capture.parser.stats()
        assert parser_stats["request_marks"] == 0  # v2: the vector instead of moe.request marks
        for name in ("unknown_names", "malformed_payloads", "malformed_vectors", "misplaced", "orphans"):
            assert parser_stats[name] == 0, (name, parser_stats)
    finally:
        if collector is not None:
            collector.close()
        _stop(proc)
        for name in os.listdir(ring_dir):
            os.unlink(os.path.join(ring_dir, name))
        os.rmdir(ring_dir)


# ----- the load generator's --stream


def test_loadgen_stream_reports_client_ttft_tpot_per_request(start_server: Callable[..., RunningServer]) -> None:
    server = start_server()
    before = stats(server)["counters"]
    out = subprocess.run([sys.executable, "-m", "moescope.examples.loadgen", "--url", f"http://127.0.0.1:{server.port}",
                          "--stream", "--requests", "8", "--concurrency", "2", "--max-tokens", "5"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    summary = json.loads(out.stdout)
    after = stats(server)["counters"]
    assert summary["ok"] == summary["requests"] == 8 and summary["failures"] == 0 and summary["stream"] is True
    assert after["streams"] - before["streams"] == 8 and after["stream_disconnects"] == 0
    assert summary["tokens_per_s"] > 0
    per_request = summary["per_request"]
    assert [r["index"] for r in per_request] == list(range(8))
    for r in per_request:
        assert isinstance(r["request_key"], int) and r["request_key"] > 2  # a connection's fd
        assert r["token_events"] == r["completion_tokens"] == 5 and r["prompt_tokens"] > 1
        assert r["sent_ns"] < r["first_token_ns"] <= r["last_token_ns"]
        assert r["ttft_ms"] == round((r["first_token_ns"] - r["sent_ns"]) / 1e6, 3)
        assert r["tpot_ms"] == round((r["last_token_ns"] - r["first_token_ns"]) / 1e6 / 4, 3)
    for name in ("ttft_ms", "tpot_ms"):
        q = summary[name]
        values = sorted(r[name] for r in per_request)
        assert q["p50"] <= q["p95"] <= q["p99"] <= q["max"]
        assert values[0] <= q["p50"] and abs(q["max"] - values[-1]) <= 0.001  # the same numbers, rounded
    # each client's requests are sent one after another on one keep-alive connection: its key repeats
    assert len({r["request_key"] for r in per_request}) == 2
    # without --stream the summary is as before: no streaming fields
    plain = subprocess.run([sys.executable, "-m", "moescope.examples.loadgen", "--url",
                            f"http://127.0.0.1:{server.port}", "--requests", "2", "--max-tokens", "2"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert not {"stream", "ttft_ms", "tpot_ms", "per_request"} & set(json.loads(plain.stdout))
