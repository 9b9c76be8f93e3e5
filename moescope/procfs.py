"""One reading of /proc for everything moescope asks about a process: name, command line, start
time and liveness.

Liveness has two strengths:

* ``pid_exists(pid)`` — some live process has this pid now (a zombie or a dead task does not
  count). For a pid known only by number (a state file's name, a ring file's name).
* ``ProcessIdentity`` — pid plus start time (``/proc/PID/stat`` field 22, clock ticks since boot),
  taken once; ``alive()`` is False when the process is gone, a zombie, or the pid now belongs to a
  different process (another start time). For a process the agent observes over time.

``/proc/PID/stat`` is parsed past the command name, which is in parentheses and may itself contain
spaces and ``)``: the fields start after the *last* ``)`` on the line.

Every function takes ``proc_root`` (default ``/proc``) so fixture trees can stand in for it, and
none raises for a process that is gone or unreadable: it answers None or False.

Neutral module: imports nothing of moescope's agent, collectors, probes or examples.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PROC",
    "ProcStat",
    "ProcessIdentity",
    "name_thread",
    "parse_stat",
    "pid_exists",
    "read_cmdline",
    "read_comm",
    "read_start_ticks",
    "read_stat",
    "task_cpu",
    "task_cpu_by_name",
    "task_exists",
]

PROC = Path("/proc")

# State letters of a task that has exited: Z zombie (not yet reaped), X dead (being torn down).
EXITED_STATES = frozenset({"Z", "X"})

# Fields after the comm's closing ')' up to and including starttime (field 22 = index 19).
_STAT_FIELDS_AFTER_COMM = 20


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of one /proc/PID/stat line that moescope uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    start_ticks: int
    cpu_ticks: int = 0  # user + system time (fields 14 and 15), clock ticks

    @property
    def exited(self) -> bool:
        return self.state in EXITED_STATES


def parse_stat(line: str | bytes) -> ProcStat:
    """Parse a /proc/PID/stat line; ``ValueError`` on a malformed one."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 1 or close_paren < open_paren:
        raise ValueError(f"not a /proc stat line (no '(comm)'): {text[:80]!r}")
    fields = text[close_paren + 1 :].split()
    if len(fields) < _STAT_FIELDS_AFTER_COMM:
        raise ValueError(f"/proc stat line has {len(fields)} fields after comm, need {_STAT_FIELDS_AFTER_COMM}")
    try:
        return ProcStat(
            pid=int(text[:open_paren]),
            comm=text[open_paren + 1 : close_paren],
            state=fields[0],
            ppid=int(fields[1]),
            start_ticks=int(fields[19]),
            cpu_ticks=int(fields[11]) + int(fields[12]),
        )
    except ValueError:
        raise ValueError(f"/proc stat line has a non-numeric field: {text[:80]!r}") from None


def _task_dir(pid: int, tid: int | None, proc_root: Path) -> Path:
    base = proc_root / str(pid)
    return base if tid is None else base / "task" / str(tid)


def _stat_or_raise(pid: int, tid: int | None, proc_root: Path) -> ProcStat | None:
    """The parsed stat, None when gone or malformed; ``PermissionError`` when hidden (hidepid)."""
    try:
        with open(_task_dir(pid, tid, proc_root) / "stat", "rb") as f:
            raw = f.read()
    except PermissionError:
        raise
    except OSError:  # FileNotFoundError, or ESRCH when the task exits mid-read
        return None
    try:
        return parse_stat(raw)
    except ValueError:
        return None


def read_stat(pid: int, *, tid: int | None = None, proc_root: Path = PROC) -> ProcStat | None:
    """/proc/PID/stat (or /proc/PID/task/TID/stat) parsed; None when gone, unreadable or malformed."""
    if pid <= 0 or (tid is not None and tid <= 0):
        return None
    try:
        return _stat_or_raise(pid, tid, proc_root)
    except PermissionError:
        return None


def read_start_ticks(pid: int, *, proc_root: Path = PROC) -> int | None:
    """Start time of pid in clock ticks since boot (stat field 22); None when gone or unreadable."""
    stat = read_stat(pid, proc_root=proc_root)
    return None if stat is None else stat.start_ticks


def read_comm(pid: int, *, proc_root: Path = PROC) -> str | None:
    """The process's command name (/proc/PID/comm, at most 15 bytes); None when gone or unreadable."""
    if pid <= 0:
        return None
    try:
        with open(proc_root / str(pid) / "comm", encoding="utf-8", errors="replace") as f:
            return f.read().rstrip("\n")  # only the kernel's newline: a name may end in a space
    except OSError:
        return None


