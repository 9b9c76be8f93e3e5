"""Drop the agent's privileges once its eBPF programs are attached.

CAP_BPF and CAP_PERFMON are needed only to load the programs and open the tracepoint perf
events (probes/bpf.py); after that the agent reads and writes its maps through descriptors it
already holds, which the kernel does not check again. What it still needs for the rest of its
life (docs/security.md, measured by tests/deploy): CAP_SYS_PTRACE and CAP_DAC_OVERRIDE to read a
later target's /proc entries and open its 0600 NVTX ring and control socket (`--port` follows a
restarted server), and CAP_NET_BIND_SERVICE only when /metrics is asked for on a port below 1024.

Capabilities belong to threads, not processes: capset(2) changes the calling thread only and a new
thread copies its creator's. So the drop runs on the main thread before the agent starts any
other (export workers, telemetry, policy, state publisher, gRPC's own), and refuses — leaving
privileges as they were, with a note — when another thread already exists. The bounding set is
reduced first (while CAP_SETPCAP is still there) so no program the agent might execute later can
regain what was dropped.
"""

from __future__ import annotations

import ctypes as ct
import os
import threading
from dataclasses import dataclass
from pathlib import Path

# bit numbers from <linux/capability.h> (a documented ABI)
CAP_NUMBERS = {
    "CAP_DAC_OVERRIDE": 1, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10, "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38, "CAP_BPF": 39,
}
KEEP_AFTER_ATTACH = ("CAP_DAC_OVERRIDE", "CAP_SYS_PTRACE")
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAPBSET_DROP = 24
_libc = ct.CDLL(None, use_errno=True)


class _CapHeader(ct.Structure):
    _fields_ = [("version", ct.c_uint32), ("pid", ct.c_int)]


class _CapData(ct.Structure):
    _fields_ = [("effective", ct.c_uint32), ("permitted", ct.c_uint32), ("inheritable", ct.c_uint32)]


@dataclass(frozen=True)
class Capabilities:
    effective: int
    permitted: int
    bounding: int


def thread_capabilities(status: Path = Path("/proc/thread-self/status")) -> Capabilities:
    fields = {}
    for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("CapEff", "CapPrm", "CapBnd"):
            fields[key] = int(value.strip(), 16)
    return Capabilities(effective=fields["CapEff"], permitted=fields["CapPrm"], bounding=fields["CapBnd"])


def names(mask: int) -> list[str]:
    known = {bit: name for name, bit in CAP_NUMBERS.items()}
    return [known.get(bit, f"cap_{bit}") for bit in range(64) if mask >> bit & 1]


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40


def _other_threads() -> int:
    return max(len(os.listdir("/proc/self/task")), threading.active_count()) - 1


def drop_to(keep: tuple[str, ...]) -> str:
    """Keep only `keep` (effective, permitted, bounding; inheritable and ambient emptied).
    Returns the line the agent prints; never raises for a refusal, only notes it."""
    others = _other_threads()
    if others:
        return f"privileges kept: {others} other thread(s) already running (capabilities are per thread)"
    before = thread_capabilities()
    keep_mask = sum(1 << CAP_NUMBERS[name] for name in keep) & before.permitted
    bounding_note = ""
    if before.effective >> CAP_NUMBERS["CAP_SETPCAP"] & 1:
        for bit in range(_last_cap() + 1):
            if not keep_mask >> bit & 1 and before.bounding >> bit & 1:
                if _libc.prctl(_PR_CAPBSET_DROP, bit, 0, 0, 0) != 0:
                    bounding_note = f"; bounding set kept ({os.strerror(ct.get_errno())})"
                    break
    else:
        bounding_note = "; bounding set kept (no CAP_SETPCAP)"
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for word in range(2):
        bits = keep_mask >> (32 * word) & 0xFFFFFFFF
        data[word].effective = data[word].permitted = bits
        data[word].inheritable = 0
    if _libc.capset(ct.byref(header), data) != 0:
        return f"privileges kept: capset failed ({os.strerror(ct.get_errno())})"
    dropped = len(names(before.permitted & ~keep_mask))
    kept = ", ".join(names(keep_mask)) or "none"
    return f"privileges dropped after attach: kept {kept}; {dropped} others gone{bounding_note}"
