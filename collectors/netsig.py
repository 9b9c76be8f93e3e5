"""Kernel network signals beside request timing: TCP retransmits and resets on the targets' listening
ports (eBPF, probes/netsig) and listen-queue overflows / drops of the targets' network namespaces
(``TcpExt`` in ``/proc/<pid>/net/netstat``).

These fire in softirq and timer context, not in the target's syscalls, so they are attributed by
port: the source finds each target's listening ports (probes/ingress/procnet.py) at attach and
every ``ports_refresh_s``, and the probe counts only events whose socket's local port is one of
them. Listen overflows have no per-socket tracepoint; the kernel counts them per namespace, so they
are reported per namespace (read through ``/proc/<target pid>/net`` so it is the target's).

The source emits one ``NetSignalRecord`` per period (every watched port and namespace, zeros
included, so the metric series exist from the start) and one between periods when retransmit or
reset events arrived (``ports`` and ``netns`` empty then), through the daemon's emit callback.

Helpers for the record's consumers, kept here so the join and its outputs stay thin:
``publish_net_signals`` (Prometheus counters), ``NetSignalWindow`` (the policy's and the live view's
rates over a sliding window), ``NetEventIndex`` (events tied to a request's connection and time, for
span events) and ``span_event_fields``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from moescope import errors
from moescope.collectors.registry import BACKLOG_FILL, Emit, SourceHealth, register_stream
from moescope.probes import bpf
from moescope.probes.ingress import procnet
from moescope.probes.netsig.loader import KIND_NAMES, NetEvent, NetSignalProbe, NetsigOptions
from moescope.procfs import name_thread

log = logging.getLogger(__name__)

register_stream(
    "netsig",
    help="TCP retransmits, resets and listen-queue overflows on the targets' ports "
    "(eBPF tcp/sock tracepoints, /proc/PID/net/netstat); on when the probe loads",
)

DEFAULT_PERIOD_S = 1.0  # counters and netstat; events are drained on every poll
# Listening sockets are opened once at start: a slow refresh is enough. In another network namespace
# than the agent's it is also dear: reading /proc/PID/net/tcp{,6} walks the kernel's whole
# established hash (262144 buckets here) whatever the namespace holds, 2.5-11 ms of CPU for the pair
# on this VM (in the agent's own namespace a sock_diag dump of the listening hash: ~0.03 ms,
# probes/ingress/procnet.py listening_sockets).
DEFAULT_PORTS_REFRESH_S = 30.0
DEFAULT_WINDOW_NS = 10_000_000_000  # the policy's sliding windows (10 s)
NETSTAT_GROUP = "TcpExt"
NETSTAT_FIELDS = ("ListenOverflows", "ListenDrops")
NETSTAT_READ_BYTES = 1 << 16  # the whole file in one read (4 KiB on 6.18)

SignalKind = str  # a loader.KIND_NAMES value


# ---------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class PortSignals:
    """Increase since the previous record, for one watched listening port."""

    port: int
    retransmits: int = 0
    synack_retransmits: int = 0
    resets_sent: int = 0
    resets_received: int = 0
    established: int = 0  # handshakes completed (SYN_RECV -> ESTABLISHED)


@dataclass(frozen=True, slots=True)
class NetnsSignals:
    """Increase since the previous record of one target namespace's listen-queue counters."""

    netns: str  # the namespace's inode number, as `ls -l /proc/PID/ns/net` shows it
    listen_overflows: int = 0  # a full accept queue refused a connection (TcpExt ListenOverflows)
    listen_drops: int = 0  # SYNs/ACKs dropped on a listener, overflows included (TcpExt ListenDrops)


@dataclass(frozen=True, slots=True)
class NetSignalRecord:
    """One netsig reading. Times are CLOCK_MONOTONIC ns, like the ingress probe's."""

    at_ns: int
    ports: tuple[PortSignals, ...] = ()  # every watched port on a periodic record; () between periods
    netns: tuple[NetnsSignals, ...] = ()  # every target namespace on a periodic record; () between
    events: tuple[NetEvent, ...] = ()  # retransmits and resets since the previous record, oldest first

    @property
    def periodic(self) -> bool:
        return bool(self.ports or self.netns)


