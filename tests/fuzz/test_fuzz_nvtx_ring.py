"""The agent's NVTX ring parser under hostile ring contents: the real NvtxCollector attached to a
ring file the test writes with the documented layout (tests/fuzz/ringfile.py), then polled as the
daemon polls it. Nothing may escape, every anomaly must be counted, and what the agent keeps
(string table, open ranges) must stay under the caps in docs/hardening.md. The polls use a fake
clock, so collectors here drain on every poll (drain_period_ns=0; tests/nvtx checks the period)."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzzing import fuzz
from hypothesis import event, given
from hypothesis import strategies as st
from ringfile import Record, RingFile, header_bytes, string_entry

from moescope.collectors import nvtx
from moescope.collectors.moe_convention import MoeConventionParser
from moescope.collectors.nvtx import NvtxBatch, NvtxCollector
from moescope.errors import NvtxUnavailable

PID = os.getpid()  # the ring is "ours": the collector's liveness checks see a live process
TID = threading.get_native_id()
U32 = st.integers(min_value=0, max_value=(1 << 32) - 1)
U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
I32 = st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1)


def fake_clock_collector(directory: Path, *, sink: Any = None, **options: Any) -> NvtxCollector:
    """The real collector on the test's fake clock (now_ns=1, then poll(2), poll(3), ...): it drains
    on every poll (drain_period_ns=0), since the polls here are not spaced like the daemon's."""
    return NvtxCollector(PID, sink=sink or (lambda batch: None), directory=directory, now_ns=1,
                         drain_period_ns=0, **options)


@pytest.fixture(scope="module")
def ring_root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="moescope-fuzz-rings-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fresh_dir(root: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=root))


class Counting:
    """Sink: the real convention parser behind a tally of what the collector delivered."""

    def __init__(self) -> None:
        self.parser = MoeConventionParser(sink=lambda steps: None)
        self.ranges = 0
        self.marks = 0
        self.lost = 0

    def __call__(self, batch: NvtxBatch) -> None:
        self.ranges += len(batch.ranges)
        self.marks += len(batch.marks)
        self.lost += len(batch.lost_uids)
        self.parser(batch)


# --- corrupt headers ----------------------------------------------------------------------------

HEADER_FIELDS = [  # (offset, struct format) of every identity field of header line 0
    (nvtx.OFF_MAGIC, "<Q"), (nvtx.OFF_VERSION, "<I"), (nvtx.OFF_HEADER_BYTES, "<I"),
    (nvtx.OFF_RECORD_BYTES, "<I"), (nvtx.OFF_CAPACITY, "<I"), (nvtx.OFF_RING_OFFSET, "<Q"),
    (nvtx.OFF_STRINGS_OFFSET, "<Q"), (nvtx.OFF_STRINGS_BYTES, "<Q"),
]


@st.composite
def corrupt_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    header = header_bytes(pid=PID, capacity=64, strings_bytes=4096)
    honest_size = nvtx.HEADER_BYTES + 64 * nvtx.RECORD_BYTES + 4096
    for offset, fmt in draw(st.lists(st.sampled_from(HEADER_FIELDS), max_size=4)):
        bits = struct.calcsize(fmt) * 8
        value = draw(st.one_of(st.integers(0, (1 << bits) - 1), st.sampled_from([0, 1, 63, 64, 4096, 1 << 20])))
        struct.pack_into(fmt, header, offset, value)
    if draw(st.booleans()):  # the line-0 bytes around the fields, too
        start = draw(st.integers(0, 63))
        garbage = draw(st.binary(max_size=64 - start))
        header[start : start + len(garbage)] = garbage
    size = draw(st.one_of(st.just(honest_size), st.integers(0, honest_size + 8192)))
    return bytes(header), size


