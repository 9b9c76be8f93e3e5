"""The agent's native helpers (plain C shared objects loaded with ctypes, built by setup.py).

``count_rows`` runs the per-row reductions of routing_health.layer_table in one pass per row
(routing_health.c says why). ``available()`` is False when the library was not built (a source
checkout without `pip install -e .`); routing_health then computes the same numbers with numpy.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

LIBRARY = Path(__file__).resolve().parent / "libmoescope_health.so"


class RowHealth(NamedTuple):
    """Per row of a count matrix (and its over-capacity twin), as routing_health.layer_table
    defines them; the float columns are NaN for a row with no tokens."""

    total: np.ndarray  # int64: sum of c
    dropped: np.ndarray  # int64: sum of d
    top: np.ndarray  # int64: max of c (0 for an all-zero row)
    entropy_bits: np.ndarray  # float64
    gini: np.ndarray
    cv: np.ndarray
    max_share: np.ndarray
    drop_fraction: np.ndarray


def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError:
        return None
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    for name in ("moescope_count_rows_i32", "moescope_count_rows_i64"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, i64, i64, i64, i64, i64, i64, i64, p, i64, p, i64, p, p]
        fn.restype = ctypes.c_int
    return lib


_LIB = _load()
_FUNCTIONS = {np.dtype(np.int32): "moescope_count_rows_i32", np.dtype(np.int64): "moescope_count_rows_i64"}


def available() -> bool:
    return _LIB is not None


class _Scratch(threading.local):
    """Per thread: ctypes lets go of the GIL during the call, and the join (daemon thread) and the
    live view's window tables (state thread) both call count_rows."""

    def __init__(self) -> None:
        self.hist: dict[int, tuple[np.ndarray, int]] = {}  # E -> (histogram buffer, its address)


_SCRATCH = _Scratch()
_TABLES: dict[int, tuple[np.ndarray, int]] = {}  # id of a c log2 c table -> (contiguous copy, address)


def _element_strides(a: np.ndarray) -> bool:
    """Rows of contiguous elements, other strides whole elements and not negative (what C walks)."""
    s = a.strides
    return s[-1] == a.itemsize and all(x >= 0 and x % a.itemsize == 0 for x in s)


def _address(a: np.ndarray) -> int:
    address: int = a.__array_interface__["data"][0]  # (ndarray.ctypes costs ~3 µs per use)
    return address


def count_rows(c: np.ndarray, d: np.ndarray, clog_table: np.ndarray) -> RowHealth | None:
    """RowHealth of the [rows, E] integer matrices ``c`` and ``d`` (same shape and dtype, int32 or
    int64; rows may be strided), or of [k, R, E] stacks of them (k steps' blocks, apart in one
    buffer: rows step after step). ValueError on a negative count; None for counts of 2^24 or more
    or E > 2^16 (the caller's float path)."""
    assert _LIB is not None
    if c.ndim == 2:
        c, d = c[None], d[None]
    blocks, rows_per_block, e = c.shape
    rows = blocks * rows_per_block
    if not _element_strides(c):
        c = np.ascontiguousarray(c)
    if not _element_strides(d):
        d = np.ascontiguousarray(d)
    ints = np.empty((3, rows), dtype=np.int64)
    floats = np.empty((5, rows), dtype=np.float64)
    hist = _SCRATCH.hist.get(e)
    if hist is None:
        buffer = np.empty(2 * (4 * e + 1), dtype=np.int64)  # two histograms of counts below 4E (else a sorted copy)
        hist = _SCRATCH.hist[e] = (buffer, _address(buffer))
    table = _TABLES.get(id(clog_table))
    if table is None:
        copy = np.ascontiguousarray(clog_table, dtype=np.float64)
        table = _TABLES[id(clog_table)] = (copy, _address(copy))
    fn = getattr(_LIB, _FUNCTIONS[c.dtype])
    if not rows:
        return RowHealth(ints[0], ints[1], ints[2], floats[0], floats[1], floats[2], floats[3], floats[4])
    item = c.itemsize
    status = fn(_address(c), _address(d), rows, e, c.strides[1] // item, d.strides[1] // item, max(1, rows_per_block),
                c.strides[0] // item, d.strides[0] // item, table[1], len(table[0]), hist[1], len(hist[0]),
                _address(ints), _address(floats))
    if status == -2:
        raise ValueError("expert counts must be >= 0")
    if status == -3:
        return None
    if status != 0:
        raise MemoryError("count_rows: no memory for a row copy")
    return RowHealth(ints[0], ints[1], ints[2], floats[0], floats[1], floats[2], floats[3], floats[4])
