"""Batch reader for a BPF ring buffer (BPF_MAP_TYPE_RINGBUF) through mmap, without a callback per
record: the consumer and producer positions and the data pages are mapped, every committed record
is copied out in one numpy operation, then the space is handed back by advancing the consumer.

The kernel maps the data area twice back to back, so a run of records that wraps around the end
is still contiguous in the mapping. Each record is an 8-byte header (length with BUSY and
DISCARD bits, page offset) followed by the data, padded to 8 bytes.
"""

from __future__ import annotations

import mmap

import numpy as np

HEADER_BYTES = 8
BUSY_BIT = 1 << 31  # reserved, not yet submitted
DISCARD_BIT = 1 << 30  # submitted as discarded: skip


class RingFormatError(RuntimeError):
    """A record of an unexpected size: the reader and the program disagree on the struct."""


class RingReader:
    def __init__(self, *, map_fd: int, data_bytes: int, record: np.dtype) -> None:
        if data_bytes <= 0 or data_bytes & (data_bytes - 1):
            raise ValueError(f"ring data size must be a power of two, got {data_bytes}")
        page = mmap.PAGESIZE
        self.record = record
        self.slot_bytes = (HEADER_BYTES + record.itemsize + 7) // 8 * 8
        self._consumer_map = mmap.mmap(map_fd, page, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._producer_map = mmap.mmap(
            map_fd, page + 2 * data_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=page
        )
        self._consumer = np.frombuffer(self._consumer_map, dtype=np.uint64, count=1)
        self._producer = np.frombuffer(self._producer_map, dtype=np.uint64, count=1)
        self._data = np.frombuffer(self._producer_map, dtype=np.uint8, offset=page)
        self._mask = data_bytes - 1

    def pending_bytes(self) -> int:
        return int(self._producer[0]) - int(self._consumer[0])

    def fill(self) -> float:
        """The share of the data area records wait in (0 empty, 1 full)."""
        return self.pending_bytes() / (self._mask + 1)

    def read(self) -> np.ndarray:
        """Copy out every submitted record now in the ring (in order) and release their space."""
        consumer = int(self._consumer[0])
        available = int(self._producer[0]) - consumer
        if available <= 0:
            return np.empty(0, dtype=self.record)
        start = consumer & self._mask
        # the kernel never has more than one ring's worth pending; a nonsense position is not
        # allowed to slice past the (doubly mapped) data area
        available = min(available, self._mask + 1)
        count = available // self.slot_bytes
        rows = self._data[start : start + count * self.slot_bytes].reshape(count, self.slot_bytes)
        headers = np.ascontiguousarray(rows[:, :4]).view("<u4").ravel()
        busy = np.flatnonzero(headers & BUSY_BIT)
        if busy.size:
            count = int(busy[0])  # records after a busy one wait for the next read
            rows, headers = rows[:count], headers[:count]
        lengths = headers & ~np.uint32(BUSY_BIT | DISCARD_BIT)
        if np.any(lengths != self.record.itemsize):
            raise RingFormatError(
                f"ring record of {sorted(set(lengths.tolist()))} bytes, expected {self.record.itemsize}"
            )
        kept = rows[(headers & DISCARD_BIT) == 0, HEADER_BYTES : HEADER_BYTES + self.record.itemsize]
        records = np.ascontiguousarray(kept).view(self.record).ravel()
        self._consumer[0] = consumer + count * self.slot_bytes  # hand the space back
        return records

    def close(self) -> None:
        # numpy views hold buffer exports; drop them before closing the maps.
        del self._consumer, self._producer, self._data
        self._consumer_map.close()
        self._producer_map.close()
