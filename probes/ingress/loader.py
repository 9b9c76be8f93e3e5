"""Load the ingress probe (ingress.bpf.c; compiled by bcc in a child process), manage its targets, drain its
ring buffer.

    probe = IngressProbe(on_record=records.append)
    probe.load()                 # compile (child process) + attach (~0.5 s); tracks nothing until a target is added
    probe.add_target(pid)        # seeds the target's established connections, then tracks it
    probe.poll(time.monotonic_ns())   # drains completed requests into on_record; call on a timer
    probe.stats()                # records, sampled_out and drop counters (summed over CPUs)
    probe.totals()               # the in-kernel aggregate: exact request count, bytes, latency histogram
    probe.close()                # flushes answered-but-unclosed requests, drains, unloads

The ctypes structures below mirror ingress.h; tests/ingress checks their sizes against gcc's.
"""

from __future__ import annotations

import ctypes as ct
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from moescope import errors
from moescope.collectors.registry import BACKLOG_FILL, SourceHealth
from moescope.probes import bpf
from moescope.probes.ingress import procnet
from moescope.probes.ingress.aggregate import IngressStats, RequestTotals, sum_over_cpus
from moescope.probes.ingress.ring import HEADER_BYTES, RingReader
from moescope.probes.ingress.sampling import RecordSampler

log = logging.getLogger(__name__)

PROBE_DIR = Path(__file__).resolve().parent
BPF_SOURCE = PROBE_DIR / "ingress.bpf.c"
HEADER = PROBE_DIR / "ingress.h"

# Mirrors of ingress.h's #defines (a test compiles the header and compares).
F_NO_RESPONSE = 0x1
F_SEEDED = 0x2
F_FLUSHED = 0x4
DROP_RINGBUF_FULL = 0
DROP_CONN_EVICTED = 1
DROP_INFLIGHT_FULL = 2
DROP_NR = 3
CC_KERNEL_INSERTS = 0
CC_KERNEL_DELETES = 1
CC_USER_INSERTS = 2
CC_USER_DELETES = 3
CC_GENERATION = 4
CC_NR = 5
TARGET_SLOTS = 16384
TARGET_SHARED = 0xFFFFFFFF
K_ACCEPT = 1
K_READ = 2
K_WRITE = 3
DROP_NAMES = {DROP_RINGBUF_FULL: "ringbuf_full", DROP_CONN_EVICTED: "conn_evicted", DROP_INFLIGHT_FULL: "inflight_full"}



class IngressEvent(ct.Structure):
    _fields_ = [
        ("start_ns", ct.c_uint64),
        ("last_read_ns", ct.c_uint64),
        ("first_response_ns", ct.c_uint64),
        ("end_ns", ct.c_uint64),
        ("bytes_in", ct.c_uint64),
        ("bytes_out", ct.c_uint64),
        ("generation", ct.c_uint64),
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("fd", ct.c_int32),
        ("seq", ct.c_uint32),
        ("family", ct.c_uint16),
        ("peer_port", ct.c_uint16),
        ("flags", ct.c_uint32),
        ("peer_addr", ct.c_uint8 * 16),
    ]


EVENT_DTYPE = np.dtype(IngressEvent)


class IngressConnKey(ct.Structure):
    _fields_ = [("tgid", ct.c_uint32), ("fd", ct.c_int32)]


class IngressConn(ct.Structure):
    _fields_ = [
        ("generation", ct.c_uint64),
        ("start_ns", ct.c_uint64),
        ("last_read_ns", ct.c_uint64),
        ("first_response_ns", ct.c_uint64),
        ("last_write_ns", ct.c_uint64),
        ("bytes_in", ct.c_uint64),
        ("bytes_out", ct.c_uint64),
        ("tid", ct.c_uint32),
        ("seq", ct.c_uint32),
        ("family", ct.c_uint16),
        ("peer_port", ct.c_uint16),
        ("flags", ct.c_uint32),
        ("peer_addr", ct.c_uint8 * 16),
    ]


class IngressInflight(ct.Structure):
    _fields_ = [
        ("enter_ns", ct.c_uint64),
        ("sockaddr_ptr", ct.c_uint64),
        ("fd", ct.c_int32),
        ("kind", ct.c_uint32),
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
    ]