def read_cmdline(pid: int, *, proc_root: Path = PROC) -> list[str] | None:
    """argv from /proc/PID/cmdline ([] for a kernel thread or a zombie); None when gone or unreadable."""
    if pid <= 0:
        return None
    try:
        with open(proc_root / str(pid) / "cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw:
        return []
    # NUL-terminated arguments; a process that rewrote its title may leave no trailing NUL
    parts = raw[:-1].split(b"\0") if raw.endswith(b"\0") else raw.split(b"\0")
    return [part.decode("utf-8", "replace") for part in parts]


def _live(pid: int, tid: int | None, proc_root: Path) -> bool:
    if pid <= 0 or (tid is not None and tid <= 0):
        return False
    try:
        stat = _stat_or_raise(pid, tid, proc_root)
    except PermissionError:
        return True  # procfs mounted hidepid=1: the entry exists, we may not read it
    if stat is not None:
        return not stat.exited
    if proc_root != PROC or tid is not None:
        return False
    # hidepid=2 hides other users' processes entirely; the kernel still answers a null signal
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # exists, owned by someone else (root agent, unprivileged reader)
    except OSError:
        return False
    return True  # signalable without a /proc entry: this /proc shows another pid namespace


def pid_exists(pid: int, *, proc_root: Path = PROC) -> bool:
    """True while some live (not zombie) process has this pid; no pid-reuse guard."""
    return _live(pid, None, proc_root)


def task_exists(pid: int, tid: int, *, proc_root: Path = PROC) -> bool:
    """True while thread ``tid`` of process ``pid`` is live (/proc/PID/task/TID, not zombie)."""
    return _live(pid, tid, proc_root)


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """One process, not just its pid: pid plus start time, so a recycled pid is a different process."""

    pid: int
    start_ticks: int

    @classmethod
    def of(cls, pid: int, *, proc_root: Path = PROC) -> ProcessIdentity | None:
        """The identity of the live process now holding pid; None when there is none (gone, zombie)."""
        stat = read_stat(pid, proc_root=proc_root)
        if stat is None or stat.exited:
            return None
        return cls(pid=pid, start_ticks=stat.start_ticks)

    def alive(self, *, proc_root: Path = PROC) -> bool:
        """False once the process is gone, a zombie, or its pid belongs to another process."""
        stat = read_stat(self.pid, proc_root=proc_root)
        return stat is not None and not stat.exited and stat.start_ticks == self.start_ticks


def task_cpu(pid: int, *, proc_root: Path = PROC, precise: bool = False) -> dict[int, tuple[str, float]]:
    """Every thread of ``pid`` now: {tid: (its name, CPU seconds used, user + system)}. Threads
    that exit while being read are left out; {} when the process is gone or unreadable.
    ``precise``: the seconds from the thread's schedstat (the scheduler's nanoseconds on a CPU;
    user + system are 10 ms ticks, too coarse for a thread that runs a few ms a second), its ticks
    where it has none (a kernel without CONFIG_SCHED_INFO)."""
    if pid <= 0:
        return {}
    try:
        tids = os.listdir(proc_root / str(pid) / "task")
    except OSError:
        return {}
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for name in tids:
        if not name.isdigit():
            continue
        stat = read_stat(pid, tid=int(name), proc_root=proc_root)
        if stat is not None:
            run_ns = _schedstat_run_ns(proc_root / str(pid) / "task" / name) if precise else None
            out[int(name)] = (stat.comm, stat.cpu_ticks / ticks_per_s if run_ns is None else run_ns / 1e9)
    return out


def _schedstat_run_ns(task_dir: Path) -> int | None:
    """A thread's time on a CPU in ns (the first field of its schedstat); None when unreadable."""
    try:
        return int((task_dir / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def task_cpu_by_name(pid: int, *, proc_root: Path = PROC, precise: bool = False) -> dict[str, float]:
    """``task_cpu`` by thread name: {name: CPU seconds}, threads of one name summed, the main
    thread (tid = pid) as ``main`` (its own name is the process's)."""
    out: dict[str, float] = {}
    for tid, (comm, cpu_s) in task_cpu(pid, proc_root=proc_root, precise=precise).items():
        name = "main" if tid == pid else comm
        out[name] = out.get(name, 0.0) + cpu_s
    return out


def name_thread(name: str, *, tid: int | None = None) -> bool:
    """Give a thread of this process ``name`` as its OS name (/proc/self/task/TID/comm: what
    ``top -H``, ``ps -L`` and ``task_cpu`` show; the kernel keeps 15 bytes): the calling thread, or
    ``tid`` (any thread of this process). Never the main thread: its name is the process's. False
    where it cannot (a read-only /proc, a thread gone); never raises."""
    path = PROC / "thread-self" / "comm" if tid is None else PROC / "self" / "task" / str(tid) / "comm"
    if (threading.get_native_id() if tid is None else tid) == os.getpid():
        return False
    try:
        with open(path, "wb") as f:
            f.write(name.encode("utf-8", "replace")[:15])
    except OSError:
        return False
    return True
