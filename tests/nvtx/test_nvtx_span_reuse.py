"""The agent copies a drain's payload bytes out of the shared ring into a buffer it reuses while
nothing views it (fresh pages cost a fault each), and never while a decoded vector still does."""

from __future__ import annotations

import types

import numpy as np

from moescope.collectors.nvtx import SPAN_ROUND_BYTES, NvtxRing


def _holder() -> types.SimpleNamespace:
    return types.SimpleNamespace(_span_buffer=None)


def test_a_span_nobody_views_is_reused() -> None:
    ring = _holder()
    first = NvtxRing._span(ring, 1000)  # type: ignore[arg-type]
    address = first.__array_interface__["data"][0]
    assert len(first) == 1000 and len(ring._span_buffer) == SPAN_ROUND_BYTES
    del first
    again = NvtxRing._span(ring, 5000)  # type: ignore[arg-type]
    assert again.__array_interface__["data"][0] == address and len(again) == 5000


def test_a_span_with_a_live_view_is_never_written_again() -> None:
    ring = _holder()
    span = NvtxRing._span(ring, 64)  # type: ignore[arg-type]
    span[:] = 7
    decoded = np.ndarray(shape=(4, 4), dtype=np.int32, buffer=span, strides=(16, 4))  # as decode_arrays
    del span
    other = NvtxRing._span(ring, 64)  # type: ignore[arg-type]
    other[:] = 0
    assert not np.shares_memory(decoded, other)
    assert (decoded == 0x07070707).all()  # the vector still reads what was copied for it
    del decoded, other
    grown = NvtxRing._span(ring, SPAN_ROUND_BYTES + 1)  # type: ignore[arg-type]
    assert len(ring._span_buffer) == 2 * SPAN_ROUND_BYTES and len(grown) == SPAN_ROUND_BYTES + 1