class IngressRecord(NamedTuple):
    """One request as the kernel saw it. Times are CLOCK_MONOTONIC ns (time.monotonic_ns()).
    A NamedTuple: one is built per request, so construction must be cheap."""

    tgid: int
    tid: int
    fd: int
    generation: int
    seq: int
    family: int
    peer_addr: str | None
    peer_port: int
    start_ns: int
    first_response_ns: int
    end_ns: int
    bytes_in: int
    bytes_out: int
    flags: int
    last_read_ns: int = 0  # return of the last read before the first response byte (0: unknown)

    @property
    def latency_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def answered(self) -> bool:
        return not self.flags & F_NO_RESPONSE

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "tgid": self.tgid,
            "tid": self.tid,
            "fd": self.fd,
            "generation": self.generation,
            "seq": self.seq,
            "peer_addr": self.peer_addr,
            "peer_port": self.peer_port,
            "start_ns": self.start_ns,
            "last_read_ns": self.last_read_ns,
            "first_response_ns": self.first_response_ns,
            "end_ns": self.end_ns,
            "latency_ns": self.latency_ns,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "flags": flag_names(self.flags),
        }


def flag_names(flags: int) -> list[str]:
    names = [(F_NO_RESPONSE, "no_response"), (F_SEEDED, "seeded"), (F_FLUSHED, "flushed")]
    return [name for bit, name in names if flags & bit]


def _record_from(
    raw: IngressEvent | IngressConn, *, tgid: int, fd: int, end_ns: int, seq: int, flags: int
) -> IngressRecord:
    return IngressRecord(
        tgid=tgid,
        tid=raw.tid,
        fd=fd,
        generation=raw.generation,
        seq=seq,
        family=raw.family,
        peer_addr=procnet.address_text(raw.family, bytes(raw.peer_addr)),
        peer_port=raw.peer_port,
        start_ns=raw.start_ns,
        first_response_ns=raw.first_response_ns,
        end_ns=end_ns,
        bytes_in=raw.bytes_in,
        bytes_out=raw.bytes_out,
        flags=flags,
        last_read_ns=raw.last_read_ns,
    )


_SCALARS = (
    "tgid", "tid", "fd", "generation", "seq", "family", "peer_port",
    "start_ns", "first_response_ns", "end_ns", "bytes_in", "bytes_out", "flags", "last_read_ns",
)
_PEER_WORDS = np.dtype([("low", "<u8"), ("high", "<u8")])


def decode_events(events: np.ndarray, *, peer_cache: dict[tuple[int, bytes], str | None]) -> list[IngressRecord]:
    """Records from a batch of ingress_event rows, column-wise: each distinct peer address is
    formatted once per batch (np.unique), and each record is one tuple built from its columns."""
    if events.size == 0:
        return []
    # (family, 16 address bytes) as three integers, so the distinct peers are found in one pass
    words = np.ascontiguousarray(events["peer_addr"]).view(_PEER_WORDS).ravel()
    keys = np.empty(events.size, dtype=[("family", "<u2"), ("low", "<u8"), ("high", "<u8")])
    keys["family"], keys["low"], keys["high"] = events["family"], words["low"], words["high"]
    distinct, inverse = np.unique(keys, return_inverse=True)
    texts: list[str | None] = []
    for family, low, high in distinct.tolist():
        raw = int(low).to_bytes(8, "little") + int(high).to_bytes(8, "little")
        key = (int(family), raw)
        if key not in peer_cache:
            if len(peer_cache) > 65536:
                peer_cache.clear()  # bounded: many distinct peers just cost a re-format
            peer_cache[key] = procnet.address_text(int(family), raw)
        texts.append(peer_cache[key])
    peers = [texts[i] for i in inverse.ravel().tolist()]
    c = {name: events[name].tolist() for name in _SCALARS}
    make = IngressRecord._make
    return [
        make(row)
        for row in zip(
            c["tgid"], c["tid"], c["fd"], c["generation"], c["seq"], c["family"], peers, c["peer_port"],
            c["start_ns"], c["first_response_ns"], c["end_ns"], c["bytes_in"], c["bytes_out"], c["flags"],
            c["last_read_ns"],
        )
    ]


