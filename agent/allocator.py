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
  back 235 MB of holes, which a 5 s period keeps from piling up). The free top of a heap goes back
  at free() past TRIM_THRESHOLD_BYTES, set above a round's working set so that it is not faulted
  in anew every round.
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


class Allocator:
    def __init__(self, *, trim_period_ns: int = TRIM_PERIOD_NS) -> None:
        self._libc = _libc()
        self.trim_period_ns = trim_period_ns
        self._last_trim_ns: int | None = None
        self.trims = 0

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

    def trim_now(self) -> None:
        """Hand every free page of every arena back to the kernel (after start-up, say)."""
        if self._libc is not None:
            self._libc.malloc_trim(0)
            self.trims += 1

    def trim(self, now_ns: int) -> None:
        """Daemon tick hook: malloc_trim(0) once per trim period (the first tick only starts the clock)."""
        if self._libc is None:
            return None
        if self._last_trim_ns is None:
            self._last_trim_ns = now_ns
        elif now_ns - self._last_trim_ns >= self.trim_period_ns:
            self._last_trim_ns = now_ns
            self.trim_now()
        return None
