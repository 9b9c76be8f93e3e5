"""Load the netsig probe (netsig.bpf.c; compiled by bcc in a child process), set the ports it
watches, read its counters and drain its event ring.

    probe = NetSignalProbe()
    probe.load()                    # compile (child process) + attach (~0.5 s); watches no port yet
    probe.set_ports({8000})         # the target's listening ports (collectors/netsig.py finds them)
    probe.read_counts()             # {(port, kind): total since load}
    probe.drain_events()            # retransmits and resets since the last drain, oldest first
    probe.drops()                   # counts_full, ringbuf_full (summed over CPUs)
    probe.close()

`python -m moescope.probes.netsig.loader --ebpf` prints the program exactly as compiled.
The ctypes structures below mirror netsig.h; tests/netsig checks their sizes against gcc's.
"""

from __future__ import annotations

import argparse
import ctypes as ct
import functools
import mmap
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moescope import errors
from moescope.probes import bpf
from moescope.probes.ingress import procnet
from moescope.probes.ingress.procnet import address_text
from moescope.probes.ingress.ring import RingReader

PROBE_DIR = Path(__file__).resolve().parent
BPF_SOURCE = PROBE_DIR / "netsig.bpf.c"
HEADER = PROBE_DIR / "netsig.h"

# Mirrors of netsig.h's #defines (a test compiles the header and compares).
K_RETRANSMIT = 1
K_RESET_SENT = 2
K_RESET_RECEIVED = 3
K_ESTABLISHED = 4
K_SYNACK_RETRANSMIT = 5
K_NR = 6
DROP_COUNTS_FULL = 0
DROP_RINGBUF_FULL = 1
DROP_NR = 2
PORTS = 65536
AF_INET, AF_INET6 = procnet.AF_INET, procnet.AF_INET6  # the families an event carries

KIND_NAMES = {
    K_RETRANSMIT: "retransmit",
    K_RESET_SENT: "reset_sent",
    K_RESET_RECEIVED: "reset_received",
    K_ESTABLISHED: "established",
    K_SYNACK_RETRANSMIT: "synack_retransmit",
}
DROP_NAMES = {DROP_COUNTS_FULL: "counts_full", DROP_RINGBUF_FULL: "ringbuf_full"}


def parse_symbolic(format_text: str, field: str) -> dict[int, str]:
    """The value names of `field` in a tracefs format's print fmt (`__print_symbolic(REC->field,
    { 0, "NAME" }, ...)`): the running kernel's own numbering of an enum such as sk_rst_reason."""
    start = format_text.find(f"__print_symbolic(REC->{field},")
    if start < 0:
        return {}
    end = format_text.find(")", start)
    body = format_text[start:end if end > 0 else len(format_text)]
    return {int(number): name for number, name in re.findall(r'\{\s*(\d+)\s*,\s*"([A-Za-z0-9_]+)"\s*\}', body)}


@functools.lru_cache(maxsize=1)
def _reset_reasons() -> dict[int, str]:
    for root in bpf.TRACEFS_DIRS:
        try:
            return parse_symbolic((root / "events/tcp/tcp_send_reset/format").read_text(), "reason")
        except OSError:
            continue
    return {}


def reset_reason_name(code: int) -> str | None:
    """The kernel's name for a reset reason (tcp_send_reset's `reason`), None when unknown."""
    return _reset_reasons().get(code)


class NetsigKey(ct.Structure):
    _fields_ = [("port", ct.c_uint16), ("kind", ct.c_uint16)]


class NetsigEvent(ct.Structure):
    _fields_ = [
        ("ts_ns", ct.c_uint64),
        ("kind", ct.c_uint32),
        ("detail", ct.c_uint32),
        ("family", ct.c_uint16),
        ("local_port", ct.c_uint16),
        ("remote_port", ct.c_uint16),
        ("pad", ct.c_uint16),
        ("local_addr", ct.c_uint8 * 16),
        ("remote_addr", ct.c_uint8 * 16),
    ]


EVENT_DTYPE = np.dtype(NetsigEvent)


@dataclass(frozen=True, slots=True)
class NetEvent:
    """One retransmit or reset on a watched port, as the kernel saw it (CLOCK_MONOTONIC ns)."""

    ts_ns: int
    kind: str  # a KIND_NAMES value
    detail: int  # retransmit: the TCP state; reset_sent: the kernel's sk_rst_reason; else 0
    family: int
    local_addr: str | None
    local_port: int
    remote_addr: str | None
    remote_port: int

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "ts_ns": self.ts_ns, "kind": self.kind, "detail": self.detail,
            "local_addr": self.local_addr, "local_port": self.local_port,
            "remote_addr": self.remote_addr, "remote_port": self.remote_port,
        }


