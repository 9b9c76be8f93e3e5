"""The HTTP front end as a real process on loopback: 200/400/404 paths, keep-alive, concurrency,
and dynamic batching observed through /stats; and its connections' TCP_NODELAY (in process)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable

from tests.runtime.conftest import RunningServer


def test_completion_health_stats_and_errors(start_server: Callable[..., RunningServer]) -> None:
    server = start_server()
    status, body = server.get("/healthz")
    assert status == 200 and body == {"ok": True}
    status, body = server.post({"prompt": "hello", "max_tokens": 5})
    assert status == 200
    assert len(body["tokens"]) == 5 and isinstance(body["text"], str)
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    # Same prompt alone again: greedy decoding is deterministic.
    assert server.post({"prompt": "hello", "max_tokens": 5})[1]["tokens"] == body["tokens"]
    bad = [
        (b'{"prompt": "x",', "malformed JSON"),
        (b'[1, 2]', "must be a JSON object"),
        (b'{"max_tokens": 3}', "'prompt' must be a string"),
        (b'{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be an integer"),
        (b'{"prompt": "x", "max_tokens": true}', "'max_tokens' must be an integer"),
        (b'{"prompt": "x", "max_tokens": "3"}', "'max_tokens' must be an integer"),
        (b'{"prompt": "x", "temperature": 1}', "unknown field"),
        (b'{"prompt": "' + b"a" * 600 + b'", "max_tokens": 4}', "at most"),
        (b'\xff\xfe', "malformed JSON"),
    ]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for raw, message in bad:
            status, body = server.post(None, raw=raw, conn=conn)  # keep-alive survives 400s
            assert status == 400, raw
            assert message in body["error"]["message"], (raw, body)
        assert server.post(None, raw=b"{}", conn=conn, path="/nope")[0] == 404
        status, body = server.post({"prompt": "still fine", "max_tokens": 2}, conn=conn)
        assert status == 200 and len(body["tokens"]) == 2
    finally:
        conn.close()
    assert server.get("/nope")[0] == 404
    status, stats = server.get("/stats")
    assert status == 200
    assert stats["counters"]["requests_completed"] == 3
    assert stats["protocol"] == "moescope-control/1"
    assert server.proc.poll() is None


def test_concurrent_clients_are_batched(start_server: Callable[..., RunningServer]) -> None:
    server = start_server("--max-batch-size", "8", "--max-wait-ms", "50")
    prompts = [f"request number {i}" for i in range(24)]
    alone = {p: server.post({"prompt": p, "max_tokens": 4})[1]["tokens"] for p in prompts[:2]}
    results: dict[str, tuple[int, list[int]]] = {}
    lock = threading.Lock()

    def client(chunk: list[str]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            for p in chunk:
                status, body = server.post({"prompt": p, "max_tokens": 4}, conn=conn)
                with lock:
                    results[p] = (status, body.get("tokens", []))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(prompts[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 24 and all(status == 200 and len(toks) == 4 for status, toks in results.values())
    _, stats = server.get("/stats")
    counters = stats["counters"]
    assert counters["requests_completed"] == 26
    assert counters["multi_request_steps"] > 0
    assert counters["max_batch_requests"] > 1
    assert counters["max_batch_requests"] <= 8
    # Fewer steps than serving one request at a time would take (26 requests x 4 tokens).
    assert counters["steps"] < 26 * 4
    assert json.dumps(alone)  # the solo results were well-formed


def test_every_connection_sends_without_waiting_for_acks() -> None:
    """A JSON answer is two writes (headers, then body): with Nagle's algorithm on, the body waited
    for the client's delayed ACK, 40-48 ms on every non-streamed answer of a kept-alive connection
    (76 against 33 ms a request, measured by a scratch client). The handler's setup turns it off."""
    import socket

    from moescope.examples.moe_runtime.server import CompletionHandler

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        with client, conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # the kernel's default
            handler = CompletionHandler.__new__(CompletionHandler)
            handler.request = conn
            handler.setup()
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            handler.finish()
