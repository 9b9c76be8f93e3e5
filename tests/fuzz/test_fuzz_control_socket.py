"""The reference runtime's control socket (docs/control-protocol.md) under hostile clients: a real
runtime process, and hypothesis-generated lines (invalid JSON and UTF-8, deep nesting, huge
numbers, wrong types, unknown commands and keys), over-long lines, and partial lines cut by a
close. Every reply is one JSON line (an error reply unless the request was valid); the only close
is the documented one after an over-long line; afterwards the runtime still serves HTTP and
`stats` still answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from fuzzing import fuzz
from hypothesis import event, given
from hypothesis import strategies as st

from moescope.examples.moe_runtime.control import COMMAND_ARGS, DRAIN_MAX_BYTES, MAX_LINE_BYTES, ControlClient
from tests.runtime.conftest import REPO, SMALL_MODEL, RunningServer, _read_banner, _stop

REPLY_TIMEOUT_S = 60.0  # generous: only bounds waiting on a shared, noisy 2-core machine


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    directory = tempfile.mkdtemp(prefix="moe-fuzz-", dir="/tmp")
    path = os.path.join(directory, "control.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moescope.examples.moe_runtime", "--port", "0", "--control-socket", path, *SMALL_MODEL],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        banner = _read_banner(proc, timeout_s=120)
        yield RunningServer(proc=proc, port=int(banner["http port"]), socket_path=banner["control socket"],
                            banner=banner)
    finally:
        _stop(proc)
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


class Conn:
    """A raw client: sends bytes, reads reply lines."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_TIMEOUT_S)
        self.sock.connect(path)
        self.file = self.sock.makefile("rb")

    def reply(self) -> dict[str, Any] | None:
        line = self.file.readline()
        if not line:
            return None  # closed
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        reply = json.loads(line)
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool) and "id" in reply
        assert isinstance(reply.get("elapsed_ms"), float | int)
        if not reply["ok"]:
            assert isinstance(reply["error"], str) and reply["error"] and "\n" not in reply["error"]
        return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.sampled_from(["cpu", "host", "cuda:0", "fp16", "int8", "", -1, 0, 2**63, 1e308]),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
