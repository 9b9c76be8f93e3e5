"""Start the reference runtime and read its start-up banner: the one helper tests and benchmarks use.

    from moescope.examples.moe_runtime.launch import launch, runtime_argv

    rt = launch(runtime_argv("--port", "0", "--no-nvtx"), stderr=subprocess.DEVNULL, timeout_s=120)
    try:
        print(rt.banner.http_port, rt.banner.control_socket, rt.banner.nvtx)
    finally:
        rt.stop()

`python -m moescope.examples.moe_runtime` prints, flushed and in this order, before it serves:

    http port: PORT
    control socket: PATH
    nvtx: active|inactive (no NVTX tool attached)|disabled
    ready

Every wait here is bounded: the child's stdout is read on a daemon thread into a queue, so a silent
child cannot hang the caller, and the thread keeps draining the pipe to EOF afterwards, so the child
never blocks on a full pipe. If the banner does not arrive (timeout, early exit, malformed line),
`launch` kills the child's whole process group, reaps it, and raises `LaunchError`.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from moescope.errors import EXIT_SOURCE_UNAVAILABLE, MoescopeError

REPO = Path(__file__).resolve().parents[2]
HTTP_PORT_PREFIX = "http port: "
CONTROL_SOCKET_PREFIX = "control socket: "
NVTX_PREFIX = "nvtx: "
READY_LINE = "ready"
# Lines kept for error messages once the banner is read (the runtime prints nothing more on stdout).
DEFAULT_TAIL_LINES = 200
REAP_TIMEOUT_S = 15.0


class LaunchError(MoescopeError):
    """A child did not print an expected start-up line: it timed out, exited first, or printed a
    malformed banner. `launch` sets pid, returncode and the last lines read."""

    exit_code = EXIT_SOURCE_UNAVAILABLE

    def __init__(self, message: str, *, pid: int | None = None, returncode: int | None = None,
                 lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.pid = pid
        self.returncode = returncode
        self.lines = tuple(lines)


@dataclass(frozen=True)
class Banner:
    """The runtime's start-up banner."""

    http_port: int
    control_socket: str
    nvtx: str  # "active", "inactive (no NVTX tool attached)" or "disabled"
    lines: tuple[str, ...]  # every line read up to and including "ready" (other lines too, if interleaved)

    @property
    def nvtx_active(self) -> bool:
        return self.nvtx == "active"

    @property
    def nvtx_line(self) -> str:
        return f"{NVTX_PREFIX}{self.nvtx}"


