"""HTTP/1.1 keep-alive front end: POST /v1/completions, GET /healthz, GET /stats.
Handler threads validate, enqueue and wait; only the model thread runs the model.

Model-agnostic: it serves any `ServedRuntime` (the reference runtime, or the Hugging Face server in
examples/hf_server/), so every runtime speaks the same API and request-key convention."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from moescope.errors import MoescopeError
from moescope.examples.moe_runtime.batcher import BatchEngine, Overloaded, Request
from moescope.examples.moe_runtime.control import ControlServer, default_socket_path

log = logging.getLogger("moe_runtime.server")

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 300.0


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
    def max_seq(self) -> int: ...
    @property
    def max_tokens_limit(self) -> int: ...
    def stats_dict(self) -> dict[str, Any]: ...


def parse_completion(body: bytes, *, runtime: ServedRuntime) -> tuple[list[int], int]:
    """Validates a completion request body; returns (prompt ids, max_tokens) or raises BadRequest."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(payload) - {"prompt", "max_tokens"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; accepted: ['max_tokens', 'prompt']")
    prompt = payload.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string")
    max_tokens = payload.get("max_tokens", 16)
    limit = runtime.max_tokens_limit
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= limit:
        raise BadRequest(f"'max_tokens' must be an integer in 1..{limit}")
    ids = runtime.tokenizer.encode(prompt)
    room = runtime.max_seq - max_tokens
    if len(ids) > room:
        raise BadRequest(f"prompt is {len(ids)} tokens; with max_tokens={max_tokens} at most {room} fit "
                         f"(max_seq {runtime.max_seq})")
    return ids, max_tokens


class CompletionHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: MoeHTTPServer

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
            prompt_ids, max_tokens = parse_completion(body, runtime=runtime)
        except BadRequest as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
            return
        request = Request(request_key=self.connection.fileno(), prompt_ids=prompt_ids, max_tokens=max_tokens)
        try:
            runtime.engine.submit(request)
        except Overloaded as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
            return
        if not request.done.wait(REQUEST_TIMEOUT_S):
            self._error(HTTPStatus.GATEWAY_TIMEOUT, f"no result within {REQUEST_TIMEOUT_S:.0f} s")
            return
        if request.error is not None:
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, request.error)
            return
        prompt_tokens = len(prompt_ids)
        self._reply(HTTPStatus.OK, {
            "object": "text_completion",
            "request_key": request.request_key,  # the moe.request NVTX payload: this connection's fd
            "tokens": request.generated,
            "text": runtime.tokenizer.decode(request.generated),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(request.generated),
                      "total_tokens": prompt_tokens + len(request.generated)},
            "timing": {"queue_ms": round((request.started_ns - request.enqueued_ns) / 1e6, 3),
                       "total_ms": round((request.finished_ns - request.enqueued_ns) / 1e6, 3),
                       "steps": request.steps},
        })


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
    try:
        while not stop.wait(0.5):
            pass
    finally:
        http.shutdown()
        http.server_close()
        control.close()
        runtime.engine.stop()
    return 0
