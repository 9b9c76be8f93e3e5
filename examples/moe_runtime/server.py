"""HTTP/1.1 keep-alive front end: POST /v1/completions, GET /healthz, GET /stats.
Handler threads validate, enqueue and wait; only the model thread runs the model.

`"stream": true` answers server-sent events as OpenAI-compatible servers do (chunked transfer
encoding; one `data:` event per token; the last token's event carries `finish_reason`, `usage` and
`request_key`; then `data: [DONE]`). The status line, headers and the first token's event leave in
one write, so the first response byte on the wire is the first token (what an observer outside the
process times as time to first token).

Model-agnostic: it serves any `ServedRuntime` (the reference runtime, or the Hugging Face server in
examples/hf_server/), so every runtime speaks the same API and request-key convention."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from moescope.errors import MoescopeError
from moescope.examples.moe_runtime.batcher import BatchEngine, Overloaded, Request
from moescope.examples.moe_runtime.control import ControlServer, default_socket_path

log = logging.getLogger("moe_runtime.server")
# how long SIGTERM waits for the step in progress (a starved 2-core machine can take seconds per step)
ENGINE_STOP_TIMEOUT_S = 20.0  # under LaunchedRuntime.stop's 30 s before SIGKILL

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 300.0
COMPLETION_FIELDS = ("max_tokens", "prompt", "stream")
SSE_DONE = b"data: [DONE]\n\n"
CHUNKED_END = b"0\r\n\r\n"  # the terminating zero-length chunk (no trailers)
REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for an incomplete multi-byte character


class BadRequest(ValueError):
    pass


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ServedRuntime(Protocol):
    """What the HTTP front end needs of a runtime."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def engine(self) -> BatchEngine: ...
    @property
    def model_name(self) -> str: ...
    @property
    def max_seq(self) -> int: ...
    @property
    def max_tokens_limit(self) -> int: ...
    def stats_dict(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """A validated POST /v1/completions body."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool


def parse_completion(body: bytes, *, runtime: ServedRuntime) -> Completion:
    """Validates a completion request body; raises BadRequest with a one-line reason."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(payload) - set(COMPLETION_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; accepted: {list(COMPLETION_FIELDS)}")
    prompt = payload.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string")
    max_tokens = payload.get("max_tokens", 16)
    limit = runtime.max_tokens_limit
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= limit:
        raise BadRequest(f"'max_tokens' must be an integer in 1..{limit}")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean (true or false)")
    ids = runtime.tokenizer.encode(prompt)
    room = runtime.max_seq - max_tokens
    if len(ids) > room:
        raise BadRequest(f"prompt is {len(ids)} tokens; with max_tokens={max_tokens} at most {room} fit "
                         f"(max_seq {runtime.max_seq})")
    return Completion(prompt_ids=ids, max_tokens=max_tokens, stream=stream)


