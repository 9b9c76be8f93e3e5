"""The eBPF compiler process (see probes/bpf.py): `python -m moescope.probes.bpf_child FD`.

Reads one request on socket FD (8-byte length + JSON {"text", "flags"}), compiles and loads the
program with bcc without attaching anything, and answers with one message: 8-byte length + JSON
{"programs": ["category:event", ...], "maps": [name, ...]} carrying one descriptor per name (in
that order) as SCM_RIGHTS; or {"error": "BccMissing" | "ProbeLoadError", "message": one line}.
Then it exits; the parent holds the only references that keep the programs and maps alive.
"""

from __future__ import annotations

import ctypes as ct
import json
import os
import socket
import sys
from typing import Any

from moescope.probes.bpf import MAX_FDS, read_message


def _reply(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    body = json.dumps(message).encode()
    socket.send_fds(sock, [len(body).to_bytes(8, "little") + body], fds)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load(request: dict[str, Any]) -> tuple[dict[str, Any], list[int], Any]:
    try:
        import bcc
        from bcc.libbcc import lib
    except ImportError as exc:
        return {"error": "BccMissing",
                "message": f"bcc is not importable ({exc}): install Debian's python3-bpfcc (`make setup`)"}, [], None

    class _LoadOnly(bcc.BPF):
        def _trace_autoload(self) -> None:
            """Attaching is the parent's job: a program attached here too would run twice."""

    try:
        module = _LoadOnly(text=request["text"].encode(), cflags=list(request["flags"]))
        programs: list[str] = []
        fds: list[int] = []
        for index in range(lib.bpf_num_functions(module.module)):
            name = lib.bpf_function_name(module.module, index)
            if not name.startswith(b"tracepoint__"):
                continue
            function = module.load_func(name, bcc.BPF.TRACEPOINT)
            programs.append(name[len(b"tracepoint__"):].decode().replace("__", ":", 1))
            fds.append(function.fd)
        # libbcc exports these two without ctypes declarations; a module pointer passed as a
        # default int would be truncated.
        lib.bpf_num_tables.argtypes = [ct.c_void_p]
        lib.bpf_num_tables.restype = ct.c_ulonglong
        lib.bpf_table_name.argtypes = [ct.c_void_p, ct.c_ulonglong]
        lib.bpf_table_name.restype = ct.c_char_p
        maps: list[str] = []
        for index in range(lib.bpf_num_tables(module.module)):
            table_name = lib.bpf_table_name(module.module, index)
            maps.append(table_name.decode())
            fds.append(module.get_table(table_name).map_fd)
    except Exception as exc:  # bcc raises bare Exception for compile and load failures
        return (
            {"error": "ProbeLoadError", "message": f"eBPF program failed to compile/load: {_one_line(exc)}"},
            [],
            None,
        )
    if len(fds) > MAX_FDS:
        return {"error": "ProbeLoadError", "message": f"{len(fds)} programs and maps: at most {MAX_FDS}"}, [], None
    return {"programs": programs, "maps": maps}, fds, module


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    try:
        request = read_message(sock)
    except (OSError, ValueError) as exc:
        print(f"bpf_child: bad request: {exc}", file=sys.stderr)
        return 2
    message, fds, _module = _load(request)
    _reply(sock, message, fds)
    sock.close()
    sys.stderr.flush()
    # Skip bcc's teardown: the parent's descriptors keep everything alive; exiting closes ours.
    os._exit(0 if "error" not in message else 1)


if __name__ == "__main__":
    sys.exit(main())