@fuzz(300)
@given(corrupt_headers(), st.lists(st.tuples(U64, U64), max_size=3))
def test_corrupt_header_is_refused_in_one_line_or_read_safely(
    ring_root: Path, header_and_size: tuple[bytes, int], positions: list[tuple[int, int]]
) -> None:
    header, size = header_and_size
    directory = fresh_dir(ring_root)
    path = nvtx.ring_path(PID, directory=directory)
    path.write_bytes(header[:size].ljust(size, b"\0"))
    sink = Counting()
    try:
        collector = fake_clock_collector(directory, sink=sink)
    except NvtxUnavailable as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
        event("header refused")
        return
    event("header accepted")
    try:
        # attached to a header that passed the checks: wild head/tail values must not hurt either
        fd = os.open(path, os.O_RDWR)
        try:
            for now, (head, tail) in enumerate(positions, start=2):
                os.pwrite(fd, struct.pack("<Q", head), nvtx.OFF_HEAD)
                os.pwrite(fd, struct.pack("<Q", tail), nvtx.OFF_TAIL)
                collector.poll(now * 3 * nvtx.STALLED_SLOT_NS)
            os.pwrite(fd, struct.pack("<I", 1), nvtx.OFF_PRODUCER_EXITED)
        finally:
            os.close(fd)
        collector.poll(10**12)
        stats = collector.stats()
        assert stats["finished"] == 1 and stats["open_ranges"] == 0
    finally:
        collector.close()


# --- wild records and string regions -------------------------------------------------------------

record_strategy = st.builds(
    Record,
    kind=st.integers(0, 7),
    tid=st.sampled_from([TID, TID, TID, 1, 2**32 - 1]),  # mostly live (ours), some dead or absurd
    domain_id=st.one_of(st.integers(0, 3), U32),
    string_id=st.one_of(st.integers(0, 8), U32),
    level=st.one_of(st.integers(-2, 40), I32),
    range_id=st.one_of(st.integers(0, 12), U64),
    flags=st.integers(0, 15),
    payload_type=st.integers(0, 10),
    payload=U64,
    category=st.one_of(st.integers(0, 4), U32),
    color=U32,
    ts_ns=U64,
)

MOE_TEXTS = [b"moe", b"moe.step", b"moe.layer", b"moe.router", b"moe.expert.load", b"moe.expert.ffn",
             b"moe.request", b"moe.expert.tokens", b"moe.bogus", b"other"]


@st.composite
def string_entries(draw: st.DrawFn) -> tuple[bytes, dict[str, int]]:
    """A region of entries, mostly well-formed; returns it and the counts the collector must report."""
    blob = b""
    expect = {"dropped": 0, "invalid_utf8": 0, "corrupt": 0, "schemas": 0}
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 6))
        sid = draw(st.one_of(st.integers(0, 9), st.integers(nvtx.MAX_STRING_ID - 1, nvtx.MAX_STRING_ID + 1), U32))
        text = draw(
            st.one_of(
                st.sampled_from(MOE_TEXTS),
                st.binary(max_size=40),
                st.integers(nvtx.MAX_STRING_BYTES - 1, nvtx.MAX_STRING_BYTES + 1).map(lambda n: b"x" * n),
            )
        )
        blob += string_entry(
            kind=kind, sid=sid, text=text, domain_id=draw(st.integers(0, 3)), flags=draw(st.integers(0, 3))
        )
        bad = (len(text) > nvtx.MAX_STRING_BYTES or kind not in (1, 2, 3, 4, 5)
               or (kind in (1, 2) and not 0 < sid <= nvtx.MAX_STRING_ID))
        if bad:
            expect["dropped"] += 1
        elif kind == nvtx.STR_SCHEMA:
            expect["schemas"] += 1  # a schema entry (ring format 2): kept if it parses, else counted
        else:
            try:
                text.decode("utf-8")
            except UnicodeDecodeError:
                expect["invalid_utf8"] += 1
    if draw(st.booleans()):  # one entry whose lengths lie: the reader must stop there, once counted
        lie = draw(st.sampled_from(["short", "past_end", "text_too_long"]))
        honest = string_entry(kind=1, sid=1, text=b"liar")
        if lie == "short":
            blob += string_entry(kind=1, sid=1, text=b"liar", entry_bytes=draw(st.integers(0, 23)))
        elif lie == "past_end":
            blob += string_entry(kind=1, sid=1, text=b"liar", entry_bytes=len(honest) + 8 * draw(st.integers(1, 10**6)))
        else:
            blob += string_entry(kind=1, sid=1, text=b"liar", text_bytes=len(honest) - 23)
        expect["corrupt"] = 1
    return blob, expect


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[list[Record]], list[list[bool]]]:
    chunks = draw(st.lists(st.lists(record_strategy, max_size=80), min_size=1, max_size=4))
    commits = [[draw(st.booleans()) if draw(st.integers(0, 20)) == 0 else True for _ in chunk] for chunk in chunks]
    return chunks, commits