harmless_cmds = [c for c in COMMAND_ARGS if c not in ("set_resident_capacity",)]  # keep the pool intact
arg_names = sorted({name for spec in COMMAND_ARGS.values() for name in spec} | {"bogus", ""})


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """One request line (no newline), hostile in one of many ways."""
    kind = draw(st.sampled_from(["object", "object", "object", "json", "text", "bytes", "deep", "digits", "specials"]))
    if kind == "object":
        request: dict[str, Any] = {}
        if draw(st.booleans()):
            request["id"] = draw(json_values)
        request["cmd"] = draw(st.one_of(st.sampled_from(harmless_cmds), json_values))
        if draw(st.booleans()):
            request["args"] = draw(st.one_of(st.dictionaries(st.sampled_from(arg_names), json_values, max_size=4),
                                             json_values))
        if draw(st.booleans()):
            request[draw(st.text(max_size=5))] = draw(json_values)
        return json.dumps(request).encode()
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "text":
        return draw(st.text(max_size=60)).encode("utf-8", "surrogatepass")
    if kind == "bytes":
        return draw(st.binary(max_size=60))
    if kind == "deep":
        opener = draw(st.sampled_from([b"[", b'{"id":', b"[" * 7]))
        n = draw(st.integers(1, (MAX_LINE_BYTES - 100) // len(opener)))
        if draw(st.booleans()):  # closed: valid JSON nested up to (and past) Python's recursion limit
            depth = draw(st.integers(900, 1100))
            return b'{"cmd":"ping","id":' + b"[" * depth + b"]" * depth + b"}"
        return opener * n
    if kind == "digits":
        return b'{"cmd":"ping","id":' + b"9" * draw(st.integers(4000, 20_000)) + b"}"
    return draw(
        st.sampled_from(
            [
                b'{"cmd":"ping","id":NaN}',
                b'{"cmd":"ping","id":1e999}',
                b'{"cmd":"ping","id":-Infinity}',
                b'{"cmd":"set_router_penalty","args":{"expert":0,"penalty":1e999}}',
                b'{"cmd":"ping","args":null}',
                b'{"cmd":"ping"}\r',
                b"\xef\xbb\xbf{}",
                b"\x00",
            ]
        )
    )


def expect_replies(conn: Conn, line: bytes) -> None:
    payload = line.replace(b"\n", b"")  # one line, whatever the generator made
    conn.sock.sendall(payload + b"\n")
    if not payload.strip():
        return  # a blank line gets no reply (documented: one reply per request)
    reply = conn.reply()
    assert reply is not None, f"connection closed on a {len(payload)}-byte line"
    if not could_be_valid(payload):
        assert reply["ok"] is False, reply
    event("ok reply" if reply["ok"] else "error reply")


def could_be_valid(payload: bytes) -> bool:
    """Whether the line is a JSON object naming a known command (it may then succeed)."""
    try:
        request = json.loads(payload)
    except (ValueError, RecursionError):
        return False
    cmd = request.get("cmd") if isinstance(request, dict) else None
    return isinstance(cmd, str) and cmd in COMMAND_ARGS


@pytest.fixture(scope="module")
def conn(server: RunningServer) -> Iterator[Conn]:
    c = Conn(server.socket_path)
    try:
        yield c
    finally:
        c.close()


@fuzz(300)
@given(st.lists(requests(), min_size=1, max_size=4))
def test_hostile_lines_get_one_line_replies_on_one_connection(conn: Conn, lines: list[bytes]) -> None:
    # one connection for the whole run: any hostile line that broke it would fail every later example
    for line in lines:
        expect_replies(conn, line)
    conn.sock.sendall(b'{"id":"probe","cmd":"ping"}\n')
    reply = conn.reply()
    assert reply is not None and reply["ok"] and reply["id"] == "probe"


@fuzz(20)
@given(st.binary(min_size=1, max_size=200), st.booleans())
def test_partial_line_then_close(server: RunningServer, head: bytes, shutdown_write: bool) -> None:
    c = Conn(server.socket_path)
    try:
        c.sock.sendall(head.replace(b"\n", b""))
        if shutdown_write:  # EOF mid-line: the server just closes its side, no reply promised
            c.sock.shutdown(socket.SHUT_WR)
            assert c.file.readline() == b""
    finally:
        c.close()


@pytest.mark.parametrize("extra", [1, 70_000, DRAIN_MAX_BYTES // 2])
def test_over_long_line_gets_the_documented_error_then_close(server: RunningServer, extra: int) -> None:
    c = Conn(server.socket_path)
    try:
        try:
            c.sock.sendall(b'{"cmd":"ping","id":"' + b"x" * (MAX_LINE_BYTES + extra))
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise AssertionError("the server must read what is sent after the limit (up to DRAIN_MAX_BYTES)") from exc
        reply = c.reply()
        assert reply is not None and reply["ok"] is False and reply["id"] is None
        assert f"longer than {MAX_LINE_BYTES} bytes" in reply["error"]
        assert c.reply() is None  # then the documented close
    finally:
        c.close()


def test_the_runtime_still_serves_after_the_fuzzing(server: RunningServer) -> None:
    """Runs last in this file (pytest keeps file order): HTTP and `stats` after everything above."""
    status, body = server.post({"prompt": "still serving after the fuzz", "max_tokens": 3})
    assert status == 200 and len(body["tokens"]) == 3
    with ControlClient(server.socket_path, timeout_s=REPLY_TIMEOUT_S) as client:
        stats = client.call("stats")
    assert stats["protocol"] == "moescope-control/1"
    assert server.proc.poll() is None