# ---------------------------------------------------------------- procfs


def parse_netstat(text: str) -> dict[str, dict[str, int]]:
    """``/proc/net/netstat`` (and ``snmp``): pairs of "Group: names" / "Group: values" lines."""
    out: dict[str, dict[str, int]] = {}
    lines = text.splitlines()
    for names_line, values_line in zip(lines[::2], lines[1::2]):
        group, _, names = names_line.partition(":")
        value_group, _, values = values_line.partition(":")
        if group != value_group or not group:
            continue  # a misaligned pair is skipped, never fatal
        parsed: dict[str, int] = {}
        for name, value in zip(names.split(), values.split()):
            try:
                parsed[name] = int(value)
            except ValueError:
                continue
        out[group] = parsed
    return out


def read_listen_counters(pid: int, *, proc_root: Path = Path("/proc")) -> tuple[int, int] | None:
    """(ListenOverflows, ListenDrops) of `pid`'s network namespace; None when unreadable (exited)."""
    try:
        with open(proc_root / str(pid) / "net" / "netstat", "rb", buffering=0) as f:
            data = f.read(NETSTAT_READ_BYTES)
    except OSError:
        return None
    # Only the two TcpExt lines are split: the kernel's ~130 us to generate the file is the cost.
    prefix = f"{NETSTAT_GROUP}:".encode()
    start = data.find(prefix)
    lines = data[start:].split(b"\n", 2) if start >= 0 else []
    if len(lines) < 2 or not lines[1].startswith(prefix):
        return None
    names, values = lines[0].split(), lines[1].split()
    try:
        found = {name: int(values[names.index(name.encode())]) for name in NETSTAT_FIELDS}
    except (ValueError, IndexError):
        return None
    return found["ListenOverflows"], found["ListenDrops"]


def netns_id(pid: int, *, proc_root: Path = Path("/proc")) -> str | None:
    """The inode number of `pid`'s network namespace ("net:[4026531840]" -> "4026531840")."""
    try:
        link = os.readlink(proc_root / str(pid) / "ns" / "net")
    except OSError:
        return None
    inside = link.partition("[")[2].rstrip("]")
    return inside if inside.isdigit() else None


def listening_ports(pid: int, *, proc_root: Path = Path("/proc")) -> frozenset[int]:
    """TCP ports `pid` itself holds a listening socket on (IPv4 and IPv6), from procfs."""
    fds = procnet.socket_fds(pid, proc_root=proc_root)
    if not fds:
        return frozenset()
    return frozenset(s.local_port for s in procnet.listening_sockets(pid, proc_root=proc_root) if s.inode in fds)


# ---------------------------------------------------------------- the source


@dataclass(slots=True)
class _Netns:
    reader_pid: int  # a target in this namespace, whose /proc/PID/net is read
    last: tuple[int, int] | None = None  # the last (overflows, drops) read


