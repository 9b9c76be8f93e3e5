"""Tiny HTTP/1.1 keep-alive servers for the ingress tests, run as subprocesses (never imported).

    python http_servers.py threaded|asyncio [--port-file PATH] [--self-request]

Listens on 127.0.0.1 (ephemeral port), prints "PORT <n>" on stdout (and writes it to --port-file).
GET /size/<n> answers n body bytes; POST echoes the length of its body; GET /exit answers, then
the process exits with status 3. --self-request: right after listening, the server makes one
request to itself (shows whether a tracer was attached before the server did any work).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import http.server
import os
import sys
import threading

EXIT_STATUS = 3


def response_body(method: str, path: str, body_len: int) -> bytes:
    if method == "POST":
        return b"got %d" % body_len
    if path.startswith("/size/"):
        return b"x" * int(path[len("/size/") :])
    return b"ok"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body_in = self.rfile.read(length) if length else b""
        body = response_body(method, self.path, len(body_in))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.path == "/exit":
            self.wfile.flush()
            os._exit(EXIT_STATUS)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def log_message(self, format: str, *args: object) -> None:
        pass


def announce(port: int, port_file: str | None) -> None:
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(port_file + ".tmp", port_file)
    print(f"PORT {port}", flush=True)


def self_request(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/size/7")
    conn.getresponse().read()
    conn.close()


def run_threaded(port_file: str | None, self_req: bool) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if self_req:
        threading.Thread(target=self_request, args=(server.server_address[1],), daemon=True).start()
    announce(server.server_address[1], port_file)
    server.serve_forever()


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body_in = await reader.readexactly(length) if length else b""
            body = response_body(method, path, len(body_in))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            if path == "/exit":
                os._exit(EXIT_STATUS)
    finally:
        writer.close()


async def run_asyncio(port_file: str | None) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    announce(server.sockets[0].getsockname()[1], port_file)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["threaded", "asyncio"])
    parser.add_argument("--port-file")
    parser.add_argument("--self-request", action="store_true")
    args = parser.parse_args()
    if args.kind == "threaded":
        run_threaded(args.port_file, args.self_request)
    else:
        asyncio.run(run_asyncio(args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
