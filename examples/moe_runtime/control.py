"""Control socket (docs/control-protocol.md): UNIX stream socket, mode 0600, JSON lines, peer uid
checked with SO_PEERCRED (root or the runtime's own uid). Nothing a client sends can crash the
server: every failure becomes a one-line error reply."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from moescope.errors import ControlError, MoescopeError, UsageError

log = logging.getLogger("moe_runtime.control")

MAX_LINE_BYTES = 65536
# After an over-long line: what is still arriving is read and discarded (this much, this long at
# most) before the close, so the kernel does not reset the connection and drop the error reply.
DRAIN_MAX_BYTES = 1 << 20
DRAIN_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 300.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def default_socket_path(*, pid: int) -> str:
    """First that works: /run/moescope/, $XDG_RUNTIME_DIR, /tmp (see docs/control-protocol.md)."""
    run_dir = "/run/moescope"
    try:
        os.makedirs(run_dir, mode=0o755, exist_ok=True)
        if os.access(run_dir, os.W_OK | os.X_OK):
            return os.path.join(run_dir, f"runtime-{pid}.sock")
    except OSError:
        pass
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return os.path.join(xdg, f"moescope-runtime-{pid}.sock")
    return f"/tmp/moescope-runtime-{pid}.sock"


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    if value is None:
        return "null"
    return type(value).__name__


# Argument schema per command: name -> (accepted JSON kinds, required).
ArgSpec = dict[str, tuple[tuple[str, ...], bool]]
COMMAND_ARGS: dict[str, ArgSpec] = {
    "ping": {},
    "stats": {"fields": (("list", "null"), False), "placement_since": (("int", "null"), False)},
    "migrate_expert": {"layer": (("int",), True), "expert": (("int",), True), "device": (("str",), True),
                       "dtype": (("str", "null"), False)},
    "offload_expert": {"layer": (("int",), True), "expert": (("int",), True), "dtype": (("str",), False)},
    "restore_expert": {"layer": (("int",), True), "expert": (("int",), True), "device": (("str", "null"), False)},
    "set_precision": {"precision": (("str",), True), "experts": (("list", "null"), False)},
    "set_router_penalty": {"expert": (("int",), True), "penalty": (("int", "float"), True),
                           "layer": (("int", "null"), False)},
    "prefetch": {"count": (("int",), False), "layer": (("int", "null"), False), "device": (("str", "null"), False)},
    "set_resident_capacity": {"device": (("str",), True), "experts": (("int",), True)},
}


def check_args(cmd: str, args: dict[str, Any]) -> dict[str, Any]:
    spec = COMMAND_ARGS[cmd]
    unknown = sorted(set(args) - set(spec))
    if unknown:
        raise UsageError(f"{cmd}: unknown argument(s) {unknown}; accepted: {sorted(spec)}")
    out: dict[str, Any] = {}
    for name, (kinds, required) in spec.items():
        if name not in args:
            if required:
                raise UsageError(f"{cmd}: missing argument {name!r}")
            continue
        value = args[name]
        if _kind(value) not in kinds:
            raise UsageError(f"{cmd}: argument {name!r} must be {'|'.join(kinds)}, got {_kind(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{cmd}: argument {name!r} must be finite")
        if value is not None:
            out[name] = float(value) if "float" in kinds and isinstance(value, int) else value
    return out


class ControlServer:
    """Accepts connections on a thread; one thread per connection; commands run one at a time."""

    def __init__(self, *, path: str, handlers: dict[str, Callable[..., dict[str, Any]]],
                 mode: int = 0o600) -> None:
        self.path = path
        self.handlers = handlers
        self.mode = mode
        self.uid = os.getuid()
        self._command_lock = threading.Lock()
        self._closing = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            # A stale socket from a dead runtime; refuse to steal a live one.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)
            else:
                probe.close()
                self._sock.close()
                raise ControlError(f"control socket {path} is in use by a running process")
            finally:
                probe.close()
        old_umask = os.umask(0o177)  # the socket is never reachable by others, even briefly
        try:
            self._sock.bind(path)
        except OSError as exc:
            self._sock.close()
            raise ControlError(f"cannot bind control socket {path}: {exc.strerror}") from exc
        finally:
            os.umask(old_umask)
        os.chmod(path, mode)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name="moe-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)
                continue
            threading.Thread(target=self._serve_connection, args=(conn,), name="moe-control-conn",
                             daemon=True).start()

    def _serve_connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                if uid not in (0, self.uid):
                    log.warning("control: refused peer pid %d uid %d", pid, uid)
                    _send(conn, {"id": None, "ok": False, "elapsed_ms": 0.0,
                                 "error": f"peer uid {uid} not permitted (only uid 0 and uid {self.uid})"})
                    return
                conn.settimeout(IDLE_TIMEOUT_S)
                buffer = b""
                while not self._closing.is_set():
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip():
                            _send(conn, self.handle_line(line))
                    if len(buffer) > MAX_LINE_BYTES:
                        _send(conn, {"id": None, "ok": False, "elapsed_ms": 0.0,
                                     "error": f"request line longer than {MAX_LINE_BYTES} bytes; closing"})
                        _discard_input(conn)
                        return
            except (TimeoutError, OSError):
                return

    def handle_line(self, line: bytes) -> dict[str, Any]:
        start_ns = time.perf_counter_ns()
        request_id: Any = None
        try:
            try:
                request = json.loads(line)
            except (ValueError, RecursionError) as exc:  # also: nesting or integer digits past Python's limits
                raise UsageError(f"malformed JSON: {exc}") from exc
            if not isinstance(request, dict):
                raise UsageError(f"request must be a JSON object, got {_kind(request)}")
            request_id = request.get("id")
            cmd = request.get("cmd")
            if not isinstance(cmd, str):
                raise UsageError("missing 'cmd' (a string)")
            if cmd not in COMMAND_ARGS or cmd not in self.handlers:
                raise UsageError(f"unknown cmd {cmd!r}; known: {sorted(COMMAND_ARGS)}")
            raw_args = request.get("args", {})
            if raw_args is None:
                raw_args = {}
            if not isinstance(raw_args, dict):
                raise UsageError(f"'args' must be an object, got {_kind(raw_args)}")
            args = check_args(cmd, raw_args)
            with self._command_lock:
                result = self.handlers[cmd](**args)
            return {"id": request_id, "ok": True, "result": result, "elapsed_ms": _elapsed_ms(start_ns)}
        except MoescopeError as exc:
            return {"id": request_id, "ok": False, "error": str(exc), "elapsed_ms": _elapsed_ms(start_ns)}
        except Exception as exc:  # noqa: BLE001 - a bug in a command must not take the server down
            log.exception("control command failed")
            return {"id": request_id, "ok": False, "error": f"internal error: {type(exc).__name__}: {exc}",
                    "elapsed_ms": _elapsed_ms(start_ns)}


def _discard_input(conn: socket.socket) -> None:
    """Half-closes, then reads what the client still sends (bounded) so the close is an EOF."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(DRAIN_TIMEOUT_S)
    received = 0
    while received < DRAIN_MAX_BYTES:
        chunk = conn.recv(65536)
        if not chunk:
            return
        received += len(chunk)