class BannerParser:
    """Feed stdout lines one at a time; `feed` returns the Banner on the "ready" line.

    Lines that are not banner lines are kept in `lines` but otherwise ignored, so the banner can be
    read from output it is interleaved with (an `agent start -- RUNTIME` whose child inherits its
    stdout)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.http_port: int | None = None
        self.control_socket: str | None = None
        self.nvtx: str | None = None

    def feed(self, line: str) -> Banner | None:
        line = line.strip()
        self.lines.append(line)
        if line.startswith(HTTP_PORT_PREFIX):
            value = line.removeprefix(HTTP_PORT_PREFIX)
            if not value.isdigit() or not 0 < int(value) < 65536:
                raise LaunchError(f"malformed banner line {line!r}", lines=self.lines)
            self.http_port = int(value)
        elif line.startswith(CONTROL_SOCKET_PREFIX):
            self.control_socket = line.removeprefix(CONTROL_SOCKET_PREFIX)
        elif line.startswith(NVTX_PREFIX):
            self.nvtx = line.removeprefix(NVTX_PREFIX)
        elif line == READY_LINE:
            missing = [name for name, value in (("http port", self.http_port),
                                                ("control socket", self.control_socket), ("nvtx", self.nvtx))
                       if value is None]
            if missing:
                raise LaunchError(f"banner ended ('ready') without {', '.join(missing)}", lines=self.lines)
            assert self.http_port is not None and self.control_socket is not None and self.nvtx is not None
            return Banner(http_port=self.http_port, control_socket=self.control_socket, nvtx=self.nvtx,
                          lines=tuple(self.lines))
        return None


def parse_banner(lines: Iterable[str]) -> Banner:
    """The first complete banner in lines already read (LaunchError if there is none)."""
    parser = BannerParser()
    for line in lines:
        banner = parser.feed(line)
        if banner is not None:
            return banner
    raise LaunchError("no 'ready' line: the banner is incomplete", lines=parser.lines)


class LineReader:
    """Reads a child's text stream to EOF on a daemon thread.

    Lines wait in a queue for `next_line`/`wait_for` (bounded waits); `keep_lines` of them (None:
    all) stay in `lines()`; `on_line` sees each one on the reader thread (to echo it). Call `drain()`
    once nothing more will be waited for: the thread then only keeps the tail, so an unread queue
    cannot grow while the child runs."""

    def __init__(self, stream: IO[str], *, on_line: Callable[[str], None] | None = None,
                 keep_lines: int | None = DEFAULT_TAIL_LINES) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._kept: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._lock = threading.Lock()
        self._queueing = True
        self._eof = False
        self._on_line = on_line
        self._thread = threading.Thread(target=self._run, args=(stream,), name="line-reader", daemon=True)
        self._thread.start()

    def _run(self, stream: IO[str]) -> None:
        try:
            for raw in stream:
                line = raw.rstrip("\r\n")
                with self._lock:
                    self._kept.append(line)
                    if self._queueing:
                        self._queue.put(line)
                if self._on_line is not None:
                    self._on_line(line)
        except (OSError, ValueError):  # the stream was closed under us: that is EOF for a reader
            pass
        finally:
            self._queue.put(None)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._kept)

    def next_line(self, *, timeout_s: float) -> str | None:
        """The next line (without its newline); None at EOF; TimeoutError after timeout_s."""
        if self._eof:
            return None
        try:
            line = self._queue.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise TimeoutError(f"no line within {timeout_s:.1f} s") from None
        if line is None:
            self._eof = True
        return line

    def wait_for(self, match: str | re.Pattern[str], *, timeout_s: float) -> str:
        """The next line starting with `match` (a str) or matching it (re.search, a Pattern);
        LaunchError on timeout or EOF. Lines before it are consumed."""
        deadline = time.monotonic() + timeout_s
        what = match.pattern if isinstance(match, re.Pattern) else match
        while True:
            try:
                line = self.next_line(timeout_s=deadline - time.monotonic())
            except TimeoutError:
                raise LaunchError(f"timed out after {timeout_s:.0f} s waiting for {what!r}",
                                  lines=self.lines()) from None
            if line is None:
                raise LaunchError(f"stream ended before {what!r}: {self.lines()[-5:]}", lines=self.lines())
            if line.startswith(match) if isinstance(match, str) else match.search(line):
                return line

    def drain(self) -> None:
        """Stop queueing lines (keep reading to EOF, keeping the tail)."""
        with self._lock:
            self._queueing = False
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def join(self, timeout_s: float) -> bool:
        """Wait for EOF; True if the reader finished."""
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()


def read_banner(reader: LineReader, *, timeout_s: float) -> Banner:
    """Read lines until the banner's "ready"; LaunchError on timeout, EOF or a malformed banner."""
    deadline = time.monotonic() + timeout_s
    parser = BannerParser()
    while True:
        try:
            line = reader.next_line(timeout_s=deadline - time.monotonic())
        except TimeoutError:
            raise LaunchError(f"no banner within {timeout_s:.0f} s (read so far: {parser.lines[-5:]})",
                              lines=parser.lines) from None
        if line is None:
            raise LaunchError(f"stdout closed before the banner's 'ready' (read so far: {parser.lines[-5:]})",
                              lines=parser.lines)
        banner = parser.feed(line)
        if banner is not None:
            return banner


def runtime_argv(*args: str, python: str = sys.executable) -> list[str]:
    """`python -m moescope.examples.moe_runtime ARGS`."""
    return [python, "-m", "moescope.examples.moe_runtime", *args]


def kill_group(popen: subprocess.Popen[Any], *, timeout_s: float = REAP_TIMEOUT_S) -> None:
    """SIGKILL the child's process group (it was started in its own session) and reap the child."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    popen.wait(timeout=timeout_s)


@dataclass
class LaunchedRuntime:
    """A started runtime whose banner arrived; stdout keeps being drained by `stdout`."""

    popen: subprocess.Popen[str]
    banner: Banner
    stdout: LineReader

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, *, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the process group, SIGKILL it after timeout_s; returns the exit status."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
                return self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(self.popen)
            except ProcessLookupError:
                pass
        return self.popen.wait(timeout=REAP_TIMEOUT_S)


def launch(argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] = REPO, stderr: int | IO[Any] | None = None,
           on_line: Callable[[str], None] | None = None) -> LaunchedRuntime:
    """Start argv (normally `runtime_argv(...)`) in its own session with stdout piped, and return it
    once its banner is read. Otherwise (timeout, exit, malformed banner, or an exception such as
    KeyboardInterrupt while waiting) kill its process group, reap it and raise; LaunchError carries
    pid, returncode and the lines read.

    stderr: as for subprocess.Popen (None inherits). on_line: called with every stdout line, on the
    reader thread."""
    popen = subprocess.Popen(list(argv), cwd=cwd, env=None if env is None else dict(env), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=stderr, text=True, errors="replace",
                             start_new_session=True)
    assert popen.stdout is not None
    reader = LineReader(popen.stdout, on_line=on_line)
    try:
        banner = read_banner(reader, timeout_s=timeout_s)
    except LaunchError as exc:
        kill_group(popen)
        reader.join(REAP_TIMEOUT_S)
        raise LaunchError(f"{shlex.join(argv[:4])} (pid {popen.pid}, exit status {popen.returncode}): {exc}",
                          pid=popen.pid, returncode=popen.returncode, lines=reader.lines()) from None
    except BaseException:
        kill_group(popen)
        raise
    reader.drain()
    return LaunchedRuntime(popen=popen, banner=banner, stdout=reader)