def decode_events(rows: np.ndarray) -> list[NetEvent]:
    """Events from a batch of netsig_event rows (few: retransmits and resets are rare)."""
    out: list[NetEvent] = []
    for row in rows:
        family = int(row["family"])
        out.append(
            NetEvent(
                ts_ns=int(row["ts_ns"]),
                kind=KIND_NAMES.get(int(row["kind"]), f"kind_{int(row['kind'])}"),
                detail=int(row["detail"]),
                family=family,
                local_addr=address_text(family, row["local_addr"].tobytes()),
                local_port=int(row["local_port"]),
                remote_addr=address_text(family, row["remote_addr"].tobytes()),
                remote_port=int(row["remote_port"]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class NetsigOptions:
    """Map sizes; they reach the program as typed -D cflags."""

    max_counts: int = 4096  # (port, kind) pairs: 819 watched ports x 5 kinds
    ringbuf_pages: int = 16  # 64 KiB: ~1,100 events between two drains

    def validate(self) -> None:
        for name in ("max_counts", "ringbuf_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise errors.UsageError(f"netsig option {name} must be a positive integer, got {value!r}")
        if self.ringbuf_pages & (self.ringbuf_pages - 1):
            raise errors.UsageError(f"netsig option ringbuf_pages must be a power of two, got {self.ringbuf_pages}")


def cflags(options: NetsigOptions) -> list[str]:
    options.validate()
    return [f"-I{PROBE_DIR}", f"-DMAX_COUNTS={options.max_counts:d}", f"-DRINGBUF_PAGES={options.ringbuf_pages:d}"]


def program_text() -> str:
    return BPF_SOURCE.read_text()


def ebpf_listing(options: NetsigOptions) -> str:
    """What `--ebpf` prints: the program exactly as compiled, its cflags and the header it includes."""
    return (
        f"// cflags: {' '.join(cflags(options))}\n"
        f"// ---- {HEADER.name} ----\n{HEADER.read_text()}\n"
        f"// ---- {BPF_SOURCE.name} ----\n{program_text()}"
    )


class NetSignalProbe:
    """The netsig eBPF program and its maps."""

    def __init__(self, *, options: NetsigOptions | None = None) -> None:
        self.options = options or NetsigOptions()
        self.options.validate()
        self._object: bpf.LoadedObject | None = None
        self._maps: _Maps | None = None
        self._ring: RingReader | None = None
        self._ports: set[int] = set()
        self._final_drops = dict.fromkeys(DROP_NAMES.values(), 0)

    def load(self, *, build_dir: Path | None = None) -> None:
        loaded = bpf.load_program(text=program_text(), flags=cflags(self.options), build_dir=build_dir)
        try:
            self._maps = _Maps(loaded.maps)
            self._ring = RingReader(
                map_fd=loaded.maps["events"], data_bytes=self.options.ringbuf_pages * mmap.PAGESIZE, record=EVENT_DTYPE
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

    @property
    def loaded(self) -> bool:
        return self._object is not None

    def close(self) -> None:
        if self._object is None:
            return
        self._final_drops = self.drops()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._object.close()
        self._object = None
        self._maps = None

    def ports(self) -> frozenset[int]:
        return frozenset(self._ports)

    def set_ports(self, ports: Iterable[int]) -> None:
        """Watch exactly `ports` from now on (only the differences are written)."""
        maps = self._require_loaded()
        wanted = set(ports)
        bad = sorted(p for p in wanted if not 0 < p < PORTS)
        if bad:
            raise errors.UsageError(f"netsig: not a TCP port: {bad[0]}")
        for port in sorted(wanted - self._ports):
            maps.ports.update(ct.c_uint32(port), ct.c_uint32(1))
        for port in sorted(self._ports - wanted):
            maps.ports.update(ct.c_uint32(port), ct.c_uint32(0))
            for kind in KIND_NAMES:  # free its counters' slots; its totals were already read
                maps.counts.delete(NetsigKey(port=port, kind=kind))
        self._ports = wanted

    def read_counts(self) -> dict[tuple[int, str], int]:
        """Total per (port, kind name) since the port was first watched."""
        maps = self._require_loaded()
        return {(key.port, KIND_NAMES.get(key.kind, f"kind_{key.kind}")): int(value.value)
                for key, value in maps.counts.items()}

    def ring_fill(self) -> float:
        """The share of the event ring waiting to be drained (0 when not loaded)."""
        return 0.0 if self._ring is None else self._ring.fill()

    def drain_events(self) -> list[NetEvent]:
        """Every event submitted since the last drain, oldest first."""
        if self._ring is None:
            return []
        return decode_events(self._ring.read())

    def drops(self) -> dict[str, int]:
        """Losses, all of which should stay 0: counts_full (a signal not counted), ringbuf_full
        (an event record lost; its count is kept)."""
        if self._maps is None:
            return dict(self._final_drops)
        return {name: self._maps.drops.sum(ct.c_uint32(index)) for index, name in DROP_NAMES.items()}

    def run_stats(self) -> dict[str, tuple[int, int]]:
        """Per tracepoint: (run_time_ns, run_cnt) the kernel measured (kernel.bpf_stats_enabled=1)."""
        if self._object is None:
            return {}
        return {name: bpf.program_run_stats(fd) for name, fd in sorted(self._object.programs.items())}

    def _require_loaded(self) -> _Maps:
        if self._maps is None:
            raise errors.ProbeLoadError("netsig probe is not loaded")
        return self._maps


class _Maps:
    """The program's maps by name, typed as netsig.h declares them."""

    def __init__(self, fds: dict[str, int]) -> None:
        def typed(name: str, key: type[Any], value: type[Any]) -> bpf.BpfMap[Any, Any]:
            if name not in fds:
                raise errors.ProbeLoadError(f"the netsig program has no map {name!r}")
            return bpf.BpfMap(fd=fds[name], name=name, key_type=key, value_type=value)

        self.ports = typed("ports", ct.c_uint32, ct.c_uint32)
        self.counts = typed("counts", NetsigKey, ct.c_uint64)
        self.drops = typed("drops", ct.c_uint32, ct.c_uint64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moescope.probes.netsig.loader",
                                     description="Print the netsig eBPF program exactly as compiled.")
    parser.add_argument("--ebpf", action="store_true", help="print the program, its cflags and header, then exit")
    args = parser.parse_args(argv)
    if not args.ebpf:
        parser.print_usage(sys.stderr)
        return errors.UsageError.exit_code
    sys.stdout.write(ebpf_listing(NetsigOptions()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