def _elapsed_ms(start_ns: int) -> float:
    return round((time.perf_counter_ns() - start_ns) / 1e6, 4)


def _send(conn: socket.socket, reply: dict[str, Any]) -> None:
    try:
        line = json.dumps(reply, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # a bug in a result: still one well-formed error line
        error = {"ok": False, "elapsed_ms": reply.get("elapsed_ms", 0.0),
                 "error": f"internal error: reply not JSON-serialisable: {exc}"}
        try:
            line = json.dumps({"id": reply.get("id"), **error}, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # the id itself (NaN, nested too deep): null
            line = json.dumps({"id": None, **error})
    conn.sendall((line + "\n").encode())


class ControlClient:
    """A blocking JSON-lines client for the control socket (used by the load generator and tests)."""

    def __init__(self, path: str, *, timeout_s: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise ControlError(f"cannot connect to control socket {path}: {exc.strerror or exc}") from exc
        self._file = self._sock.makefile("rb")
        self._next_id = 0

    def request(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Sends one command and returns the whole reply object."""
        self._next_id += 1
        message = {"id": self._next_id, "cmd": cmd, "args": args or {}}
        self._sock.sendall((json.dumps(message) + "\n").encode())
        line = self._file.readline()
        if not line:
            raise ControlError("control socket closed without a reply")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Sends one command and returns its result; an error reply raises ControlError."""
        reply = self.request(cmd, args)
        if not reply.get("ok"):
            raise ControlError(f"{cmd}: {reply.get('error')}")
        result: dict[str, Any] = reply["result"]
        return result

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