class NetSignalSource:
    """Polls the netsig probe and the targets' namespace counters; satisfies collectors.registry.Source.

    Everything runs on the daemon thread inside ``poll`` (a few map reads and one small procfs
    file per namespace per period): nothing blocks and nothing raises into the daemon."""

    name = "netsig"

    def __init__(
        self,
        *,
        emit: Emit,
        probe: NetSignalProbe,
        period_s: float = DEFAULT_PERIOD_S,
        ports_refresh_s: float = DEFAULT_PORTS_REFRESH_S,
        proc_root: Path = Path("/proc"),
    ) -> None:
        if period_s <= 0 or ports_refresh_s <= 0:
            raise errors.UsageError(f"netsig: period and refresh must be positive, got {period_s}, {ports_refresh_s}")
        if not probe.loaded:
            raise errors.ProbeLoadError("netsig: the probe must be loaded before the source is built")
        self._emit = emit
        self._probe = probe
        self.period_ns = int(period_s * 1e9)
        self.ports_refresh_ns = int(ports_refresh_s * 1e9)
        self.proc_root = proc_root
        self._ports_by_target: dict[int, frozenset[int]] = {}
        self._netns_by_target: dict[int, str | None] = {}
        self._netns: dict[str, _Netns] = {}
        self._last_counts: dict[tuple[int, str], int] = {}
        self._pending: dict[tuple[int, str], int] = {}  # counted since the last periodic record
        self._next_sample_ns = 0
        self._next_refresh_ns = 0
        self._counts = dict.fromkeys(("records", "events", "emit_errors", "netstat_unreadable"), 0)
        self._health = SourceHealth()

    # ---- targets ---------------------------------------------------------------------------

    def add_target(self, pid: int) -> frozenset[int]:
        """Watch `pid`'s listening ports and namespace from now on; returns the ports found."""
        ports = listening_ports(pid, proc_root=self.proc_root)
        self._ports_by_target[pid] = ports
        netns = netns_id(pid, proc_root=self.proc_root)
        self._netns_by_target[pid] = netns
        if netns is not None and netns not in self._netns:
            # The baseline: what the namespace counted before the agent came is not reported.
            self._netns[netns] = _Netns(pid, read_listen_counters(pid, proc_root=self.proc_root))
        self._apply_ports()
        return ports

    def remove_target(self, pid: int) -> None:
        self._ports_by_target.pop(pid, None)
        netns = self._netns_by_target.pop(pid, None)
        if netns is not None and netns not in self._netns_by_target.values():
            self._netns.pop(netns, None)
        elif netns is not None and self._netns[netns].reader_pid == pid:
            self._netns[netns].reader_pid = next(p for p, n in self._netns_by_target.items() if n == netns)
        self._apply_ports()

    def targets(self) -> list[int]:
        return sorted(self._ports_by_target)

    def ports(self) -> frozenset[int]:
        return self._probe.ports()

    # ---- Source ----------------------------------------------------------------------------

    def poll(self, now_ns: int) -> int:
        """Drain events every call; counters and namespace counters once per period. Returns the
        number of events drained."""
        if not self._probe.loaded:
            return 0
        started_ns = time.monotonic_ns()
        try:
            if now_ns >= self._next_refresh_ns:
                self._refresh_targets()
                # A target with no listener yet (a command the agent launched) is looked at every period.
                waiting = any(not ports for ports in self._ports_by_target.values())
                self._next_refresh_ns = now_ns + (min(self.period_ns, self.ports_refresh_ns) if waiting
                                                  else self.ports_refresh_ns)
            events = tuple(self._probe.drain_events())
            record: NetSignalRecord | None = None
            if now_ns >= self._next_sample_ns:
                self._next_sample_ns = now_ns + self.period_ns
                record = self._sample(now_ns, events)
            elif events:
                record = NetSignalRecord(at_ns=now_ns, events=events)
        except Exception as exc:  # a map or procfs failure is reported in health, never raised
            self._health = SourceHealth(time.monotonic_ns() - started_ns, False, f"{type(exc).__name__}: {exc}")
            log.debug("netsig: poll failed: %s", exc)
            return 0
        if record is not None:
            self._deliver(record)
        self._health = SourceHealth(time.monotonic_ns() - started_ns, True, None)
        return len(events)

    def stats(self) -> dict[str, int]:
        """records and events emitted, and the probe's losses (named "*dropped*", as the agent's
        moescope_agent_events_dropped_total{source,reason} reads them)."""
        drops = self._probe.drops()
        return dict(self._counts) | {
            "signals_dropped_counts_full": drops["counts_full"],
            "events_dropped_ringbuf_full": drops["ringbuf_full"],
        }

    def health(self) -> SourceHealth:
        return self._health

    def backlogged(self) -> bool:
        """The probe's event ring is past BACKLOG_FILL (the quiet daemon's peek)."""
        return self._probe.loaded and self._probe.ring_fill() >= BACKLOG_FILL

    def close(self) -> None:
        """Emit what was counted since the last record, then unload the probe."""
        if self._probe.loaded:
            self.poll_now()
            self._probe.close()

    def poll_now(self) -> int:
        """A periodic record now, whatever the period (tests and close use it)."""
        self._next_sample_ns = 0
        return self.poll(time.monotonic_ns())

    # ---- internals -------------------------------------------------------------------------

    def _refresh_targets(self) -> None:
        for pid in list(self._ports_by_target):
            self._ports_by_target[pid] = listening_ports(pid, proc_root=self.proc_root)
        self._apply_ports()

    def _apply_ports(self) -> None:
        wanted = frozenset().union(*self._ports_by_target.values()) if self._ports_by_target else frozenset()
        if wanted == self._probe.ports():
            return
        self._collect_counts()  # a port leaving the map loses its counters: take them first
        self._probe.set_ports(wanted)
        for key in [k for k in self._last_counts if k[0] not in wanted]:
            del self._last_counts[key]

    def _collect_counts(self) -> None:
        for key, total in self._probe.read_counts().items():
            last = self._last_counts.get(key, 0)
            delta = total - last if total >= last else total  # below the last: the key was re-created
            self._last_counts[key] = total
            if delta:
                self._pending[key] = self._pending.get(key, 0) + delta

    def _sample(self, now_ns: int, events: tuple[NetEvent, ...]) -> NetSignalRecord:
        self._collect_counts()
        pending, self._pending = self._pending, {}
        ports = tuple(
            PortSignals(
                port=port,
                retransmits=pending.get((port, "retransmit"), 0),
                synack_retransmits=pending.get((port, "synack_retransmit"), 0),
                resets_sent=pending.get((port, "reset_sent"), 0),
                resets_received=pending.get((port, "reset_received"), 0),
                established=pending.get((port, "established"), 0),
            )
            for port in sorted(self._probe.ports() | {p for p, _ in pending})
        )
        netns: list[NetnsSignals] = []
        for ident, state in sorted(self._netns.items()):
            current = read_listen_counters(state.reader_pid, proc_root=self.proc_root)
            if current is None:
                self._counts["netstat_unreadable"] += 1
                continue
            last = state.last or current
            state.last = current
            netns.append(NetnsSignals(ident, max(current[0] - last[0], 0), max(current[1] - last[1], 0)))
        return NetSignalRecord(at_ns=now_ns, ports=ports, netns=tuple(netns), events=events)

    def _deliver(self, record: NetSignalRecord) -> None:
        self._counts["records"] += 1
        self._counts["events"] += len(record.events)
        try:
            self._emit(record)
        except Exception:  # a failing sink must not stop the source; counted and logged
            self._counts["emit_errors"] += 1
            log.exception("netsig: record callback failed")