def sse_chunk(event: bytes) -> bytes:
    """One chunk of the chunked transfer encoding holding one server-sent event."""
    return b"%x\r\n%s\r\n" % (len(event), event)


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class IncrementalText:
    """The text each new token adds, for a tokenizer whose decode is not per-token (bytes of one
    UTF-8 character in several tokens, word pieces): decodes a short window from the last clean
    boundary and holds text back while it ends in an incomplete character; the last call flushes.
    The pieces joined equal the whole sequence decoded (tests/runtime/test_streaming.py checks)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._prefix_at = 0  # window start: a clean boundary before the last emitted piece
        self._read_at = 0  # tokens up to here are emitted

    def piece(self, ids: list[int], end: int, *, final: bool) -> str:
        """The text ids[:end] adds to what the earlier calls (with smaller ends) handed out."""
        decode = self._tokenizer.decode
        before = decode(ids[self._prefix_at:self._read_at])
        now = decode(ids[self._prefix_at:end])
        if len(now) > len(before) and (final or not now.endswith(REPLACEMENT_CHAR)):
            self._prefix_at, self._read_at = self._read_at, end
            return now[len(before):]
        return ""


class CompletionHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: MoeHTTPServer

    def setup(self) -> None:
        """TCP_NODELAY on every connection: a JSON answer is two writes (the headers, then the body),
        and with Nagle's algorithm the body waited for the client's delayed ACK of the headers: 40-48
        ms added to every non-streamed answer on a kept-alive connection (a user trial: the client
        measured 162 ms p50 where the kernel-timed request took 118)."""
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # not TCP (a test's socketpair): nothing to turn off

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, {"error": {"message": message, "code": status}})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level errors (bad request line, oversized headers) answer JSON like ours."""
        self.close_connection = True
        try:
            self._error(code, message or HTTPStatus(code).phrase)
        except OSError:
            pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        try:
            if self.path == "/healthz":
                self._reply(HTTPStatus.OK, {"ok": True})
            elif self.path == "/stats":
                self._reply(HTTPStatus.OK, self.server.runtime.stats_dict())
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
        except Exception as exc:  # noqa: BLE001 - answer 500, keep serving
            log.exception("GET failed")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        length_header = self.headers.get("Content-Length")
        try:
            length = int(length_header) if length_header is not None else -1
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._error(HTTPStatus.BAD_REQUEST, f"Content-Length required, at most {MAX_BODY_BYTES} bytes")
            return
        body = self.rfile.read(length)
        if self.path != "/v1/completions":
            self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
            return
        runtime = self.server.runtime
        try:
            completion = parse_completion(body, runtime=runtime)
        except BadRequest as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
            return
        prompt_ids = completion.prompt_ids
        request = Request(request_key=self.connection.fileno(), prompt_ids=prompt_ids,
                          max_tokens=completion.max_tokens, stream=completion.stream)
        try:
            runtime.engine.submit(request)
        except Overloaded as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
            return
        if request.stream:
            self._stream(request, deadline=time.monotonic() + REQUEST_TIMEOUT_S)
            return
        if not request.done.wait(REQUEST_TIMEOUT_S):
            self._error(HTTPStatus.GATEWAY_TIMEOUT, f"no result within {REQUEST_TIMEOUT_S:.0f} s")
            return
        if request.error is not None:
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, request.error)
            return
        self._reply(HTTPStatus.OK, {
            "object": "text_completion",
            "request_key": request.request_key,  # the moe.request NVTX payload: this connection's fd
            "tokens": request.generated,
            "text": runtime.tokenizer.decode(request.generated),
            "usage": _usage(request),
            "timing": _timing(request),
        })

    # ----- streamed answers (server-sent events)

    def _stream(self, request: Request, *, deadline: float) -> None:
        """Writes each token as an event as the model thread hands it over. Before the first token
        an error still answers a plain JSON status; after it, an error event ends the stream."""
        runtime = self.server.runtime
        stats = runtime.engine.stats
        progress = request.progress
        assert progress is not None  # Request(stream=True) makes it
        text = IncrementalText(runtime.tokenizer)
        common = {"id": f"cmpl-{os.getpid()}-{request.enqueued_ns}", "object": "text_completion",
                  "created": int(time.time()), "model": runtime.model_name}
        sent = 0
        started = False
        while True:
            with progress:
                while len(request.generated) <= sent and not request.done.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    progress.wait(left)
            generated = request.generated
            available = min(len(generated), request.max_tokens)
            if available == sent:  # nothing new: the request failed or ran out of time
                if request.done.is_set():
                    status, message = HTTPStatus.INTERNAL_SERVER_ERROR, request.error or "request ended early"
                else:
                    request.cancelled = True
                    status, message = HTTPStatus.GATEWAY_TIMEOUT, f"no result within {REQUEST_TIMEOUT_S:.0f} s"
                if not started:
                    self._error(status, message)
                else:
                    error = sse_event({"error": {"message": message, "code": int(status)}})
                    self._write_stream(sse_chunk(error) + sse_chunk(SSE_DONE) + CHUNKED_END, request=request)
                return
            final = available == request.max_tokens
            if final:
                # the engine appends the last token, then marks the request done: a moment later
                request.done.wait(max(0.0, deadline - time.monotonic()))
            ids = generated[:available]
            events = []
            for i in range(sent, available):
                last = final and i == available - 1
                choice = {"text": text.piece(ids, i + 1, final=last), "index": 0, "logprobs": None,
                          "finish_reason": "length" if last else None}
                event: dict[str, Any] = {**common, "choices": [choice], "tokens": [ids[i]]}
                if last:
                    event["request_key"] = request.request_key
                    event["usage"] = _usage(request)
                    event["timing"] = _timing(request)
                events.append(sse_chunk(sse_event(event)))
            if final:
                events += (sse_chunk(SSE_DONE), CHUNKED_END)
            data = b"".join(events)
            if not started:
                data = self._stream_head() + data  # one write: the first byte out is the first token
                stats.count("streams")
            if not self._write_stream(data, request=request):
                return
            started = True
            sent = available
            if final:
                return

    def _stream_head(self) -> bytes:
        """Status line and headers of a streamed answer (TCP_NODELAY, set in setup(), sends each
        event at once)."""
        self.log_request(HTTPStatus.OK)
        return (f"{self.protocol_version} 200 OK\r\n"
                f"Server: {self.version_string()}\r\n"
                f"Date: {self.date_time_string()}\r\n"
                "Content-Type: text/event-stream\r\n"
                "Cache-Control: no-cache\r\n"
                "Transfer-Encoding: chunked\r\n\r\n").encode("latin-1")

    def _write_stream(self, data: bytes, *, request: Request) -> bool:
        """False when the client went away: counted, the request cancelled, the connection closed."""
        try:
            self.wfile.write(data)
            return True
        except OSError:
            self.server.runtime.engine.stats.count("stream_disconnects")
            if not request.done.is_set():
                request.cancelled = True  # the engine drops it at its next step
            self.close_connection = True
            return False