@fuzz(200)
@given(string_entries(), workloads(), st.sampled_from([64, 128, 256]))
def test_wild_records_and_strings_are_counted_never_fatal(
    ring_root: Path, region: tuple[bytes, dict[str, int]], work: tuple[list[list[Record]], list[list[bool]]],
    capacity: int,
) -> None:
    blob, expect = region
    chunks, commits = work
    directory = fresh_dir(ring_root)
    ring = RingFile(directory, pid=PID, capacity=capacity, strings_bytes=1 << 16)
    sink = Counting()
    collector = fake_clock_collector(directory, sink=sink)
    try:
        ring.add_strings(blob)
        now = 2
        received: list[Record] = []
        stalled = False
        for chunk, commit in zip(chunks, commits, strict=True):
            tail_before = ring.u64(nvtx.OFF_TAIL)
            head_before = ring.u64(nvtx.OFF_HEAD)
            ring.add_records(chunk, commit=commit)
            written = ring.u64(nvtx.OFF_HEAD) - head_before
            # what the collector can take: the records written, in order, up to the first uncommitted
            if not stalled and tail_before == head_before:
                for rec, ok in zip(chunk[:written], commit[:written], strict=True):
                    if not ok:
                        stalled = True
                        break
                    received.append(rec)
            else:
                stalled = True
            now += 1000  # far below STALLED_SLOT_NS: a stalled slot is waited for, not skipped
            collector.poll(now)
        ring.exit()
        collector.poll(now + 1000)
        stats = collector.stats()
        table = collector.strings
    finally:
        collector.close()
        ring.close()
    assert stats["finished"] == 1
    event("stalled" if stalled else "all committed")
    # conservation: every record written was received or counted as never committed
    assert stats["records_received"] + stats["lost_uncommitted"] == ring.written
    if not stalled:
        assert stats["records_received"] == len(received) == ring.written
        kinds = np.array([r.kind for r in received], dtype=np.int64)
        ptypes = np.array([r.payload_type for r in received], dtype=np.int64)
        flags = np.array([r.flags for r in received], dtype=np.int64)
        assert stats["unknown_kind"] == int(np.count_nonzero((kinds < 1) | (kinds > 5)))
        # ring format 2: a payload-extension record with its bytes (EXT) or without them (EXT_LOST)
        ext_types = [nvtx.PAYLOAD_EXT, nvtx.PAYLOAD_EXT_LOST]
        assert stats["ext_payload_records"] == int(np.count_nonzero(np.isin(ptypes, ext_types)))
        assert stats["unknown_payload_records"] == int(np.count_nonzero(ptypes == nvtx.PAYLOAD_UNKNOWN))
        assert stats["messages_lost"] == int(np.count_nonzero(flags & nvtx.MSG_LOST))
        stacked = int(np.count_nonzero(np.isin(kinds, [nvtx.KIND_PUSH, nvtx.KIND_POP, nvtx.KIND_MARK])))
        assert stats["marks"] == int(np.count_nonzero(kinds == nvtx.KIND_MARK))
        # every pop is paired with a push or counted; every end with a start or counted
        pops = int(np.count_nonzero(kinds == nvtx.KIND_POP))
        ends = int(np.count_nonzero(kinds == nvtx.KIND_END))
        push_ranges = stats["ranges_completed"] - (ends - stats["end_without_start"])
        assert push_ranges + stats["pop_without_push"] == pops
        assert stacked >= stats["marks"] + push_ranges
    assert stats["ranges_completed"] == sink.ranges and stats["marks"] == sink.marks
    # the string region: each anomaly counted exactly, nothing kept past the caps
    assert stats["string_entries_dropped"] == expect["dropped"]
    if not expect["corrupt"]:  # a lying entry stops the reader: what follows it is never seen
        assert stats["schema_entries_dropped"] + len(table.schemas) == expect["schemas"]
    assert stats["invalid_utf8_strings"] == expect["invalid_utf8"]
    assert stats["string_region_corrupt"] == expect["corrupt"]
    kept = len(table.strings) + len(table.domains) - 1 + len(table.categories) + len(table.thread_names)
    assert kept <= table.entries <= nvtx.MAX_STRING_ENTRIES
    assert table.text_bytes <= nvtx.MAX_STRING_TABLE_BYTES
    assert len(table.known) <= 2 * (nvtx.MAX_STRING_ID + 1)
    assert all(
        len(text.encode("utf-8", "surrogatepass")) <= 3 * nvtx.MAX_STRING_BYTES for text in table.strings.values()
    )
    parser = sink.parser.stats()
    assert parser["pending_parents"] <= 100_000


