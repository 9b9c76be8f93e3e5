"""The runtime's stats page: the per-period part of `stats` in a small shared-memory file.

A policy reads a runtime's queues five times a second. Over the control socket each read wakes the
agent twice and the runtime once (~0.3 ms of CPU cold on each side, measured: docs/benchmarks.md
"Stats page"); from a file on tmpfs in which the runtime keeps those counters (its own arrays are
views of the file: a layer's routing lands there as it is counted) it is one `pread` and wakes
nobody. The runtime names the page in its `stats` reply (docs/control-protocol.md "Stats page");
the poller reads it each period and asks the socket again only when the page's `version` moved
(placement, precision or capacity changed) or a refresh is due.

Layout ``moescope-stats-page/2`` (little-endian; every field 8-byte aligned):

    offset  field
    0       magic           8 bytes  b"MOESTAT1"
    8       layout          u32      2
    12      header_bytes    u32      64
    16      layers          u32      L
    20      experts         u32      E
    24      seq             u64      even when consistent; odd while the writer is in an update
    32      version         u64      bumped when anything of `stats` outside this page may have changed
    40      updates         u64      updates written (layers routed, idles, penalties, versions)
    48      pid             i64      the writer's pid
    56      peak_bucket     u64      the newest peak bucket written: CLOCK_MONOTONIC ns // 200 ms
    64      queue_depth     i64[L*E] tokens routed to each expert by its layer's latest routing (0 when idle)
            penalty         f64[L*E] the router penalty set on each expert
            queue_peak      i64[2*L*E] the deepest queue_depth of each expert in a 200 ms bucket:
                                     bucket b in half b % 2 (layout 2)
            tokens          i64[L*E] tokens routed to each expert since start (cumulative)
            entropy_bits    f64[L]   each layer's latest mean token router entropy

Peaks: a queue is a step's, and a prefill's (hundreds of tokens on one expert) lasts one step, so a
poller reading `queue_depth` every 200 ms saw it by chance. The writer keeps the deepest value per
expert per 200 ms bucket of CLOCK_MONOTONIC (``PEAK_BUCKET_NS``), the current bucket and the one
before; a reader at bucket r takes both halves when the newest written is r, only that half when it
is r - 1, nothing when older (``held_peak``). A queue is thus seen for 200-400 ms after it was
routed: by every poller reading at least every 200 ms, and by at most two consecutive 200 ms polls.

A reader copies the file with one `pread` and reads `seq` again after it: equal and even, the copy
is one update's (seqlock). Every 8-byte value is written whole, so a copy that races an update on a
weakly ordered CPU still holds only values the runtime had. The reader never maps the file: a
runtime that truncates it makes a short read (an error counted), never a SIGBUS in the agent.

Neutral module: the reference runtime writes pages, the agent reads them.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from moescope.procfs import pid_exists

_native: ModuleType | None
try:
    import moescope._page_busy as _native
except ImportError:  # a source checkout without `pip install -e .`: numpy's path (busy_numpy)
    _native = None

LAYOUT_NAME = "moescope-stats-page/2"
MAGIC = b"MOESTAT1"
LAYOUT = 2
HEADER_BYTES = 64
# magic, layout, header_bytes, layers, experts, seq, version, updates, pid, peak_bucket
_HEADER = struct.Struct("<8sIIIIQQQqQ")
_SEQ_OFFSET = 24
_VERSION_OFFSET = 32  # version, then updates
PEAK_BUCKET_NS = 200_000_000  # the queue peaks' bucket: the policy's sample period (DESIGN.md)
MAX_PAGE_BYTES = 64 << 20  # a reader refuses larger pages: ~2.8 M experts, far past any model
READ_TRIES = 3  # copies a read makes while the writer is mid-update before it gives up for the period
FILE_PREFIX = "moescope-stats-"  # then the writer's pid, "-", a random part


class StatsPageError(Exception):
    """A page that cannot be (or no longer be) read: the message is one line, the path in it."""


def page_bytes(layers: int, experts: int) -> int:
    return HEADER_BYTES + 40 * layers * experts + 8 * layers


def peak_bucket(now_ns: int) -> int:
    """The peak bucket of a CLOCK_MONOTONIC time (time.monotonic_ns())."""
    return now_ns // PEAK_BUCKET_NS


def roll_peaks(peaks: np.ndarray, written: int, bucket: int) -> None:
    """Make ``peaks`` ([2, ...], bucket b in half b % 2, the newest written ``written``) ready for
    a write in ``bucket``: the half it reuses is cleared, both after a gap of two buckets or more."""
    if bucket == written + 1:
        peaks[bucket & 1] = 0
    elif bucket != written:
        peaks[...] = 0


def held_peak(peaks: np.ndarray, written: int, now_bucket: int) -> np.ndarray:
    """The deepest value of each entry over the current bucket and the one before (a new array):
    both halves when the newest written is ``now_bucket`` (or ahead of it: another clock), that half
    when it is the one before, zeros when older."""
    if written >= now_bucket:
        return np.maximum(peaks[0], peaks[1])
    if written == now_bucket - 1:
        return peaks[written & 1].copy()
    return np.zeros_like(peaks[0])


def default_directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class StatsPageWriter:
    """The runtime's side: creates the page (mode 0600, a fresh name). Its arrays are numpy
    views of the page: the runtime keeps its own counters in them (``RuntimeStats.attach_page``),
    so an update costs the seq words around it, not a copy. Every update is made between
    ``begin()`` and ``end()`` (one lock: a step's layers and the control thread's penalties)."""

    def __init__(self, *, layers: int, experts: int, directory: Path | None = None) -> None:
        if layers < 1 or experts < 1:
            raise ValueError(f"a stats page needs layers and experts >= 1, got {layers} x {experts}")
        self.layers, self.experts = layers, experts
        self.size = page_bytes(layers, experts)
        directory = directory or default_directory()
        sweep_stale_pages(directory)
        fd, name = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{os.getpid()}-", dir=directory)
        self.path = Path(name)
        try:
            os.ftruncate(fd, self.size)
            os.pwrite(fd, _HEADER.pack(MAGIC, LAYOUT, HEADER_BYTES, layers, experts, 0, 0, 0, os.getpid(), 0), 0)
            # never unmapped: the runtime's arrays stay views of it after close() removed the file
            mapped = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        n, shape = layers * experts, (layers, experts)
        # seq, version, updates, pid, peak_bucket
        self._words = np.frombuffer(mapped, dtype="<u8", count=5, offset=_SEQ_OFFSET)
        self.queue_depth = np.frombuffer(mapped, dtype="<i8", count=n, offset=HEADER_BYTES).reshape(shape)
        self.penalty = np.frombuffer(mapped, dtype="<f8", count=n, offset=HEADER_BYTES + 8 * n).reshape(shape)
        self.queue_peak = np.frombuffer(mapped, dtype="<i8", count=2 * n,
                                        offset=HEADER_BYTES + 16 * n).reshape((2, *shape))
        self.tokens = np.frombuffer(mapped, dtype="<i8", count=n, offset=HEADER_BYTES + 32 * n).reshape(shape)
        self.entropy_bits = np.frombuffer(mapped, dtype="<f8", count=layers, offset=HEADER_BYTES + 40 * n)
        self._lock = threading.Lock()
        self._seq = self._version = self._updates = 0
        self._version_key: object = None
        self._unlink = weakref.finalize(self, _unlink, self.path)  # at exit too, if close() was not called

    def begin(self) -> None:
        """Start an update (the page's seq goes odd); the arrays may be written until ``end()``."""
        self._lock.acquire()
        self._seq += 1
        self._words[0] = self._seq

    def end(self, version_key: object = None, *, moved: bool = False) -> None:
        """Finish an update; the version moves on with ``moved``, or when ``version_key`` (what the
        rest of `stats` depends on) differs from the last one given."""
        try:
            if moved or (version_key is not None and version_key != self._version_key):
                self._version += 1
                self._words[1] = self._version
            if version_key is not None:
                self._version_key = version_key
            self._updates += 1
            self._words[2] = self._updates
            self._seq += 1
            self._words[0] = self._seq
        finally:
            self._lock.release()

    def set_peak_bucket(self, bucket: int) -> None:
        """Inside an update: the newest bucket the peaks hold (see ``roll_peaks``)."""
        self._words[4] = bucket

    def publish_penalty(self, penalty: np.ndarray) -> None:
        self.begin()
        try:
            self.penalty[...] = penalty
        finally:
            self.end()

    def note_version(self, version_key: object) -> None:
        """Once a step: an update that moves the version only when ``version_key`` changed (an
        on-demand load cached into a pool moves the placement without a command)."""
        if version_key != self._version_key:  # (read unlocked: a stale read makes one extra update)
            self.begin()
            self.end(version_key)

    def touch(self, version_key: object = None) -> None:
        """After a command that may have changed something outside the page: the version moves on."""
        self.begin()
        self.end(version_key, moved=True)

    def close(self) -> None:
        """Remove the page (a reader holding it open keeps reading the last update)."""
        self._unlink()


def sweep_stale_pages(directory: Path) -> int:
    """Remove the pages in ``directory`` that this user's processes left behind when they were killed
    (a page is removed on a clean exit); returns how many. Another user's pages are left alone."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    uid = os.getuid()
    for entry in entries:
        pid_text, _, rest = entry.name.removeprefix(FILE_PREFIX).partition("-")
        if not entry.name.startswith(FILE_PREFIX) or not pid_text.isdigit() or not rest:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid or pid_exists(int(pid_text)):
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:
            continue
    return removed


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


@dataclass(frozen=True, slots=True)
class PageBusy:
    """One consistent update of a page, as the policy's queue signal reads it beside NVTX: the
    experts at or past a queue floor and the penalised ones (``StatsPageReader.read_busy``)."""

    version: int
    updates: int
    queued: dict[tuple[int, int], float]  # (layer, expert) -> max(queue_depth, held peak), at or past the floor
    penalised: list[tuple[int, int]]  # penalty > 0, in index order
    peaks: bool  # any held peak non-zero


def busy_numpy(buf: bytes | bytearray | memoryview, layers: int, experts: int, floor: float, written: int,
               now_bucket: int) -> tuple[dict[tuple[int, int], float], list[tuple[int, int]], bool]:
    """``_page_busy.busy`` with numpy (where the module is not built; tests hold both equal): the
    queued experts of a page copy (level = max(queue_depth, held peak) >= floor, as floats), the
    penalised ones, and whether any held peak is non-zero."""
    n = layers * experts
    words = np.frombuffer(buf, dtype=np.uint8, count=32 * n, offset=HEADER_BYTES)
    depth = words[:8 * n].view("<i8")
    penalty = words[8 * n:16 * n].view("<f8")
    peak = held_peak(words[16 * n:32 * n].view("<i8").reshape(2, n), written, now_bucket)
    level = np.maximum(depth, peak)
    at = np.flatnonzero(level >= floor)
    queued = dict(zip(map(divmod, at.tolist(), itertools.repeat(experts)), map(float, level[at].tolist()),
                      strict=True))
    penalised = [divmod(i, experts) for i in np.flatnonzero(penalty > 0).tolist()]
    return queued, penalised, bool(peak.any())


busy_of_copy = busy_numpy if _native is None else _native.busy
# StatsPageReader.read_busy's whole read in one native call (None: the Python path, as without it)
read_busy_native: Callable[..., Any] | None = None if _native is None else _native.read_busy


@dataclass(frozen=True, slots=True)
class PageSnapshot:
    """One consistent update of a page."""

    version: int
    updates: int
    queue_depth: np.ndarray  # int64 [L, E]
    penalty: np.ndarray  # float64 [L, E]
    queue_peak: np.ndarray  # int64 [L, E]: held_peak at the read's time (the deepest in 200-400 ms)
    tokens: np.ndarray  # int64 [L, E] (read without routing: [0, E], nothing)
    entropy_bits: np.ndarray  # float64 [L] (read without routing: [0])


class StatsPageReader:
    """The agent's side. ``open`` checks the file before anything is read from it: a regular file
    (not followed through a link), owned by ``owner_uid``, of exactly the size its shape makes, with
    this layout's header for that shape and pid. Errors are StatsPageError, one line each."""

    def __init__(self, fd: int, path: str, layers: int, experts: int, pid: int) -> None:
        self._fd = fd
        self.path = path
        self.layers, self.experts, self.pid = layers, experts, pid
        self.size = page_bytes(layers, experts)
        self._buf = bytearray(self.size)
        self._seq = bytearray(8)
        self._words = bytearray(16)  # version, updates: what a read checks first
        # the last snapshot returned, while it can stand for the page: (it, routing), or (the last
        # PageBusy, its floor); kept only when its held peaks were all 0 (see ``read``)
        self._last: tuple[PageSnapshot, bool] | tuple[PageBusy, float] | None = None

    @classmethod
    def open(cls, path: str, *, layers: int, experts: int, pid: int, owner_uid: int | None) -> StatsPageReader:
        size = page_bytes(layers, experts)
        if size > MAX_PAGE_BYTES:
            raise StatsPageError(f"stats page {path}: {layers} x {experts} experts is past the "
                                 f"{MAX_PAGE_BYTES} byte cap")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise StatsPageError(f"stats page {path}: cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StatsPageError(f"stats page {path}: not a regular file")
            if owner_uid is not None and st.st_uid != owner_uid:
                raise StatsPageError(f"stats page {path}: owned by uid {st.st_uid}, not the runtime's {owner_uid}")
            if st.st_size != size:
                raise StatsPageError(f"stats page {path}: {st.st_size} bytes, want {size} for {layers} x {experts}")
            header = os.pread(fd, HEADER_BYTES, 0)
            if len(header) != HEADER_BYTES:
                raise StatsPageError(f"stats page {path}: short header")
            magic, layout, header_bytes, got_l, got_e, _, _, _, got_pid, _ = _HEADER.unpack(header)
            if magic != MAGIC or layout != LAYOUT or header_bytes != HEADER_BYTES:
                raise StatsPageError(f"stats page {path}: not a {LAYOUT_NAME} page")
            if (got_l, got_e, got_pid) != (layers, experts, pid):
                raise StatsPageError(f"stats page {path}: for {got_l} x {got_e} experts of pid {got_pid}, "
                                     f"want {layers} x {experts} of pid {pid}")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, layers, experts, pid)

    def read(self, *, routing: bool = True) -> PageSnapshot | None:
        """One consistent update (None: the writer was mid-update on every try); without ``routing``
        only the header, queues, penalties and peaks are copied (a fifth less to copy, and to race with
        a writer in the middle of a step). StatsPageError when the page went wrong (cut short, its
        header changed).

        The previous snapshot itself is returned when the page has had no update since it (the same
        ``version`` and ``updates``: every write moves ``updates``) and its held peaks were all 0: its
        values are then the page's now (a held peak only falls to 0 as buckets pass). An idle runtime's
        page is thus checked with one 16-byte read, and a caller may keep what it made of the object."""
        last = self._last
        if last is not None and type(last[0]) is PageSnapshot and last[1] == routing and self._unchanged(last[0]):
            return last[0]
        self._last = None
        length = self.size if routing else HEADER_BYTES + 32 * self.layers * self.experts
        copied = self._copy(length)
        if copied is None:
            return None
        snapshot = self._snapshot(*copied, length)
        if not snapshot.queue_peak.any():
            self._last = (snapshot, routing)
        return snapshot

    def read_busy(self, floor: float) -> PageBusy | None:
        """``read(routing=False)`` as the policy's queue signal takes it: the experts whose queue
        (or held peak) is at or past ``floor`` and the penalised ones, made in one pass over the copy
        (``_page_busy``: no arrays are made). Returned again while the page has had no update and
        held no peak, as ``read`` does (for the same ``floor``)."""
        last = self._last
        held = last[0] if last is not None and type(last[0]) is PageBusy and last[1] == floor else None
        if read_busy_native is not None:
            return self._read_busy_native(floor, held)
        if held is not None and self._unchanged(held):
            return held
        self._last = None
        copied = self._copy(HEADER_BYTES + 32 * self.layers * self.experts)
        if copied is None:
            return None
        version, updates, written = copied
        queued, penalised, peaks = busy_of_copy(self._buf, self.layers, self.experts, float(floor), written,
                                                peak_bucket(time.monotonic_ns()))
        busy = PageBusy(version, updates, queued, penalised, peaks)
        if not peaks:
            self._last = (busy, floor)
        return busy

    def _read_busy_native(self, floor: float, held: PageBusy | None) -> PageBusy | None:
        """read_busy in one native call (``_page_busy.read_busy``: the version check, the seqlock
        copy and the busy pass), with the same outcomes and errors as the Python path."""
        native = read_busy_native
        assert native is not None
        if self._fd < 0:
            raise StatsPageError(f"stats page {self.path}: closed")
        try:
            got = native(self._fd, self._buf, self.layers, self.experts, float(floor),
                         peak_bucket(time.monotonic_ns()), held is not None,
                         held.version if held is not None else 0, held.updates if held is not None else 0)
        except OSError as exc:
            raise StatsPageError(f"stats page {self.path}: read failed: {exc.strerror}") from None
        if got is None:
            return held  # no update since it
        self._last = None
        if len(got) == 5:
            busy = PageBusy(*got)
            if not busy.peaks:
                self._last = (busy, floor)
            return busy
        if got[0] == 0:
            return None  # the writer was mid-update on every try
        if got[0] == -1:
            what = "header bytes" if got[2] == 16 else "bytes"
            raise StatsPageError(f"stats page {self.path}: cut short ({got[1]} of {got[2]} {what})")
        raise StatsPageError(f"stats page {self.path}: its header changed")

    def _unchanged(self, last: PageSnapshot | PageBusy) -> bool:
        """The page has had no update since ``last`` (its version and updates read: 16 bytes)."""
        if self._fd < 0:
            raise StatsPageError(f"stats page {self.path}: closed")
        try:
            got = os.preadv(self._fd, [self._words], _VERSION_OFFSET)
        except OSError as exc:
            raise StatsPageError(f"stats page {self.path}: read failed: {exc.strerror}") from None
        if got != 16:
            raise StatsPageError(f"stats page {self.path}: cut short ({got} of 16 header bytes)")
        version, updates = struct.unpack_from("<QQ", self._words)
        return version == last.version and updates == last.updates

    def _copy(self, length: int) -> tuple[int, int, int] | None:
        """The page's first ``length`` bytes into the buffer, one update's (seqlock); its version,
        updates and peak bucket written, or None when the writer was mid-update on every try."""
        fd = self._fd
        if fd < 0:
            raise StatsPageError(f"stats page {self.path}: closed")
        buf = memoryview(self._buf)[:length]
        for _ in range(READ_TRIES):
            try:
                got = os.preadv(fd, [buf], 0)
                got_seq = os.preadv(fd, [self._seq], _SEQ_OFFSET)
            except OSError as exc:
                raise StatsPageError(f"stats page {self.path}: read failed: {exc.strerror}") from None
            if got != length or got_seq != 8:
                raise StatsPageError(f"stats page {self.path}: cut short ({got} of {length} bytes)")
            seq, version, updates, _, written = struct.unpack_from("<QQQqQ", buf, _SEQ_OFFSET)
            if seq & 1 or self._seq != buf[_SEQ_OFFSET:_SEQ_OFFSET + 8]:
                continue  # mid-update, or an update landed during the copy
            if bytes(buf[:8]) != MAGIC or struct.unpack_from("<II", buf, 16) != (self.layers, self.experts):
                raise StatsPageError(f"stats page {self.path}: its header changed")
            return version, updates, written
        return None

    def _snapshot(self, version: int, updates: int, written: int, length: int) -> PageSnapshot:
        n, layers = self.layers * self.experts, self.layers
        shape = (layers, self.experts)
        data = np.frombuffer(self._buf, dtype=np.uint8, count=length - HEADER_BYTES, offset=HEADER_BYTES)
        arrays = data.copy()  # the next read reuses the buffer: the snapshot owns its values
        routing = length == self.size
        return PageSnapshot(
            version=version,
            updates=updates,
            queue_depth=arrays[:8 * n].view("<i8").reshape(shape),
            penalty=arrays[8 * n:16 * n].view("<f8").reshape(shape),
            queue_peak=held_peak(arrays[16 * n:32 * n].view("<i8").reshape((2, *shape)), written,
                                 peak_bucket(time.monotonic_ns())),
            tokens=arrays[32 * n:40 * n].view("<i8").reshape(shape if routing else (0, self.experts)),
            entropy_bits=arrays[40 * n:].view("<f8"),  # (empty without routing)
        )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
