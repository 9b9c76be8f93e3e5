"""Which processes `agent start` observes: by pid, by listening TCP port, or a command it launches.

A Target knows whether its process is still the same live process (pid plus start time, so a
recycled pid is not mistaken for the target; a zombie counts as exited).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moescope import errors
from moescope.agent import inherited_environ
from moescope.probes.ingress import procnet
from moescope.procfs import PROC, ProcessIdentity, read_comm

# Holds the launched command until the probe is attached: blocks reading the pipe fd (argv[1]),
# closes it, then execs the command in the same pid, so the pid is traced before the command runs.
# On EOF (agent gone) it runs the command anyway: the agent never holds a server hostage.
_TRAMPOLINE = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "os.read(fd, 1)\n"
    "os.close(fd)\n"
    "for name in filter(None, sys.argv[2].split(',')):\n"
    "    os.environ[name] = str(os.getpid())\n"
    "try:\n"
    "    os.execvp(sys.argv[3], sys.argv[3:])\n"
    "except OSError as exc:\n"
    "    print(f'agent: cannot run {sys.argv[3]}: {exc}', file=sys.stderr)\n"
    "    os._exit(127)\n"
)


@dataclass
class Target:
    """A process being observed."""

    pid: int
    start_ticks: int
    name: str
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # The TCP port it was found by (--port): when it exits, a new listener there is its successor.
    port: int | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return ProcessIdentity(pid=self.pid, start_ticks=self.start_ticks).alive()

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name})"


def target_for_pid(pid: int) -> Target:
    if pid <= 0:
        raise errors.UsageError(f"--pid must be a positive process id, got {pid}")
    if pid == os.getpid():
        raise errors.UsageError(f"--pid {pid} is the agent itself; the agent never traces its own process")
    identity = ProcessIdentity.of(pid)
    if identity is None:
        raise errors.NoSuchProcess(f"no such process: pid {pid}")
    return Target(pid=pid, start_ticks=identity.start_ticks, name=read_comm(pid) or "?")


def pids_listening_on(port: int, *, proc_root: Path = PROC) -> list[int]:
    """Processes holding a TCP socket listening on `port` (in the agent's network namespace).
    Several with SO_REUSEPORT or a pre-forking server: all of them are returned."""
    if not 1 <= port <= 65535:
        raise errors.UsageError(f"--port must be 1..65535, got {port}")
    inodes = {s.inode for s in procnet.listening_sockets(proc_root=proc_root) if s.local_port == port}
    if not inodes:
        raise errors.PortNotListening(f"nothing is listening on TCP port {port}")
    own = os.getpid()
    pids: list[int] = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        if inodes & procnet.socket_fds(int(entry.name), proc_root=proc_root).keys():
            pids.append(int(entry.name))
    if not pids:
        raise errors.PortNotListening(
            f"TCP port {port} is listening but no process visible here holds it (another namespace?)"
        )
    return sorted(pids)


def targets_for_port(port: int) -> list[Target]:
    targets = [target_for_pid(pid) for pid in pids_listening_on(port)]
    for target in targets:
        target.port = port
    return targets


def successors_on_port(port: int, *, known_pids: set[int]) -> list[Target]:
    """Processes now listening on `port` that are not in `known_pids` (a restarted server): [] while
    nothing (visible) listens there. A process that exits between the scan and the check is left
    out; the next scan sees its own successor."""
    try:
        pids = pids_listening_on(port)
    except errors.PortNotListening:
        return []
    found: list[Target] = []
    for pid in pids:
        if pid in known_pids:
            continue
        try:
            target = target_for_pid(pid)
        except errors.NoSuchProcess:
            continue
        target.port = port
        found.append(target)
    return found


class LaunchedCommand:
    """A command started by the agent, held before exec until release() (after attach)."""

    def __init__(self, argv: list[str], *, extra_env: dict[str, str] | None = None,
                 pid_env: tuple[str, ...] = ()) -> None:
        """`extra_env` is added to the agent's environment for the command (e.g. the NVTX
        injection variables); each variable of `pid_env` is set to the command's own pid, which
        only the held process knows before exec (the NVTX library arms the ring of that pid)."""
        if any(not name or "," in name or "=" in name for name in pid_env):
            raise ValueError(f"pid_env names variables: {pid_env!r}")
        if not argv:
            raise errors.UsageError("no command given after --")
        if shutil.which(argv[0]) is None:
            raise errors.UsageError(f"command not found: {argv[0]}")
        read_fd, self._release_fd = os.pipe()
        try:
            self.popen: subprocess.Popen[bytes] = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(read_fd), ",".join(pid_env), *argv],
                pass_fds=(read_fd,),
                env={**inherited_environ(), **(extra_env or {})},
            )
        finally:
            os.close(read_fd)
        identity = ProcessIdentity.of(self.popen.pid)
        self.target = Target(
            pid=self.popen.pid,
            start_ticks=identity.start_ticks if identity else 0,  # alive() asks the Popen, not this
            name=os.path.basename(argv[0]),
            popen=self.popen,
        )

    def release(self) -> None:
        """Let the held command exec (same pid, now traced)."""
        if self._release_fd >= 0:
            try:
                os.write(self._release_fd, b"go\n")
            except BrokenPipeError:
                pass  # it already exited; its status is reported
            os.close(self._release_fd)
            self._release_fd = -1

    def exit_status(self) -> int:
        """The command's exit status, shell style: 128 + N when killed by signal N."""
        code = self.popen.wait()
        return 128 - code if code < 0 else code

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s; never leaves it running or unreaped. A command
        still held (the agent failed before its release, e.g. /metrics could not bind) is stopped
        in the trampoline: it never runs (releasing it first ran it for a moment, or for good when
        the agent exited before it died: a user trial found the server orphaned)."""
        try:
            if self.popen.poll() is not None:
                return
            self.popen.send_signal(signal.SIGTERM)  # the trampoline, or the command it became
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        finally:
            if self._release_fd >= 0:  # never released: closed unwritten (its reader is gone)
                os.close(self._release_fd)
                self._release_fd = -1
