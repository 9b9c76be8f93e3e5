"""The agent copies a drain's payload bytes out of the shared ring into a buffer it reuses while
nothing views it (fresh pages cost a fault each), and never while a decoded vector still does. The
buffers are a pool per draining thread, shared by every ring that thread drains (eight producers'
rings used to keep a buffer each, at their largest drain)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moescope.collectors import nvtx
from moescope.collectors.nvtx import SPAN_POOL_BUFFERS, SPAN_ROUND_BYTES, NvtxRing


@pytest.fixture(autouse=True)
def _empty_pool() -> None:
    nvtx._scratch.spans.clear()


def _address(a: np.ndarray) -> int:
    address: int = a.__array_interface__["data"][0]
    return address


def test_a_span_nobody_views_is_reused() -> None:
    first = NvtxRing._span(1000)
    address = _address(first)
    assert len(first) == 1000 and [len(b) for b in nvtx._scratch.spans] == [SPAN_ROUND_BYTES]
    del first
    again = NvtxRing._span(5000)  # (another ring's drain: the same pool)
    assert _address(again) == address and len(again) == 5000


def test_a_span_with_a_live_view_is_never_written_again() -> None:
    span = NvtxRing._span(64)
    span[:] = 7
    decoded = np.ndarray(shape=(4, 4), dtype=np.int32, buffer=span, strides=(16, 4))  # as decode_arrays
    del span
    other = NvtxRing._span(64)
    other[:] = 0
    assert not np.shares_memory(decoded, other)
    assert (decoded == 0x07070707).all()  # the vector still reads what was copied for it
    del decoded, other
    grown = NvtxRing._span(SPAN_ROUND_BYTES + 1)  # both free but small: one is replaced by a bigger one
    assert len(grown) == SPAN_ROUND_BYTES + 1
    assert sorted(len(b) for b in nvtx._scratch.spans) == [SPAN_ROUND_BYTES, 2 * SPAN_ROUND_BYTES]


def test_the_pool_stays_bounded_while_views_outlive_their_drains() -> None:
    held = []
    for i in range(SPAN_POOL_BUFFERS + 3):  # every drain's vectors kept: each needs a buffer of its own
        span = NvtxRing._span(4096)
        span[:] = i
        held.append(np.ndarray(shape=(4,), dtype=np.uint8, buffer=span))
        del span
        assert len(nvtx._scratch.spans) <= SPAN_POOL_BUFFERS
    assert [int(v[0]) for v in held] == list(range(SPAN_POOL_BUFFERS + 3))  # none written over
    assert len({_address(v) for v in held}) == len(held)
    held.clear()  # their drains consumed: the pool's buffers serve again, nothing new is made
    pool = [_address(b) for b in nvtx._scratch.spans]
    assert {_address(NvtxRing._span(10)) for _ in range(5)} <= set(pool)


def test_each_draining_thread_has_its_own_pool() -> None:
    mine = NvtxRing._span(100)
    theirs: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: theirs.append(NvtxRing._span(100)))
    worker.start()
    worker.join()
    assert not np.shares_memory(mine, theirs[0])
    assert [_address(b) for b in nvtx._scratch.spans] == [_address(mine)]