def open_netsig(
    *, emit: Emit, options: NetsigOptions | None = None, period_s: float = DEFAULT_PERIOD_S,
    proc_root: Path = Path("/proc"), build_dir: Path | None = None,
) -> NetSignalSource:
    """Load the probe and build the source. Must run while the agent still has CAP_BPF and
    CAP_PERFMON (before agent/privileges.py drops them). SourceUnavailable (one line) when the
    probe cannot load or attach: the agent then runs without network signals."""
    probe = NetSignalProbe(options=options)
    try:
        probe.load(build_dir=build_dir)
    except (errors.MoescopeError, OSError) as exc:
        raise errors.SourceUnavailable(f"netsig probe not loaded: {exc}") from exc
    return NetSignalSource(emit=emit, probe=probe, period_s=period_s, proc_root=proc_root)


class PendingNetsig:
    """A source being opened on a thread of its own (`start_netsig`): the compile runs in its child
    process beside the ingress probe's, so attaching costs the longer of the two, not their sum.
    `wait()` joins the thread (the privilege drop needs it gone) and returns the source or raises
    SourceUnavailable; `cancel()` waits and unloads whatever was loaded."""

    def __init__(self, open_source: Callable[[], NetSignalSource]) -> None:
        self._source: NetSignalSource | None = None
        self._error: errors.SourceUnavailable | None = None
        self._thread = threading.Thread(target=self._run, args=(open_source,), name="netsig-load", daemon=True)
        self._thread.start()

    def _run(self, open_source: Callable[[], NetSignalSource]) -> None:
        name_thread("ms-netsig-load")
        try:
            self._source = open_source()
        except errors.SourceUnavailable as exc:
            self._error = exc
        except Exception as exc:  # a bug must still end as "off", never as a hung attach
            self._error = errors.SourceUnavailable(f"netsig probe not loaded: {type(exc).__name__}: {exc}")

    def wait(self, *, timeout_s: float = bpf.CHILD_TIMEOUT_S) -> NetSignalSource:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise errors.SourceUnavailable(f"netsig probe not loaded: still compiling after {timeout_s:.0f} s")
        if self._source is None:
            raise self._error or errors.SourceUnavailable("netsig probe not loaded")
        return self._source

    def cancel(self) -> None:
        try:
            self.wait().close()
        except errors.SourceUnavailable:
            pass


