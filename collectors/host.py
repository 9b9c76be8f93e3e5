"""Host memory telemetry: the target's RSS and its cgroup memory, as the "device memory used / total"
signal the policy reads when there is no GPU (or no NVIDIA driver).

Everything is read from procfs and the cgroup filesystem. Both roots are injectable (`proc_root`,
`rootfs`) so tests point them at fixture trees; nothing here needs root except reading another
user's /proc/PID files.

Signal choice on the host, first that applies:
  budget  a configured budget: used = the target's RSS, total = the budget
  cgroup  the target's cgroup (v2 or v1) has a memory limit at some level: used = working set
          (usage minus inactive file cache, the kubelet's eviction signal), total = the limit
  rss     otherwise: used = the target's RSS, total = MemTotal of the host
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moescope.collectors.registry import CollectorConfig, register
from moescope.errors import SourceUnavailable
from moescope.procfs import EXITED_STATES, pid_exists

log = logging.getLogger("moescope.host")

MemorySource = Literal["nvml", "cgroup", "budget", "rss"]
RssSource = Literal["status", "smaps_rollup"]

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE (0x7FFFFFFFFFFFF000 with 4 KiB pages);
# anything this large cannot be a real limit on any machine.
CGROUP_V1_UNLIMITED_MIN_BYTES = 1 << 62
# Bounds the process-tree walk so a pathological /proc cannot keep a collection busy.
MAX_TREE_PIDS = 4096


@dataclass(frozen=True, slots=True)
class MemorySignal:
    """The one memory number the policy reads: used / total of whatever bounds the target."""

    used_bytes: int
    total_bytes: int
    source: MemorySource
    scope: str  # what the numbers describe, e.g. "GPU 0 GPU-…", "cgroup v2 /a/b", "host RAM"
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        ratio = self.used_bytes / self.total_bytes if self.total_bytes > 0 else math.nan
        object.__setattr__(self, "ratio", ratio)


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """One cgroup level's memory: usage, limit (None = unlimited) and reclaimable file cache."""

    version: Literal[1, 2]
    path: str  # the cgroup path, as /proc/PID/cgroup names it
    directory: str  # where it was read (under rootfs)
    current_bytes: int
    max_bytes: int | None
    inactive_file_bytes: int | None

    @property
    def working_set_bytes(self) -> int:
        # Inactive file pages are the first the kernel reclaims before the limit bites.
        inactive = self.inactive_file_bytes or 0
        return max(self.current_bytes - inactive, 0)


@dataclass(frozen=True, slots=True)
class HostSample:
    at_ns: int  # wall clock, time.time_ns()
    pid: int
    alive: bool
    rss_bytes: int | None
    cgroup: CgroupMemory | None
    cgroup_error: str | None  # why there is no cgroup reading, when there is none
    host_total_bytes: int | None
    signal: MemorySignal | None

    def memory_signal(self) -> MemorySignal | None:
        return self.signal


class TargetGone(Exception):
    """Internal: the target's /proc entry disappeared while reading it."""


# ---------------------------------------------------------------- procfs readers


_READ_CHUNK_BYTES = 1 << 16


