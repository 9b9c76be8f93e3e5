"""Loads the ingress probe with the full capability set, then drops CAP_BPF and CAP_PERFMON from
the process with agent/privileges.py (effective and permitted: they cannot come back) and goes on
tracing a target. Prints one JSON object. The evidence for docs/security.md, "Dropping privileges after attach":

    python drop_after_load.py --target-pid PID --port PORT --requests N --keep CAP_NAME...
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time

# agent first: it limits numpy's BLAS to one thread, and the drop refuses while other threads run
from moescope.agent import privileges


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-pid", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--keep", nargs="*", default=[], choices=sorted(privileges.CAP_NUMBERS))
    args = parser.parse_args()

    from moescope.probes.ingress.loader import IngressProbe

    records: list[object] = []
    probe = IngressProbe(on_record=records.append)
    probe.load()
    note = privileges.drop_to(tuple(args.keep))  # what `agent start` does after attach
    result: dict[str, object] = {"caps_after_drop": f"{privileges.thread_capabilities().effective:016x}"}
    if note.startswith("privileges kept"):
        result["error"] = note
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
