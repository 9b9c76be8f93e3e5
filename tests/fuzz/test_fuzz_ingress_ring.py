"""The ingress probe's ring-buffer reader and event decoder under wild contents. The kernel writes
this ring, so its contents are trusted; what is fuzzed is the reader's arithmetic (positions,
wrap-around, BUSY/DISCARD bits, a struct size that disagrees) and the decoder's handling of any
field value. The ring is a file laid out as the kernel maps a BPF ring buffer (consumer page,
producer page, data area mapped twice), read through the real RingReader."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
from fuzzing import fuzz
from hypothesis import event, given
from hypothesis import strategies as st

from moescope.probes.ingress import procnet
from moescope.probes.ingress.loader import EVENT_DTYPE, decode_events
from moescope.probes.ingress.ring import BUSY_BIT, DISCARD_BIT, HEADER_BYTES, RingFormatError, RingReader

PAGE = mmap.PAGESIZE
DATA_BYTES = 4096
SLOT = (HEADER_BYTES + EVENT_DTYPE.itemsize + 7) // 8 * 8


@st.composite
def ring_contents(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, bytes]]]:
    """(consumer position, records as (length field, BUSY/DISCARD bits, event bytes))."""
    consumer = draw(st.one_of(st.integers(0, 4 * DATA_BYTES // SLOT).map(lambda n: n * SLOT),
                              st.integers(0, (1 << 62) // SLOT).map(lambda n: n * SLOT)))
    n = draw(st.integers(0, DATA_BYTES // SLOT))
    records = []
    for _ in range(n):
        length = draw(st.one_of(st.just(EVENT_DTYPE.itemsize), st.just(EVENT_DTYPE.itemsize),
                                st.just(EVENT_DTYPE.itemsize), st.integers(0, (1 << 30) - 1)))
        bits = draw(st.sampled_from([0, 0, 0, DISCARD_BIT, BUSY_BIT, BUSY_BIT | DISCARD_BIT]))
        records.append((length, bits, draw(st.binary(min_size=EVENT_DTYPE.itemsize, max_size=EVENT_DTYPE.itemsize))))
    return consumer, records


@fuzz(200)
@given(ring_contents(), st.integers(0, SLOT - 1))
def test_ring_reader_takes_the_submitted_prefix_or_raises_its_format_error(
    contents: tuple[int, list[tuple[int, int, bytes]]], producer_skew: int
) -> None:
    consumer, records = contents
    data = bytearray(DATA_BYTES)
    start = consumer % DATA_BYTES
    for i, (length, bits, body) in enumerate(records):
        at = (start + i * SLOT) % DATA_BYTES
        slot = struct.pack("<II", length | bits, 0) + body
        for k, byte in enumerate(slot.ljust(SLOT, b"\0")):
            data[(at + k) % DATA_BYTES] = byte
    # the producer position may be ahead by part of a record (one being reserved)
    producer = consumer + len(records) * SLOT + producer_skew
    fd = os.memfd_create("fuzz-ringbuf")
    try:
        os.ftruncate(fd, 2 * PAGE + 2 * DATA_BYTES)
        os.pwrite(fd, struct.pack("<Q", consumer), 0)
        os.pwrite(fd, struct.pack("<Q", producer), PAGE)
        os.pwrite(fd, bytes(data) * 2, 2 * PAGE)  # the kernel maps the data area twice, back to back
        reader = RingReader(map_fd=fd, data_bytes=DATA_BYTES, record=EVENT_DTYPE)
        try:
            # what must come out: records up to the first busy one; a wrong length among them is
            # the format error (the reader and the program disagree on the struct)
            ready = []
            for length, bits, body in records:
                if bits & BUSY_BIT:
                    break
                ready.append((length, bits, body))
            try:
                out = reader.read()
            except RingFormatError as exc:
                assert any(length != EVENT_DTYPE.itemsize for length, _, _ in ready), str(exc)
                event("RingFormatError")
                assert reader.pending_bytes() == producer - consumer  # nothing handed back
                return
            kept = [body for _, bits, body in ready if not bits & DISCARD_BIT]
            assert out.tobytes() == b"".join(kept)
            assert reader.pending_bytes() == producer - consumer - len(ready) * SLOT
            event("records" if len(out) else "empty")
        finally:
            reader.close()
    finally:
        os.close(fd)


def test_ring_reader_never_reads_past_the_data_area() -> None:
    """A producer position further ahead than the ring holds (impossible from the kernel) is read
    as at most one ring's worth, never as a slice beyond the mapping."""
    fd = os.memfd_create("fuzz-ringbuf")
    try:
        os.ftruncate(fd, 2 * PAGE + 2 * DATA_BYTES)
        os.pwrite(fd, struct.pack("<Q", 1 << 40), PAGE)
        reader = RingReader(map_fd=fd, data_bytes=DATA_BYTES, record=EVENT_DTYPE)
        try:
            try:
                out = reader.read()
            except RingFormatError:
                out = None  # zeroed slots have length 0: the format error, not a crash
            assert out is None or len(out) <= DATA_BYTES // SLOT
        finally:
            reader.close()
    finally:
        os.close(fd)


@fuzz(150)
@given(st.lists(st.binary(min_size=EVENT_DTYPE.itemsize, max_size=EVENT_DTYPE.itemsize), max_size=60),
       st.lists(st.sampled_from([0, procnet.AF_INET, procnet.AF_INET6, 1, 0xFFFF]), max_size=60))
def test_decode_events_accepts_any_field_values(rows: list[bytes], families: list[int]) -> None:
    events = np.frombuffer(b"".join(rows), dtype=EVENT_DTYPE).copy() if rows else np.empty(0, dtype=EVENT_DTYPE)
    for i, family in enumerate(families[: len(events)]):
        events[i]["family"] = family
    cache: dict[tuple[int, bytes], str | None] = {}
    records = decode_events(events, peer_cache=cache)
    assert len(records) == len(events)
    for record, row in zip(records, events, strict=True):
        assert record.tgid == int(row["tgid"]) and record.bytes_in == int(row["bytes_in"])
        if int(row["family"]) in (procnet.AF_INET, procnet.AF_INET6):
            assert isinstance(record.peer_addr, str) and record.peer_addr
        else:
            assert record.peer_addr is None
    assert len(cache) <= 65536


def test_peer_cache_stays_bounded() -> None:
    events = np.zeros(70_000, dtype=EVENT_DTYPE)
    events["family"] = procnet.AF_INET6
    addrs = np.arange(70_000, dtype=">u8").view(np.uint8).reshape(70_000, 8)
    events["peer_addr"][:, 8:] = addrs  # 70000 distinct peers
    cache: dict[tuple[int, bytes], str | None] = {}
    assert len(decode_events(events, peer_cache=cache)) == 70_000
    assert len(cache) <= 65536
