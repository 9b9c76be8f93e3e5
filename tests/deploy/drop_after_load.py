"""Loads the ingress probe with the full capability set, then drops CAP_BPF and CAP_PERFMON from
the process (effective and permitted: they cannot come back) and goes on tracing a target. Prints
one JSON object. The evidence for docs/security.md, "Dropping privileges after attach":

    python drop_after_load.py --target-pid PID --port PORT --requests N --keep CAP_NAME...
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import sys
import time
from pathlib import Path

# bit numbers from <linux/capability.h>
CAP_BITS = {"CAP_DAC_OVERRIDE": 1, "CAP_SYS_PTRACE": 19, "CAP_PERFMON": 38, "CAP_BPF": 39}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def keep_only(names: list[str]) -> None:
    """capset(2): effective = permitted = `names`, inheritable = none, for this thread's process."""
    mask = sum(1 << CAP_BITS[name] for name in names)
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for word in range(2):
        bits = (mask >> (32 * word)) & 0xFFFFFFFF
        data[word].effective = bits
        data[word].permitted = bits
        data[word].inheritable = 0
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return -1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-pid", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--keep", nargs="*", default=[], choices=sorted(CAP_BITS))
    args = parser.parse_args()

    from probes.ingress.loader import IngressProbe

    records: list[object] = []
    probe = IngressProbe(on_record=records.append)
    probe.load()
    keep_only(args.keep)
    result: dict[str, object] = {"caps_after_drop": f"{effective_caps():016x}"}
    try:
        result["seeded"] = probe.add_target(args.target_pid)  # BPF map updates through the map's fd
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
        for _ in range(args.requests):
            conn.request("GET", "/")
            conn.getresponse().read()
        conn.close()
        deadline = time.monotonic() + 30
        while len(records) < args.requests and time.monotonic() < deadline:
            probe.poll(time.monotonic_ns())  # ring buffer: epoll + mmap, no bpf(2) call
            time.sleep(0.02)
        result["records"] = len(records)
        probe.remove_target(args.target_pid)
        result["drops"] = probe.drop_total()
        probe.close()
        result["closed"] = True
    except Exception as exc:  # the outcome is the evidence; report it instead of a traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