def start_netsig(
    *, emit: Emit, options: NetsigOptions | None = None, period_s: float = DEFAULT_PERIOD_S
) -> PendingNetsig:
    """`open_netsig` started now, finished by `PendingNetsig.wait()`."""
    return PendingNetsig(functools.partial(open_netsig, emit=emit, options=options, period_s=period_s))


# ---------------------------------------------------------------- metrics

PORT_COUNTERS: tuple[tuple[str, str, dict[str, str]], ...] = (
    # (PortSignals field, metric family, fixed labels)
    ("retransmits", "moescope_tcp_retransmits", {}),
    ("synack_retransmits", "moescope_tcp_synack_retransmits", {}),
    ("resets_sent", "moescope_tcp_resets", {"direction": "sent"}),
    ("resets_received", "moescope_tcp_resets", {"direction": "received"}),
    ("established", "moescope_tcp_connections_established", {}),
)
NETNS_COUNTERS: tuple[tuple[str, str], ...] = (
    ("listen_overflows", "moescope_listen_overflows"),
    ("listen_drops", "moescope_listen_drops"),
)


class CounterSink(Protocol):
    """What publish_net_signals needs of moescope.agent.metrics.Metrics (which has it)."""

    def inc(self, name: str, amount: float, **labels: str) -> None: ...


def publish_net_signals(metrics: CounterSink, record: NetSignalRecord) -> None:
    """Advance the network-signal counters by one record's increases (0 increments create the
    series, so a port with no trouble reads 0, not "no data")."""
    for signals in record.ports:
        port = str(signals.port)
        for attribute, name, labels in PORT_COUNTERS:
            metrics.inc(name, float(getattr(signals, attribute)), port=port, **labels)
    for ns in record.netns:
        for attribute, name in NETNS_COUNTERS:
            metrics.inc(name, float(getattr(ns, attribute)), netns=ns.netns)


# ---------------------------------------------------------------- policy and live view


@dataclass(frozen=True, slots=True)
class NetRates:
    """Per second over the window (NaN before the first periodic record), and totals since attach."""

    window_s: float
    listen_overflows_per_s: float
    listen_drops_per_s: float
    retransmits_per_s: float
    resets_per_s: float  # sent + received
    listen_overflows_total: int
    retransmits_total: int
    resets_total: int


@dataclass(slots=True)
class NetSignalWindow:
    """Rates over a sliding window from periodic records: the policy's signals
    (``listen_overflows_per_s``, ...) and the live view's network line read the same numbers."""

    window_ns: int = DEFAULT_WINDOW_NS
    max_entries: int = 4096  # bounded whatever the period
    _entries: deque[tuple[int, int, int, int, int]] = field(default_factory=deque)
    _first_ns: int | None = None
    _totals: list[int] = field(default_factory=lambda: [0, 0, 0])

    def add(self, record: NetSignalRecord) -> None:
        if not record.periodic:
            return
        overflows = sum(n.listen_overflows for n in record.netns)
        drops = sum(n.listen_drops for n in record.netns)
        retransmits = sum(p.retransmits for p in record.ports)
        resets = sum(p.resets_sent + p.resets_received for p in record.ports)
        if self._first_ns is None:
            self._first_ns = record.at_ns
        self._entries.append((record.at_ns, overflows, drops, retransmits, resets))
        if len(self._entries) > self.max_entries:
            self._entries.popleft()
        self._totals[0] += overflows
        self._totals[1] += retransmits
        self._totals[2] += resets

    def rates(self, now_ns: int) -> NetRates:
        while self._entries and self._entries[0][0] <= now_ns - self.window_ns:
            self._entries.popleft()
        window_s = self.window_ns / 1e9

        def rate(index: int) -> float:
            # Over the whole window even while it fills: a rate is never overstated at start.
            if self._first_ns is None:
                return float("nan")
            return sum(entry[index] for entry in self._entries) / window_s

        return NetRates(
            window_s=window_s,
            listen_overflows_per_s=rate(1),
            listen_drops_per_s=rate(2),
            retransmits_per_s=rate(3),
            resets_per_s=rate(4),
            listen_overflows_total=self._totals[0],
            retransmits_total=self._totals[1],
            resets_total=self._totals[2],
        )


