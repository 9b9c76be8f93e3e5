"""Added cost per HTTP request of the ingress probe (bar: <= 400 ns per request).

A C keep-alive responder (the target) serves a C client doing N requests on one connection.
A runs: no probe. B runs: the probe loaded, the responder its target, the agent's daemon draining
records every 50 ms. Runs alternate A/B (order swapped every pair), medians compared.

The responder and the client are pinned to one CPU, so each request is a direct switch between
them on that CPU (no cross-CPU wake-ups, whose latency swings wildly in a VM) and the wall time
per request is exactly the CPU work of both sides, the probe's in-kernel work included. The agent
(this process) is pinned to the other CPUs, as it would run beside a server in production.
Also reported: the responder's own CPU per request and the agent's CPU per record drained.

    sudo .venv/bin/python -m benchmarks.ingress_overhead [--pairs 7] [--requests 100000]
        [--drain live|deferred]   deferred: B measures the in-kernel probe alone
        [--probe ingress|empty]   empty: B measures the bare syscall-tracepoint cost (the floor)
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import Metrics, alternate_ab, build_c, write_result
from moescope.agent.daemon import Daemon
from moescope.probes.bpf import load_program
from moescope.probes.ingress.loader import DROP_NAMES, IngressOptions, IngressProbe, program_text

BAR_NS_PER_REQUEST = 400
SOURCE = Path(__file__).resolve().parent / "ingress_keepalive.c"
PRIMARY = "wall_ns_per_request"


def task_cpu_ns(pid: int) -> int:
    """CPU time of a (single-threaded) process in ns, from the scheduler's own accounting."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def pinned(cpu: int | None) -> Callable[[], None] | None:
    """preexec_fn pinning a child to `cpu` (None: no pinning)."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


class Responder:
    """The C keep-alive server, running for the whole benchmark."""

    def __init__(self, binary: Path, *, cpu: int | None) -> None:
        self.popen = subprocess.Popen(
            [str(binary), "server"], stdout=subprocess.PIPE, text=True, preexec_fn=pinned(cpu)
        )
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"responder did not start: {line!r}")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        self.popen.kill()
        self.popen.wait()


def client_run(
    binary: Path, *, server_pid: int, port: int, requests: int, cpu: int | None, during: Daemon | None = None
) -> Metrics:
    """One client run. With `during`, the daemon ticks (drains) until the client exits."""
    server_before = task_cpu_ns(server_pid)
    client = subprocess.Popen(
        [str(binary), "client", str(port), str(requests)], stdout=subprocess.PIPE, text=True, preexec_fn=pinned(cpu)
    )
    if during is not None:
        during.tick_hooks[:] = [lambda _now: "client done" if client.poll() is not None else None]
        during.run()
    out, _ = client.communicate(timeout=600)
    if client.returncode != 0:
        raise RuntimeError(f"client failed with status {client.returncode}")
    server_ns = task_cpu_ns(server_pid) - server_before
    wall_ns, client_ns = (int(v) for v in out.split())
    return {
        PRIMARY: wall_ns / requests,
        "cpu_ns_per_request": (client_ns + server_ns) / requests,
        "server_cpu_ns_per_request": server_ns / requests,
    }


def empty_program_text() -> str:
    """Programs that return at once, on exactly the tracepoints the ingress probe uses."""
    names = re.findall(r"TRACEPOINT_PROBE\(syscalls, (sys_\w+)\)", program_text())
    return "\n".join(f"TRACEPOINT_PROBE(syscalls, {name}) {{ return 0; }}" for name in names)


def own_cpu_ns() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return int((usage.ru_utime + usage.ru_stime) * 1e9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=7, help="A/B pairs (>= 5 for a result)")
    parser.add_argument("--requests", type=int, default=100_000, help="requests per run")
    parser.add_argument(
        "--probe", choices=["ingress", "empty"], default="ingress",
        help="empty: B attaches programs that return at once to the same tracepoints, measuring "
        "the kernel's syscall-tracepoint cost that no program can go below",
    )
    parser.add_argument(
        "--drain", choices=["live", "deferred"], default="live",
        help="live: the daemon drains every 50 ms during the run (as deployed); deferred: drain after "
        "the run, so B measures the in-kernel probe alone (the ring is sized to hold every record)",
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("ingress_overhead: needs root (loads eBPF)", file=sys.stderr)
        return 3

    binary = build_c(SOURCE, name="ingress_keepalive")
    cpus = sorted(os.sched_getaffinity(0))
    bench_cpu = cpus[0] if len(cpus) > 1 else None
    if bench_cpu is not None:
        os.sched_setaffinity(0, set(cpus[1:]))  # the agent: off the benchmark's CPU
    responder = Responder(binary, cpu=bench_cpu)
    drops_total: dict[str, int] = {name: 0 for name in DROP_NAMES.values()}
    records_per_run: list[int] = []

    def probe_off() -> Metrics:
        return client_run(
            binary, server_pid=responder.popen.pid, port=responder.port, requests=args.requests, cpu=bench_cpu
        )

    def empty_on() -> Metrics:
        empty = load_program(text=empty_program_text(), flags=[])
        try:
            empty.attach()
            return client_run(
                binary, server_pid=responder.popen.pid, port=responder.port, requests=args.requests, cpu=bench_cpu
            )
        finally:
            empty.close()

    def probe_on() -> Metrics:
        count = [0]
        daemon = Daemon()
        daemon.add_sink(lambda _record: count.__setitem__(0, count[0] + 1))
        options = IngressOptions()
        if args.drain == "deferred":
            needed_pages = args.requests * 96 // mmap.PAGESIZE + 1
            options = IngressOptions(ringbuf_pages=max(options.ringbuf_pages, 1 << needed_pages.bit_length()))
        probe = IngressProbe(on_record=daemon.emit, options=options)
        probe.load()
        try:
            probe.add_target(responder.popen.pid)
            daemon.add_source(probe)
            agent_before = own_cpu_ns()
            metrics = client_run(
                binary, server_pid=responder.popen.pid, port=responder.port, requests=args.requests,
                cpu=bench_cpu, during=daemon if args.drain == "live" else None,
            )
            deadline = time.monotonic() + 10
            while count[0] < args.requests and time.monotonic() < deadline:
                probe.poll(time.monotonic_ns())  # the last request ends at the responder's next read
                time.sleep(0.01)
            metrics["agent_cpu_ns_per_record"] = (own_cpu_ns() - agent_before) / max(1, count[0])
        finally:
            probe.close()
        stats = probe.stats()
        for name in drops_total:
            drops_total[name] += stats[name]
        records_per_run.append(count[0])
        return metrics

    try:
        probe_off()  # warm-up: page cache, CPU frequency, socket buffers
        result = alternate_ab(
            run_a=probe_off, run_b=probe_on if args.probe == "ingress" else empty_on, pairs=args.pairs,
            progress=lambda line: print(f"ingress_overhead: {line}", flush=True),
        )
    finally:
        responder.stop()

    added_ns = result.delta(PRIMARY)
    complete = all(n == args.requests for n in records_per_run) and not any(drops_total.values())
    complete = complete and (args.probe == "empty" or len(records_per_run) == args.pairs)
    ok = added_ns <= BAR_NS_PER_REQUEST and complete
    agent_runs = [run["agent_cpu_ns_per_record"] for run in result.b if "agent_cpu_ns_per_record" in run]
    agent_ns = statistics.median(agent_runs) if agent_runs else 0.0
    name = "ingress_overhead_empty" if args.probe == "empty" else f"ingress_overhead_{args.drain}"
    path = write_result(
        name,
        {
            "probe": args.probe,
            "drain": args.drain,
            "added_ns_per_request_of_minimums": result.minimum("b", PRIMARY) - result.minimum("a", PRIMARY),
            "added_server_ns_per_request_of_minimums": result.minimum("b", "server_cpu_ns_per_request")
            - result.minimum("a", "server_cpu_ns_per_request"),
            "command": "python -m benchmarks.ingress_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
            "metric": PRIMARY,
            "requests_per_run": args.requests,
            "pairs": args.pairs,
            "ab": result.to_dict(),
            "added_ns_per_request": added_ns,
            "ratio": result.ratio(PRIMARY),
            "added_cpu_ns_per_request": result.delta("cpu_ns_per_request"),
            "pinned_cpu": bench_cpu,
            "added_server_cpu_ns_per_request": result.delta("server_cpu_ns_per_request"),
            "agent_cpu_ns_per_record": agent_ns,
            "bar_ns_per_request": BAR_NS_PER_REQUEST,
            "records_per_on_run": records_per_run,
            "drops": drops_total,
            "pass": ok,
        },
    )
    server_min_ns = result.minimum("b", "server_cpu_ns_per_request") - result.minimum("a", "server_cpu_ns_per_request")
    print(
        f"ingress_overhead ({args.probe}, {args.drain} drain): ns per request (client+server on one CPU) "
        f"off {result.median('a', PRIMARY):.0f}, "
        f"on {result.median('b', PRIMARY):.0f} (medians of {args.pairs} pairs): added {added_ns:+.0f} ns/request "
        f"(bar {BAR_NS_PER_REQUEST}), ratio {result.ratio(PRIMARY):.3f}; server alone "
        f"{result.delta('server_cpu_ns_per_request'):+.0f} ns; of minimums: added "
        f"{result.minimum('b', PRIMARY) - result.minimum('a', PRIMARY):+.0f} ns, server "
        f"{server_min_ns:+.0f} ns; "
        f"agent {agent_ns:.0f} CPU ns/record; "
        f"records per on-run {sorted(set(records_per_run))}, drops {sum(drops_total.values())} -> {path}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
