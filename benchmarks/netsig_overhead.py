"""Cost of the netsig probe and source (probes/netsig, collectors/netsig.py).

Kernel side: the kernel's own per-program accounting (sysctl kernel.bpf_stats_enabled=1 for the
run, restored after): run_time_ns / run_cnt per tracepoint program, while this script opens and
closes loopback connections to a watched port and to an unwatched one (inet_sock_set_state fires
on every state change of every TCP socket on the machine), and resets connections on the watched
port (the counted path plus an event in the ring). A keep-alive request fires none of these
tracepoints: its added cost is 0.

Agent side: CPU (thread time) of NetSignalSource.poll on the daemon thread, per idle poll (ring
drain only) and per periodic poll (counters + the namespace's netstat), median of --runs rounds.

    sudo .venv/bin/python -m benchmarks.netsig_overhead [--connections 20000] [--runs 5]

Output: bench-results/netsig_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

from benchmarks.common import bpf_stats_enabled
from moescope.collectors.netsig import NetSignalSource
from moescope.probes.netsig.loader import NetSignalProbe

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench-results" / "netsig_overhead.json"


def _connections(listener: socket.socket, count: int, *, reset: bool = False) -> None:
    address = listener.getsockname()
    for _ in range(count):
        client = socket.create_connection(address)
        server, _ = listener.accept()
        if reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        server.close()


def _per_call_ns(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, (run_ns, runs) in after.items():
        d_ns, d_runs = run_ns - before[name][0], runs - before[name][1]
        out[name] = {"runs": d_runs, "ns_per_run": d_ns / d_runs if d_runs else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netsig_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=20000)
    parser.add_argument("--resets", type=int, default=2000)
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("netsig_overhead: needs root (eBPF)", file=sys.stderr)
        return 2
    probe = NetSignalProbe()
    probe.load()
    watched = socket.socket()
    watched.bind(("127.0.0.1", 0))
    watched.listen(128)
    # The target is this process with one listener; no refresh during the run, so the second
    # listener (opened after) stays unwatched.
    source = NetSignalSource(emit=lambda _record: None, probe=probe, ports_refresh_s=1e9)
    source.add_target(os.getpid())
    unwatched = socket.socket()
    unwatched.bind(("127.0.0.1", 0))
    unwatched.listen(128)
    phases: dict[str, dict[str, object]] = {}
    idle: list[float] = []
    periodic: list[float] = []
    try:
        with bpf_stats_enabled() as on:
            if not on:
                raise OSError("cannot set kernel.bpf_stats_enabled (the kernel's per-program run times)")
            for phase, listener, count, reset in (
                ("connections_watched_port", watched, args.connections, False),
                ("connections_unwatched_port", unwatched, args.connections, False),
                ("resets_watched_port", watched, args.resets, True),
            ):
                before = probe.run_stats()
                started = time.perf_counter()
                _connections(listener, count, reset=reset)
                elapsed_s = time.perf_counter() - started
                stats = _per_call_ns(before, probe.run_stats())
                kernel_ns = sum(s["runs"] * s["ns_per_run"] for s in stats.values())
                phases[phase] = {"connections": count, "programs": stats,
                                 "probe_ns_per_connection": kernel_ns / count,
                                 "workload_us_per_connection": elapsed_s / count * 1e6}
        source.poll_now()  # drain what the phases left in the ring
        for _ in range(args.runs):
            t0 = time.thread_time_ns()
            for _ in range(args.polls):
                source.poll(0)  # not due: the ring drain only
            idle.append((time.thread_time_ns() - t0) / args.polls)
            t0 = time.thread_time_ns()
            for _ in range(args.polls // 10):
                source.poll_now()
            periodic.append((time.thread_time_ns() - t0) / (args.polls // 10))
        counts = {f"{port}/{kind}": n for (port, kind), n in sorted(probe.read_counts().items())}
    finally:
        probe.close()
    result = {
        "kernel": phases,
        "keepalive_request_added_ns": 0,
        "source_poll_idle_us_median": statistics.median(idle) / 1e3,
        "source_poll_periodic_us_median": statistics.median(periodic) / 1e3,
        "runs": args.runs,
        "counts": counts,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for phase, data in phases.items():
        print(f"{phase}: probe {data['probe_ns_per_connection']:.0f} ns per connection "
              f"(workload {data['workload_us_per_connection']:.1f} us per connection)")
    print(f"source poll: idle {result['source_poll_idle_us_median']:.2f} us, "
          f"periodic {result['source_poll_periodic_us_median']:.1f} us (median of {args.runs})")
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
