"""A stand-in for a serving process owned by another uid, for the capability tests (run as a script,
never imported; the test starts it with `setpriv --reuid=65534`):

    python cap_target.py --socket-dir DIR --ring-dir DIR

It serves HTTP/1.1 keep-alive on 127.0.0.1 (ephemeral port), creates the two private files a real
runtime creates — an NVTX ring file and a UNIX control socket, both mode 0600 and owned by this uid
— then prints one JSON line {"port", "ring", "socket"} and serves until killed.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import sys
import threading


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--ring-dir", required=True)
    args = parser.parse_args()
    os.umask(0o077)
    ring = os.path.join(args.ring_dir, f"moescope-captest.{os.getpid()}")
    fd = os.open(ring, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    control_path = os.path.join(args.socket_dir, f"runtime-{os.getpid()}.sock")
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.bind(control_path)
    os.chmod(control_path, 0o600)
    control.listen(8)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True

    def accept_forever() -> None:
        while True:
            conn, _ = control.accept()
            conn.close()

    threading.Thread(target=accept_forever, daemon=True).start()
    print(json.dumps({"port": server.server_address[1], "ring": ring, "socket": control_path}), flush=True)
    try:
        server.serve_forever()
    finally:
        os.unlink(ring)
        os.unlink(control_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