# ---------------------------------------------------------------- span events

SPAN_EVENT_NAMES: Mapping[SignalKind, str] = {
    "retransmit": "tcp.retransmit",
    "reset_sent": "tcp.reset.sent",
    "reset_received": "tcp.reset.received",
}
SpanAttribute = str | int


class NetEventIndex:
    """Recent events by connection (peer address, peer port), bounded in count and age, so a
    request span can carry the retransmits and resets of its connection during its interval.

    Ties by the peer, as an ingress record names it: a client's (address, port) is one connection
    to the server at a time. Events after the request's last write (a retransmit of its response
    tail, a reset at close) reach the index after the request was joined and stay in metrics only."""

    def __init__(self, *, max_events: int = 4096, retention_ns: int = 120_000_000_000) -> None:
        self.max_events = max_events
        self.retention_ns = retention_ns
        self._order: deque[NetEvent] = deque()
        self._by_peer: dict[tuple[str | None, int], deque[NetEvent]] = {}
        self.evicted = 0  # pushed out by max_events before their age

    def add(self, events: Iterable[NetEvent]) -> None:
        for event in events:
            self.expire(event.ts_ns)  # age first: only a live event pushed out early is an eviction
            self._order.append(event)
            self._by_peer.setdefault((event.remote_addr, event.remote_port), deque()).append(event)
            if len(self._order) > self.max_events:
                self._forget(self._order.popleft())
                self.evicted += 1

    def expire(self, now_ns: int) -> None:
        while self._order and self._order[0].ts_ns < now_ns - self.retention_ns:
            self._forget(self._order.popleft())

    def for_request(self, *, peer_addr: str | None, peer_port: int, start_ns: int, end_ns: int) -> list[NetEvent]:
        """This connection's events with start_ns <= ts_ns <= end_ns, oldest first."""
        found = self._by_peer.get((peer_addr, peer_port))
        if not found or not peer_port:
            return []
        return [e for e in found if start_ns <= e.ts_ns <= end_ns]

    def __len__(self) -> int:
        return len(self._order)

    def _forget(self, event: NetEvent) -> None:
        key = (event.remote_addr, event.remote_port)
        found = self._by_peer.get(key)
        if found:
            found.popleft()  # per-peer deques are in arrival order, like _order
            if not found:
                del self._by_peer[key]


def span_event_fields(
    event: NetEvent, *, reset_reasons: Callable[[int], str | None] | None = None
) -> tuple[str, dict[str, SpanAttribute]]:
    """(name, attributes) of the span event for one retransmit or reset (its time is ts_ns)."""
    attributes: dict[str, SpanAttribute] = {"network.local.port": event.local_port,
                                           "network.peer.port": event.remote_port}
    if event.local_addr is not None:
        attributes["network.local.address"] = event.local_addr
    if event.remote_addr is not None:
        attributes["network.peer.address"] = event.remote_addr
    if event.kind == "reset_sent" and reset_reasons is not None:
        reason = reset_reasons(event.detail)
        if reason is not None:
            attributes["tcp.reset.reason"] = reason
    return SPAN_EVENT_NAMES.get(event.kind, f"tcp.{event.kind}"), attributes


__all__ = [
    "KIND_NAMES", "NetEventIndex", "NetRates", "NetSignalRecord", "NetSignalSource", "NetSignalWindow",
    "NetnsSignals", "PortSignals", "listening_ports", "netns_id", "open_netsig", "parse_netstat",
    "PendingNetsig", "publish_net_signals", "read_listen_counters", "span_event_fields", "start_netsig",
]
