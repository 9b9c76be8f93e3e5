"""TCP peers for the netsig tests, run as subprocesses (inside the test's network namespace with
`ip netns exec`). Every loop is bounded; a server exits by itself after MAX_LIFE_S.

Servers print "PORT <n> PID <pid>" once listening, then:
  backlog N        listen(N) and never accept (the accept queue overflows)
  reset            per connection, read one command line: "linger" -> SO_LINGER 0 and close (the
                   server sends a reset); "hold" -> read until the peer goes (it resets: the server
                   receives one)
  bulk SIZE        per connection: on "get" send SIZE bytes; on "done" answer with the socket's
                   tcpi_total_retrans (TCP_INFO), then wait for the peer to close

Clients print one JSON line:
  flood PORT COUNT WAIT_S          COUNT non-blocking connects, kept WAIT_S seconds, then closed
  reset-client PORT linger|hold    one connection; "hold" ends with SO_LINGER 0 close (a reset)
  resets PORT COUNT                COUNT connections, each reset by the client
  bulk-client PORT CONNS SIZE      CONNS connections fetch SIZE bytes each; prints {"downloaded": ...}
                                   then waits for a line on stdin before sending "done" on each
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time

MAX_LIFE_S = 120.0
TCP_INFO_TOTAL_RETRANS_OFFSET = 100  # struct tcp_info: u32 tcpi_total_retrans (linux/tcp.h)
TCP_INFO_BYTES = 104


def _listen(backlog: int) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(backlog)
    print(f"PORT {server.getsockname()[1]} PID {os.getpid()}", flush=True)
    return server


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < 64:
        chunk = conn.recv(64 - len(data))
        if not chunk:
            break
        data += chunk
    return data.strip()


def _linger_zero(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def serve_backlog(backlog: int) -> None:
    server = _listen(backlog)
    time.sleep(MAX_LIFE_S)
    server.close()


def serve_reset() -> None:
    server = _listen(16)
    server.settimeout(MAX_LIFE_S)
    deadline = time.monotonic() + MAX_LIFE_S
    while time.monotonic() < deadline:
        conn, _ = server.accept()
        conn.settimeout(30)
        try:
            command = _read_line(conn)
            if command == b"linger":
                _linger_zero(conn)
            elif command == b"hold":
                while conn.recv(4096):
                    pass
        except OSError:
            pass  # the peer's reset ends the read
        finally:
            conn.close()


def _serve_bulk_connection(conn: socket.socket, payload: bytes) -> None:
    # The whole life, not a shorter per-connection limit: the client reads the connections one after
    # another, so one connection stalled in retransmit backoff under the drop rule delays every other
    # server's "done" (a 60 s limit here once closed all four unanswered on a busy machine).
    conn.settimeout(MAX_LIFE_S)
    try:
        if _read_line(conn) == b"get":
            conn.sendall(payload)
        if _read_line(conn) == b"done":
            info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            (total_retrans,) = struct.unpack_from("I", info, TCP_INFO_TOTAL_RETRANS_OFFSET)
            conn.sendall(f"{total_retrans}\n".encode())
            while conn.recv(4096):
                pass
    except OSError:
        pass
    finally:
        conn.close()


def serve_bulk(size: int) -> None:
    server = _listen(16)
    server.settimeout(MAX_LIFE_S)
    payload = b"x" * size
    deadline = time.monotonic() + MAX_LIFE_S
    while time.monotonic() < deadline:
        conn, _ = server.accept()
        # a thread per connection: the client reads them all before it answers any
        threading.Thread(target=_serve_bulk_connection, args=(conn, payload), daemon=True).start()


def client_flood(port: int, count: int, wait_s: float) -> None:
    sockets = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        sockets.append(sock)
    time.sleep(wait_s)  # SYNs are retried meanwhile: each refused one is an overflow again
    for sock in sockets:
        sock.close()
    print(json.dumps({"connects": count}), flush=True)


def client_reset(port: int, mode: str) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    local_port = sock.getsockname()[1]
    start_ns = time.monotonic_ns()
    sock.sendall(mode.encode() + b"\n")
    error = None
    if mode == "linger":
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError as exc:
            error = type(exc).__name__
        sock.close()
    else:
        time.sleep(0.2)  # the server is reading
        _linger_zero(sock)
        sock.close()
    print(json.dumps({"local_port": local_port, "start_ns": start_ns, "end_ns": time.monotonic_ns(),
                      "error": error}), flush=True)


def client_resets(port: int, count: int) -> None:
    """COUNT connections, each ending in a reset the server receives."""
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(b"hold\n")
        _linger_zero(sock)
        sock.close()
    print(json.dumps({"resets": count}), flush=True)


def client_bulk(port: int, conns: int, size: int) -> None:
    sockets = []
    for _ in range(conns):
        sock = socket.create_connection(("127.0.0.1", port), timeout=MAX_LIFE_S)
        sock.sendall(b"get\n")
        sockets.append(sock)
    received = []
    for sock in sockets:
        got = 0
        while got < size:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        received.append(got)
    print(json.dumps({"downloaded": received, "local_ports": [s.getsockname()[1] for s in sockets]}), flush=True)
    sys.stdin.readline()  # the test lifts the drop rule first
    retrans = []
    for sock in sockets:
        sock.sendall(b"done\n")
        retrans.append(int(_read_line(sock) or b"-1"))  # -1: the server closed without answering
        sock.close()
    print(json.dumps({"server_total_retrans": retrans}), flush=True)


def main(argv: list[str]) -> int:
    role, args = argv[0], argv[1:]
    if role == "backlog":
        serve_backlog(int(args[0]))
    elif role == "reset":
        serve_reset()
    elif role == "bulk":
        serve_bulk(int(args[0]))
    elif role == "flood":
        client_flood(int(args[0]), int(args[1]), float(args[2]))
    elif role == "reset-client":
        client_reset(int(args[0]), args[1])
    elif role == "resets":
        client_resets(int(args[0]), int(args[1]))
    elif role == "bulk-client":
        client_bulk(int(args[0]), int(args[1]), int(args[2]))
    else:
        print(f"net_peers: unknown role {role!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
