"""In-test OTLP receivers: gRPC (opentelemetry-proto's TraceService) and HTTP (/v1/traces, protobuf).

Both bind 127.0.0.1:0, keep every ExportTraceServiceRequest they accept, and can be told to
answer UNAVAILABLE (gRPC) / 503 (HTTP) or to hold requests until released, for fault tests.
``flatten`` turns requests into ``FlatSpan``s with Python attribute values; it is written
independently of agent/export/store.py so tests can compare the two.

    with GrpcOtlpReceiver() as rx:
        ... export to rx.endpoint ...
        spans = rx.wait_for_spans(10)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

WAIT_TIMEOUT_S = 60.0  # generous: only bounds a wait, never asserts speed


def python_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "bytes_value":
        return value.bytes_value
    if kind == "array_value":
        return [python_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: python_value(kv.value) for kv in value.kvlist_value.values}
    return None


def _attrs(items: Any) -> dict[str, Any]:
    return {kv.key: python_value(kv.value) for kv in items}


@dataclass(frozen=True)
class FlatSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]
    events: list[tuple[str, int, dict[str, Any]]]
    status_code: int
    resource: dict[str, Any]
    scope: str
    dropped_links: int = 0
    dropped_attributes: int = 0


def flatten(requests: list[ExportTraceServiceRequest]) -> list[FlatSpan]:
    out: list[FlatSpan] = []
    for request in requests:
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        FlatSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex() or None,
                            kind=int(s.kind),
                            start_ns=int(s.start_time_unix_nano),
                            end_ns=int(s.end_time_unix_nano),
                            attributes=_attrs(s.attributes),
                            links=[(lk.trace_id.hex(), lk.span_id.hex(), _attrs(lk.attributes)) for lk in s.links],
                            events=[(e.name, int(e.time_unix_nano), _attrs(e.attributes)) for e in s.events],
                            status_code=int(s.status.code),
                            resource=resource,
                            scope=ss.scope.name,
                            dropped_links=int(s.dropped_links_count),
                            dropped_attributes=int(s.dropped_attributes_count),
                        )
                    )
    return out


@dataclass
class _State:
    requests: list[ExportTraceServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    unavailable: bool = False
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    released: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        self.released.set()


class _ReceiverBase:
    def __init__(self) -> None:
        self._state = _State()

    # fault injection
    def set_unavailable(self, unavailable: bool) -> None:
        """While set, every export is refused (gRPC UNAVAILABLE / HTTP 503) and counted in ``refused``."""
        with self._state.lock:
            self._state.unavailable = unavailable

    def hold(self) -> None:
        """Block incoming exports (after receipt, before answering) until ``release``."""
        self._state.released.clear()

    def release(self) -> None:
        self._state.released.set()

    @property
    def refused(self) -> int:
        with self._state.lock:
            return self._state.refused

    def _accept(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> bool:
        """Record the request unless unavailable; returns whether it was accepted."""
        self._state.released.wait(WAIT_TIMEOUT_S)
        with self._state.changed:
            if self._state.unavailable:
                self._state.refused += 1
                self._state.changed.notify_all()
                return False
            self._state.requests.append(request)
            self._state.headers.append(headers)
            self._state.changed.notify_all()
            return True

    # results
    @property
    def requests(self) -> list[ExportTraceServiceRequest]:
        with self._state.lock:
            return list(self._state.requests)

    @property
    def headers(self) -> list[dict[str, str]]:
        with self._state.lock:
            return list(self._state.headers)

    def spans(self) -> list[FlatSpan]:
        return flatten(self.requests)

    def span_count(self) -> int:
        with self._state.lock:
            return sum(len(ss.spans) for r in self._state.requests for rs in r.resource_spans for ss in rs.scope_spans)

    def wait_for_spans(self, n: int, *, timeout_s: float = WAIT_TIMEOUT_S) -> list[FlatSpan]:
        """Wait until at least ``n`` spans arrived (AssertionError after ``timeout_s``)."""
        end = time.monotonic() + timeout_s
        with self._state.changed:
            while True:
                have = sum(
                    len(ss.spans) for r in self._state.requests for rs in r.resource_spans for ss in rs.scope_spans
                )
                if have >= n:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver got {have} spans, expected {n}")
                self._state.changed.wait(left)
        return self.spans()

    def wait_for_refusals(self, n: int, *, timeout_s: float = WAIT_TIMEOUT_S) -> int:
        end = time.monotonic() + timeout_s
        with self._state.changed:
            while self._state.refused < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver refused {self._state.refused} exports, expected {n}")
                self._state.changed.wait(left)
            return self._state.refused


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: GrpcOtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: ExportTraceServiceRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        headers = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        if not self._receiver._accept(request, headers):
            context.abort(grpc.StatusCode.UNAVAILABLE, "receiver set unavailable by the test")
        return trace_service_pb2.ExportTraceServiceResponse()


class GrpcOtlpReceiver(_ReceiverBase):
    """OTLP/gRPC TraceService on 127.0.0.1:<ephemeral>; ``endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-rx"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        if not self.port:
            raise RuntimeError("could not bind the gRPC receiver on 127.0.0.1")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> GrpcOtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self.release()
        self._server.stop(grace=None).wait(10)

    def __enter__(self) -> GrpcOtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HttpOtlpReceiver(_ReceiverBase):
    """OTLP/HTTP (protobuf) on 127.0.0.1:<ephemeral>; ``endpoint`` is the full /v1/traces URL."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(415)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                if not receiver._accept(request, {k.lower(): v for k, v in self.headers.items()}):
                    self.send_error(503)
                    return
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="otlp-http-rx", daemon=True)

    def start(self) -> HttpOtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)

    def __enter__(self) -> HttpOtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
