"""Keep the agent's resident memory near what it uses: glibc malloc tuning, applied by `agent start`.

Python's small objects live in its own arenas, but numpy arrays, dicts past a size and bytes go to
malloc, and glibc hands freed memory back to the kernel only from the top of a heap. Measured at
DeepSeek-V3 shape (8 producers x 25 steps/s, benchmarks/agent_memory.py --step-retention-s 2):
after 45 s the main heap was 304 MB, 59 MB in use and 245 MB free but resident in holes. Three
causes, three settings, all no-ops off glibc:

- glibc's mmap threshold is dynamic: freeing one mmapped block (an NVTX drain's multi-MB arrays)
  raises it to that size, up to 32 MB, and the trim threshold to twice that, so from then on the
  drain's big temporaries come from the heap and their holes stay. Setting M_MMAP_THRESHOLD fixes
  both thresholds: blocks of MMAP_THRESHOLD_BYTES and more are mmapped and unmapped at free.
- Free pages in the middle of a heap are returned only by `malloc_trim(0)`: once right after
  start-up, then every TRIM_PERIOD_NS (under 1 ms with little to return; 94 ms measured to hand
  back 235 MB of holes, which a 5 s period keeps from piling up) while the heaps hold at least
  TRIM_MIN_FREE_BYTES free (glibc's mallinfo2): a quiet round's working set is not handed back
  only to be faulted in again the next round. The free top of a heap goes back at free() past
  TRIM_THRESHOLD_BYTES, set above a round's working set for the same reason.
- Each thread that allocates gets its own arena (main loop, exporter, metrics server, collectors),
  each with its own holes: at most ARENAS (M_ARENA_MAX), set before the agent starts any thread.

The same start-up also tunes Python's cyclic garbage collector (`configure_gc`, `settle`): the
agent makes and drops many short-lived objects per drain and holds tens of thousands of buffered
steps, and with the default thresholds (700, 10, 10) collections took ~0.9 s of CPU in a 20 s run
at DeepSeek-V3 shape (gen-2 passes ~90 ms each over everything, bcc and the imported libraries
included). GC_THRESHOLDS collect gen 0 every 20,000 net allocations, and `settle` freezes what
start-up made (gc.freeze: never traversed again): ~0.3 s in the same run. The agent's own data
holds no reference cycles on its hot path (a step's tree, tables and spans are plain trees), so
nothing waits longer to be freed for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# mallopt parameters, <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENAS = 2
# The drain's arrays (MBs each, freed within the tick) and the join's per-batch routing blocks go
# to mmap; small objects stay in the heap. 256 KiB: twice glibc's starting value (128 KiB), so a
# 119 KB single-step table (DeepSeek-V3 shape) is not an mmap + page faults of its own.
MMAP_THRESHOLD_BYTES = 256 << 10
# Free top of a heap above this goes back at free(). 4 MiB, not 1: a quiet round's working set
# (its span texts, trace-file lines, the objects of ~60 steps; ~1-2 MB) was handed back at the end
# of every round and faulted in again page by page in the next one: the main loop took ~300 page
# faults a second beside the reference runtime, ~160 with 4 MiB (16 MiB: the same), its RSS
# 79 -> 80 MB (docs/benchmarks.md, "Interpreted calls counted, page faults counted").
TRIM_THRESHOLD_BYTES = 4 << 20
TRIM_PERIOD_NS = 5_000_000_000
# A periodic trim runs only when the heaps hold this much free (mallinfo2's fordblks, every arena):
# the holes a production-shape drain leaves (hundreds of MB at DeepSeek-V3 shape) go back every
# period as before, while beside the reference runtime (1.2-2.9 MB free at each trim) the trim
# handed a round's working set back and the next round faulted it in again: the main loop's page
# faults ~120 -> ~60 a second without those trims, RSS +0.1-0.3 MB (docs/benchmarks.md, "Page faults
# halved: the periodic trim only past 8 MiB free"). Where glibc lacks mallinfo2 (before 2.33) the
# trim runs every period.
TRIM_MIN_FREE_BYTES = 8 << 20
GC_THRESHOLDS = (20_000, 20, 20)  # gc.set_threshold: gen 0 every 20k net allocations (default 700, 10, 10)


def configure_gc() -> None:
    """The collector's thresholds for a long-running agent (module docstring)."""
    gc.set_threshold(*GC_THRESHOLDS)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc (musl has neither)
    return libc


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (<malloc.h>, glibc 2.33+): ten size_t counters, summed over arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class Allocator:
    def __init__(self, *, trim_period_ns: int = TRIM_PERIOD_NS,
                 trim_min_free_bytes: int = TRIM_MIN_FREE_BYTES) -> None:
        self._libc = _libc()
        self.trim_period_ns = trim_period_ns
        self.trim_min_free_bytes = trim_min_free_bytes
        self._last_trim_ns: int | None = None
        self.trims = 0
        self.trims_skipped = 0  # periodic trims not run: less than trim_min_free_bytes free
        self._mallinfo2: Callable[[], _MallInfo2] | None = None
        if self._libc is not None and hasattr(self._libc, "mallinfo2"):
            mallinfo2 = self._libc.mallinfo2
            mallinfo2.restype = _MallInfo2
            mallinfo2.argtypes = []
            self._mallinfo2 = mallinfo2

    @property
    def available(self) -> bool:
        """glibc's malloc is there to tune."""
        return self._libc is not None

    def configure(self) -> bool:
        """Cap arenas and fix the mmap/trim thresholds (and the collector's thresholds, glibc or
        not); call before the agent starts any thread. True when glibc took every setting."""
        configure_gc()
        libc = self._libc
        if libc is None:
            return False
        settings = ((M_ARENA_MAX, ARENAS), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                    (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        return all([libc.mallopt(param, value) == 1 for param, value in settings])

    def settle(self) -> None:
        """Once start-up is over: what it made is collected, the rest frozen out of every later
        collection (gc.freeze), and every free page handed back (trim_now)."""
        gc.collect()
        gc.freeze()
        self.trim_now()

    def free_bytes(self) -> int | None:
        """Bytes free in malloc's heaps, every arena (mallinfo2's fordblks; None: glibc has no
        mallinfo2, or this is not glibc)."""
        if self._mallinfo2 is None:
            return None
        return int(self._mallinfo2().fordblks)

    def trim_now(self) -> None:
        """Hand every free page of every arena back to the kernel (after start-up, say)."""
        if self._libc is not None:
            self._libc.malloc_trim(0)
            self.trims += 1

    def trim(self, now_ns: int) -> None:
        """Daemon tick hook: malloc_trim(0) once per trim period (the first tick only starts the
        clock) when the heaps hold at least trim_min_free_bytes free; else counted in trims_skipped."""
        if self._libc is None:
            return None
        if self._last_trim_ns is None:
            self._last_trim_ns = now_ns
        elif now_ns - self._last_trim_ns >= self.trim_period_ns:
            self._last_trim_ns = now_ns
            free = self.free_bytes()
            if free is not None and free < self.trim_min_free_bytes:
                self.trims_skipped += 1
            else:
                self.trim_now()
        return None
