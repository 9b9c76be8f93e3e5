"""Live NVTX capture: the agent side of moescope's NVTX injection library.

A process started with NVTX_INJECTION64_PATH=<libmoescope_nvtx.so> (`agent nvtx-env` prints it)
creates a shared-memory file `<dir>/moescope-nvtx.<pid>` on its first NVTX call. NvtxCollector
attaches to it, drains the event ring in batches (numpy views over the mapping: no per-event
Python callback), rebuilds per-thread range trees (push/pop nesting per thread and domain,
start/end by range id), reads the string region, and hands completed ranges and marks to a sink
in batches. Payload-extension (schema) payloads arrive as bytes in a per-batch blob with the
registered schemas (NvtxBatch.payload_array decodes the 1-D numeric arrays the `nvtx` package
sends). Every anomaly is counted in stats(). The wire format is docs/nvtx-transport.md;
collectors/nvtx_inject/ring_format.h is its C definition and this module mirrors it.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moescope.collectors.registry import SourceHealth
from moescope.errors import NoSuchProcess, NvtxUnavailable
from moescope.procfs import pid_exists, task_exists

log = logging.getLogger("moescope.nvtx")

INJECTION_ENV = "NVTX_INJECTION64_PATH"
RING_DIR_ENV = "MOESCOPE_NVTX_DIR"
# The pid of a process the agent launched (`agent start -- CMD`): its ring records from its first
# event, before the agent finds it (the library arms it; NvtxRing.attach takes it whole)
ARMED_ENV = "MOESCOPE_NVTX_ARMED"
RING_RECORDS_ENV = "MOESCOPE_NVTX_RING_RECORDS"
DEFAULT_RING_DIR = "/dev/shm"
RING_FILE_PREFIX = "moescope-nvtx."
LIBRARY_NAME = "libmoescope_nvtx.so"

# --- layout mirror of ring_format.h (tests/nvtx/test_layout.py checks it against the C) --------
MAGIC = 0x32305854564E534D  # "MSNVTX02"
MAGIC_V1 = 0x31305854564E534D  # "MSNVTX01": a library from before the payload extension
VERSION = 2
HEADER_BYTES = 4096
RECORD_BYTES = 64
STRING_ENTRY_BYTES = 24
MAX_STRING_BYTES = 4096
COUNTERS = 32
BLOB_ENTRY_BYTES = 16
SCHEMA_HEADER_BYTES = 40
SCHEMA_FIELD_BYTES = 40
MAX_SCHEMAS = 4096  # the library records at most this many (MSRING_MAX_SCHEMAS)
MAX_SCHEMA_FIELDS = 32

OFF_MAGIC = 0
OFF_VERSION = 8
OFF_HEADER_BYTES = 12
OFF_RECORD_BYTES = 16
OFF_CAPACITY = 20
OFF_RING_OFFSET = 24
OFF_STRINGS_OFFSET = 32
OFF_STRINGS_BYTES = 40
OFF_PID = 48
OFF_CREATED_NS = 56
OFF_CONSUMER_ATTACHED = 64
OFF_CONSUMER_PID = 68
OFF_CONSUMER_HEARTBEAT_NS = 72
OFF_ATTACH_COUNT = 80
OFF_PRODUCER_EXITED = 88
OFF_HEAD = 128
OFF_TAIL = 192
OFF_STRINGS_USED = 256
OFF_STRINGS_COUNT = 264
OFF_COUNTERS = 320
OFF_BLOB_OFFSET = 576
OFF_BLOB_BYTES = 584
OFF_PAYLOAD_MAX_BYTES = 592
OFF_BLOB_HEAD = 640
OFF_BLOB_TAIL = 704
MAX_BLOB_BYTES = 1 << 30  # the library's largest blob region (MOESCOPE_NVTX_BLOB_BYTES)

# header.counters[...] names, in ring_format.h's order (enum msring_counter).
PRODUCER_COUNTERS: tuple[str, ...] = (
    "dropped_ring_full",
    "dropped_string_full",
    "strings_truncated",
    "ext_payloads",
    "unknown_payloads",
    "unknown_messages",
    "unsupported_calls",
    "init_calls",
    "bad_unicode",
    "depth_shared",
    "ext_payload_oversize_dropped",
    "ext_payload_blob_full_dropped",
    "ext_payload_unknown_schema_dropped",
    "ext_payload_malformed_dropped",
    "ext_payload_entries_dropped",
    "schemas_registered",
    "schemas_dropped",
    "schemas_malformed_dropped",
    "ext_payloads_recorded",
    "ext_init_calls",
    "ext_unknown_modules",
)

KIND_PUSH = 1
KIND_POP = 2
KIND_START = 3
KIND_END = 4
KIND_MARK = 5

PAYLOAD_NONE = 0
PAYLOAD_U64 = 1
PAYLOAD_I64 = 2
PAYLOAD_DOUBLE = 3
PAYLOAD_U32 = 4
PAYLOAD_I32 = 5
PAYLOAD_FLOAT = 6
PAYLOAD_EXT = 7
PAYLOAD_UNKNOWN = 8
PAYLOAD_EXT_LOST = 9  # an extension payload whose bytes were not recorded (reason: a counter)

MSG_SOURCE_MASK = 3
MSG_LOST = 4
MSG_GAP = 8  # events of this thread and domain were dropped just before this record
MAX_STACK = 32  # the library keeps push ids this deep (deeper pushes are not reported)

STR_STRING = 1
STR_DOMAIN = 2
STR_CATEGORY = 3
STR_THREAD = 4
STR_SCHEMA = 5
STRF_TRUNCATED = 1
STRF_BAD_UNICODE = 2

RECORD_DTYPE = np.dtype(
    {
        "names": [
            "seq", "ts_ns", "payload", "range_id", "tid", "domain_id", "string_id", "category",
            "color", "kind", "payload_type", "flags", "level",
        ],
        "formats": ["<u8", "<u8", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u4", "<u2", "<u2", "<u4", "<i4"],
        "offsets": [0, 8, 16, 24, 32, 36, 40, 44, 48, 52, 54, 56, 60],
        "itemsize": RECORD_BYTES,
    }
)

# Gathers and masks go through this opaque view: numpy copies a structured dtype field by field
# (about 10x slower than moving 64-byte items).
_RECORD_VOID = np.dtype((np.void, RECORD_BYTES))


def _records_at(records: np.ndarray, index: np.ndarray) -> np.ndarray:
    """records[index] (integer or boolean index) for contiguous RECORD_DTYPE arrays, fast."""
    return records.view(_RECORD_VOID)[index].view(RECORD_DTYPE)


# What the sink receives. uid: collector-assigned id of a range; parent_uid: enclosing push range
# on the same thread and domain (0: none). depth: nesting level (0 = outermost); -1 for start/end.
RANGE_DTYPE = np.dtype(
    [
        ("uid", "<u8"), ("parent_uid", "<u8"), ("start_ns", "<u8"), ("end_ns", "<u8"),
        ("payload", "<u8"), ("range_id", "<u8"), ("tid", "<u4"), ("domain_id", "<u4"),
        ("string_id", "<u4"), ("category", "<u4"), ("color", "<u4"), ("depth", "<i4"),
        ("kind", "<u2"), ("payload_type", "<u2"),
    ]
)
MARK_DTYPE = np.dtype(
    [
        ("parent_uid", "<u8"), ("ts_ns", "<u8"), ("payload", "<u8"), ("tid", "<u4"),
        ("domain_id", "<u4"), ("string_id", "<u4"), ("category", "<u4"), ("color", "<u4"),
        ("payload_type", "<u2"),
    ]
)
# Start/end ranges still open, carried between batches in this form (open pushes are carried as
# their records).
_OPEN_DTYPE = np.dtype(
    [
        ("uid", "<u8"), ("parent_uid", "<u8"), ("ts_ns", "<u8"), ("payload", "<u8"),
        ("range_id", "<u8"), ("tid", "<u4"), ("domain_id", "<u4"), ("string_id", "<u4"),
        ("category", "<u4"), ("color", "<u4"), ("kind", "<u2"), ("payload_type", "<u2"),
    ]
)

THREAD_CHECK_PERIOD_NS = 1_000_000_000
PROCESS_CHECK_PERIOD_NS = 200_000_000
# The ring is drained fully at most every DRAIN_PERIOD_NS, or at once when it holds more than
# 1/EARLY_DRAIN_FRACTION of its records or 1/BLOB_EARLY_DRAIN_FRACTION of its payload blob: a drain
# has a fixed cost (a few dozen array operations, per batch in the parser and the join) that fewer
# drains save (measured: agent 7.65 -> 6.7 % of a core under the reference load from 50 to 200 ms;
# at DeepSeek-V3 shape, 25 steps/s a rank, a batch of 5 steps costs ~1.7x per step what one of 20
# does), while a burst still never waits longer than the daemon's 150 ms peek to be drained. The
# blob's mark is a quarter (2 MiB of the default 8): a DeepSeek-V3 rank's 119 KB step vectors
# passed an eighth every ~9 steps, before the period; a quarter leaves 6 MiB (~50 such steps)
# free for the producer while the agent is late.
DRAIN_PERIOD_NS = 500_000_000
EARLY_DRAIN_FRACTION = 8
BLOB_EARLY_DRAIN_FRACTION = 4
SPAN_ROUND_BYTES = 1 << 20  # copy_ext's buffer grows in whole MiB (fewer regrowths as drains vary)
STALLED_SLOT_NS = 1_000_000_000  # a reserved slot never committed for this long is skipped
DEFAULT_BATCH_RECORDS = 1 << 16
STRINGS_READ_BYTES = 1 << 20  # NvtxRing.read_strings copies the string region this much at a time
PEEK_MIN_RECORDS = 1024  # NvtxRing.committed's copy holds at least this many records (64 KiB)
# copy_ext's span buffers kept for reuse, per thread, shared by every ring that thread drains: a
# drain's views are consumed (or copied by the join) before the next ring is drained, so two serve
# one ring or eight (eight DeepSeek-V3 producers, 10 s: three buffers made in all). One buffer per
# ring, each kept at its largest drain, held 16 blocks of ~2 MB, 31 MB of the agent's resident
# memory with eight producers (docs/benchmarks.md, "The agent's memory in steady state").
SPAN_POOL_BUFFERS = 2
MAX_RING_RECORDS = 1 << 24  # the library's largest ring (MOESCOPE_NVTX_RING_RECORDS)
# Caps on what a producer can make the agent hold (docs/hardening.md). The library records at most
# 65536 texts (its intern table) and ids above that never come from it; each text is at most
# MAX_STRING_BYTES. Entries past these are dropped and counted (`string_entries_dropped`).
MAX_STRING_ENTRIES = 1 << 16
MAX_STRING_ID = 1 << 16
MAX_STRING_TABLE_BYTES = 16 << 20  # all texts together (16x the library's default region)
# Ranges still open (pushes without their pop, starts without their end) kept between polls; past
# this the oldest are given up as lost and counted (`ranges_open_overflow`).
MAX_OPEN_RANGES = 1 << 18
_MAX_LEVEL = (1 << 12) - 1  # nesting deeper than this loses its parent link (packed sort key)
# Extension-payload bytes of still-open ranges kept between batches; past this the payloads of the
# newest are given up (the ranges still complete) and counted (`ext_payload_carry_dropped`).
MAX_CARRY_BLOB_BYTES = 64 << 20


# --- where things are ---------------------------------------------------------------------------


def injection_library_path() -> Path:
    """The built injection library (pip install -e . / scripts/setup.sh builds it)."""
    # found from the package's folder, not this module's file: the module may be the compiled build
    # (moescope/compiled.py), which lives under build/compiled/
    import moescope.collectors as package

    path = Path(package.__path__[0]).resolve() / "nvtx_inject" / LIBRARY_NAME
    if not path.is_file():
        raise NvtxUnavailable(
            f"NVTX injection library not built ({path} missing): run `bash scripts/setup.sh`"
        )
    return path


def injection_env() -> dict[str, str]:
    """Environment to add to a serving process so its NVTX calls reach moescope."""
    return {INJECTION_ENV: str(injection_library_path())}


def ring_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(RING_DIR_ENV) or DEFAULT_RING_DIR)


def ring_path(pid: int, *, directory: Path | None = None) -> Path:
    return (directory or ring_dir()) / f"{RING_FILE_PREFIX}{pid}"


def _namespace_pid(pid: int) -> int:
    """pid as the process itself sees it (innermost pid namespace; NSpid in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid


def _maps_library(pid: int) -> bool:
    """Whether pid has the injection library mapped (/proc/PID/maps names the file)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip().endswith("/" + LIBRARY_NAME) for line in f)
    except OSError:
        return False


def _read_environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except PermissionError:
        return None
    except (FileNotFoundError, ProcessLookupError) as exc:  # gone, or exited and not reaped yet (ESRCH)
        raise NoSuchProcess(f"no such process: {pid}") from exc
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def cleanup_stale_rings(*, directory: Path | None = None) -> int:
    """Removes ring files (and half-created ones) of processes that no longer exist. Returns how
    many were removed. A file some agent still holds locked is left alone."""
    base = directory or ring_dir()
    removed = 0
    try:
        entries = list(base.iterdir())
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if not name.startswith(RING_FILE_PREFIX):
            continue
        pid_text = name[len(RING_FILE_PREFIX) :].removesuffix(".tmp")
        if not pid_text.isdigit() or pid_exists(int(pid_text)):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            entry.unlink()
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# --- payload-extension schemas ------------------------------------------------------------------

SCHEMA_ID_STATIC_START = 1 << 24  # below: a predefined entry type used directly as the schema id
SCHEMA_TYPE_STATIC = 1
SCHEMA_TYPE_DYNAMIC = 2
ENTRY_FLAG_ARRAY_MASK = 0x70
ENTRY_FLAG_ARRAY_FIXED_SIZE = 0x10
ENTRY_FLAG_ARRAY_LENGTH_INDEX = 0x30
# Predefined entry types that decode to a numpy number (LP64 sizes for the C types 1-10, 22).
ENTRY_TYPE_DTYPES: dict[int, np.dtype] = {
    t: np.dtype(code)
    for t, code in {
        1: "i1", 2: "u1", 3: "<i2", 4: "<u2", 5: "<i4", 6: "<u4", 7: "<i8", 8: "<u8", 9: "<i8", 10: "<u8",
        11: "i1", 12: "u1", 13: "<i2", 14: "<u2", 15: "<i4", 16: "<u4", 17: "<i8", 18: "<u8",
        19: "<f4", 20: "<f8", 22: "<u8", 42: "<f2", 43: "<f4", 44: "<f8",
    }.items()
}
_INTEGER_ENTRY_TYPES = frozenset(t for t, d in ENTRY_TYPE_DTYPES.items() if d.kind in "iu")


@dataclass(frozen=True)
class SchemaField:
    flags: int
    type: int  # predefined entry type, or the id of another schema
    array_detail: int
    offset: int
    name: str


@dataclass(frozen=True)
class Schema:
    schema_id: int
    type: int  # 1 static, 2 dynamic, 3/4 unions
    flags: int
    static_size: int
    name: str
    domain_id: int
    fields: tuple[SchemaField, ...]


def _parse_schema(raw: bytes, domain_id: int) -> Schema | None:
    """A schema string-region entry -> Schema; None if it is malformed."""
    if len(raw) < SCHEMA_HEADER_BYTES:
        return None
    schema_id, flags, static_size, stype, n, name_bytes = struct.unpack_from("<QQQIII", raw, 0)
    at = SCHEMA_HEADER_BYTES + n * SCHEMA_FIELD_BYTES
    if not 0 < n <= MAX_SCHEMA_FIELDS or at + name_bytes > len(raw):
        return None
    name = raw[at : at + name_bytes].decode("utf-8", errors="replace")
    at += name_bytes
    fields = []
    for i in range(n):
        fflags, ftype, detail, offset, fname_bytes = struct.unpack_from(
            "<QQQQI", raw, SCHEMA_HEADER_BYTES + i * SCHEMA_FIELD_BYTES
        )
        if at + fname_bytes > len(raw):
            return None
        fname = raw[at : at + fname_bytes].decode("utf-8", errors="replace")
        fields.append(SchemaField(fflags, ftype, detail, offset, fname))
        at += fname_bytes
    return Schema(schema_id, stype, flags, static_size, name, domain_id, tuple(fields))


@dataclass
class SchemaTable:
    """Payload schemas the producer registered (keyed by schema id), and array decoding."""

    schemas: dict[int, Schema] = field(default_factory=dict)

    def get(self, schema_id: int) -> Schema | None:
        return self.schemas.get(schema_id)

    def __len__(self) -> int:
        return len(self.schemas)

    def element_dtype(self, entry_type: int) -> np.dtype | None:
        """dtype of a numeric field type: a predefined type, or a 1-field static scalar schema."""
        dtype = ENTRY_TYPE_DTYPES.get(entry_type)
        if dtype is not None or entry_type < SCHEMA_ID_STATIC_START:
            return dtype
        inner = self.schemas.get(entry_type)
        if inner is None or inner.type != SCHEMA_TYPE_STATIC or len(inner.fields) != 1:
            return None
        only = inner.fields[0]
        if only.flags & ENTRY_FLAG_ARRAY_MASK or only.offset != 0 or only.type >= SCHEMA_ID_STATIC_START:
            return None
        dtype = ENTRY_TYPE_DTYPES.get(only.type)
        if dtype is None or (inner.static_size and inner.static_size != dtype.itemsize):
            return None
        return dtype

    def fixed_array(self, schema_id: int) -> tuple[np.dtype, int] | None:
        """(element dtype, count) of a static one-field schema whose field is a fixed-size array of a
        numeric type, directly or through one more static one-field schema: what the nvtx package
        registers for a 0-d numpy array of dtype [(name, T, (n,))], a vector it does not copy per
        set. None for anything else."""
        for _ in range(2):
            schema = self.schemas.get(schema_id)
            if schema is None or schema.type != SCHEMA_TYPE_STATIC or len(schema.fields) != 1:
                return None
            only = schema.fields[0]
            if only.offset != 0:
                return None
            if only.flags & ENTRY_FLAG_ARRAY_MASK == ENTRY_FLAG_ARRAY_FIXED_SIZE:
                dtype = self.element_dtype(only.type)
                if dtype is None or only.array_detail <= 0:
                    return None
                if schema.static_size and schema.static_size != dtype.itemsize * only.array_detail:
                    return None
                return dtype, only.array_detail
            if only.flags & ENTRY_FLAG_ARRAY_MASK or only.type < SCHEMA_ID_STATIC_START:
                return None
            schema_id = only.type
        return None

    def decode_array(self, schema_id: int, raw: bytes | memoryview | np.ndarray) -> np.ndarray | None:
        """Payload bytes -> 1-D numpy array (a copy), for the layouts the `nvtx` package sends: a
        predefined numeric type as the schema id (elements = size // itemsize), a static scalar
        schema (one element), or an array schema (`size` integer, then `data` with the
        length-index flag typed by a numeric scalar). None for anything else, unknown schemas and
        truncated bytes (the caller counts)."""
        view = self._decode_view(schema_id, raw)
        return None if view is None else view.copy()

    def _decode_view(self, schema_id: int, raw: bytes | memoryview | np.ndarray) -> np.ndarray | None:
        """decode_array without the copy: a view of ``raw``'s bytes."""
        buf = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
        nbytes = len(buf)
        if schema_id < SCHEMA_ID_STATIC_START:
            dtype = ENTRY_TYPE_DTYPES.get(schema_id)
            if dtype is None:
                return None
            return buf[: nbytes - nbytes % dtype.itemsize].view(dtype)
        schema = self.schemas.get(schema_id)
        if schema is None:
            return None
        if len(schema.fields) == 1 and schema.type == SCHEMA_TYPE_STATIC:
            fixed = self.fixed_array(schema_id)
            if fixed is not None:  # a held vector (0-d structured array): n elements, no length
                dtype, count = fixed
                if nbytes < count * dtype.itemsize:
                    return None
                return buf[: count * dtype.itemsize].view(dtype)
            dtype = self.element_dtype(schema_id)
            if dtype is None or nbytes < dtype.itemsize:
                return None
            return buf[: dtype.itemsize].view(dtype)
        if len(schema.fields) != 2:
            return None
        size_field, data_field = schema.fields
        length_dtype = ENTRY_TYPE_DTYPES.get(size_field.type)
        if (
            size_field.type not in _INTEGER_ENTRY_TYPES
            or length_dtype is None
            or size_field.flags & ENTRY_FLAG_ARRAY_MASK
            or size_field.offset != 0
            or data_field.flags & ENTRY_FLAG_ARRAY_MASK != ENTRY_FLAG_ARRAY_LENGTH_INDEX
            or data_field.array_detail != 0
        ):
            return None
        dtype = self.element_dtype(data_field.type)
        if dtype is None or nbytes < length_dtype.itemsize:
            return None
        length = int(buf[: length_dtype.itemsize].view(length_dtype)[0])
        align = dtype.itemsize  # natural alignment of a numeric element
        start = data_field.offset or -(-length_dtype.itemsize // align) * align
        if length < 0:  # a signed length below zero means an empty array
            length = 0
        if start + length * dtype.itemsize > nbytes:
            return None  # truncated: fewer bytes than the length claims
        return buf[start : start + length * dtype.itemsize].view(dtype)


    def decode_arrays(self, schema_id: int, blob: np.ndarray, offsets: np.ndarray, size: int) -> np.ndarray | None:
        """``decode_array`` of many payloads at once: ``size`` bytes at each of ``offsets`` in
        ``blob``, all of schema ``schema_id`` -> a [payloads, length] array (a view of ``blob`` where
        the payloads are evenly spaced and aligned, else a copy), or None when
        one decode_array would refuse, or when their lengths differ (the caller decodes them one
        by one then). One gather for all of them: a step's routing vectors share schema and size."""
        n = len(offsets)
        if n == 0 or size <= 0:
            return None
        first = self._decode_view(schema_id, blob[int(offsets[0]) : int(offsets[0]) + size])
        if first is None:
            return None
        dtype = first.dtype
        if schema_id < SCHEMA_ID_STATIC_START or len(self.schemas[schema_id].fields) == 1:
            start, length = 0, len(first)
        else:
            size_field, data_field = self.schemas[schema_id].fields
            length_dtype = ENTRY_TYPE_DTYPES[size_field.type]
            heads = _byte_windows(blob, length_dtype.itemsize)[offsets]
            lengths = heads.view(length_dtype).reshape(n)
            if (lengths != lengths[0]).any():
                return None
            length = len(first)
            start = data_field.offset or -(-length_dtype.itemsize // dtype.itemsize) * dtype.itemsize
        width = length * dtype.itemsize
        if width == 0:
            return np.zeros((n, 0), dtype=dtype)
        starts = offsets + start
        item = dtype.itemsize
        if blob.__array_interface__["data"][0] % item == 0 and not (starts % item).any():
            spacing = int(starts[1] - starts[0]) if n > 1 else width
            if spacing >= width and int(starts[-1]) + width <= len(blob) and (
                    n < 3 or (np.diff(starts) == spacing).all()):
                # evenly spaced (a producer's step vectors, batch after batch): a strided view of
                # the blob, no copy (the blob is this batch's private copy of the ring's bytes)
                return np.ndarray(shape=(n, length), dtype=dtype, buffer=blob, offset=int(starts[0]),
                                  strides=(spacing, item))
            # every payload as one row of a typed window view of the blob (element strides: the gather
            # copies elements, not bytes), rows picked by offset
            windows = np.ndarray(shape=((len(blob) - width) // item + 1, length), dtype=dtype, buffer=blob,
                                 strides=(item, item))
            return windows[starts // item]
        # unaligned: a byte window view, rows picked by offset
        gathered = _byte_windows(blob, width)[starts]
        return gathered.view(dtype).reshape(n, length)


def _byte_windows(blob: np.ndarray, width: int) -> np.ndarray:
    """Every ``width``-byte window of a 1-D uint8 ``blob`` as a read-only [len - width + 1, width]
    view (numpy's sliding_window_view, without its argument handling: ~15 µs a call, several a
    batch); ``width`` <= len(blob)."""
    if blob.dtype != np.uint8 or blob.ndim != 1 or not blob.flags.c_contiguous or not 0 < width <= len(blob):
        return np.lib.stride_tricks.sliding_window_view(blob, width)  # (and its errors)
    view = np.ndarray(shape=(len(blob) - width + 1, width), dtype=np.uint8, buffer=blob, strides=(1, 1))
    view.flags.writeable = False
    return view


# --- string tables ------------------------------------------------------------------------------


@dataclass
class StringTable:
    """Texts the producer recorded once each: messages, domain names, category and thread names."""

    strings: dict[int, str] = field(default_factory=dict)
    domains: dict[int, str] = field(default_factory=lambda: {0: ""})
    categories: dict[tuple[int, int], str] = field(default_factory=dict)
    thread_names: dict[int, str] = field(default_factory=dict)
    truncated: set[int] = field(default_factory=set)
    known: np.ndarray = field(default_factory=lambda: np.zeros(1024, dtype=bool))
    entries: int = 0  # texts recorded, all kinds (capped at MAX_STRING_ENTRIES by the collector)
    text_bytes: int = 0  # their UTF-8 bytes as received (capped at MAX_STRING_TABLE_BYTES)
    schemas: SchemaTable = field(default_factory=SchemaTable)

    def add_string(self, string_id: int, text: str) -> None:
        self.strings[string_id] = text
        if string_id >= len(self.known):
            # string_id <= MAX_STRING_ID (the collector drops others): the mask stays <= 128 KiB
            grown = np.zeros(max(string_id + 1, 2 * len(self.known)), dtype=bool)
            grown[: len(self.known)] = self.known
            self.known = grown
        self.known[string_id] = True

    def name(self, string_id: int) -> str | None:
        return self.strings.get(string_id)

    def names(self, string_ids: np.ndarray) -> np.ndarray:
        """Vectorised id -> text (object array; None for id 0 or unknown ids)."""
        unique, inverse = np.unique(string_ids, return_inverse=True)
        texts = np.array([self.strings.get(int(i)) for i in unique], dtype=object)
        return texts[inverse] if len(unique) else np.empty(0, dtype=object)

    def domain_id(self, name: str) -> int | None:
        for domain_id, domain_name in self.domains.items():
            if domain_name == name:
                return domain_id
        return None

    def string_ids(self, texts: set[str]) -> dict[str, int]:
        return {text: sid for sid, text in self.strings.items() if text in texts}


# --- batches handed to the sink -----------------------------------------------------------------


def payload_as_float(payload: np.ndarray, payload_type: np.ndarray) -> np.ndarray:
    """Payloads as float64 (NaN where there is none, or it is an extension/unknown payload)."""
    raw = payload.astype("<u8", copy=False)
    out = np.full(len(raw), np.nan)
    signed = (payload_type == PAYLOAD_I64) | (payload_type == PAYLOAD_I32)
    unsigned = (payload_type == PAYLOAD_U64) | (payload_type == PAYLOAD_U32)
    floating = (payload_type == PAYLOAD_DOUBLE) | (payload_type == PAYLOAD_FLOAT)
    out[signed] = raw[signed].view("<i8")
    out[unsigned] = raw[unsigned]
    out[floating] = raw[floating].view("<f8")
    return out


def payload_as_int(payload: np.ndarray, payload_type: np.ndarray) -> np.ndarray:
    """Integer payloads as int64 (0 where the payload is not an integer; check payload_type)."""
    raw = payload.astype("<u8", copy=False)
    integer = (payload_type >= PAYLOAD_U64) & (payload_type <= PAYLOAD_I32) & (payload_type != PAYLOAD_DOUBLE)
    return np.where(integer, raw.view("<i8"), 0)


@dataclass
class NvtxBatch:
    """One poll's completed ranges and marks of one process. Arrays are owned by the batch."""

    pid: int
    ranges: np.ndarray  # RANGE_DTYPE
    marks: np.ndarray  # MARK_DTYPE
    strings: StringTable
    # uids of ranges that began but whose end is lost (dropped pop, thread or process exit): they
    # will never be in `ranges`, though they may be the parent_uid of ranges and marks
    lost_uids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    # Extension payloads: a row with payload_type PAYLOAD_EXT has, in `payload`, the offset in
    # `blob` of a 16-byte entry header (schema id u64, size u32, 0 u32) followed by its bytes.
    blob: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint8))

    @property
    def schemas(self) -> SchemaTable:
        return self.strings.schemas

    def ext_entries(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For rows of `ranges` or `marks` (vectorised): (schema id, offset of the bytes in `blob`,
        size); schema id 0 and size 0 where a row has no recorded extension payload."""
        ext = rows["payload_type"] == PAYLOAD_EXT
        schema_ids = np.zeros(len(rows), dtype=np.uint64)
        offsets = np.zeros(len(rows), dtype=np.int64)
        sizes = np.zeros(len(rows), dtype=np.int64)
        if ext.any():
            at = rows["payload"][ext].astype(np.int64)
            schema_ids[ext], sizes[ext] = _entry_headers(self.blob, at)
            offsets[ext] = at + BLOB_ENTRY_BYTES
        return schema_ids, offsets, sizes

    def ext_payload(self, row: np.void) -> tuple[int, np.ndarray] | None:
        """(schema id, bytes as a uint8 view of `blob`) of one row, or None if it has none."""
        if int(row["payload_type"]) != PAYLOAD_EXT:
            return None
        at = int(row["payload"])
        schema_id, size = struct.unpack_from("<QI", self.blob[at : at + 12].tobytes())
        start = at + BLOB_ENTRY_BYTES
        return int(schema_id), self.blob[start : start + size]

    def payload_array(self, row: np.void) -> np.ndarray | None:
        """One row's extension payload decoded as a 1-D numeric array (see SchemaTable.decode_array);
        None when the row has none, or it cannot be decoded."""
        found = self.ext_payload(row)
        if found is None:
            return None
        return self.strings.schemas.decode_array(*found)

    def mark_array(self, index: int) -> np.ndarray | None:
        """payload_array of marks[index]."""
        return self.payload_array(self.marks[index])

    def range_array(self, index: int) -> np.ndarray | None:
        """payload_array of ranges[index]."""
        return self.payload_array(self.ranges[index])

    def decode_array(self, schema_id: int, raw: bytes | memoryview | np.ndarray) -> np.ndarray | None:
        return self.strings.schemas.decode_array(schema_id, raw)

    def mark_arrays(self, indices: np.ndarray) -> list[np.ndarray | None]:
        """payload_array of each of marks[indices], decoded in groups of one schema and size (one
        gather per group instead of one decode per mark)."""
        out: list[np.ndarray | None] = [None] * len(indices)
        for members, block in self.mark_blocks(indices):
            for at, array in zip(members.tolist(), block, strict=True):
                out[at] = array
        return out

    def mark_blocks(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray | list[np.ndarray | None]]]:
        """The extension payloads of marks[indices] as (positions in `indices`, their arrays): a
        [members, length] block per group of one schema and size where it decodes as one, else a
        list of payload_array results. Marks without a recorded payload are in no group."""
        if not len(indices):
            return []
        schema_ids, offsets, sizes = self.ext_entries(self.marks[indices])
        rows = np.flatnonzero(sizes > 0)
        if not len(rows):
            return []
        # one int64 key per (schema, size): the schema's rank among the batch's ids, then the size
        # (a u32): two 1-D uniques instead of one over rows (schema ids are 64-bit)
        ids, id_rank = np.unique(schema_ids[rows], return_inverse=True)
        keys, inverse = np.unique((id_rank.reshape(-1).astype(np.int64) << 32) | sizes[rows], return_inverse=True)
        id_list = ids.tolist()
        groups = [(id_list[key >> 32], key & 0xFFFFFFFF) for key in keys.tolist()]
        inverse = inverse.reshape(-1)
        schemas = self.strings.schemas
        out: list[tuple[np.ndarray, np.ndarray | list[np.ndarray | None]]] = []
        for g, (schema_id, size) in enumerate(groups):
            members = rows[inverse == g] if len(groups) > 1 else rows
            block = schemas.decode_arrays(schema_id, self.blob, offsets[members], size)
            if block is not None:
                out.append((members, block))
            else:
                out.append((members, [schemas.decode_array(schema_id, self.blob[int(at) : int(at) + size])
                                      for at in offsets[members].tolist()]))
        return out

    def range_names(self) -> np.ndarray:
        return self.strings.names(self.ranges["string_id"])

    def mark_names(self) -> np.ndarray:
        return self.strings.names(self.marks["string_id"])


NvtxSink = Callable[[NvtxBatch], None]


def _entry_headers(blob: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(schema ids, sizes) of the blob entries at offsets (each within blob, checked by caller)."""
    if len(offsets) == 0:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64)
    heads = blob[offsets[:, None] + np.arange(BLOB_ENTRY_BYTES)].view("<u8")
    return heads[:, 0].copy(), (heads[:, 1] & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _gather_segments(blob: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copies the byte segments blob[offsets[i] : offsets[i] + sizes[i]] back to back; returns the
    new blob and each segment's new offset. One gather, no Python loop."""
    if len(offsets) == 0:
        return np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.int64)
    new_offsets = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=new_offsets[1:])
    total = int(new_offsets[-1] + sizes[-1])
    index = np.repeat(offsets - new_offsets, sizes) + np.arange(total, dtype=np.int64)
    return blob[index], new_offsets


# --- the shared-memory file ---------------------------------------------------------------------


class _DrainScratch(threading.local):
    """The buffers a drain copies into and lets go of, reused by every ring drained on a thread:
    committed()'s records peek (used within the call) and copy_ext's spans (reused once nothing
    views them). Per thread: the agent drains every ring from its main loop."""

    def __init__(self) -> None:
        self.peek: np.ndarray | None = None
        self.spans: list[np.ndarray] = []


_scratch = _DrainScratch()


class NvtxRing:
    """One process's ring file, mapped read-write by the one consumer that holds its lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NvtxUnavailable(f"no NVTX ring at {path}") from exc
        except PermissionError as exc:
            raise NvtxUnavailable(f"cannot open {path}: permission denied (run the agent as root)") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise NvtxUnavailable(f"{path} is already drained by another moescope agent") from exc
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise NvtxUnavailable(f"{path} is not a moescope NVTX ring (too small)")
            # Only the header is mapped (the positions and flags shared with the producers):
            # records, texts and payload bytes are copied out with preadv (_fill), so the agent's
            # RSS does not take in the producer's whole ring (13.3 MB each by default, 106 MB of
            # RssShmem with eight producers), and a file cut short past its header reads as
            # zeros where a mapping would raise SIGBUS.
            self._map = mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        magic, version, header_bytes, record_bytes, capacity = struct.unpack_from("<QIIII", self._map, 0)
        ring_offset, strings_offset, strings_bytes, pid = struct.unpack_from("<QQQI", self._map, OFF_RING_OFFSET)
        if magic == MAGIC_V1:
            self.close()
            raise NvtxUnavailable(
                f"{path}: written by an older moescope injection library (ring format 1, no payload "
                "extension); restart the process with this agent's library (`agent nvtx-env`)"
            )
        if magic != MAGIC or version != VERSION or record_bytes != RECORD_BYTES or header_bytes != HEADER_BYTES:
            self.close()
            raise NvtxUnavailable(
                f"{path}: unsupported ring (magic {magic:#x}, version {version}); "
                "agent and injection library versions differ"
            )
        blob_offset, blob_bytes, payload_max = struct.unpack_from("<QQQ", self._map, OFF_BLOB_OFFSET)
        if (
            not 0 < capacity <= MAX_RING_RECORDS
            or capacity & (capacity - 1)
            or ring_offset + capacity * RECORD_BYTES > size
            or strings_offset + strings_bytes > size
            or not 0 < blob_bytes <= MAX_BLOB_BYTES
            or blob_bytes & (blob_bytes - 1)
            or blob_offset + blob_bytes > size
            or payload_max > blob_bytes
        ):
            self.close()
            raise NvtxUnavailable(f"{path}: corrupt ring header")
        self.pid = pid
        self.capacity = capacity
        self.mask = capacity - 1
        self.strings_offset = strings_offset
        self.strings_bytes = strings_bytes
        self.blob_bytes = blob_bytes
        self.payload_max_bytes = payload_max
        self.ring_offset = ring_offset
        self.blob_offset = blob_offset
        self.short_reads = 0  # copies that met the end of the file (a ring cut short): zeros read
        self._blob_head = ctypes.c_uint64.from_buffer(self._map, OFF_BLOB_HEAD)
        self._blob_tail = ctypes.c_uint64.from_buffer(self._map, OFF_BLOB_TAIL)
        # blob bytes below _epoch_blob are free once every record below _epoch_records is read
        self._epoch: tuple[int, int] | None = None
        # 8-byte aligned scalars: single loads/stores on x86-64 (see docs/nvtx-transport.md)
        self._head = ctypes.c_uint64.from_buffer(self._map, OFF_HEAD)
        self._tail = ctypes.c_uint64.from_buffer(self._map, OFF_TAIL)
        self._strings_used = ctypes.c_uint64.from_buffer(self._map, OFF_STRINGS_USED)
        self._attached = ctypes.c_uint32.from_buffer(self._map, OFF_CONSUMER_ATTACHED)
        self._consumer_pid = ctypes.c_uint32.from_buffer(self._map, OFF_CONSUMER_PID)
        self._heartbeat = ctypes.c_uint64.from_buffer(self._map, OFF_CONSUMER_HEARTBEAT_NS)
        self._attach_count = ctypes.c_uint64.from_buffer(self._map, OFF_ATTACH_COUNT)
        self._exited = ctypes.c_uint32.from_buffer(self._map, OFF_PRODUCER_EXITED)
        self._counters = np.frombuffer(self._map, dtype="<u8", count=COUNTERS, offset=OFF_COUNTERS)
        self._strings_read = 0
        self.strings_corrupt_at = -1  # region offset of an entry that can never be read (-1: none)

    # header fields
    @property
    def head(self) -> int:
        return int(self._head.value)

    @property
    def tail(self) -> int:
        return int(self._tail.value)

    @property
    def attached(self) -> bool:
        return bool(self._attached.value)

    @property
    def producer_exited(self) -> bool:
        return bool(self._exited.value)

    def counters(self) -> dict[str, int]:
        values = self._counters.copy()
        return {name: int(values[i]) for i, name in enumerate(PRODUCER_COUNTERS)}

    @property
    def armed(self) -> bool:
        """Raised by its producer at creation for the agent that launched it (`agent start --
        CMD`: MOESCOPE_NVTX_ARMED, docs/nvtx-transport.md), and no agent attached since: every
        record in it was made for that agent."""
        return bool(self._attached.value) and self._consumer_pid.value == 0 and self._attach_count.value == 0

    def attach(self, *, now_ns: int) -> int:
        """Starts receiving: skips what a previous agent left, then raises the producers' flag.
        An armed ring is taken whole instead, and its generation kept: its producers' nesting
        state holds the ranges they opened before this attach. Returns how many records were
        skipped."""
        self._heartbeat.value = now_ns
        if self.armed:
            self._consumer_pid.value = os.getpid()
            self.release_blob()
            return 0
        head = self.head
        skipped = head - self.tail
        self._tail.value = head
        self._epoch = None
        self.release_blob()  # what the skipped records reserved is freed once they are behind us
        self._consumer_pid.value = os.getpid()
        self._attach_count.value += 1
        self._attached.value = 1
        return skipped

    def heartbeat(self, now_ns: int) -> None:
        self._heartbeat.value = now_ns

    def detach(self) -> None:
        if self._map.closed:
            return
        self._attached.value = 0
        self._consumer_pid.value = 0

    def blob_in_flight(self) -> int:
        """Payload-blob bytes producers reserved that the agent has not released yet."""
        return int(self._blob_head.value) - int(self._blob_tail.value)

    def committed(self, max_records: int) -> tuple[int, int]:
        """(records ready to read from tail, records reserved beyond them not yet committed)."""
        tail = self.tail
        avail = self.head - tail
        n = min(avail, max_records)
        if n <= 0:
            return 0, 0
        scratch = _scratch
        peek = scratch.peek
        if peek is None or len(peek) < n:  # the largest drain so far (any ring's), in powers of two
            peek = scratch.peek = np.empty(max(PEEK_MIN_RECORDS, 1 << (n - 1).bit_length()), dtype=_RECORD_VOID)
        seqs = self._records_into(peek[:n], tail).view(RECORD_DTYPE)["seq"]
        ok = seqs == tail + 1 + np.arange(n, dtype=np.uint64)
        if ok.all():
            return n, avail - n
        ready = int(np.argmin(ok))
        return ready, avail - ready

    def read(self, n: int) -> np.ndarray:
        """Copies n committed records from tail (committed() must have said so), then frees them.
        A copy of its own, made after committed() saw their sequence numbers: what one copy reads
        of a record is complete only if its seq was read before the rest of it, and a single copy
        does not order its loads (the producer writes the fields, then the seq)."""
        tail = self.tail
        out = self._records_into(np.empty(n, dtype=_RECORD_VOID), tail)
        # release the slots only after the copy: producers reuse them once tail moves
        self._tail.value = tail + n
        return out.view(RECORD_DTYPE)

    def _records_into(self, out: np.ndarray, tail: int) -> np.ndarray:
        """The len(out) record slots from position ``tail`` on (the ring wraps), copied into ``out``."""
        n = len(out)
        start = tail & self.mask
        first = min(n, self.capacity - start)
        raw = out.view(np.uint8)
        self._fill(raw[: first * RECORD_BYTES], self.ring_offset + start * RECORD_BYTES)
        if n > first:
            self._fill(raw[first * RECORD_BYTES :], self.ring_offset)
        return out

    def _fill(self, out: np.ndarray, offset: int) -> None:
        """``out`` (contiguous bytes) <- the file's bytes from ``offset``. Past the end of the file
        (a producer truncated it) zeros are read, counted in short_reads: a record of zeros is never
        committed, a payload entry of zeros is malformed; nothing faults."""
        view = out.data  # (contiguous bytes: a writable memoryview)
        done, size = 0, len(view)
        while done < size:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                out[done:] = 0
                self.short_reads += 1
                return
            done += got

    def skip(self, n: int) -> None:
        self._tail.value = self.tail + n

    def copy_ext(self, records: np.ndarray) -> tuple[np.ndarray, int]:
        """Copies the blob bytes the EXT records of a batch (just read, tail not yet released past
        their bytes) refer to, as one span; rewrites their payload to the entry's offset in that
        span. Entries outside what producers reserved, or malformed, become PAYLOAD_EXT_LOST.
        Returns (span, entries found corrupt)."""
        ptype = records["payload_type"]
        ext = np.flatnonzero(ptype == PAYLOAD_EXT)
        if len(ext) == 0:
            return np.empty(0, dtype=np.uint8), 0
        tail = int(self._blob_tail.value)
        head = int(self._blob_head.value)  # after the records: covers every committed entry
        pos = records["payload"][ext]
        inside = (pos >= np.uint64(tail)) & (pos + np.uint64(BLOB_ENTRY_BYTES) <= np.uint64(head))
        if head - tail > self.blob_bytes or not inside.any():
            inside[:] = False
            span = np.empty(0, dtype=np.uint8)
        else:
            lo = int(pos[inside].min())
            start, n = lo & (self.blob_bytes - 1), head - lo
            first = min(n, self.blob_bytes - start)
            span = self._span(n)
            self._fill(span[:first], self.blob_offset + start)
            if n > first:
                self._fill(span[first:], self.blob_offset)
            rel = (pos.astype(np.int64) - lo) * inside
            _, sizes = _entry_headers(span, rel)
            inside &= (sizes > 0) & (sizes <= self.payload_max_bytes) & (rel + BLOB_ENTRY_BYTES + sizes <= n)
            records["payload"][ext[inside]] = rel[inside].astype(np.uint64)
        bad = ext[~inside]
        records["payload_type"][bad] = PAYLOAD_EXT_LOST
        records["payload"][bad] = 0
        return span, len(bad)

    @staticmethod
    def _span(n: int) -> np.ndarray:
        """n bytes to copy a batch's payloads into: a buffer of this thread's pool (any ring's
        earlier drain) once nothing holds a view of it (the decoded vectors are views: the join
        copies what it keeps), else a new one, kept in the pool in place of a free smaller one or
        of the oldest (which lives on while its views do). Fresh pages cost a fault each on first
        touch: ~6 us a page on this VM, ~4 ms for a 2.4 MB drain, more than the copy itself."""
        pool = _scratch.spans
        free = -1
        for i in range(len(pool)):
            buffer = pool[i]
            # references when unused: the pool's, `buffer`, getrefcount's argument
            if sys.getrefcount(buffer) <= 3:
                if len(buffer) >= n:
                    return buffer[:n]
                free = i
        buffer = np.empty(-(-n // SPAN_ROUND_BYTES) * SPAN_ROUND_BYTES, dtype=np.uint8)
        if len(pool) >= SPAN_POOL_BUFFERS:
            del pool[free if free >= 0 else 0]
        pool.append(buffer)
        return buffer[:n]

    def release_blob(self) -> None:
        """Frees blob bytes no unread record can refer to. A producer reserves its record slot
        before its blob bytes, so every blob reservation below a blob_head read now belongs to a
        record below the head read just after it: once tail passes that head, they are free."""
        epoch = self._epoch
        if epoch is not None and self.tail >= epoch[1]:
            self._blob_tail.value = max(int(self._blob_tail.value), epoch[0])
            epoch = None
        if epoch is None:
            blob_head = int(self._blob_head.value)
            self._epoch = (blob_head, self.head)

    def read_strings(self) -> list[tuple[int, int, int, int, bytes]]:
        """New string-region entries since the last call: (kind, flags, id, domain_id, text)."""
        used = min(int(self._strings_used.value), self.strings_bytes)
        out: list[tuple[int, int, int, int, bytes]] = []
        offset = self._strings_read
        while offset + STRING_ENTRY_BYTES <= used:
            # what was published since the last call, copied after strings_used was read, a piece
            # of at most STRINGS_READ_BYTES at a time (the header's numbers are the producer's)
            first = offset
            limit = min(used, first + STRINGS_READ_BYTES)
            region = bytearray(limit - first)
            self._fill(np.frombuffer(region, dtype=np.uint8), self.strings_offset + first)
            while offset + STRING_ENTRY_BYTES <= limit:
                entry_bytes, kind, flags, sid, domain_id, text_bytes = struct.unpack_from("<IHHIII", region,
                                                                                          offset - first)
                if (
                    entry_bytes < STRING_ENTRY_BYTES
                    or offset + entry_bytes > used
                    or text_bytes > entry_bytes - STRING_ENTRY_BYTES
                ):
                    # entries below strings_used are complete (published after the write): corrupt;
                    # stop here, never read past what was published
                    self.strings_corrupt_at = offset
                    self._strings_read = offset
                    return out
                if offset + entry_bytes > limit:
                    break  # complete, past this piece: the next piece starts with it
                start = offset - first + STRING_ENTRY_BYTES
                out.append((kind, flags, sid, domain_id, bytes(region[start : start + text_bytes])))
                offset += entry_bytes
            if offset == first:  # (an entry longer than a piece: not one the library writes)
                self.strings_corrupt_at = offset
                break
        self._strings_read = offset
        return out

    def unlink_if_present(self) -> None:
        try:
            if os.path.samestat(os.stat(self.path), os.fstat(self._fd)):
                self.path.unlink()
        except OSError:
            pass

    def close(self) -> None:
        for name in ("_head", "_tail", "_strings_used", "_attached", "_consumer_pid", "_heartbeat",
                     "_attach_count", "_exited", "_counters", "_blob_head", "_blob_tail"):
            if hasattr(self, name):
                delattr(self, name)
        if hasattr(self, "_map") and not self._map.closed:
            self._map.close()
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1


# --- the collector ------------------------------------------------------------------------------


_STAT_NAMES: tuple[str, ...] = (
    "records_received", "ranges_completed", "marks", "batches", "polls",
    "pop_without_push", "end_without_start", "unknown_string_id", "unknown_domain_id",
    "unknown_kind", "messages_lost", "ext_payload_records", "unknown_payload_records",
    "invalid_utf8_strings", "ranges_open_at_thread_exit", "ranges_open_at_exit",
    "lost_uncommitted", "skipped_at_attach", "detached_by_producer", "attaches",
    "sink_errors", "deep_nesting", "stale_rings_removed", "ranges_lost_end", "parent_unknown",
    "string_entries_dropped", "string_region_corrupt", "ranges_open_overflow",
    "ext_payloads_lost", "ext_payload_corrupt_dropped", "ext_payload_carry_dropped",
    "schema_entries_dropped", "ring_short_reads",
)


def _past_early_drain_marks(ring: NvtxRing) -> bool:
    """The ring holds 1/EARLY_DRAIN_FRACTION of its records or 1/BLOB_EARLY_DRAIN_FRACTION of its
    payload blob: drained now, whatever the drain period."""
    return (ring.head - ring.tail >= ring.capacity // EARLY_DRAIN_FRACTION
            or ring.blob_in_flight() >= ring.blob_bytes // BLOB_EARLY_DRAIN_FRACTION)


_NOT_RUN = SourceHealth()  # frozen: one shared "not run yet"


class NvtxCollector:
    """Drains one process's NVTX ring. Source shape for the agent's daemon loop: poll(now_ns) -> int
    (records drained), stats() -> dict[str, int], close()."""

    name = "nvtx"

    def __init__(
        self,
        pid: int,
        *,
        sink: NvtxSink,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        directory: Path | None = None,
        now_ns: int | None = None,
        max_open_ranges: int = MAX_OPEN_RANGES,
        drain_period_ns: int = DRAIN_PERIOD_NS,
    ) -> None:
        self.pid = pid
        self._sink = sink
        self.drain_period_ns = drain_period_ns
        self._health = _NOT_RUN  # until the first drain
        self._last_drain_ns: int | None = None  # the first poll always drains
        # Monotonic time at which the last full drain began: every record committed before it has
        # been handed to the sink (the pipeline joins requests that ended before this).
        self.drained_through_ns = 0
        self._batch_records = batch_records
        self._max_open_ranges = max_open_ranges
        self._stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
        self._producer_base: dict[str, int] = {}
        self._producer_last: dict[str, int] = dict.fromkeys(PRODUCER_COUNTERS, 0)
        self.strings = StringTable()
        # push rows still open, as received, with the uid and parent uid given to them
        self._open_pushes = np.empty(0, dtype=RECORD_DTYPE)
        self._open_uid = np.empty(0, dtype=np.uint64)
        self._open_parent = np.empty(0, dtype=np.uint64)
        self._open_tainted = np.empty(0, dtype=bool)  # a drop hit its thread+domain since its push
        self._open_starts = np.empty(0, dtype=_OPEN_DTYPE)
        # blob entries of open ranges with extension payloads (their payload is an offset here)
        self._carry_blob = np.empty(0, dtype=np.uint8)
        self._next_uid = 1
        self._ring: NvtxRing | None = None
        self._finished = False
        self._last_thread_check_ns = 0
        self._last_process_check_ns = 0
        self._stall_position = -1
        self._stall_since_ns = 0
        # the library names its file with the pid it sees: inside a pid namespace, not ours
        self._ring_pid = _namespace_pid(pid)
        self._directory = directory if directory is not None else self._find_directory(pid)
        self._ring_file = ring_path(self._ring_pid, directory=self._directory)
        if self._ring_pid == pid:  # file names hold pids of our namespace: liveness is checkable
            self._stats["stale_rings_removed"] = cleanup_stale_rings(directory=self._directory)
        self._try_attach(now_ns if now_ns is not None else _monotonic_ns(), first=True)

    # -- discovery

    @staticmethod
    def _find_directory(pid: int) -> Path:
        """The ring directory of pid: its MOESCOPE_NVTX_DIR, seen through its root (containers).
        Raises NvtxUnavailable when pid was not started with the injection variable."""
        if not os.path.exists(f"/proc/{pid}"):
            raise NoSuchProcess(f"no such process: {pid}")
        env = _read_environ(pid)
        if env is not None:
            injected = env.get(INJECTION_ENV)
            if not injected and _maps_library(pid):
                # set in-process (moescope.instrument() puts it in os.environ before the first
                # NVTX call), which /proc/PID/environ never shows: the library is loaded, so it is ours
                injected = LIBRARY_NAME
            if not injected:
                raise NvtxUnavailable(
                    f"pid {pid} was not started with {INJECTION_ENV}, so its NVTX events cannot be "
                    f"captured; restart it with `env $(agent nvtx-env) CMD` or via `agent start -- CMD`"
                )
            if Path(injected).name != LIBRARY_NAME:
                raise NvtxUnavailable(
                    f"pid {pid} loads another NVTX tool ({INJECTION_ENV}={injected}); "
                    "only one tool can be injected: restart it with `env $(agent nvtx-env) CMD`"
                )
        directory = ring_dir(env or {})
        seen_through_root = (
            Path(f"/proc/{pid}/root") / directory.relative_to("/") if directory.is_absolute() else directory
        )
        if not (directory / f"{RING_FILE_PREFIX}{_namespace_pid(pid)}").exists() and seen_through_root.exists():
            try:
                if not os.path.samefile(seen_through_root, directory):
                    return seen_through_root
            except OSError:
                pass
        return directory

    def _try_attach(self, now_ns: int, *, first: bool = False) -> bool:
        path = self._ring_file
        if not path.exists():
            if not pid_exists(self.pid):
                self._finished = True
                if first:
                    raise NoSuchProcess(f"no such process: {self.pid}")
            return False  # started with the variable but no NVTX call yet: look again next poll
        ring = NvtxRing(path)
        if ring.pid != self._ring_pid:
            ring.close()
            raise NvtxUnavailable(f"{path} belongs to pid {ring.pid}, not {self._ring_pid}")
        self._ring = ring
        armed = ring.armed  # (before the attach, which takes it over)
        self._stats["skipped_at_attach"] += ring.attach(now_ns=now_ns)
        self._stats["attaches"] += 1
        # an armed ring's counters are this agent's since the producer's first event
        self._producer_base = {} if armed else ring.counters()
        self._read_strings()
        return True

    @property
    def attached(self) -> bool:
        return self._ring is not None

    @property
    def finished(self) -> bool:
        """The target exited and everything it sent has been drained."""
        return self._finished

    # -- Source protocol

    def poll(self, now_ns: int, *, force: bool = False) -> int:
        started_ns = _monotonic_ns()
        drain_before = self._last_drain_ns
        try:
            drained = self._poll_once(now_ns, force=force)
        except Exception as exc:
            self._health = SourceHealth(_monotonic_ns() - started_ns, False, f"{type(exc).__name__}: {exc}")
            raise
        if self._last_drain_ns != drain_before:  # timed only when it drained (not waiting for its period)
            self._health = SourceHealth(_monotonic_ns() - started_ns, True, None)
        return drained

    def health(self) -> SourceHealth:
        """The last drain: its duration and whether it completed (None before the first)."""
        return self._health

    def backlogged(self) -> bool:
        """The ring past its early-drain marks (the quiet daemon's peek: a few header words read),
        so that the round this brings forward does drain it; or, before the attach, the ring file
        there now (one stat), so that the round this brings forward attaches. The library records
        nothing until an agent is attached (docs/nvtx-transport.md), and a quiet loop's rounds are
        up to 4 s apart: without this a process launched under `agent start -- CMD` lost the steps
        it served in its first seconds, before the round that found its ring."""
        ring = self._ring
        if ring is None:
            return not self._finished and self._ring_file.exists()
        return not self._finished and _past_early_drain_marks(ring)

    def _poll_once(self, now_ns: int, *, force: bool = False) -> int:
        self._stats["polls"] += 1
        if self._finished:
            return 0
        if self._ring is None and not self._try_attach(now_ns):
            return 0
        ring = self._ring
        assert ring is not None
        ring.heartbeat(now_ns)
        if not ring.attached:
            # a producer saw our heartbeat stale (we were stopped) and detached us: rejoin
            self._stats["detached_by_producer"] += 1
            self._stats["skipped_at_attach"] += ring.attach(now_ns=now_ns)
            # the library restarts its nesting count at each attach: what was open is lost
            self._stats["ranges_lost_end"] += len(self._open_pushes)
            self._open_pushes = np.empty(0, dtype=RECORD_DTYPE)
            self._open_uid = np.empty(0, dtype=np.uint64)
            self._open_parent = np.empty(0, dtype=np.uint64)
            self._open_tainted = np.empty(0, dtype=bool)
        exited = ring.producer_exited
        if not exited and now_ns - self._last_process_check_ns >= PROCESS_CHECK_PERIOD_NS:
            self._last_process_check_ns = now_ns
            exited = not pid_exists(self.pid)
        if (
            not (force or exited)
            and self._last_drain_ns is not None
            and now_ns - self._last_drain_ns < self.drain_period_ns
            and not _past_early_drain_marks(ring)
        ):
            return 0
        self._last_drain_ns = now_ns
        # threads' liveness before the drain, not after: a thread seen gone here reserved all its
        # records below this head, so its last pops are drained before its ranges are called open
        check_threads = now_ns - self._last_thread_check_ns >= THREAD_CHECK_PERIOD_NS
        dead_tids = self._dead_open_tids() if check_threads else []
        reserved_at_check = ring.head
        drained = 0
        while True:
            ready, pending = ring.committed(self._batch_records)
            # after seeing the records committed: a text is published before any event using it
            self._read_strings()
            if ready == 0:
                if pending:
                    self._handle_stall(ring, now_ns, exited)
                break
            records = ring.read(ready)
            span, corrupt = ring.copy_ext(records)
            ring.release_blob()  # after the copy: producers may reuse what it frees
            self._stats["ext_payload_corrupt_dropped"] += corrupt
            drained += ready
            self._process(records, span)
            if ready < self._batch_records:
                if pending:
                    self._handle_stall(ring, now_ns, exited)
                break
        ring.release_blob()
        if ring.short_reads:
            self._stats["ring_short_reads"] += ring.short_reads
            ring.short_reads = 0
        self._sync_producer_counters()
        if check_threads:
            self._last_thread_check_ns = now_ns
            if dead_tids and ring.tail >= reserved_at_check:  # else a slot below it is in flight: next check
                self._close_dead_threads(dead_tids)
        self.drained_through_ns = now_ns
        if exited:
            self._finish()
        return drained

    def stats(self) -> dict[str, int]:
        if self._ring is not None:
            self._sync_producer_counters()
        out = dict(self._stats)
        out.update(self._producer_last)
        out["open_ranges"] = len(self._open_pushes) + len(self._open_starts)
        out["attached"] = int(self._ring is not None)
        out["finished"] = int(self._finished)
        return out

    def close(self) -> None:
        if self._ring is not None and not self._finished:
            try:
                self.poll(_monotonic_ns(), force=True)  # what arrived since the last drain
            except Exception:  # closing must go on; the records left are in the counters
                log.exception("nvtx: final drain of pid %d failed", self.pid)
        if self._ring is not None:
            self._sync_producer_counters()
            self._ring.detach()
            self._ring.close()
            self._ring = None

    # -- internals

    def _sync_producer_counters(self) -> None:
        ring = self._ring
        if ring is None:
            return
        now = ring.counters()
        for name in PRODUCER_COUNTERS:
            # counted since this agent attached (drops before it are another agent's business)
            self._producer_last[name] = now[name] - self._producer_base.get(name, 0)

    def _handle_stall(self, ring: NvtxRing, now_ns: int, exited: bool) -> None:
        """A slot reserved but not committed: normal for microseconds; skipped (and counted) when
        the producer died or a writer never came back."""
        position = ring.tail
        if exited:
            lost = ring.head - position
            self._stats["lost_uncommitted"] += lost
            ring.skip(lost)
            return
        if position != self._stall_position:
            self._stall_position = position
            self._stall_since_ns = now_ns
        elif now_ns - self._stall_since_ns >= STALLED_SLOT_NS:
            self._stats["lost_uncommitted"] += 1
            ring.skip(1)
            self._stall_position = -1

    def _read_strings(self) -> None:
        ring = self._ring
        if ring is None:
            return
        table = self.strings
        corrupt_before = ring.strings_corrupt_at
        entries = ring.read_strings()
        if ring.strings_corrupt_at != corrupt_before:
            self._stats["string_region_corrupt"] += 1
        for kind, flags, sid, domain_id, raw in entries:
            if (
                table.entries >= MAX_STRING_ENTRIES
                or len(raw) > MAX_STRING_BYTES
                or table.text_bytes + len(raw) > MAX_STRING_TABLE_BYTES
                or kind not in (STR_STRING, STR_DOMAIN, STR_CATEGORY, STR_THREAD, STR_SCHEMA)
                or (kind in (STR_STRING, STR_DOMAIN) and not 0 < sid <= MAX_STRING_ID)
            ):
                # the library never writes these: a corrupt or hostile region; nothing grows
                self._stats["string_entries_dropped"] += 1
                continue
            table.entries += 1
            table.text_bytes += len(raw)
            if kind == STR_SCHEMA:
                schema = _parse_schema(raw, domain_id)
                full = len(table.schemas) >= MAX_SCHEMAS
                if schema is None or (full and schema.schema_id not in table.schemas.schemas):
                    self._stats["schema_entries_dropped"] += 1
                else:
                    table.schemas.schemas[schema.schema_id] = schema  # a later registration of an id wins
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="replace")
                self._stats["invalid_utf8_strings"] += 1
            if kind == STR_STRING:
                table.add_string(sid, text)
                if flags & STRF_TRUNCATED:
                    table.truncated.add(sid)
            elif kind == STR_DOMAIN:
                table.domains[sid] = text
            elif kind == STR_CATEGORY:
                table.categories[(domain_id, sid)] = text
            elif kind == STR_THREAD:
                table.thread_names[sid] = text

    def _process(self, records: np.ndarray, span: np.ndarray | None = None) -> None:
        self._stats["records_received"] += len(records)
        ptype_all = records["payload_type"]
        carry = self._carry_blob
        blob = span if span is not None else np.empty(0, dtype=np.uint8)
        if len(carry):
            # one blob for the batch: the open ranges' entries first, then this batch's
            ext_rows = ptype_all == PAYLOAD_EXT
            records["payload"][ext_rows] += np.uint64(len(carry))
            blob = np.concatenate([carry, blob]) if len(blob) else carry
        self._stats["batches"] += 1
        kind = records["kind"]
        flags = records["flags"]
        self._stats["messages_lost"] += int(np.count_nonzero(flags & MSG_LOST))
        ptype = records["payload_type"]
        lost_ext = int(np.count_nonzero(ptype == PAYLOAD_EXT_LOST))
        self._stats["ext_payload_records"] += int(np.count_nonzero(ptype == PAYLOAD_EXT)) + lost_ext
        self._stats["ext_payloads_lost"] += lost_ext
        self._stats["unknown_payload_records"] += int(np.count_nonzero(ptype == PAYLOAD_UNKNOWN))
        sids = records["string_id"]
        named = sids != 0
        if named.any():
            known = self.strings.known
            ids = sids[named]
            inside = ids < len(known)
            ok = np.zeros(len(ids), dtype=bool)
            ok[inside] = known[ids[inside]]
            self._stats["unknown_string_id"] += int(np.count_nonzero(~ok))
        domains = records["domain_id"]
        if domains.any():
            top = int(domains.max())
            # the ids present: a count per id when they are small (they are: one per domain), else a sort
            present = np.flatnonzero(np.bincount(domains, minlength=top + 1)) if top < 1 << 16 else np.unique(domains)
            unknown_domains = [d for d in present.tolist() if d not in self.strings.domains]
            if unknown_domains:
                self._stats["unknown_domain_id"] += int(np.count_nonzero(np.isin(domains, unknown_domains)))
        bad_kind = (kind < KIND_PUSH) | (kind > KIND_MARK)
        self._stats["unknown_kind"] += int(np.count_nonzero(bad_kind))

        stacked = (kind == KIND_PUSH) | (kind == KIND_POP) | (kind == KIND_MARK)
        if stacked.all():
            ranges, marks, lost = self._nest(records)
        else:
            ranges, marks, lost = self._nest(_records_at(records, stacked))
            se = (kind == KIND_START) | (kind == KIND_END)
            if se.any():
                ranges_se, lost_se = self._pair_start_end(_records_at(records, se))
                ranges = np.concatenate([ranges, ranges_se]) if len(ranges) else ranges_se
                lost = np.concatenate([lost, lost_se])
        self._carry_ext(blob)
        self._emit(ranges, marks, lost, blob)

    def _carry_ext(self, blob: np.ndarray) -> None:
        """Keeps (compacted) the blob entries of ranges still open, for the batch that closes them."""
        push_at = np.flatnonzero(self._open_pushes["payload_type"] == PAYLOAD_EXT)
        start_at = np.flatnonzero(self._open_starts["payload_type"] == PAYLOAD_EXT)
        if len(push_at) == 0 and len(start_at) == 0:
            self._carry_blob = np.empty(0, dtype=np.uint8)
            return
        offsets = np.concatenate([self._open_pushes["payload"][push_at], self._open_starts["payload"][start_at]])
        offsets = offsets.astype(np.int64)
        _, sizes = _entry_headers(blob, offsets)
        segments = sizes + BLOB_ENTRY_BYTES
        keep = np.cumsum(segments) <= MAX_CARRY_BLOB_BYTES
        if not keep.all():  # bounded memory: payloads past the cap are given up, the ranges kept
            self._stats["ext_payload_carry_dropped"] += int(np.count_nonzero(~keep))
        self._carry_blob, new_offsets = _gather_segments(blob, offsets[keep], segments[keep])
        moved = np.full(len(offsets), -1, dtype=np.int64)
        moved[keep] = new_offsets
        for table, at, part in ((self._open_pushes, push_at, moved[: len(push_at)]),
                                (self._open_starts, start_at, moved[len(push_at):])):
            table["payload"][at] = np.where(part >= 0, part, 0).astype(np.uint64)
            table["payload_type"][at[part < 0]] = PAYLOAD_EXT_LOST

    def _emit(self, ranges: np.ndarray, marks: np.ndarray, lost: np.ndarray | None = None,
              blob: np.ndarray | None = None) -> None:
        lost = np.empty(0, dtype=np.uint64) if lost is None else lost
        if len(ranges) == 0 and len(marks) == 0 and len(lost) == 0:
            return
        self._stats["ranges_completed"] += len(ranges)
        self._stats["marks"] += len(marks)
        try:
            self._sink(NvtxBatch(pid=self.pid, ranges=ranges, marks=marks, strings=self.strings, lost_uids=lost,
                                 blob=blob if blob is not None else np.empty(0, dtype=np.uint8)))
        except Exception:  # the sink is the pipeline's code: count and log, keep draining
            self._stats["sink_errors"] += 1
            log.exception("nvtx sink failed")

    def _nest(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Push/pop/mark rows (ring order) -> completed push ranges and marks, with parents.

        The library gives every push an id and every pop the id of the push it closes, plus the
        nesting level on its thread and domain and a flag on the first event after a drop. So:
        pairs are exact (by id) even when the ring dropped events; a push whose pop was dropped
        is known closed as soon as a later event of its thread and domain is at its level or
        above; a parent (the latest push one level up on the same thread and domain) is reported
        only when it was provably still open, never guessed across a drop. Vectorised: one stable
        sort groups rows by (tid, domain), everything else is array arithmetic."""
        if len(rows) == 0:
            return np.empty(0, dtype=RANGE_DTYPE), np.empty(0, dtype=MARK_DTYPE), np.empty(0, dtype=np.uint64)
        opens = self._open_pushes
        n_open = len(opens)
        n = n_open + len(rows)
        if n >= 1 << 32:
            raise ValueError("batch too large")  # batch_records bounds it far below this

        def take(src: np.ndarray) -> np.ndarray:
            """Whole records by combined index (opens first): one gather, then sequential reads."""
            if n_open == 0:
                return _records_at(rows, src)
            out = np.empty(len(src), dtype=_RECORD_VOID)
            old = src < n_open
            out[old] = opens.view(_RECORD_VOID)[src[old]]
            out[~old] = rows.view(_RECORD_VOID)[src[~old] - n_open]
            return out.view(RECORD_DTYPE)

        def both(name: str) -> np.ndarray:
            return np.concatenate([opens[name], rows[name]]) if n_open else rows[name]

        gkey = (both("tid").astype(np.uint64) << np.uint64(32)) | both("domain_id").astype(np.uint64)
        if (gkey == gkey[0]).all():
            # one thread and domain (the usual producer): the stable sort is the identity, so no
            # sort and no gathers (at moe/v1 depth a drain is ~18k records)
            order = np.arange(n, dtype=np.intp)

            def by_order(a: np.ndarray) -> np.ndarray:
                return a

            def ring(at: np.ndarray) -> np.ndarray:
                return at
        else:
            order = np.argsort(gkey, kind="stable")  # by group, ring order within a group

            def by_order(a: np.ndarray) -> np.ndarray:
                return a[order]

            def ring(at: np.ndarray) -> np.ndarray:
                return order[at]
        gk = by_order(gkey)
        starts_mask = np.empty(n, dtype=bool)
        starts_mask[0] = True
        np.not_equal(gk[1:], gk[:-1], out=starts_mask[1:])
        gi = np.cumsum(starts_mask, dtype=np.int64) - 1
        group_last = (np.append(np.flatnonzero(starts_mask)[1:], n) - 1)[gi]
        k = by_order(both("kind"))
        lv = by_order(both("level")).astype(np.int64)
        rid = by_order(both("range_id"))
        gap = (by_order(both("flags")) & MSG_GAP) != 0
        is_push = k == KIND_PUSH
        is_pop = k == KIND_POP
        is_mark = k == KIND_MARK
        pos = np.arange(n, dtype=np.int64)  # sorted position: ring order within a group

        uid_in = np.zeros(n, dtype=np.uint64)
        uid_in[:n_open] = self._open_uid
        new_push = rows["kind"] == KIND_PUSH
        n_new_push = int(np.count_nonzero(new_push))
        uid_in[n_open:][new_push] = np.arange(self._next_uid, self._next_uid + n_new_push, dtype=np.uint64)
        self._next_uid += n_new_push
        uid = by_order(uid_in)
        carried_parent = np.zeros(n, dtype=np.uint64)
        carried_parent[:n_open] = self._open_parent
        carried_parent = by_order(carried_parent)
        tainted = np.zeros(n, dtype=bool)
        tainted[:n_open] = self._open_tainted
        tainted = by_order(tainted)

        # 1. pairs, by id
        push_at = np.flatnonzero(is_push & (rid != 0))
        by_id = np.argsort(rid[push_at])
        push_ids = rid[push_at][by_id]
        pop_at = np.flatnonzero(is_pop)
        pop_ids = rid[pop_at]
        hit = np.searchsorted(push_ids, pop_ids)
        found = (hit < len(push_ids)) & (pop_ids != 0)
        found[found] = push_ids[hit[found]] == pop_ids[found]
        a = push_at[by_id[hit[found]]]
        b = pop_at[found]
        sane = (gi[a] == gi[b]) & (b > a)
        a, b = a[sane], b[sane]
        self._stats["pop_without_push"] += len(pop_at) - len(a)
        paired = np.zeros(n, dtype=bool)
        paired[a] = True
        pop_pos = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        pop_pos[a] = b

        # 2. unpaired pushes: closed (their pop was dropped) once a later event of the group sits
        # at their level or above it; otherwise still open
        big = 2 * (int(lv.max()) - min(int(lv.min()), 0) + 2)
        shift = (gi.max() - gi) * big  # reversed scan: later-scanned groups shifted lower
        suffix_min = (np.minimum.accumulate((lv - shift)[::-1]) + shift[::-1])[::-1]
        after_min = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        after_min[:-1] = suffix_min[1:]
        after_min[group_last] = np.iinfo(np.int64).max
        unpaired = is_push & ~paired
        too_deep = unpaired & (rid == 0)
        self._stats["deep_nesting"] += int(np.count_nonzero(too_deep & (order >= n_open)))
        closed = unpaired & ~too_deep & (after_min <= lv)
        self._stats["ranges_lost_end"] += int(np.count_nonzero(closed))
        still_open = unpaired & ~too_deep & ~closed

        # 3. parents: the latest push one level up, if provably open at the child
        cumgap = np.cumsum(gap, dtype=np.int64)
        parent = np.zeros(n, dtype=np.uint64)
        levels_ok = (lv >= 1) & (lv <= _MAX_LEVEL)
        need = np.flatnonzero((is_push | is_mark) & levels_ok & (carried_parent == 0))
        pushes = np.flatnonzero(is_push & (lv >= 0) & (lv <= _MAX_LEVEL))
        if len(need) and len(pushes):
            packed = (
                (gi[pushes].astype(np.uint64) << np.uint64(44))
                | (lv[pushes].astype(np.uint64) << np.uint64(32))
                | pos[pushes].astype(np.uint64)
            )
            by_key = np.argsort(packed)  # pos ascending within (group, level) already; sort by group, level
            push_keys = packed[by_key]
            push_of_key = pushes[by_key]
            q = (
                (gi[need].astype(np.uint64) << np.uint64(44))
                | ((lv[need] - 1).astype(np.uint64) << np.uint64(32))
                | pos[need].astype(np.uint64)
            )
            h = np.searchsorted(push_keys, q) - 1
            cand = push_of_key[np.maximum(h, 0)]
            ok = (h >= 0) & (gi[cand] == gi[need]) & (lv[cand] == lv[need] - 1)
            open_at_child = np.where(
                paired[cand],
                pop_pos[cand] > need,
                (cumgap[need] - cumgap[cand] == 0) & ~tainted[cand],
            )
            ok &= open_at_child
            parent[need[ok]] = uid[cand[ok]]
            self._stats["parent_unknown"] += int(np.count_nonzero(~ok & (ring(need) >= n_open)))
        parent = np.where(carried_parent != 0, carried_parent, parent)

        src_a = ring(a)
        push_rec = take(src_a)
        ranges = np.empty(len(a), dtype=RANGE_DTYPE)
        ranges["uid"] = uid[a]
        ranges["parent_uid"] = parent[a]
        ranges["start_ns"] = push_rec["ts_ns"]
        ranges["end_ns"] = take(ring(b))["ts_ns"]
        for name in ("payload", "tid", "domain_id", "string_id", "category", "color", "payload_type"):
            ranges[name] = push_rec[name]
        ranges["range_id"] = 0
        ranges["depth"] = lv[a]
        ranges["kind"] = KIND_PUSH

        still = np.flatnonzero(still_open)
        keep = np.argsort(ring(still), kind="stable")  # ring order
        still = still[keep]
        over = len(still) - self._max_open_ranges
        lost_uids = uid[closed]
        if over > 0:  # bounded memory: the oldest open pushes are given up, counted, reported lost
            self._stats["ranges_open_overflow"] += over
            lost_uids = np.concatenate([lost_uids, uid[still[:over]]])
            still = still[over:]
        self._open_pushes = take(ring(still))
        self._open_uid = uid[still]
        self._open_parent = parent[still]
        # a drop later in its group makes an open push's later children unprovable
        self._open_tainted = tainted[still] | (cumgap[group_last[still]] - cumgap[still] > 0)

        m = np.flatnonzero(is_mark)
        m = m[np.argsort(ring(m), kind="stable")]  # ring order
        mark_rec = take(ring(m))
        marks = np.empty(len(m), dtype=MARK_DTYPE)
        marks["parent_uid"] = parent[m]
        for name in ("ts_ns", "payload", "tid", "domain_id", "string_id", "category", "color", "payload_type"):
            marks[name] = mark_rec[name]
        return ranges, marks, lost_uids

    def _pair_start_end(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start/end rows -> completed ranges, and uids of open starts given up at the cap."""
        starts_new = np.zeros(int(np.count_nonzero(rows["kind"] == KIND_START)), dtype=_OPEN_DTYPE)
        start_rows = rows[rows["kind"] == KIND_START]
        for name in ("ts_ns", "payload", "range_id", "tid", "domain_id", "string_id", "category",
                     "color", "kind", "payload_type"):
            starts_new[name] = start_rows[name]
        starts_new["uid"] = np.arange(self._next_uid, self._next_uid + len(starts_new), dtype=np.uint64)
        self._next_uid += len(starts_new)
        ends = rows[rows["kind"] == KIND_END]
        starts = np.concatenate([self._open_starts, starts_new]) if len(self._open_starts) else starts_new
        starts = starts[np.argsort(starts["range_id"], kind="stable")]
        ids = starts["range_id"]
        hit = np.searchsorted(ids, ends["range_id"])
        found = hit < len(ids)
        found[found] = ids[hit[found]] == ends["range_id"][found]
        self._stats["end_without_start"] += int(np.count_nonzero(~found))
        matched_start = hit[found]
        matched_end = ends[found]
        ranges = np.zeros(len(matched_start), dtype=RANGE_DTYPE)
        s = starts[matched_start]
        ranges["uid"] = s["uid"]
        ranges["start_ns"] = s["ts_ns"]
        ranges["end_ns"] = matched_end["ts_ns"]
        for name in ("payload", "range_id", "tid", "domain_id", "string_id", "category", "color", "payload_type"):
            ranges[name] = s[name]
        ranges["depth"] = -1
        ranges["kind"] = KIND_START
        keep = np.ones(len(starts), dtype=bool)
        keep[matched_start] = False
        open_starts = starts[keep]
        lost = np.empty(0, dtype=np.uint64)
        over = len(open_starts) - self._max_open_ranges
        if over > 0:  # bounded memory: the oldest (smallest uid) open starts are given up, counted
            by_age = np.argsort(open_starts["uid"], kind="stable")
            lost = open_starts["uid"][by_age[:over]]
            open_starts = open_starts[np.sort(by_age[over:])]
            self._stats["ranges_open_overflow"] += over
        self._open_starts = open_starts
        return ranges, lost

    def _dead_open_tids(self) -> list[int]:
        """Threads with a range open that no longer exist."""
        if len(self._open_pushes) == 0:
            return []
        tids = sorted(set(self._open_pushes["tid"].tolist()))  # (np.unique: its first plain call imports numpy.ma)
        return [t for t in tids if not task_exists(self.pid, int(t))]

    def _close_dead_threads(self, dead: list[int]) -> None:
        """Gives up the open ranges of threads gone (their records all drained since)."""
        gone = np.isin(self._open_pushes["tid"], dead)
        if not gone.any():
            return
        self._stats["ranges_open_at_thread_exit"] += int(np.count_nonzero(gone))
        lost = self._open_uid[gone]
        self._open_pushes = _records_at(self._open_pushes, ~gone)
        self._open_uid = self._open_uid[~gone]
        self._open_parent = self._open_parent[~gone]
        self._open_tainted = self._open_tainted[~gone]
        self._emit(np.empty(0, dtype=RANGE_DTYPE), np.empty(0, dtype=MARK_DTYPE), lost)

    def _finish(self) -> None:
        """The target exited: everything committed is drained; the rest is counted, the file removed."""
        ring = self._ring
        if ring is not None:
            leftover = ring.head - ring.tail
            if leftover > 0:
                self._stats["lost_uncommitted"] += leftover
                ring.skip(leftover)
            self._sync_producer_counters()
            ring.unlink_if_present()
            ring.detach()
            ring.close()
            self._ring = None
        self._stats["ranges_open_at_exit"] += len(self._open_pushes) + len(self._open_starts)
        lost = np.concatenate([self._open_uid, self._open_starts["uid"]])
        if len(lost):
            self._emit(np.empty(0, dtype=RANGE_DTYPE), np.empty(0, dtype=MARK_DTYPE), lost)
        self._open_pushes = np.empty(0, dtype=RECORD_DTYPE)
        self._open_uid = np.empty(0, dtype=np.uint64)
        self._open_parent = np.empty(0, dtype=np.uint64)
        self._open_tainted = np.empty(0, dtype=bool)
        self._open_starts = np.empty(0, dtype=_OPEN_DTYPE)
        self._finished = True


def _monotonic_ns() -> int:
    import time

    return time.monotonic_ns()