def _usage(request: Request) -> dict[str, int]:
    prompt_tokens = len(request.prompt_ids)
    completion_tokens = len(request.generated)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _timing(request: Request) -> dict[str, float | int]:
    return {"queue_ms": round((request.started_ns - request.enqueued_ns) / 1e6, 3),
            "total_ms": round((request.finished_ns - request.enqueued_ns) / 1e6, 3),
            "steps": request.steps}


class MoeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many concurrent clients connect at once

    def __init__(self, address: tuple[str, int], *, runtime: ServedRuntime) -> None:
        self.runtime = runtime
        super().__init__(address, CompletionHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanishes mid-request is normal; log, never crash.
        log.debug("connection error from %s", client_address, exc_info=True)




def serve(runtime: ServedRuntime, *, prog: str, host: str, port: int, control_socket: str | None,
          control_mode: int, nvtx_state: str) -> int:
    """Serve HTTP and the control socket (the runtime's `cmd_*` methods) until SIGINT/SIGTERM.
    Prints the start-up banner (launch.py reads it): http port, control socket, nvtx, ready."""
    try:
        http = MoeHTTPServer((host, port), runtime=runtime)
    except OSError as exc:
        print(f"{prog}: error: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 2
    path = control_socket or default_socket_path(pid=os.getpid())
    handlers = {name.removeprefix("cmd_"): getattr(runtime, name) for name in dir(runtime) if name.startswith("cmd_")}
    try:
        control = ControlServer(path=path, handlers=handlers, mode=control_mode)
    except MoescopeError as exc:
        http.server_close()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runtime.engine.start()
    control.start()
    serving = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.2}, name="moe-http",
                               daemon=True)
    serving.start()
    print(f"http port: {http.server_address[1]}", flush=True)
    print(f"control socket: {path}", flush=True)
    print(f"nvtx: {nvtx_state}", flush=True)
    print("ready", flush=True)
    stopped = False
    try:
        while not stop.wait(0.5):
            pass
    finally:
        http.shutdown()
        http.server_close()
        control.close()
        stopped = runtime.engine.stop(timeout_s=ENGINE_STOP_TIMEOUT_S)
        runtime.close()
    if not stopped:
        # the model thread is still inside a step: finalizing the interpreter under a daemon thread
        # in a torch call aborts the process ("terminate called without an active exception")
        log.warning("model thread still in a step after %.0f s: exiting without finalizing", ENGINE_STOP_TIMEOUT_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
