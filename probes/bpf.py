"""eBPF programs compiled in a short-lived child process, then attached and used from this one.

Why a child: bcc compiles with clang/LLVM inside the calling process. Mapping and relocating
libLLVM and libclang-cpp costs ~86 MB of resident memory that stays for the life of the agent
(measured: 188 MB agent RSS, 54 MB of it libLLVM, 28 MB libclang-cpp), and the compile's heap
is never returned. Here a child (`python -m moescope.probes.bpf_child`) compiles and loads the programs
and maps, passes their file descriptors back over a socketpair (SCM_RIGHTS) and exits; this
process attaches the tracepoints itself (perf_event_open + PERF_EVENT_IOC_SET_BPF) and reads and
writes the maps through bpf(2). It never imports bcc, so libLLVM is never mapped here.

The child loads without attaching (bcc's auto-attach of TRACEPOINT_PROBE functions is turned
off there): a program attached in both processes at once would run twice per event.

After `attach()` nothing here needs CAP_BPF or CAP_PERFMON: map operations on a descriptor one
already holds are not privileged (kernel >= 6.5 checks privilege at map/program creation), so
the agent can drop both (agent/privileges.py).
"""

from __future__ import annotations

import ctypes as ct
import errno
import functools
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from moescope import errors

# syscall numbers per architecture (bpf, perf_event_open)
_SYSCALLS = {"x86_64": (321, 298), "aarch64": (280, 241)}
# bpf(2) commands (include/uapi/linux/bpf.h)
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_ANY = 0
BPF_NOEXIST = 1
# map types whose values are one slot per possible CPU
_PERCPU_TYPES = {5, 6, 10}  # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
# perf_event_open(2)
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400  # _IO('$', 0)
PERF_EVENT_IOC_SET_BPF = 0x40042408  # _IOW('$', 8, __u32)
TRACEFS_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
CHILD_TIMEOUT_S = 120.0
MAX_FDS = 250  # SCM_RIGHTS carries at most 253 descriptors in one message

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


@functools.cache
def _numbers() -> tuple[int, int]:
    """(bpf, perf_event_open) syscall numbers of this machine, looked up once: every map read goes
    through _bpf, and the policy reads maps five times a second."""
    machine = platform.machine()
    if machine not in _SYSCALLS:
        raise errors.ProbeLoadError(f"no bpf(2) syscall number known for architecture {machine}")
    return _SYSCALLS[machine]


class _ElemAttr(ct.Structure):
    _fields_ = [("map_fd", ct.c_uint32), ("pad", ct.c_uint32), ("key", ct.c_uint64),
                ("value", ct.c_uint64), ("flags", ct.c_uint64)]


class _InfoAttr(ct.Structure):
    _fields_ = [("bpf_fd", ct.c_uint32), ("info_len", ct.c_uint32), ("info", ct.c_uint64)]


class MapInfo(ct.Structure):
    """The head of struct bpf_map_info; the kernel fills as much as info_len asks for."""

    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("key_size", ct.c_uint32),
                ("value_size", ct.c_uint32), ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32),
                ("name", ct.c_char * 16)]


class _PerfAttr(ct.Structure):
    """perf_event_attr as of PERF_ATTR_SIZE_VER0 (64 bytes); later fields stay zero."""

    _fields_ = [("type", ct.c_uint32), ("size", ct.c_uint32), ("config", ct.c_uint64),
                ("sample_period", ct.c_uint64), ("sample_type", ct.c_uint64), ("read_format", ct.c_uint64),
                ("flags", ct.c_uint64), ("wakeup_events", ct.c_uint32), ("bp_type", ct.c_uint32),
                ("config1", ct.c_uint64)]


def _bpf(cmd: int, attr: ct.Structure) -> int:
    """bpf(2); returns the result or -errno."""
    result = int(_libc.syscall(_numbers()[0], cmd, ct.byref(attr), ct.sizeof(attr)))
    return result if result >= 0 else -ct.get_errno()


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ct.sizeof(info), info=ct.addressof(info))
    result = _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    if result < 0:
        raise OSError(-result, f"BPF_OBJ_GET_INFO_BY_FD: {os.strerror(-result)}")
    return info


