"""Attach to a serving process and time every request it serves, from the kernel (eBPF syscall
tracepoints; no change to the server).

  agent start --pid PID [--pid PID2 ...]    processes already running
  agent start --port 8000                   the process(es) listening on a TCP port
  agent start -- CMD ARGS...                launch CMD, attached before it runs (it is held
                                            before exec until the probe tracks its pid; its
                                            NVTX is recorded from its first event)

Beside the kernel timing it captures the target's NVTX ranges (when it was started with
`agent nvtx-env`, or launched with -- CMD), samples NVML or host memory, joins everything into one
OpenTelemetry trace per request (OTLP, or OTLP-JSON files: `agent traces list`), serves Prometheus
/metrics, runs the policy engine against the runtime's control socket, and publishes live state
for `agent top` (or shows it with --tui). Each of those fails soft with one line at start.

A target found by --port is followed through restarts: when it exits, the agent waits for a new
process to listen on that port (systemd or Kubernetes restarting the server) and re-attaches to it
by itself — ingress, NVTX, telemetry and policy — saying so on stderr. A --pid target is gone for
good when it exits (use --port to follow a server across restarts).

Request counts, bytes and kernel latency (the summary, /metrics, the live view) come from the
probe's in-kernel aggregate, exact at any rate. Per-request records (traces, --records) are sized
by --ingress-rate-hint and, past --ingress-records-per-s, sampled: unanswered and the slowest
requests kept, then 1 in N (probes/ingress/README.md); what is sampled out is counted apart from
what is lost.

Stops on SIGINT/SIGTERM, after --duration, or when every target has exited and none is awaited
(--pid targets, -- CMD, or --port with --exit-on-target-exit); then prints one summary line
(requests, p50/p99 kernel latency, drops, records, sampled out). Exit status: 0, or 8 when the targets exited
(--pid, or --port with --exit-on-target-exit), or the command's own status (-- CMD).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import signal
import sys
import time
from dataclasses import replace
from types import FrameType
from typing import IO, Any

from moescope import compiled, errors, procfs
from moescope.agent import privileges
from moescope.agent import state as st
from moescope.agent.allocator import Allocator
from moescope.agent.daemon import (
    DEFAULT_IDLE_PERIOD_NS,
    MAX_QUIET_DRAIN_S,
    MIN_QUIET_DRAIN_S,
    QUIET_EVENTS_PER_S,
    STOP_SIGNAL,
    Daemon,
    cpu_parts_line,
)
from moescope.agent.export.config import ExportConfig, add_export_arguments, flags_from_args, resolve_export_config
from moescope.agent.metrics import add_metrics_arguments
from moescope.agent.observe import Observers
from moescope.agent.outputs import DEFAULT_WINDOW_NS
from moescope.agent.outputs.kernel_requests import KernelRequestWindow
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.wiring import add_policy_arguments
from moescope.agent.targets import LaunchedCommand, Target, successors_on_port, target_for_pid, targets_for_port
from moescope.collectors.netsig import NetSignalSource, start_netsig
from moescope.collectors.registry import (
    add_collector_alias,
    add_collector_flags,
    collectors_description,
    enabled_collectors,
    sampled_names,
)
from moescope.probes import bpf
from moescope.probes.ingress import loader
from moescope.probes.ingress.aggregate import RequestTotals
from moescope.probes.ingress.loader import IngressOptions, IngressProbe, IngressRecord

log = logging.getLogger(__name__)

STOP_TARGETS_EXITED = "targets_exited"
# How often a port whose target exited is looked at for a successor: the re-attach bar is 2 s. The
# quiet loop's rounds come this often too while a port waits (TargetFollower.round_cap; they are
# up to 4 s apart otherwise, agent/daemon.py), and a round with nothing to drain is ~1 ms.
PORT_RESCAN_NS = 200_000_000
ALIVE_CHECK_PERIOD_NS = 200_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, action="append", metavar="PID", help="process to observe (repeatable)")
    parser.add_argument(
        "--port", type=int, action="append", metavar="PORT", help="observe the process(es) listening on this TCP port"
    )
    parser.add_argument(
        "--exit-on-target-exit", action="store_true",
        help="with --port: stop (exit 8) when the target exits, instead of waiting for a new process on "
             "the port and re-attaching to it",
    )
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument("--records", metavar="FILE",
                        help="write one JSON line per request record to FILE ('-': stdout); past "
                             "--ingress-records-per-s records are sampled (0: every request)")
    parser.add_argument("--ebpf", action="store_true", help="print the eBPF program and its cflags, then exit")
    ingress = parser.add_argument_group("ingress records (counts and latency are exact whatever these say)")
    ingress.add_argument(
        "--ingress-rate-hint", metavar="N", default=str(loader.DEFAULT_RATE_HINT_PER_S),
        help=f"requests/s the per-request ring is sized for: it holds {loader.RING_HOLD_S:g} s of records "
             f"(default {loader.DEFAULT_RATE_HINT_PER_S}: "
             f"{loader.IngressOptions().ring_pages() * mmap.PAGESIZE >> 20} MiB)",
    )
    ingress.add_argument("--ingress-ring-pages", metavar="N", default="0",
                         help="ring size in pages, a power of two (overrides --ingress-rate-hint)")
    ingress.add_argument(
        "--ingress-records-per-s", metavar="N", default=str(loader.DEFAULT_RECORDS_PER_S),
        help=f"per-request records (spans, --records) handed on per second before sampling (default "
             f"{loader.DEFAULT_RECORDS_PER_S}; 0 = every record): past it unanswered and the slowest 1 %% are "
             "kept, then 1 in N",
    )
    parser.add_argument("--tui", action="store_true", help="show the live view (as `agent top`) in the foreground")
    parser.add_argument("--interval", type=float, default=None, metavar="S",
                        help="live view and state file refresh period (default 0.25 s with --tui, else 1 s: "
                             "`agent top` then refreshes once a second, like top); the state file is written "
                             "at this period while something reads it, every 30 s while nothing does; at light "
                             "load the sources are drained at this period (1 s at most) while something reads, "
                             "every --quiet-drain-s while nothing does")
    parser.add_argument("--quiet-drain-s", type=float, default=None, metavar="S",
                        help=f"longest time between two drains of the sources while they are quiet (under "
                             f"{QUIET_EVENTS_PER_S:,} events/s) and no live view reads (default "
                             f"{DEFAULT_IDLE_PERIOD_NS / 1e9:g} s, {MIN_QUIET_DRAIN_S:g}-{MAX_QUIET_DRAIN_S:g}): "
                             "how stale /metrics, traces and the policy's NVTX windows may be at light load; "
                             "each drain that finds data has a set-up cost (~8 ms at the reference load), so "
                             "shorter costs CPU. A filling ring is drained within 150 ms whatever this is")
    parser.add_argument(
        "--keep-privileges", action="store_true",
        help="do not drop capabilities once the eBPF programs are attached (by default the agent keeps "
             "only CAP_SYS_PTRACE and CAP_DAC_OVERRIDE from then on: docs/security.md)",
    )
    collectors = parser.add_argument_group("collectors", collectors_description())
    add_collector_flags(collectors)
    add_collector_alias(collectors, "--no-nvtx", names=("nvtx",), enabled=False,
                        help="same as --no-collector.nvtx (kernel timing only)")
    sampled = sampled_names()
    add_collector_alias(collectors, "--no-telemetry", names=sampled, enabled=False,
                        help="same as " + " ".join(f"--no-collector.{name}" for name in sampled))
    src = parser.add_argument_group("sources")
    src.add_argument("--nvtx-records", metavar="FILE",
                     help="write every captured NVTX range and mark as one JSON line (any NVTX program)")
    src.add_argument("--num-experts", type=int, metavar="E",
                     help="experts per MoE layer, for producers that do not report it (moe/v0)")
    src.add_argument("--memory-budget-bytes", type=int, metavar="N",
                     help="device memory budget used as the memory signal's total (no GPU, no cgroup limit)")
    src.add_argument("--nvml-library", metavar="PATH", help="libnvidia-ml.so to load (default: the system's)")
    add_export_arguments(parser)
    add_metrics_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument("command", nargs="*", metavar="-- CMD ARGS", help="command to launch and observe")


class RequestSummary:
    """The exit summary line, from the probe's in-kernel totals (exact whatever happened to
    per-request records) and its record counters."""

    @staticmethod
    def line(*, totals: RequestTotals, drops: dict[str, int], records: int, sampled_out: int,
             elapsed_s: float) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value / 1e6:.3f} ms"

        drop_text = " ".join(f"{name}={count}" for name, count in drops.items())
        return (
            f"agent: summary: {totals.requests} requests ({totals.unanswered} unanswered), "
            f"latency p50 {ms(totals.percentile_ns(50))} p99 {ms(totals.percentile_ns(99))}, "
            f"drops {sum(drops.values())} ({drop_text}), records {records}, sampled out {sampled_out}, "
            f"{elapsed_s:.1f} s"
        )


class KernelObservers(Observers):
    """Observers whose live view and policy read request rate and latency from the kernel
    aggregate (the window below) instead of from per-request records, which may be sampled."""

    requests_window: KernelRequestWindow | None = None

    def snapshot(self) -> st.Snapshot:
        snapshot = super().snapshot()
        window = self.requests_window
        # no window: --no-collector.ingress; no kernel-timed requests to show (N/A, not a rate of 0)
        return replace(snapshot, requests=st.Requests() if window is None else window.panel())

    def _own_signals(self, wanted: frozenset[str] | None) -> dict[str, Any]:
        window = self.requests_window
        if window is None or (wanted is not None and "request_p99_ms" not in wanted):
            return {}
        return {"request_p99_ms": window.p99_ms()}


def cpu_by_thread_line(threads: dict[str, float]) -> str:
    """`main 0.62 s, ms-policy 0.25 s, ...`: CPU since start per thread name
    (moescope.procfs.task_cpu_by_name; the agent's threads carry OS names), largest first."""
    named = sorted(threads.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{name} {cpu_s:.2f} s" for name, cpu_s in named)


class JsonLinesSink:
    """Sink writing one JSON object per request; flushed every tick so readers see it promptly."""

    def __init__(self, path: str) -> None:
        self._owned = path != "-"
        try:
            self._file: IO[str] = open(path, "w", encoding="utf-8") if self._owned else sys.stdout
        except OSError as exc:
            raise errors.UsageError(f"cannot write --records {path}: {exc.strerror}") from exc

    def __call__(self, record: Any) -> None:
        if isinstance(record, IngressRecord):
            self._file.write(json.dumps(record.to_json_dict(), separators=(",", ":")) + "\n")

    def flush(self, _now_ns: int = 0) -> None:
        self._file.flush()

    def close(self) -> None:
        self.flush()
        if self._owned:
            self._file.close()


def _whole_number(option: str, text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise errors.UsageError(f"{option} must be a whole number, got {text!r}") from None
    if value < minimum:
        raise errors.UsageError(f"{option} must be >= {minimum}, got {value}")
    return value


def ingress_options(args: argparse.Namespace) -> IngressOptions:
    """The probe's options from the --ingress-* flags; a bad value is a one-line usage error."""
    pages = _whole_number("--ingress-ring-pages", args.ingress_ring_pages, minimum=0)
    if pages & (pages - 1):
        raise errors.UsageError(f"--ingress-ring-pages must be a power of two, got {pages}")
    options = IngressOptions(
        rate_hint_per_s=_whole_number("--ingress-rate-hint", args.ingress_rate_hint, minimum=1),
        ringbuf_pages=pages,
        records_per_s=_whole_number("--ingress-records-per-s", args.ingress_records_per_s, minimum=0),
    )
    options.validate()
    return options


def _validate(args: argparse.Namespace) -> list[str]:
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if args.ebpf:
        return command
    if command and (args.pid or args.port):
        raise errors.UsageError("give either --pid/--port or -- CMD, not both")
    if not command and not args.pid and not args.port:
        raise errors.UsageError("nothing to observe: give --pid PID, --port PORT or -- CMD ARGS")
    if args.interval is None:
        args.interval = 0.25 if args.tui else 1.0
    if not args.interval > 0:
        raise errors.UsageError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.quiet_drain_s is not None and not MIN_QUIET_DRAIN_S <= args.quiet_drain_s <= MAX_QUIET_DRAIN_S:
        raise errors.UsageError(f"--quiet-drain-s must be {MIN_QUIET_DRAIN_S:g} to {MAX_QUIET_DRAIN_S:g} seconds, "
                                f"got {args.quiet_drain_s}")
    if args.num_experts is not None and args.num_experts < 1:
        raise errors.UsageError(f"--num-experts must be >= 1, got {args.num_experts}")
    if args.memory_budget_bytes is not None and args.memory_budget_bytes < 1:
        raise errors.UsageError(f"--memory-budget-bytes must be >= 1, got {args.memory_budget_bytes}")
    if args.duration is not None and not args.duration > 0:
        raise errors.UsageError(f"--duration must be a positive number of seconds, got {args.duration}")
    if args.records and not kernel_timing(args):
        raise errors.UsageError("--records writes the kernel-timed requests: it needs the ingress collector "
                                "(drop --no-collector.ingress)")
    seen: set[int] = set()
    for pid in args.pid or []:
        if pid == os.getpid():
            raise errors.UsageError(f"--pid {pid} is the agent itself; the agent never traces its own process")
        if pid in seen:  # (its NVTX ring was reported "drained by another agent": this one's other half)
            raise errors.UsageError(f"--pid {pid} is given twice")
        seen.add(pid)
    return command


NO_KERNEL_TIMING_HINT = "or run with --no-collector.ingress for NVTX, telemetry and policy without kernel timing"


def kernel_timing(args: argparse.Namespace) -> bool:
    """Whether the ingress probe runs (--no-collector.ingress: NVTX, telemetry and policy alone)."""
    return "ingress" in enabled_collectors(args)


def _drop_counts(daemon: Daemon, probe: IngressProbe) -> dict[str, int]:
    stats = probe.stats()
    counts = {name: stats[name] for name in loader.DROP_NAMES.values()}
    counts["sink_errors"] = daemon.sink_errors + stats["callback_errors"]
    return counts


def exited_line(exited: list[str], *, most: int = 8) -> str:
    """`2 exited while observed: pid 7 (python), pid 9 (python)`, at most `most` named."""
    named = ", ".join(exited[:most]) + (f", +{len(exited) - most} more" if len(exited) > most else "")
    return f"{len(exited)} exited while observed: {named}"


class TargetFollower:
    """Tick hook: notices targets that exited and, for --port targets, re-attaches to the next process
    listening on the port. Returns STOP_TARGETS_EXITED once nothing is traced and nothing awaited."""

    def __init__(self, probe: IngressProbe | None, observers: Observers, *, targets: list[Target],
                 follow_ports: bool, netsig: NetSignalSource | None = None) -> None:
        self.probe = probe
        self.netsig = netsig
        self.observers = observers
        self.live = list(targets)
        self.follow_ports = follow_ports
        self.waiting: dict[int, int] = {}  # port -> monotonic ns its last target was seen gone
        self.reattached = 0
        self.exited: list[str] = []  # the targets that exited while observed, described, in order
        self._last_scan_ns = 0
        self._last_alive_check_ns = 0
        observers.add_round_cap(self.round_cap)

    def round_cap(self) -> int | None:
        """The quiet loop's longest period while a port waits for a successor: its rescan period."""
        return PORT_RESCAN_NS if self.waiting else None

    def tick(self, now_ns: int) -> str | None:
        # Liveness is read from /proc at ALIVE_CHECK_PERIOD_NS, not every daemon tick (it was a
        # tenth of an idle agent's CPU); a restarted server is still re-attached well within 2 s.
        if now_ns - self._last_alive_check_ns >= ALIVE_CHECK_PERIOD_NS:
            self._last_alive_check_ns = now_ns
            self._reap(now_ns)
        if self.waiting and now_ns - self._last_scan_ns >= PORT_RESCAN_NS:
            self._last_scan_ns = now_ns
            self._reattach(now_ns)
        return None if self.live or self.waiting else STOP_TARGETS_EXITED

    def _reap(self, now_ns: int) -> None:
        for target in [t for t in self.live if not t.alive()]:
            self.live.remove(target)
            self.exited.append(target.describe())
            if self.probe is not None:
                self.probe.remove_target(target.pid)  # drains and flushes its last requests first
            if self.netsig is not None:
                self.netsig.remove_target(target.pid)
            try:
                self.observers.detach(target.pid)
            except Exception:  # a tick hook that raises would end the agent: say it, go on
                log.exception("detaching from %s failed", target.describe())
            # Only a port left with no live target is watched: watching a served port would mean a
            # scan of every process's fds each period.
            if target.port is not None and self.follow_ports and not any(t.port == target.port for t in self.live):
                self.waiting.setdefault(target.port, now_ns)
                print(f"agent: target {target.describe()} exited; waiting for a process listening on port "
                      f"{target.port} to re-attach (--exit-on-target-exit to stop instead)",
                      file=sys.stderr, flush=True)
                self.observers.pace_rounds()  # the next round comes at the rescan period, not seconds later
            else:
                print(f"agent: target {target.describe()} exited", file=sys.stderr, flush=True)

    def _reattach(self, now_ns: int) -> None:
        for port, gone_ns in list(self.waiting.items()):
            known = {t.pid for t in self.live}
            for target in successors_on_port(port, known_pids=known):
                try:
                    seeded = self.probe.add_target(target.pid) if self.probe is not None else 0
                except errors.MoescopeError as exc:  # e.g. the target limit: say it, keep waiting
                    print(f"agent: cannot re-attach to {target.describe()}: {exc}", file=sys.stderr, flush=True)
                    continue
                if self.netsig is not None:
                    self.netsig.add_target(target.pid)
                self.live.append(target)
                self.reattached += 1
                self.waiting.pop(port, None)
                seeded_text = f"; {seeded} open connections seeded" if self.probe is not None else ""
                print(f"agent: re-attached to {target.describe()} listening on port {port}, "
                      f"{(now_ns - gone_ns) / 1e9:.1f} s after the previous target exited{seeded_text}",
                      file=sys.stderr, flush=True)
                try:
                    lines = self.observers.reattach(target.pid)
                except Exception:  # e.g. it exited already: the next tick reaps it; never end the agent
                    log.exception("re-attaching NVTX/telemetry/policy to %s failed", target.describe())
                    continue
                for line in lines:
                    print(f"agent: {line}", file=sys.stderr, flush=True)


def _use_kernel_totals(observers: KernelObservers, probe: IngressProbe, daemon: Daemon) -> None:
    """Request counts, bytes and latency (/metrics, the live view, the policy's request p99) from the
    probe's in-kernel aggregate: exact whatever happens to per-request records."""
    if observers.pipeline.metrics_output is not None:
        observers.pipeline.metrics_output.use_kernel_totals(probe.totals)
    metrics = observers.metrics
    metrics.add_refresh_hook(lambda: metrics.set_counter_total(
        "moescope_agent_events_sampled_out", float(probe.stats()["sampled_out"]), source=probe.name))
    window = KernelRequestWindow(probe.totals, window_ns=DEFAULT_WINDOW_NS)
    observers.requests_window = window
    daemon.add_tick_hook(window.tick, name="kernel-requests")


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment for a command the agent launches: the NVTX injection variables."""
    if "nvtx" not in enabled_collectors(args):
        return {}
    from moescope.collectors.nvtx import injection_env

    return injection_env()


def child_pid_env(args: argparse.Namespace) -> tuple[str, ...]:
    """Variables set to the launched command's own pid: the NVTX library arms that process's ring,
    so that it records from its first event rather than from the round that finds the ring."""
    if "nvtx" not in enabled_collectors(args):
        return ()
    from moescope.collectors.nvtx import ARMED_ENV

    return (ARMED_ENV,)


def privileges_to_keep(args: argparse.Namespace) -> tuple[str, ...]:
    keep: tuple[str, ...] = privileges.KEEP_AFTER_ATTACH
    if args.metrics_port and 0 < args.metrics_port < 1024:  # bound after the drop
        keep += ("CAP_NET_BIND_SERVICE",)
    return keep


def run(args: argparse.Namespace) -> int:
    command = _validate(args)
    export_config = resolve_export_config(flags_from_args(args))  # a bad flag fails before anything loads
    if args.policy is not None and not args.no_policy:
        # ... and a bad policy file: the engine is built only once the runtime's control socket is
        # found (seconds later for a launched runtime, never for one without it), which left the
        # agent running, exit 0, with only a warning that its policy was off
        load_policy(args.policy)
    options = ingress_options(args)
    if args.ebpf:
        sys.stdout.write(loader.ebpf_listing(options))
        return errors.EXIT_OK
    # Root first, before anything touches eBPF or other processes' /proc entries.
    if os.geteuid() != 0:
        raise errors.NotPermitted("agent start needs root (eBPF, other processes' memory maps): run it with sudo")
    if kernel_timing(args):
        try:
            bpf.check_kernel_headers(bpf.kernel_build_dir())
        except errors.ProbeLoadError as exc:
            raise errors.ProbeLoadError(f"{exc}; {NO_KERNEL_TIMING_HINT}") from exc

    targets: list[Target] = []
    for pid in args.pid or []:
        targets.append(target_for_pid(pid))
    for port in args.port or []:
        targets.extend(t for t in targets_for_port(port) if t.pid not in {x.pid for x in targets})

    records_sink = JsonLinesSink(args.records) if args.records else None
    summary = RequestSummary()
    # A quiet loop's rounds come at most --quiet-drain-s apart (DEFAULT_IDLE_PERIOD_NS), and at most
    # a live interval apart while a live view reads (1 s; 250 ms with --tui): Observers paces it
    # (agent/daemon.py).
    quiet_ns = DEFAULT_IDLE_PERIOD_NS if args.quiet_drain_s is None else int(args.quiet_drain_s * 1e9)
    daemon = Daemon(idle_period_ns=quiet_ns)
    if records_sink is not None:
        daemon.add_sink(records_sink)
        daemon.add_tick_hook(lambda now_ns: records_sink.flush(now_ns), name="records-file")

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        daemon.stop(STOP_SIGNAL)

    # Installed before attaching: a signal at any point from here on ends in the summary.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _observe(daemon, summary, records_sink, args=args, targets=targets, command=command, options=options,
                        export_config=export_config)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _observe(
    daemon: Daemon,
    summary: RequestSummary,
    records_sink: JsonLinesSink | None,
    *,
    args: argparse.Namespace,
    targets: list[Target],
    command: list[str],
    options: IngressOptions,
    export_config: ExportConfig,
) -> int:
    started_ns = time.monotonic_ns()
    allocator = Allocator()
    allocator.configure()  # before netsig's loader thread, the first thread: see agent/allocator.py
    daemon.add_tick_hook(allocator.trim, name="allocator")
    # --no-collector.ingress: no probe (and no network signals, eBPF too); steps become their own traces
    probe = IngressProbe(on_record=daemon.emit, options=options) if kernel_timing(args) else None
    launched: LaunchedCommand | None = None
    observers: Observers | None = None
    netsig: NetSignalSource | None = None
    # Loads eBPF, so before the privilege drop below; compiles beside the ingress probe.
    wants_netsig = probe is not None and "netsig" in enabled_collectors(args)
    pending_netsig = start_netsig(emit=daemon.emit) if wants_netsig else None
    try:
        if probe is not None:
            try:
                probe.load()
            except (errors.BccMissing, errors.ProbeLoadError) as exc:
                raise type(exc)(f"{exc}; {NO_KERNEL_TIMING_HINT}") from exc
        if command:
            launched = LaunchedCommand(command, extra_env=child_env(args), pid_env=child_pid_env(args))
            targets.append(launched.target)
        seeded = sum(probe.add_target(t.pid) for t in targets) if probe is not None else 0
        if pending_netsig is not None:
            try:
                netsig = pending_netsig.wait()  # joined here: no thread may outlive the privilege drop
            except errors.SourceUnavailable as exc:  # the agent runs on without network signals
                print(f"agent: network signals off: {exc}", file=sys.stderr, flush=True)
            else:
                for t in targets:
                    netsig.add_target(t.pid)
        attach_s = (time.monotonic_ns() - started_ns) / 1e9
        names = ", ".join(t.describe() for t in targets)
        if probe is not None:
            print(f"agent: tracing {names}; {seeded} open connections seeded; attached in {attach_s:.2f} s",
                  file=sys.stderr, flush=True)
        else:
            print(f"agent: observing {names} without kernel timing (--no-collector.ingress: no request spans, "
                  f"steps traced on their own); attached in {attach_s:.2f} s", file=sys.stderr, flush=True)
        # on: mypyc's build of the per-step / per-request modules; off says why (moescope/compiled.py)
        print(f"agent: compiled hot path {compiled.status()}", file=sys.stderr, flush=True)
        # Before any thread exists (Observers.build starts the exporters): see agent/privileges.py.
        if not args.keep_privileges:
            print(f"agent: {privileges.drop_to(privileges_to_keep(args))}", file=sys.stderr, flush=True)
        observers = KernelObservers.build(args, daemon=daemon, config=export_config)
        assert isinstance(observers, KernelObservers)  # build() is typed as returning the base class
        if probe is not None:
            _use_kernel_totals(observers, probe, daemon)
        observers.attach([t.pid for t in targets],
                         probe_names=(["ingress"] if probe else []) + (["netsig"] if netsig else []))
        observers.serve_metrics()  # a port that cannot be bound ends the agent before the command runs
        if launched is not None:
            launched.release()
        for line in observers.describe():
            print(f"agent: {line}", file=sys.stderr)
        allocator.settle()  # start-up's objects frozen out of GC, its freed memory back to the kernel
    except BaseException:
        if launched is not None:
            launched.stop()
        if probe is not None:
            probe.close()
        if netsig is not None:
            netsig.close()
        elif pending_netsig is not None:
            pending_netsig.cancel()
        if observers is not None:
            observers.close()
        if records_sink is not None:
            records_sink.close()
        raise
    if probe is not None:
        daemon.add_source(probe)
    if netsig is not None:
        daemon.add_source(netsig)  # daemon.close() closes it (its last counts are emitted first)

    follower = TargetFollower(probe, observers, targets=targets, follow_ports=not args.exit_on_target_exit,
                              netsig=netsig)
    daemon.add_tick_hook(follower.tick, name="targets")
    duration_ns = None if args.duration is None else int(args.duration * 1e9)
    observers.start()
    try:
        if args.tui:
            reason = observers.run_with_tui(daemon, duration_ns=duration_ns, interval_s=args.interval)
        else:
            reason = daemon.run(duration_ns=duration_ns)
        observed_s = (time.monotonic_ns() - started_ns) / 1e9
        by_thread = cpu_by_thread_line(procfs.task_cpu_by_name(os.getpid()))
    finally:
        daemon.close()
        observers.close()
        if records_sink is not None:
            records_sink.close()
        if launched is not None:
            launched.stop()  # the agent launched it, so it does not outlive the agent
    if probe is not None:
        stats = probe.stats()
        print(summary.line(totals=probe.totals(), drops=_drop_counts(daemon, probe), records=stats["records"],
                           sampled_out=stats["sampled_out"], elapsed_s=observed_s), flush=True)
    else:
        print(f"agent: summary: kernel timing off (--no-collector.ingress), sink errors {daemon.sink_errors}, "
              f"{observed_s:.1f} s", flush=True)
    for line in observers.summary_lines():
        print(f"agent: {line}", flush=True)
    print(f"agent: main loop: {daemon.rounds_line()}", flush=True)
    if daemon.cpu_ns:
        print(f"agent: main loop CPU: {daemon.cpu_line() or 'under 5 ms per part'}", flush=True)
    policy_cpu = observers.policy_cpu_ns()
    if any(policy_cpu.values()):
        print(f"agent: policy thread CPU: {cpu_parts_line(policy_cpu) or 'under 5 ms per part'}", flush=True)
    if by_thread:
        print(f"agent: CPU by thread: {by_thread}", flush=True)
    if follower.reattached or follower.waiting:
        waiting = ", ".join(str(port) for port in sorted(follower.waiting)) or "none"
        print(f"agent: targets: re-attached {follower.reattached} times; still waiting on ports: {waiting}", flush=True)
    if follower.exited and reason != STOP_TARGETS_EXITED:
        # one rank of eight gone mid-run: said at exit too, not only in the line at the moment it went
        print(f"agent: targets: {exited_line(follower.exited)}", flush=True)

    if reason == STOP_TARGETS_EXITED:
        if launched is not None:
            return launched.exit_status()
        raise errors.TargetExited("every target exited: " + ", ".join(t.describe() for t in targets))
    return errors.EXIT_OK
