"""Listening TCP sockets: the sock_diag dump against /proc/net/tcp{,6}, CPU per read.

The agent reads the listening sockets of a namespace when `agent start --port` looks for the server,
every 200 ms while a --port target waits for its restarted successor (agent/start.py
PORT_RESCAN_NS), and every 30 s per netsig target (every 1 s while a target has no listener yet).
Reading /proc/<pid>/net/tcp{,6} walks the kernel's whole established hash whatever the namespace
holds; a sock_diag dump asking for the LISTEN state walks the listening hash only
(probes/ingress/procnet.py). A: the /proc read; B: the dump (``procnet.listening_sockets`` as the
agent calls it). Runs alternate A and B (order swapped every pair); each run is --reads reads timed
by this thread's CPU clock; medians and their ratio are printed and written to
bench-results/listening_scan.json (its bar: B/A < 1). Both reads must give the same sockets, or the run fails.

    .venv/bin/python -m benchmarks.listening_scan [--pairs 7] [--reads 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.common import ABResult, write_result
from moescope.probes.ingress import procnet


def read_proc() -> list[procnet.TcpSocket]:
    return procnet.proc_listening_sockets(net_dir=Path("/proc/self/net"))


def read_dump() -> list[procnet.TcpSocket]:
    return procnet.listening_sockets(os.getpid())


def one_run(read: object, reads: int) -> dict[str, float]:
    assert callable(read)
    t0 = time.thread_time_ns()
    for _ in range(reads):
        read()
    return {"cpu_us_per_read": (time.thread_time_ns() - t0) / 1e3 / reads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7, help="A/B pairs (default 7)")
    parser.add_argument("--reads", type=int, default=50, help="reads per run (default 50)")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.reads < 1:
        print("listening_scan: --pairs and --reads must be at least 1", file=sys.stderr)
        return 2
    proc, dump = read_proc(), read_dump()
    if proc != dump:
        print(f"listening_scan: the dump and /proc disagree: {len(dump)} against {len(proc)} sockets",
              file=sys.stderr)
        return 1
    if procnet._diag_failures:
        print("listening_scan: sock_diag is refused here: both arms would read /proc", file=sys.stderr)
        return 1
    result = ABResult()
    for pair in range(args.pairs):
        order = (("a", read_proc), ("b", read_dump)) if pair % 2 == 0 else (("b", read_dump), ("a", read_proc))
        for side, read in order:
            getattr(result, side).append(one_run(read, args.reads))
    a, b = result.median("a", "cpu_us_per_read"), result.median("b", "cpu_us_per_read")
    ratio = result.ratio("cpu_us_per_read")
    print(f"listening_scan: {len(proc)} listening sockets; CPU per read, medians of {args.pairs} runs x "
          f"{args.reads} reads: /proc {a:.1f} us, sock_diag {b:.1f} us (B/A {ratio:.4f})")
    path = write_result("listening_scan", {
        "command": " ".join(["python -m benchmarks.listening_scan", *(argv if argv is not None else sys.argv[1:])]),
        "what": "CPU per read of the listening TCP sockets: A /proc/self/net/tcp{,6}, B sock_diag dump",
        "pairs": args.pairs, "reads": args.reads, "listening_sockets": len(proc),
        "proc_us_per_read": a, "sock_diag_us_per_read": b, "ratio_b_over_a": ratio,
        "bar": "the dump costs less CPU than the /proc read (B/A < 1)", "bar_met": ratio < 1.0,
        "runs": result.to_dict(),
    })
    print(f"listening_scan: -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