# struct bpf_prog_info (include/uapi/linux/bpf.h): run_time_ns and run_cnt, kept by the kernel
# while sysctl kernel.bpf_stats_enabled=1 (the overhead benchmarks turn it on, then off).
PROG_INFO_RUN_TIME_OFFSET = 192
PROG_INFO_RUN_CNT_OFFSET = 200
PROG_INFO_BYTES = 208


def program_run_stats(prog_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of one loaded program; (0, 0) while bpf_stats_enabled is off."""
    info = (ct.c_uint8 * PROG_INFO_BYTES)()
    attr = _InfoAttr(bpf_fd=prog_fd, info_len=PROG_INFO_BYTES, info=ct.addressof(info))
    result = _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    if result < 0:
        raise OSError(-result, f"BPF_OBJ_GET_INFO_BY_FD on a program: {os.strerror(-result)}")
    run_time = ct.c_uint64.from_buffer(info, PROG_INFO_RUN_TIME_OFFSET).value
    run_cnt = ct.c_uint64.from_buffer(info, PROG_INFO_RUN_CNT_OFFSET).value
    return int(run_time), int(run_cnt)


def possible_cpus(path: Path = Path("/sys/devices/system/cpu/possible")) -> int:
    """How many CPUs a per-CPU map holds values for ("0-3,5" -> 6 ids, counting up to the last)."""
    last = 0
    for part in path.read_text().strip().split(","):
        last = max(last, int(part.split("-")[-1]))
    return last + 1


K = TypeVar("K", bound=ct._SimpleCData | ct.Structure)
V = TypeVar("V", bound=ct._SimpleCData | ct.Structure)


class BpfMap(Generic[K, V]):
    """A map by descriptor, with ctypes keys and values of the sizes the kernel reports.

    `lookup`/`update`/`delete`/`keys`/`items` mirror the map operations; per-CPU maps read as
    one value per possible CPU (`lookup_percpu`, `sum`)."""

    def __init__(self, *, fd: int, name: str, key_type: type[K], value_type: type[V]) -> None:
        info = map_info(fd)
        if info.key_size != ct.sizeof(key_type) or info.value_size != ct.sizeof(value_type):
            raise errors.ProbeLoadError(
                f"map {name}: kernel has key/value {info.key_size}/{info.value_size} bytes, "
                f"the loader expects {ct.sizeof(key_type)}/{ct.sizeof(value_type)}"
            )
        self.fd = fd
        self.name = name
        self.key_type = key_type
        self.value_type = value_type
        self.max_entries = int(info.max_entries)
        self.percpu = info.type in _PERCPU_TYPES
        self._cpus = possible_cpus() if self.percpu else 1
        self._slot_bytes = (ct.sizeof(value_type) + 7) // 8 * 8  # per-CPU values are 8-aligned

    def _elem(self, cmd: int, key: Any, value: Any = None, *, flags: int = 0) -> int:
        attr = _ElemAttr(map_fd=self.fd, key=ct.addressof(key) if key is not None else 0,
                         value=ct.addressof(value) if value is not None else 0, flags=flags)
        return _bpf(cmd, attr)

    def lookup(self, key: K) -> V | None:
        if self.percpu:
            raise TypeError(f"map {self.name} is per-CPU: use lookup_percpu()")
        value = self.value_type()
        result = self._elem(BPF_MAP_LOOKUP_ELEM, key, value)
        if result == -errno.ENOENT:
            return None
        if result < 0:
            raise OSError(-result, f"lookup in map {self.name}: {os.strerror(-result)}")
        return value

    def lookup_percpu(self, key: K) -> list[V]:
        buf = (ct.c_uint8 * (self._slot_bytes * self._cpus))()
        result = self._elem(BPF_MAP_LOOKUP_ELEM, key, buf)
        if result < 0:
            raise OSError(-result, f"lookup in map {self.name}: {os.strerror(-result)}")
        values = [self.value_type.from_buffer_copy(buf, cpu * self._slot_bytes) for cpu in range(self._cpus)]
        # typeshed types from_buffer_copy on type[V] as V's bound (a union), not V: they are V's
        return cast(list[V], values)

    def sum(self, key: K) -> int:
        """The values of a per-CPU counter added over CPUs."""
        return sum(int(v.value) for v in self.lookup_percpu(key))

    def update(self, key: K, value: V, *, flags: int = BPF_ANY) -> bool:
        """Write; False when flags forbid it (BPF_NOEXIST and the key exists). Other errors raise."""
        result = self._elem(BPF_MAP_UPDATE_ELEM, key, value, flags=flags)
        if result == -errno.EEXIST and flags == BPF_NOEXIST:
            return False
        if result < 0:
            raise OSError(-result, f"update of map {self.name}: {os.strerror(-result)}")
        return True

    def delete(self, key: K) -> bool:
        """Remove; False when the key was not there."""
        result = self._elem(BPF_MAP_DELETE_ELEM, key)
        if result == -errno.ENOENT:
            return False
        if result < 0:
            raise OSError(-result, f"delete from map {self.name}: {os.strerror(-result)}")
        return True

    def keys(self) -> Iterator[K]:
        """Every key, walking GET_NEXT_KEY (a key deleted meanwhile restarts from the first; the
        walk is bounded by max_entries + 1 steps so a map churning under it cannot loop forever)."""
        previous: Any = None
        for _ in range(self.max_entries + 1):
            following = self.key_type()
            result = self._elem(BPF_MAP_GET_NEXT_KEY, previous, following)
            if result == -errno.ENOENT:
                return
            if result < 0:
                raise OSError(-result, f"walk of map {self.name}: {os.strerror(-result)}")
            yield following
            previous = following

    def items(self) -> list[tuple[K, V]]:
        """(key, value) pairs present now (a key removed between the walk and its read is left out)."""
        found = []
        for key in list(self.keys()):
            value = self.lookup(key)
            if value is not None:
                found.append((key, value))
        return found


def tracepoint_id(category: str, event: str) -> int:
    for root in TRACEFS_DIRS:
        path = root / "events" / category / event / "id"
        try:
            return int(path.read_text())
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise errors.AttachError(f"cannot read {path}: {exc.strerror}") from exc
    raise errors.AttachError(f"tracepoint {category}:{event} not found (is tracefs mounted? `make setup`)")


def attach_tracepoint(prog_fd: int, category: str, event: str) -> int:
    """Run program `prog_fd` on every hit of tracepoint category:event (all CPUs); returns the
    perf event descriptor that holds the attachment (closing it detaches)."""
    attr = _PerfAttr(type=PERF_TYPE_TRACEPOINT, size=ct.sizeof(_PerfAttr),
                     config=tracepoint_id(category, event), sample_period=1, wakeup_events=1)
    pfd = int(_libc.syscall(_numbers()[1], ct.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC))
    if pfd < 0:
        err = ct.get_errno()
        raise errors.AttachError(f"perf_event_open({category}:{event}): {os.strerror(err)}")
    for request, arg in ((PERF_EVENT_IOC_SET_BPF, prog_fd), (PERF_EVENT_IOC_ENABLE, 0)):
        if _libc.ioctl(pfd, ct.c_ulong(request), ct.c_int(arg)) != 0:
            err = ct.get_errno()
            os.close(pfd)
            raise errors.AttachError(f"attaching to {category}:{event}: {os.strerror(err)}")
    return pfd


@dataclass
class LoadedObject:
    """Programs (tracepoint "category:event" -> program fd) and maps (name -> fd) this process
    holds; `attach()` hooks every program to its tracepoint, `close()` detaches and frees all."""

    programs: dict[str, int]
    maps: dict[str, int]
    perf_fds: list[int] = field(default_factory=list)

    def attach(self) -> None:
        try:
            for tracepoint, prog_fd in sorted(self.programs.items()):
                category, event = tracepoint.split(":", 1)
                self.perf_fds.append(attach_tracepoint(prog_fd, category, event))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        while self.perf_fds:
            os.close(self.perf_fds.pop())

    def close(self) -> None:
        self.detach()
        for fd in list(self.programs.values()) + list(self.maps.values()):
            os.close(fd)
        self.programs, self.maps = {}, {}


def kernel_build_dir() -> Path:
    return Path("/lib/modules") / os.uname().release / "build"


def check_kernel_headers(build_dir: Path) -> None:
    """bcc compiles against build_dir (the running kernel's headers); without them its compile
    error is long and unclear."""
    if not (build_dir / "include").is_dir():
        raise errors.ProbeLoadError(
            f"kernel headers missing: {build_dir}/include not found (run `make setup` to install or map them)"
        )


def load_program(*, text: str, flags: list[str], build_dir: Path | None = None) -> LoadedObject:
    """Compile and load `text` in the eBPF compiler process (this module's docstring says why),
    after checking the kernel's headers are there; nothing is attached yet."""
    check_kernel_headers(build_dir or kernel_build_dir())
    return load_in_child(text=text, flags=flags)


def load_in_child(*, text: str, flags: list[str], timeout_s: float = CHILD_TIMEOUT_S) -> LoadedObject:
    """Compile and load `text` with bcc in a child Python; receive its programs and maps.

    Raises BccMissing / ProbeLoadError with the child's one-line reason."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    request = json.dumps({"text": text, "flags": flags}).encode()
    # stderr to an in-memory file, not a pipe: clang can warn for pages against mismatched headers,
    # and a full pipe would block the child before it answers. memfd, not a temp file: a container's
    # root filesystem is read-only (tests/deploy checks that layout).
    with os.fdopen(os.memfd_create("moescope-bpf-child-stderr", os.MFD_CLOEXEC), "w+b") as stderr_file:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moescope.probes.bpf_child", str(child_sock.fileno())],
                pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=stderr_file, cwd=Path(__file__).resolve().parent.parent,
            )
        except OSError as exc:
            parent_sock.close()
            child_sock.close()
            raise errors.ProbeLoadError(f"cannot start the eBPF compiler process: {exc}") from exc
        child_sock.close()
        try:
            parent_sock.settimeout(timeout_s)
            parent_sock.sendall(len(request).to_bytes(8, "little") + request)
            message, fds = _receive(parent_sock)
        except (OSError, ValueError) as exc:
            proc.kill()
            message, fds = {"error": "ProbeLoadError", "message": f"eBPF compiler process failed: {exc}"}, []
        finally:
            parent_sock.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr_file.seek(0)
        stderr = stderr_file.read()
    if "error" in message or not message:
        for fd in fds:
            os.close(fd)
        reason = message.get("message") or _last_line(stderr) or f"exit status {proc.returncode}"
        kind = errors.BccMissing if message.get("error") == "BccMissing" else errors.ProbeLoadError
        first_error = _first_error(stderr)
        if kind is errors.ProbeLoadError and first_error and first_error not in reason:
            reason = f"{reason} ({first_error})"  # clang's own words: which line, what is wrong
        raise kind(reason)
    names: list[str] = message["programs"] + message["maps"]
    if len(names) != len(fds):
        for fd in fds:
            os.close(fd)
        raise errors.ProbeLoadError(f"eBPF compiler process sent {len(fds)} descriptors for {len(names)} objects")
    by_name = dict(zip(names, fds))
    return LoadedObject(programs={n: by_name[n] for n in message["programs"]},
                        maps={n: by_name[n] for n in message["maps"]})


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One reply: 8-byte length, JSON, with the descriptors attached to its first bytes."""
    head, fds, _, _ = socket.recv_fds(sock, 8, MAX_FDS)
    if not head:
        return {}, list(fds)
    return read_message(sock, head=head), list(fds)


def read_message(sock: socket.socket, *, head: bytes = b"", limit_bytes: int = 16 << 20) -> dict[str, Any]:
    """One message of the compiler protocol: an 8-byte little-endian length, then that much JSON
    (`head`: bytes of it already received). ValueError when cut short or too long."""
    head = head + _recv_exact(sock, 8 - len(head))
    size = int.from_bytes(head, "little")
    if size > limit_bytes:
        raise ValueError(f"message of {size} bytes")
    message: dict[str, Any] = json.loads(_recv_exact(sock, size))
    return message


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise ValueError("message cut short")
        data += more
    return data


def _first_error(stderr: bytes | None) -> str:
    for line in (stderr or b"").decode(errors="replace").splitlines():
        if "error:" in line:
            return line.strip()[:300]
    return ""


def _last_line(stderr: bytes | None) -> str:
    lines = [line for line in (stderr or b"").decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