def _read_text(path: Path | str) -> str:
    """The whole file, read with raw os.read: procfs/cgroupfs files are small, and a text-mode
    open() (buffer + decoder objects) cost about 3x the read itself, several times per sample."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, _READ_CHUNK_BYTES)]
        while chunks[-1]:  # procfs may hand a large file over in pieces: read to EOF
            chunks.append(os.read(fd, _READ_CHUNK_BYTES))
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def read_rss_bytes(pid: int, *, proc_root: Path = Path("/proc"), source: RssSource = "status") -> int:
    """Resident set size of one process. Raises TargetGone when the process no longer exists.

    "status" (default) reads the kernel's per-mm counters without walking page tables;
    "smaps_rollup" is exact but walks every mapping under the target's mmap lock, which can stall
    a large serving process's own mmap/munmap, so it is opt-in.
    """
    name, key = ("status", "VmRSS:") if source == "status" else ("smaps_rollup", "Rss:")
    try:
        text = _read_text(proc_root / str(pid) / name)
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise TargetGone(f"process {pid} exited") from exc
    for line in text.splitlines():
        if line.startswith(key):
            parts = line.split()
            return int(parts[1]) * 1024  # procfs says "kB" and means KiB
    if source == "status":
        # A zombie (or a kernel thread) has no VmRSS line: it holds no memory.
        return 0
    raise ValueError(f"{proc_root / str(pid) / name}: no {key} line")


def read_live_rss_bytes(pid: int, *, proc_root: Path = Path("/proc")) -> int:
    """RSS from /proc/PID/status, with liveness from the same read: raises TargetGone when the
    process is gone, a zombie or dead (its State line), so a sample needs no separate stat read."""
    try:
        text = _read_text(f"{proc_root}/{pid}/status")  # a str path: Path arithmetic cost more than the read
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise TargetGone(f"process {pid} exited") from exc
    state = _status_field(text, "State:")
    if state and state[0] in EXITED_STATES:
        raise TargetGone(f"process {pid} exited")
    rss = _status_field(text, "VmRSS:")
    return int(rss[0]) * 1024 if rss else 0  # "kB" meaning KiB; no VmRSS line: holds no memory


def _status_field(text: str, key: str) -> list[str]:
    """The words after `key` on its line of a /proc status text ([] when absent); a find, not a
    split of every line: this runs on each sample."""
    if text.startswith(key):
        at = 0
    else:
        at = text.find("\n" + key)
        if at < 0:
            return []
        at += 1
    end = text.find("\n", at)
    return text[at + len(key) : end if end >= 0 else len(text)].split()


def read_meminfo_total_bytes(*, proc_root: Path = Path("/proc")) -> int | None:
    try:
        text = _read_text(proc_root / "meminfo")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def process_tree(pid: int, *, proc_root: Path = Path("/proc")) -> frozenset[int]:
    """pid and its live descendants (serving engines often hold GPU memory in worker processes).

    Uses /proc/PID/task/TID/children; falls back to scanning every /proc/N/stat for parent ids when
    the kernel lacks CONFIG_PROC_CHILDREN. Empty when pid itself is gone.
    """
    if not (proc_root / str(pid)).is_dir():
        return frozenset()
    probe = proc_root / str(pid) / "task" / str(pid) / "children"
    if probe.exists():
        return _tree_from_children_files(pid, proc_root)
    return _tree_from_stat_scan(pid, proc_root)


def _tree_from_children_files(pid: int, proc_root: Path) -> frozenset[int]:
    seen: set[int] = {pid}
    queue = [pid]
    while queue and len(seen) < MAX_TREE_PIDS:
        current = queue.pop()
        try:
            tids = os.listdir(proc_root / str(current) / "task")
        except OSError:
            continue
        for tid in tids:
            try:
                text = _read_text(proc_root / str(current) / "task" / tid / "children")
            except OSError:
                continue
            for child in text.split():
                child_pid = int(child)
                if child_pid not in seen:
                    seen.add(child_pid)
                    queue.append(child_pid)
    return frozenset(seen)


def _tree_from_stat_scan(pid: int, proc_root: Path) -> frozenset[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        try:
            stat = _read_text(proc_root / entry / "stat")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    seen: set[int] = {pid}
    queue = [pid]
    while queue and len(seen) < MAX_TREE_PIDS:
        for child in children.get(queue.pop(), []):
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return frozenset(seen)


def in_nested_pid_namespace(*, proc_root: Path = Path("/proc")) -> bool:
    """True when this process's pids are not the host's (NSpid lists more than one pid)."""
    try:
        text = _read_text(proc_root / "self" / "status")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) > 2
    return False


# ---------------------------------------------------------------- cgroups


@dataclass(frozen=True, slots=True)
class _Mount:
    root: str
    mount_point: str
    fstype: str
    super_options: frozenset[str]


def _unescape_mountinfo(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "\\" and i + 4 <= len(text) and text[i + 1 : i + 4].isdigit():
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[_Mount]:
    mounts: list[_Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf = left.split()
        rf = right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        mounts.append(
            _Mount(
                root=_unescape_mountinfo(lf[3]),
                mount_point=_unescape_mountinfo(lf[4]),
                fstype=rf[0],
                super_options=frozenset(rf[2].split(",")),
            )
        )
    return mounts


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """(v1 memory controller path, v2 unified path) from /proc/PID/cgroup text."""
    v1_memory: str | None = None
    v2: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1_memory = path
    return v1_memory, v2


def _cgroup_directory(path: str, mount: _Mount, rootfs: Path) -> Path:
    relative = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        relative = path[len(mount.root) :]
    return rootfs / mount.mount_point.lstrip("/") / relative.lstrip("/")


def _pick_mount(mounts: list[_Mount], path: str, *, version: Literal[1, 2]) -> _Mount | None:
    if version == 2:
        candidates = [m for m in mounts if m.fstype == "cgroup2"]
    else:
        candidates = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options]

    def prefix_len(m: _Mount) -> int:
        if m.root == "/":
            return 0
        return len(m.root) if path == m.root or path.startswith(m.root.rstrip("/") + "/") else -1

    ranked = sorted(candidates, key=prefix_len, reverse=True)
    return ranked[0] if ranked and prefix_len(ranked[0]) >= 0 else None


def _read_int_file(path: Path | str) -> int | None:
    """Integer content; None for "max" (v2's unlimited). Raises FileNotFoundError when absent."""
    value = _read_text(path).strip()
    if value == "max":
        return None
    return int(value)


def _read_stat_key(path: Path | str, key: str) -> int | None:
    try:
        text = _read_text(path)
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


def _read_limit(version: Literal[1, 2], directory: Path | str) -> int | None:
    """One level's memory limit, None when unlimited (v2 "max", v1's page-counter maximum)."""
    if version == 2:
        return _read_int_file(f"{directory}/memory.max")
    limit = _read_int_file(f"{directory}/memory.limit_in_bytes")
    return None if limit is not None and limit >= CGROUP_V1_UNLIMITED_MIN_BYTES else limit


def _read_level(version: Literal[1, 2], cg_path: str, directory: Path | str, *, limit: int | None = None,
                limit_read: bool = False) -> CgroupMemory:
    """One level's usage, limit and inactive file cache; `limit_read`: the caller read the limit."""
    usage_name, inactive_key = ("memory.current", "inactive_file") if version == 2 else (
        "memory.usage_in_bytes", "total_inactive_file")
    current = _read_int_file(f"{directory}/{usage_name}")
    if not limit_read:
        limit = _read_limit(version, directory)
    inactive = _read_stat_key(f"{directory}/memory.stat", inactive_key)
    if current is None:
        raise ValueError(f"{directory}: usage reads 'max'")
    return CgroupMemory(
        version=version,
        path=cg_path,
        directory=str(directory),
        current_bytes=current,
        max_bytes=limit,
        inactive_file_bytes=inactive,
    )


def read_cgroup_memory(
    pid: int, *, proc_root: Path = Path("/proc"), rootfs: Path = Path("/"), mounts: list[_Mount] | None = None
) -> CgroupMemory:
    """The target's cgroup memory, from the level that is closest to its limit.

    A limit set on a parent (a systemd slice, a pod) bounds the child too, so every level from the
    target's cgroup up to the mount root is read and the limited level with the highest working-set
    ratio wins; with no limit anywhere, the target's own level is returned with max_bytes None.
    Raises TargetGone if the process is gone, LookupError (one-line reason) if nothing can be read.
    `mounts`: this process's parsed mountinfo when the caller keeps it (read here otherwise).
    """
    try:
        cgroup_text = _read_text(f"{proc_root}/{pid}/cgroup")
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise TargetGone(f"process {pid} exited") from exc
    v1_path, v2_path = parse_proc_cgroup(cgroup_text)
    version: Literal[1, 2]
    if v1_path is not None:
        version, cg_path = 1, v1_path
    elif v2_path is not None:
        version, cg_path = 2, v2_path
    else:
        raise LookupError(f"process {pid}: no memory cgroup in {proc_root / str(pid) / 'cgroup'}")
    if mounts is None:
        mounts = read_mounts(proc_root=proc_root)
    mount = _pick_mount(mounts, cg_path, version=version)
    if mount is None:
        kind = "cgroup2" if version == 2 else "cgroup (memory)"
        raise LookupError(f"no {kind} filesystem mounted for cgroup {cg_path}")
    # str paths from here: a walk of Path objects cost more than the reads it made
    leaf_dir = str(_cgroup_directory(cg_path, mount, rootfs))
    mount_dir = str(_cgroup_directory(mount.root, mount, rootfs))
    try:
        leaf = _read_level(version, cg_path, leaf_dir)
    except FileNotFoundError as exc:
        raise LookupError(f"cgroup v{version} {cg_path}: {Path(exc.filename or '').name} missing") from exc
    except (OSError, ValueError) as exc:
        raise LookupError(f"cgroup v{version} {cg_path}: {exc}") from exc

    best = leaf if leaf.max_bytes is not None else None
    level_dir, level_path = leaf_dir, cg_path
    while level_dir != mount_dir and level_dir != os.path.dirname(level_dir):
        level_dir = os.path.dirname(level_dir)
        level_path = level_path.rstrip("/").rsplit("/", 1)[0] or "/"
        try:
            # The limit first: an unlimited level bounds nothing, so its usage and stat go unread.
            limit = _read_limit(version, level_dir)
            if limit is None:
                continue
            level = _read_level(version, level_path, level_dir, limit=limit, limit_read=True)
        except (OSError, ValueError):
            continue  # the hierarchy root has no limit files; a level we cannot read bounds nothing we see
        if best is None or _ratio(level) > _ratio(best):
            best = level
    return best if best is not None else leaf


def read_mounts(*, proc_root: Path = Path("/proc")) -> list[_Mount]:
    try:
        return parse_mountinfo(_read_text(proc_root / "self" / "mountinfo"))
    except OSError as exc:
        raise LookupError(f"cannot read mountinfo: {exc}") from exc


def _ratio(level: CgroupMemory) -> float:
    assert level.max_bytes is not None
    return level.working_set_bytes / level.max_bytes if level.max_bytes > 0 else math.inf


# ---------------------------------------------------------------- the collector

MOUNTS_REFRESH_NS = 10_000_000_000


class HostCollector:
    """Samples the target's RSS and cgroup memory; its samples carry the host memory signal."""

    name = "host"

    def __init__(
        self,
        target_pid: int,
        *,
        period_s: float = 0.2,
        budget_bytes: int | None = None,
        proc_root: Path = Path("/proc"),
        rootfs: Path = Path("/"),
        rss_source: RssSource = "status",
    ) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"memory budget must be positive, got {budget_bytes}")
        self.target_pid = target_pid
        self.period_s = period_s
        self.budget_bytes = budget_bytes
        self.proc_root = proc_root
        self.rootfs = rootfs
        self.rss_source: RssSource = rss_source
        self._gone_reported = False
        self._cgroup_error_reported: str | None = None
        # mountinfo and MemTotal are re-read every MOUNTS_REFRESH_NS, not every sample (mountinfo
        # was a third of the collector's CPU): cgroup filesystems are mounted once at boot or
        # container start, and MemTotal moves only on memory hot-plug.
        self._mounts: list[_Mount] | None = None
        self._mounts_read_ns = 0
        self._host_total: int | None = None
        self._host_total_read_ns = 0

    def collect(self) -> HostSample:
        now_ns = time.time_ns()
        if self._host_total is None or now_ns - self._host_total_read_ns > MOUNTS_REFRESH_NS:
            self._host_total = read_meminfo_total_bytes(proc_root=self.proc_root)
            self._host_total_read_ns = now_ns
        host_total = self._host_total
        try:
            if self.rss_source == "status":  # liveness and RSS from one read of /proc/PID/status
                rss = read_live_rss_bytes(self.target_pid, proc_root=self.proc_root)
            else:
                if not pid_exists(self.target_pid, proc_root=self.proc_root):
                    raise TargetGone(f"process {self.target_pid} exited")
                rss = read_rss_bytes(self.target_pid, proc_root=self.proc_root, source=self.rss_source)
            cgroup: CgroupMemory | None = None
            cgroup_error: str | None = None
            try:
                if self._mounts is None or now_ns - self._mounts_read_ns > MOUNTS_REFRESH_NS:
                    self._mounts, self._mounts_read_ns = None, now_ns
                    self._mounts = read_mounts(proc_root=self.proc_root)
                cgroup = read_cgroup_memory(
                    self.target_pid, proc_root=self.proc_root, rootfs=self.rootfs, mounts=self._mounts
                )
            except LookupError as exc:
                cgroup_error = str(exc)
                if cgroup_error != self._cgroup_error_reported:
                    log.info("host memory: no cgroup reading (%s); using %s", cgroup_error,
                             "the budget" if self.budget_bytes else "RSS / host RAM")
                    self._cgroup_error_reported = cgroup_error
        except TargetGone as exc:
            if not self._gone_reported:
                log.warning("target %s: host memory signal stopped", exc)
                self._gone_reported = True
            return HostSample(now_ns, self.target_pid, False, None, None, str(exc), host_total, None)
        signal = self._signal(rss, cgroup, host_total)
        return HostSample(now_ns, self.target_pid, True, rss, cgroup, cgroup_error, host_total, signal)

    def _signal(self, rss: int, cgroup: CgroupMemory | None, host_total: int | None) -> MemorySignal | None:
        if self.budget_bytes is not None:
            return MemorySignal(rss, self.budget_bytes, "budget", f"pid {self.target_pid} RSS / budget")
        if cgroup is not None and cgroup.max_bytes is not None:
            return MemorySignal(
                cgroup.working_set_bytes, cgroup.max_bytes, "cgroup", f"cgroup v{cgroup.version} {cgroup.path}"
            )
        if host_total is not None:
            return MemorySignal(rss, host_total, "rss", f"pid {self.target_pid} RSS / host RAM")
        return None

    def close(self) -> None:
        return None


def _factory(config: CollectorConfig) -> HostCollector:
    if config.target_pid is None:
        raise SourceUnavailable("host memory needs a target pid")
    return HostCollector(
        config.target_pid,
        period_s=config.period_s,
        budget_bytes=config.budget_bytes,
        proc_root=config.proc_root,
        rootfs=config.rootfs,
    )


register(
    "host",
    _factory,
    help="the target's RSS and cgroup memory: the memory signal where there is no GPU",
    memory_signal_priority=10,
)
