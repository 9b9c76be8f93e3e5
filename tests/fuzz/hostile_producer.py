"""A real NVTX producer that does everything a tool must survive, through the `nvtx` package (and,
for what its API cannot express, through the injection library's own ABI slots via ctypes):
huge texts, invalid UTF-8, unknown payload types, unbalanced pops, 1000+ threads alive at once
each pushing and popping, and a unique text per event. It counts every event it emits while the
agent is attached, so the test can check the agent's conservation.

stdio: prints "ready" once its ring exists, waits for a line, runs (printing "held" while all its
threads hold ranges open, and waiting for a line), writes --log, prints "done", waits for a line
(so the agent can see its exited thread first), exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
from pathlib import Path
from typing import Any

import nvtx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "nvtx"))
from abi_harness import EventAttributes, FakeNvtx  # noqa: E402  (the ABI mirror tests/nvtx already has)

from moescope.collectors.nvtx import injection_library_path  # noqa: E402

HUGE_BYTES = 200_000
UNKNOWN_PAYLOAD_TYPES = (9, 0x1234, -5, 0x7FFFFFFF)
INVALID_UTF8 = (b"bad \xff\xfe", b"cut \xc3", b"surrogate \xed\xa0\x80")


def run(*, threads: int, unique: int, unbalanced_pops: int) -> dict[str, Any]:
    d = nvtx.get_domain("hostile")
    emitted = 0
    # huge texts (truncated by the library, flagged, counted), as marks and as a range
    for ch in "abc":
        d.mark(message=ch * HUGE_BYTES, payload=1)
        emitted += 1
    d.push_range(message="d" * HUGE_BYTES)
    d.pop_range()
    emitted += 2
    # invalid UTF-8 passed as bytes (the package hands them to NVTX's ASCII API unchanged)
    for raw in INVALID_UTF8:
        d.mark(message=raw)
        emitted += 1
    # unknown payload types: the package's API cannot make them; the library's ABI slots can
    fake = FakeNvtx()
    fake.init(ctypes.CDLL(str(injection_library_path())))  # the library NVTX already loaded
    domain_create = fake.fn(5, 12, ctypes.c_void_p, ctypes.c_char_p)
    mark_ex = fake.fn(5, 1, None, ctypes.c_void_p, ctypes.POINTER(EventAttributes))
    abi_domain = domain_create(b"hostile-abi")
    for payload_type in UNKNOWN_PAYLOAD_TYPES:
        attrs = EventAttributes(version=3, size=ctypes.sizeof(EventAttributes), payload_type=payload_type,
                                message_type=1)
        attrs.payload.u64 = 0xFFFFFFFFFFFFFFFF
        attrs.message.ascii = b"unknown.payload"
        mark_ex(abi_domain, ctypes.byref(attrs))
        emitted += 1
    # many threads alive at once, each with its own nesting, all holding two ranges open together
    # until the agent has seen them (stdout "held", then a stdin line)
    threading.stack_size(256 * 1024)
    start = threading.Barrier(threads)
    pushed = threading.Barrier(threads + 1)
    release = threading.Event()

    def worker() -> None:
        start.wait()  # all of them exist before any of them emits
        d.push_range(message="t.outer", payload=1)
        d.push_range(message="t.inner", payload=2.5)
        d.mark(message="t.mark")
        pushed.wait()
        release.wait()
        d.pop_range()
        d.pop_range()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    pushed.wait()
    print("held", flush=True)
    sys.stdin.readline()
    release.set()
    for t in pool:
        t.join()
    emitted += 5 * threads
    left_open = threading.Thread(target=lambda: d.push_range(message="t.open"))
    left_open.start()
    left_open.join()
    emitted += 1
    # pops with nothing open
    for _ in range(unbalanced_pops):
        d.pop_range()
    emitted += unbalanced_pops
    # a unique text per event, which the convention forbids: fills the string region
    for i in range(unique):
        d.mark(message=f"u-{i}", payload=i)
    emitted += unique
    return {"emitted": emitted, "threads": threads, "unique": unique, "unbalanced_pops": unbalanced_pops,
            "huge_texts": 4, "invalid_utf8": len(INVALID_UTF8), "unknown_payloads": len(UNKNOWN_PAYLOAD_TYPES),
            "open_thread_tid": left_open.native_id}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log", required=True)
    parser.add_argument("--threads", type=int, default=1200)
    parser.add_argument("--unique", type=int, default=5000)
    parser.add_argument("--unbalanced-pops", type=int, default=50)
    args = parser.parse_args(argv)
    nvtx.get_domain("hostile").mark(message="hello")  # first NVTX call: the ring exists after it
    print("ready", flush=True)
    sys.stdin.readline()
    result = run(threads=args.threads, unique=args.unique, unbalanced_pops=args.unbalanced_pops)
    with open(args.log, "w") as f:
        json.dump(result, f)
    print("done", flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