DEFAULT_RATE_HINT_PER_S = 100_000  # sizes the ring: 4 MiB (ring_pages_for)
# The ring holds at least this long at the hinted rate: a quiet agent drains it once a peek finds it
# past BACKLOG_FILL (an eighth), and the peeks come up to 200 ms apart when the policy thread makes
# them (daemon.OUTSIDE_PEEK_MAX_NS): 0.2 s / (1 - 1/8). At the default hint the power-of-two
# rounding makes it 4 MiB, 0.40 s (0.2 s, 2 MiB, before the policy thread peeked).
RING_HOLD_S = 0.23
# `agent start`'s per-request records handed on per second before the sampling rule applies
# (sampling.py); every request is counted in the kernel aggregate whatever this is.
DEFAULT_RECORDS_PER_S = 200  # a kept record costs ~80 us (join, span, export): 200/s is ~1.6 % of a CPU
EVENT_SLOT_BYTES = (HEADER_BYTES + ct.sizeof(IngressEvent) + 7) // 8 * 8


def ring_pages_for(rate_per_s: int, *, hold_s: float = RING_HOLD_S) -> int:
    """Ring pages (a power of two) holding `hold_s` of records at `rate_per_s` requests/s."""
    needed = math.ceil(rate_per_s * hold_s * EVENT_SLOT_BYTES / mmap.PAGESIZE)
    return 1 << max(0, needed - 1).bit_length()


@dataclass(frozen=True, slots=True)
class IngressOptions:
    """Map sizes (they reach the program as typed -D cflags) and the record budget."""

    max_targets: int = 64
    target_slots: int = TARGET_SLOTS
    max_conns: int = 65536
    max_inflight: int = 16384
    rate_hint_per_s: int = DEFAULT_RATE_HINT_PER_S  # requests/s the ring is sized for
    ringbuf_pages: int = 0  # 0: from rate_hint_per_s (ring_pages_for); else a power of two
    records_per_s: int = 0  # sampling budget (sampling.py); 0 = every record (`agent start`: DEFAULT_RECORDS_PER_S)

    def validate(self) -> None:
        for name in ("max_targets", "target_slots", "max_conns", "max_inflight", "rate_hint_per_s"):
            _check_positive(name, getattr(self, name))
        if self.ringbuf_pages != 0:
            _check_positive("ringbuf_pages", self.ringbuf_pages)
        budget = self.records_per_s
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise errors.UsageError(f"ingress option records_per_s must be a whole number >= 0, got {budget!r}")
        for name in ("target_slots", "max_inflight", "ringbuf_pages"):
            value = getattr(self, name)
            if value & (value - 1):
                raise errors.UsageError(f"ingress option {name} must be a power of two, got {value}")

    def ring_pages(self) -> int:
        """The ring's size in pages: the explicit one, or enough for the rate hint."""
        return self.ringbuf_pages or ring_pages_for(self.rate_hint_per_s)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise errors.UsageError(f"ingress option {name} must be a positive integer, got {value!r}")


def cflags(options: IngressOptions) -> list[str]:
    options.validate()
    return [
        f"-I{PROBE_DIR}",
        f"-DMAX_TARGETS={options.max_targets:d}",
        f"-DINGRESS_TARGET_SLOTS={options.target_slots:d}",
        f"-DMAX_CONNS={options.max_conns:d}",
        f"-DMAX_INFLIGHT={options.max_inflight:d}",
        f"-DRINGBUF_PAGES={options.ring_pages():d}",
    ]


def program_text() -> str:
    return BPF_SOURCE.read_text()


def ebpf_listing(options: IngressOptions) -> str:
    """What `--ebpf` prints: the program exactly as compiled, its cflags and the header it includes."""
    return (
        f"// cflags: {' '.join(cflags(options))}\n"
        f"// ---- {HEADER.name} ----\n{HEADER.read_text()}\n"
        f"// ---- {BPF_SOURCE.name} ----\n{program_text()}"
    )