# --- the caps, reached on purpose --------------------------------------------------------------


def test_string_table_stops_at_its_cap_and_counts_the_rest(ring_root: Path) -> None:
    over = 3000
    entries = nvtx.MAX_STRING_ENTRIES + over
    blob = b"".join(string_entry(kind=nvtx.STR_THREAD, sid=i, text=b"t") for i in range(entries))
    directory = fresh_dir(ring_root)
    ring = RingFile(directory, pid=PID, capacity=64, strings_bytes=len(blob))
    assert ring.add_strings(blob) == len(blob)
    collector = fake_clock_collector(directory)
    try:
        collector.poll(2)
        stats = collector.stats()
        assert collector.strings.entries == nvtx.MAX_STRING_ENTRIES
        assert len(collector.strings.thread_names) == nvtx.MAX_STRING_ENTRIES
        assert stats["string_entries_dropped"] == over
    finally:
        collector.close()
        ring.close()


def test_string_table_stops_at_its_byte_cap(ring_root: Path) -> None:
    text = b"x" * nvtx.MAX_STRING_BYTES
    fits = nvtx.MAX_STRING_TABLE_BYTES // len(text)
    entries = fits + 50
    blob = b"".join(string_entry(kind=nvtx.STR_STRING, sid=i + 1, text=text) for i in range(entries))
    directory = fresh_dir(ring_root)
    ring = RingFile(directory, pid=PID, capacity=64, strings_bytes=len(blob))
    assert ring.add_strings(blob) == len(blob)
    collector = fake_clock_collector(directory)
    try:
        collector.poll(2)
        table = collector.strings
        assert table.entries == len(table.strings) == fits
        assert table.text_bytes == sum(len(t) for t in table.strings.values()) <= nvtx.MAX_STRING_TABLE_BYTES
        assert collector.stats()["string_entries_dropped"] == entries - fits
    finally:
        collector.close()
        ring.close()


def test_a_huge_string_id_does_not_grow_the_table(ring_root: Path) -> None:
    directory = fresh_dir(ring_root)
    ring = RingFile(directory, pid=PID, capacity=64)
    ring.add_strings(string_entry(kind=nvtx.STR_STRING, sid=(1 << 32) - 1, text=b"far")
                     + string_entry(kind=nvtx.STR_STRING, sid=nvtx.MAX_STRING_ID, text=b"last"))
    collector = fake_clock_collector(directory)
    try:
        collector.poll(2)
        assert collector.stats()["string_entries_dropped"] == 1
        assert collector.strings.name(nvtx.MAX_STRING_ID) == "last"
        assert len(collector.strings.known) <= 2 * (nvtx.MAX_STRING_ID + 1)
    finally:
        collector.close()
        ring.close()


@pytest.mark.parametrize("kind", [nvtx.KIND_PUSH, nvtx.KIND_START])
def test_open_ranges_stop_at_their_cap_and_the_oldest_are_reported_lost(ring_root: Path, kind: int) -> None:
    cap, total = 100, 300
    directory = fresh_dir(ring_root)
    ring = RingFile(directory, pid=PID, capacity=512)
    lost: list[int] = []
    collector = fake_clock_collector(directory, sink=lambda batch: lost.extend(batch.lost_uids.tolist()),
                                     max_open_ranges=cap)
    try:
        # pushes nested ever deeper on one live thread (never closed), or starts never ended
        ring.add_records([Record(kind=kind, tid=TID, level=i if kind == nvtx.KIND_PUSH else 0, range_id=i + 1)
                          for i in range(total)])
        collector.poll(2)
        stats = collector.stats()
        assert stats["open_ranges"] == cap
        assert stats["ranges_open_overflow"] == total - cap
        assert sorted(lost) == list(range(1, total - cap + 1))  # uids in arrival order: the oldest went
        # the survivors still pair: the newest range closes normally
        closing = Record(kind=nvtx.KIND_POP if kind == nvtx.KIND_PUSH else nvtx.KIND_END, tid=TID,
                         level=total - 1 if kind == nvtx.KIND_PUSH else 0, range_id=total)
        ring.add_records([closing])
        collector.poll(3)
        stats = collector.stats()
        assert stats["ranges_completed"] == 1 and stats["open_ranges"] == cap - 1
    finally:
        collector.close()
        ring.close()
