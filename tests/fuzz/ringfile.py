"""A moescope NVTX ring file written by the test itself, with the layout of
collectors/nvtx_inject/ring_format.h (docs/nvtx-transport.md), so the real NvtxCollector can be
attached to contents no well-behaved library would write: corrupt headers, wild record fields,
garbage in the string region. The test plays the producer: it writes records only into free slots
(head - tail < capacity, as the library does) and publishes `seq` and `strings_used` last."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moescope.collectors import nvtx

STRING_ENTRY = struct.Struct("<IHHIII4x")  # entry_bytes, kind, flags, id, domain_id, text_bytes


@dataclass(frozen=True)
class Record:
    kind: int
    tid: int
    domain_id: int = 0
    string_id: int = 0
    level: int = 0
    range_id: int = 0
    flags: int = 0
    payload_type: int = 0
    payload: int = 0
    category: int = 0
    color: int = 0
    ts_ns: int = 0


def string_entry(*, kind: int, sid: int, text: bytes, domain_id: int = 0, flags: int = 0,
                 entry_bytes: int | None = None, text_bytes: int | None = None) -> bytes:
    """One string-region entry; entry_bytes/text_bytes override the honest values (corruption)."""
    honest = (STRING_ENTRY.size + len(text) + 1 + 7) & ~7
    body = STRING_ENTRY.pack(honest if entry_bytes is None else entry_bytes, kind, flags, sid, domain_id,
                             len(text) if text_bytes is None else text_bytes)
    return (body + text + b"\0").ljust(honest, b"\0")


BLOB_BYTES = 4096  # the payload-extension byte region (ring format 2); these files carry no payloads
PAYLOAD_MAX_BYTES = 1024


def header_bytes(*, pid: int, capacity: int, strings_bytes: int) -> bytearray:
    """A valid header (4096 bytes) for a file of capacity records, a strings_bytes region and the
    blob region after it."""
    header = bytearray(nvtx.HEADER_BYTES)
    ring_offset = nvtx.HEADER_BYTES
    strings_offset = ring_offset + capacity * nvtx.RECORD_BYTES
    struct.pack_into("<QIIII", header, 0, nvtx.MAGIC, nvtx.VERSION, nvtx.HEADER_BYTES, nvtx.RECORD_BYTES, capacity)
    struct.pack_into("<QQQI", header, nvtx.OFF_RING_OFFSET, ring_offset, strings_offset, strings_bytes, pid)
    blob_offset = strings_offset + strings_bytes
    struct.pack_into("<QQQ", header, nvtx.OFF_BLOB_OFFSET, blob_offset, BLOB_BYTES, PAYLOAD_MAX_BYTES)
    return header


class RingFile:
    """The producer's side of one ring file in `directory`, named for `pid`."""

    def __init__(self, directory: Path, *, pid: int, capacity: int = 256, strings_bytes: int = 1 << 16,
                 header: bytes | None = None, file_bytes: int | None = None) -> None:
        self.path = nvtx.ring_path(pid, directory=directory)
        self.capacity = capacity
        self.strings_offset = nvtx.HEADER_BYTES + capacity * nvtx.RECORD_BYTES
        self.strings_bytes = strings_bytes
        size = self.strings_offset + strings_bytes + BLOB_BYTES if file_bytes is None else file_bytes
        head = bytes(
            header_bytes(pid=pid, capacity=capacity, strings_bytes=strings_bytes) if header is None else header
        )
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(head[:size])
            f.truncate(size)
        os.rename(tmp, self.path)  # as the library does: a reader never sees a half-made file
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, size)
        self.size = size
        self.strings_used = 0
        self.written = 0  # records committed into slots
        self.refused = 0  # records not written because the ring was full (the library's drop)

    def u64(self, offset: int) -> int:
        return int(struct.unpack_from("<Q", self._map, offset)[0])

    def set_u64(self, offset: int, value: int) -> None:
        struct.pack_into("<Q", self._map, offset, value)

    def set_u32(self, offset: int, value: int) -> None:
        struct.pack_into("<I", self._map, offset, value)

    def add_strings(self, blob: bytes) -> int:
        """Appends raw entries (as much as fits) and publishes them. Returns bytes written."""
        room = self.strings_bytes - self.strings_used
        blob = blob[: max(room, 0)]
        start = self.strings_offset + self.strings_used
        self._map[start : start + len(blob)] = blob
        self.strings_used += len(blob)
        self.set_u64(nvtx.OFF_STRINGS_USED, self.strings_used)
        return len(blob)

    def add_records(self, records: list[Record], *, commit: list[bool] | None = None) -> None:
        """Claims free slots like a producer; `commit[i]` False leaves record i reserved but never
        committed (its seq stays stale): a writer that stalled or died mid-write."""
        head = self.u64(nvtx.OFF_HEAD)
        for i, rec in enumerate(records):
            tail = self.u64(nvtx.OFF_TAIL)
            if head - tail >= self.capacity:
                self.refused += 1
                continue
            slot = nvtx.HEADER_BYTES + (head & (self.capacity - 1)) * nvtx.RECORD_BYTES
            row = np.zeros(1, dtype=nvtx.RECORD_DTYPE)
            for name in ("ts_ns", "payload", "range_id", "tid", "domain_id", "string_id", "category", "color",
                         "kind", "payload_type", "flags", "level"):
                row[name] = getattr(rec, name)
            committed = commit is None or commit[i]
            row["seq"] = head + 1 if committed else 0
            self._map[slot : slot + nvtx.RECORD_BYTES] = row.tobytes()
            head += 1
            self.written += 1
        self.set_u64(nvtx.OFF_HEAD, head)

    def exit(self) -> None:
        """The producer's exit handler: its flag tells the agent to drain and remove the file."""
        self.set_u32(nvtx.OFF_PRODUCER_EXITED, 1)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
