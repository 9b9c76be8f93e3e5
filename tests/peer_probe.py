"""Connect to a UNIX control socket as uid 65534 (nobody) and return what the server said.

Shared by the runtime's and the policy's tests of the SO_PEERCRED check: "EACCES" when the file
mode keeps the uid out, else the raw reply (the runtime answers a foreign peer once, then closes).
"""

from __future__ import annotations

import subprocess
import sys

NOBODY = "65534"

_CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
try:
    s.sendall(b'{"id": 1, "cmd": "ping"}\\n')
except OSError:
    pass  # the runtime may already have replied and closed
data = b""
try:
    while chunk := s.recv(65536):
        data += chunk
except ConnectionResetError:
    pass
print(data.decode().strip())
"""


def connect_as_nobody(path: str) -> str:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", _CONNECT, path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()