class IngressProbe:
    """The ingress eBPF program and its maps. Satisfies moescope.agent.daemon.Source."""

    name = "ingress"

    def __init__(self, *, on_record: Callable[[IngressRecord], None], options: IngressOptions | None = None) -> None:
        self.options = options or IngressOptions()
        self.options.validate()
        self._on_record = on_record
        self._object: bpf.LoadedObject | None = None
        self._maps: _Maps | None = None
        self._ring: RingReader | None = None
        self._peer_cache: dict[tuple[int, bytes], str | None] = {}
        self._targets: set[int] = set()
        self._user_inserts = 0
        self._user_deletes = 0
        self._records = 0
        self._flushed = 0
        self._callback_errors = 0
        self._final_drops = {name: 0 for name in DROP_NAMES.values()}
        self._health = SourceHealth()
        self._sampler = RecordSampler(records_per_s=self.options.records_per_s, flag_no_response=F_NO_RESPONSE)
        self._sampled_out = 0
        # The kernel aggregate: each target's `stats` slot, read against its value when the target
        # was added (a reused slot keeps its old counts); removed targets' final counts, and the
        # requests the loader itself flushed (the kernel never completed those), kept here.
        self._totals_lock = threading.Lock()  # totals() runs on a scrape's thread too
        self._slots: dict[int, int] = {}
        self._baselines: dict[int, RequestTotals] = {}
        self._retired: dict[int, RequestTotals] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self, *, build_dir: Path | None = None) -> None:
        loaded = bpf.load_program(text=program_text(), flags=cflags(self.options), build_dir=build_dir)
        try:
            self._maps = _Maps(loaded.maps)
            self._ring = RingReader(
                map_fd=loaded.maps["events"],
                data_bytes=self.options.ring_pages() * mmap.PAGESIZE,
                record=EVENT_DTYPE,
            )
            loaded.attach()
        except BaseException:
            if self._ring is not None:
                self._ring.close()
                self._ring = None
            self._maps = None
            loaded.close()
            raise
        self._object = loaded

    def close(self) -> None:
        """Stop tracking every target (flushing their answered requests), drain, unload."""
        if self._object is None:
            return
        for tgid in sorted(self._targets):
            self.remove_target(tgid)
        self._final_drops = self._read_drops()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._object.close()
        self._object = None
        self._maps = None

    @property
    def loaded(self) -> bool:
        return self._object is not None

    # ---- targets ---------------------------------------------------------------------------

    def targets(self) -> list[int]:
        return sorted(self._targets)

    def add_target(self, tgid: int) -> int:
        """Track process `tgid`; returns how many already-established connections were seeded."""
        maps = self._require_loaded()
        if tgid == os.getpid():
            raise errors.UsageError("the agent cannot trace its own process")
        if tgid not in self._targets and len(self._targets) >= self.options.max_targets:
            raise errors.UsageError(f"at most {self.options.max_targets} targets (max_targets)")
        with self._totals_lock:
            slot = self._slots.get(tgid)
            if slot is None:
                used = set(self._slots.values())
                slot = next(i for i in range(self.options.max_targets) if i not in used)  # < max_targets live
                # the slot's counts so far are not this target's (the kernel only adds to it from now)
                self._baselines[tgid] = self._read_slot(maps, slot)
                self._slots[tgid] = slot
        # Target first, then seed with NOEXIST: a connection accepted in between keeps the
        # kernel's entry; seeding never overwrites it.
        maps.targets.update(ct.c_uint32(tgid), ct.c_uint32(slot))
        self._targets.add(tgid)
        self._write_target_slot(tgid)
        seeded = 0
        seeded_fds: set[int] = set()
        for fd, sock in procnet.accepted_connections(tgid):
            key = IngressConnKey(tgid=tgid, fd=fd)
            conn = IngressConn(generation=0, flags=F_SEEDED, family=sock.family, peer_port=sock.remote_port)
            ct.memmove(conn.peer_addr, sock.remote_addr, len(sock.remote_addr))
            if maps.conns.update(key, conn, flags=bpf.BPF_NOEXIST):
                seeded += 1
                seeded_fds.add(fd)
        if seeded:
            self._user_inserts += seeded
            maps.conn_count.update(ct.c_uint32(CC_USER_INSERTS), ct.c_uint64(self._user_inserts))
        self._seed_blocked_threads(maps, tgid, seeded_fds=seeded_fds)
        log.debug("ingress: target %d added, %d connections seeded", tgid, seeded)
        return seeded

    def _seed_blocked_threads(self, maps: _Maps, tgid: int, *, seeded_fds: set[int]) -> None:
        """A thread already blocked in accept() or in read() on a seeded connection entered its
        syscall before the probe saw it; give it the in-flight entry its exit will look for, so
        the connection it accepts (or the request it reads) is not missed."""
        numbers = procnet.syscall_numbers()
        reads = {numbers[name] for name in procnet.READ_SYSCALLS if name in numbers}
        accepts = {numbers[name] for name in procnet.ACCEPT_SYSCALLS if name in numbers}
        for blocked in procnet.blocked_syscalls(tgid):
            fd = ct.c_int32(blocked.args[0] & 0xFFFFFFFF).value
            if blocked.nr in accepts:
                entry = IngressInflight(
                    enter_ns=time.monotonic_ns(), sockaddr_ptr=blocked.args[1], fd=-1, kind=K_ACCEPT
                )
            elif blocked.nr in reads and fd in seeded_fds:
                entry = IngressInflight(enter_ns=time.monotonic_ns(), sockaddr_ptr=0, fd=fd, kind=K_READ)
            else:
                continue
            entry.tgid, entry.tid = tgid, blocked.tid
            index = ct.c_uint32(blocked.tid & (self.options.max_inflight - 1))
            current = maps.inflight.lookup(index)
            if current is not None and not current.kind:  # a slot the kernel filled meanwhile wins
                maps.inflight.update(index, entry)

    def remove_target(self, tgid: int, *, flush: bool = True) -> int:
        """Stop tracking `tgid`; drain, then emit its answered-but-not-yet-ended requests (flag
        flushed) and forget its connections. Returns the number of flushed records."""
        maps = self._require_loaded()
        maps.targets.delete(ct.c_uint32(tgid))
        self._targets.discard(tgid)
        self._write_target_slot(tgid)
        self._drain()  # records the kernel already submitted come before the flushed ones
        flushed = 0
        deleted = 0
        flushed_totals: list[IngressRecord] = []
        for key, conn in maps.conns.items():
            if key.tgid != tgid:
                continue
            if flush and conn.start_ns and conn.bytes_out:
                record = _record_from(
                    conn, tgid=tgid, fd=key.fd, end_ns=conn.last_write_ns, seq=conn.seq + 1,
                    flags=F_FLUSHED | (conn.flags & F_SEEDED),
                )
                self._deliver(record)
                flushed_totals.append(record)
                flushed += 1
            if maps.conns.delete(key):
                deleted += 1  # else closed meanwhile (the kernel counted that delete)
        if deleted:
            self._user_deletes += deleted
            maps.conn_count.update(ct.c_uint32(CC_USER_DELETES), ct.c_uint64(self._user_deletes))
        for index, slot in maps.inflight.items():
            if slot.kind and slot.tgid == tgid:
                maps.inflight.update(index, IngressInflight())  # free the slots of its threads
        self._flushed += flushed
        self._retire(maps, tgid, flushed_totals)
        return flushed

    def _retire(self, maps: _Maps, tgid: int, flushed: list[IngressRecord]) -> None:
        """Keep a removed target's final counts (its slot's delta, plus its flushed requests) and
        free its slot."""
        extra = RequestTotals.of_latencies(
            (r.latency_ns for r in flushed), bytes_in=sum(r.bytes_in for r in flushed),
            bytes_out=sum(r.bytes_out for r in flushed),
        )
        with self._totals_lock:
            slot = self._slots.pop(tgid, None)
            if slot is None:
                return
            final = self._read_slot(maps, slot) - self._baselines.pop(tgid)
            self._retired[tgid] = self._retired.get(tgid, RequestTotals()) + final + extra

    # ---- Source protocol -------------------------------------------------------------------

    def poll(self, now_ns: int) -> int:
        """Drain every completed request the kernel has submitted; returns how many."""
        del now_ns  # the ring is drained completely on every call
        if self._object is None:
            return 0
        started_ns = time.monotonic_ns()
        try:
            drained = self._drain()
        except Exception as exc:
            self._health = SourceHealth(time.monotonic_ns() - started_ns, False, f"{type(exc).__name__}: {exc}")
            raise
        self._health = SourceHealth(time.monotonic_ns() - started_ns, True, None)
        return drained

    def health(self) -> SourceHealth:
        """The last drain: its duration and whether it completed (None before the first)."""
        return self._health

    def backlogged(self) -> bool:
        """The event ring is past BACKLOG_FILL (the quiet daemon's peek: two positions read)."""
        ring = self._ring
        return ring is not None and ring.fill() >= BACKLOG_FILL

    def stats(self) -> dict[str, int]:
        """Counters: records delivered, records the sampling rule left out (not a loss: every
        request is in totals()), and every loss (all should stay 0)."""
        result = {
            "records": self._records, "sampled_out": self._sampled_out, "flushed": self._flushed,
            "callback_errors": self._callback_errors,
        }
        return result | (self._read_drops() if self._maps is not None else self._final_drops)

    def totals(self) -> RequestTotals:
        """Every request completed since load, from the kernel aggregate (all targets, removed
        ones included): exact whatever happened to per-request records."""
        return sum(self.totals_by_target().values(), RequestTotals())

    def totals_by_target(self) -> dict[int, RequestTotals]:
        """The kernel aggregate per target tgid (live and removed)."""
        with self._totals_lock:
            result = dict(self._retired)
            maps = self._maps
            if maps is not None:
                for tgid, slot in self._slots.items():
                    live = self._read_slot(maps, slot) - self._baselines[tgid]
                    result[tgid] = result.get(tgid, RequestTotals()) + live
        return result

    @staticmethod
    def _read_slot(maps: _Maps, slot: int) -> RequestTotals:
        return sum_over_cpus(maps.stats.lookup_percpu(ct.c_uint32(slot)))

    def _read_drops(self) -> dict[str, int]:
        maps = self._require_loaded()
        return {name: maps.drops.sum(ct.c_uint32(index)) for index, name in DROP_NAMES.items()}

    def drop_total(self) -> int:
        stats = self.stats()
        return sum(stats[name] for name in DROP_NAMES.values()) + stats["callback_errors"]

    # ---- internals -------------------------------------------------------------------------

    def _write_target_slot(self, tgid: int) -> None:
        """Recompute the filter slot of `tgid` from the current targets: 0, the one target's
        tgid, or TARGET_SHARED when several targets fall in it (the kernel then asks the hash)."""
        mask = self.options.target_slots - 1
        index = tgid & mask
        sharing = [t for t in self._targets if t & mask == index]
        value = 0 if not sharing else sharing[0] if len(sharing) == 1 else TARGET_SHARED
        self._require_loaded().target_slots.update(ct.c_uint32(index), ct.c_uint32(value))

    def _require_loaded(self) -> _Maps:
        if self._maps is None:
            raise errors.ProbeLoadError("ingress probe is not loaded")
        return self._maps

    def _drain(self) -> int:
        if self._ring is None:
            return 0
        events = self._ring.read()
        if events.size == 0:
            return 0
        kept = self._sampler.select(events, time.monotonic_ns())
        if kept is not None:
            self._sampled_out += events.size - kept.size
            events = events[kept]
        # Only the records that are handed on become Python objects.
        for record in decode_events(events, peer_cache=self._peer_cache):
            self._deliver(record)
        return int(events.size)

    def _deliver(self, record: IngressRecord) -> None:
        self._records += 1
        try:
            self._on_record(record)
        except Exception:  # a failing sink must not stop the drain; it is counted and logged
            self._callback_errors += 1
            log.exception("ingress: record callback failed")


class _Maps:
    """The program's maps by name, typed as ingress.h declares them."""

    def __init__(self, fds: dict[str, int]) -> None:
        def typed(name: str, key: type[Any], value: type[Any]) -> bpf.BpfMap[Any, Any]:
            if name not in fds:
                raise errors.ProbeLoadError(f"the ingress program has no map {name!r}")
            return bpf.BpfMap(fd=fds[name], name=name, key_type=key, value_type=value)

        self.targets = typed("targets", ct.c_uint32, ct.c_uint32)
        self.target_slots = typed("target_slots", ct.c_uint32, ct.c_uint32)
        self.conns = typed("conns", IngressConnKey, IngressConn)
        self.inflight = typed("inflight", ct.c_uint32, IngressInflight)
        self.drops = typed("drops", ct.c_uint32, ct.c_uint64)
        self.conn_count = typed("conn_count", ct.c_uint32, ct.c_uint64)
        self.stats = typed("stats", ct.c_uint32, IngressStats)
