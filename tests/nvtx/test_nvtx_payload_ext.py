"""The NVTX payload extension end to end: schemas and payload bytes through the real library, the
real `nvtx` package and the real ring, decoded by the collector; and hostile input from C."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from abi_harness import build_c_harness
from nvtx_helpers import WAIT_S, Capture, Producer, close_harness, drain_until_finished

from moescope.collectors.nvtx import (
    ENTRY_FLAG_ARRAY_LENGTH_INDEX,
    MARK_DTYPE,
    MAX_SCHEMAS,
    PAYLOAD_EXT,
    PAYLOAD_EXT_LOST,
    RANGE_DTYPE,
    SCHEMA_TYPE_DYNAMIC,
    NvtxBatch,
    NvtxCollector,
    Schema,
    SchemaField,
    StringTable,
    injection_library_path,
)

EXT_COUNTER_OUTCOMES = (
    "ext_payloads_recorded", "ext_payload_oversize_dropped", "ext_payload_blob_full_dropped",
    "ext_payload_unknown_schema_dropped", "ext_payload_malformed_dropped",
)


def _decoded(capture: Capture, kind: str) -> dict[int, list[np.ndarray | None]]:
    """Per thread, in emission order: the decoded payload of every range (by start) or mark."""
    out: dict[int, list[tuple[int, np.ndarray | None]]] = {}
    for batch in capture.batches:
        rows = batch.ranges if kind == "range" else batch.marks
        for row in rows:
            ts = int(row["start_ns"] if kind == "range" else row["ts_ns"])
            out.setdefault(int(row["tid"]), []).append((ts, batch.payload_array(row)))
    return {tid: [a for _, a in sorted(items, key=lambda x: x[0])] for tid, items in out.items()}


def test_numpy_arrays_from_the_nvtx_package_decode_exactly(start_producer: Callable[..., Producer]) -> None:
    producer = start_producer("--mode", "ext", "--threads", "4", "--rounds", "2")
    producer.expect_line("ready")
    capture = Capture()
    collector = NvtxCollector(producer.pid, sink=capture, directory=producer.ring_dir)
    try:
        producer.go()
        drain_until_finished(collector)
        assert producer.wait() == 0
        stats = collector.stats()
    finally:
        collector.close()
    sent = {int(tid): items for tid, items in producer.log()["sent"].items()}
    assert len(sent) == 4
    for kind in ("range", "mark"):
        got = _decoded(capture, kind)
        assert set(got) == set(sent)
        for tid, items in sent.items():
            want = [np.array(i["values"], dtype=i["dtype"]) for i in items if i["kind"] == kind]
            assert len(got[tid]) == len(want) == 2 * 4 * 5
            for g, w in zip(got[tid], want, strict=True):
                assert g is not None and g.dtype == w.dtype and np.array_equal(g, w)
    total = 2 * 4 * 2 * 4 * 5
    assert stats["ext_payloads"] == stats["ext_payloads_recorded"] == stats["ext_payload_records"] == total
    assert stats["ext_payloads_lost"] == 0 and stats["ext_payload_corrupt_dropped"] == 0
    # the package registers each schema once per domain object: a scalar and an array per dtype
    assert stats["schemas_registered"] == len(collector.strings.schemas) >= 8
    assert stats["schemas_dropped"] == stats["schemas_malformed_dropped"] == 0
    assert stats["dropped_ring_full"] == 0  # (ext_init_calls happened before the attach)


def _run_c_harness(tmp_path: Path, ring_dir: Path, *, thread_events: int,
                   extra_env: dict[str, str] | None = None) -> tuple[dict, dict[str, int], Capture, NvtxCollector]:
    exe = build_c_harness("ext_harness", tmp_path)
    log_path = tmp_path / "ext.json"
    env = dict(os.environ, MOESCOPE_NVTX_DIR=str(ring_dir), **(extra_env or {}))
    env.pop("NVTX_INJECTION64_PATH", None)
    proc = subprocess.Popen([str(exe), str(injection_library_path()), str(log_path), str(thread_events)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    capture = Capture()
    collector = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        collector = NvtxCollector(proc.pid, sink=capture, directory=ring_dir)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        drain_until_finished(collector)
        assert proc.wait(timeout=WAIT_S) == 0  # the process finishes: nothing crashed it
        stats = collector.stats()
    finally:
        close_harness(collector, proc)
    return json.loads(log_path.read_text()), stats, capture, collector


def _thread_payloads_are_intact(capture: Capture, main_tid: int) -> int:
    """Every recorded payload of the 8 threads decodes to what its thread sent; returns how many."""
    checked = 0
    for batch in capture.batches:
        for rows in (batch.ranges, batch.marks):
            for row in rows:
                if int(row["tid"]) == main_tid or int(row["payload_type"]) != PAYLOAD_EXT:
                    continue
                values = batch.payload_array(row)
                assert values is not None and len(values) >= 1
                first = int(values[0])
                expect = np.arange(first, first + 1 + (first % 1_000_000) % 16, dtype=np.int32)
                assert np.array_equal(values, expect)
                checked += 1
    return checked


def test_hostile_payloads_and_schemas_from_c_are_counted(tmp_path: Path, ring_dir: Path) -> None:
    log, stats, capture, collector = _run_c_harness(tmp_path, ring_dir, thread_events=4000)
    assert log["ext_init"] == [1, 1, 1] and log["enabled"] == 1 and log["other_slots_untouched"] == 1
    assert stats["ext_init_calls"] == 3 and stats["ext_unknown_modules"] == 1

    # schemas: 8 malformed, one too wide, 10k arrays (20k registrations) past the 4096 cap
    assert stats["schemas_malformed_dropped"] == log["malformed_schemas"] == 8
    assert stats["schemas_registered"] == MAX_SCHEMAS == len(collector.strings.schemas)
    assert stats["schemas_registered"] + stats["schemas_dropped"] == log["schema_attempts"]
    assert stats["schema_entries_dropped"] == 0
    named = collector.strings.schemas.get(log["static_id"])
    assert named is not None and named.name == "scalar.int32" and named.fields[0].type == 15

    # the single-thread events, in order: 5 recorded, then the losses
    singles = sorted(((int(m["ts_ns"]), b, m) for b in capture.batches for m in b.marks
                      if int(m["tid"]) == collector.pid), key=lambda x: x[0])
    assert len(singles) == log["single_events"]
    decoded = [b.payload_array(m) for _, b, m in singles[: log["recorded_single"]]]
    assert [None if d is None else d.tolist() for d in decoded] == [
        [10, 11, 12, 13], None, [-1, -2, -3, -4], [42], [10, 11, 12, 13]]  # 2nd: truncated, refused
    truncated_batch, truncated_row = singles[1][1], singles[1][2]
    found = truncated_batch.ext_payload(truncated_row)
    assert found is not None and found[0] == log["array_schema"] and len(found[1]) == 12
    lost = [m for _, _, m in singles[log["recorded_single"]:]]
    assert all(int(m["payload_type"]) == PAYLOAD_EXT_LOST for m in lost)
    assert stats["ext_payload_unknown_schema_dropped"] == log["unknown_schema"]
    assert stats["ext_payload_oversize_dropped"] == log["oversize"]
    assert stats["ext_payload_malformed_dropped"] == log["malformed_events"]
    assert stats["ext_payload_entries_dropped"] == log["entries_dropped"]

    # conservation, records and payloads: every event received or counted; every payload that got a
    # slot recorded or counted by its reason
    assert stats["records_received"] + stats["dropped_ring_full"] == log["emitted"]
    assert stats["lost_uncommitted"] == 0
    assert stats["ext_payloads"] == sum(stats[name] for name in EXT_COUNTER_OUTCOMES)
    assert stats["ext_payload_records"] == stats["ext_payloads"]
    assert stats["ext_payloads_lost"] == stats["ext_payloads"] - stats["ext_payloads_recorded"]
    assert stats["ext_payload_corrupt_dropped"] == 0
    checked = _thread_payloads_are_intact(capture, collector.pid)
    assert stats["ext_payloads_recorded"] - log["recorded_single"] == log["thread_ext_events"]
    # a range whose thread exited between reading its push and its pop is counted, not reported
    assert checked + stats["ranges_open_at_thread_exit"] == log["thread_ext_events"]


def test_a_small_blob_region_fills_and_loses_payloads_not_events(tmp_path: Path, ring_dir: Path) -> None:
    """64 KiB of blob for 8 threads: payloads are lost when the agent is behind, counted; the events
    all flow and every payload that was recorded is intact."""
    log, stats, capture, collector = _run_c_harness(tmp_path, ring_dir, thread_events=20000,
                                            extra_env={"MOESCOPE_NVTX_BLOB_BYTES": "65536",
                                                       "MOESCOPE_NVTX_RING_RECORDS": str(1 << 20)})
    assert stats["dropped_ring_full"] == 0 and stats["records_received"] == log["emitted"]
    assert stats["ext_payloads"] == sum(stats[name] for name in EXT_COUNTER_OUTCOMES)
    assert stats["ext_payload_blob_full_dropped"] > 0
    checked = _thread_payloads_are_intact(capture, collector.pid)
    assert checked + stats["ranges_open_at_thread_exit"] == stats["ext_payloads_recorded"] - log["recorded_single"]


def test_decode_array_refuses_what_it_cannot_read() -> None:
    batch = NvtxBatch(pid=0, ranges=np.empty(0), marks=np.empty(0), strings=StringTable())
    ints = batch.decode_array(15, np.arange(3, dtype=np.int32).tobytes())
    assert ints is not None and ints.tolist() == [0, 1, 2]
    doubles = batch.decode_array(20, b"\x00" * 12)
    assert doubles is not None and doubles.tolist() == [0.0]  # trailing bytes ignored
    assert batch.decode_array(32, b"\x01\x02") is None  # BYTE: not a numeric array
    assert batch.decode_array(1 << 32, b"\x00" * 16) is None  # unknown schema


@pytest.mark.parametrize("shift", [0, 3])
def test_grouped_decoding_equals_decoding_one_by_one(shift: int) -> None:
    """NvtxBatch.mark_arrays (one gather per schema and size) gives exactly what mark_array gives
    per mark: arrays of one length, of another, a truncated one, an unknown schema, no payload;
    payloads aligned in the blob, and (``shift``) not."""
    array_schema = 1 << 24
    fields = (SchemaField(0, 8, 0, 0, "size"), SchemaField(ENTRY_FLAG_ARRAY_LENGTH_INDEX, 7, 0, 0, "data"))
    strings = StringTable()
    strings.schemas.schemas[array_schema] = Schema(array_schema, SCHEMA_TYPE_DYNAMIC, 0, 0, "vec", 1, fields)
    blob = bytearray(shift)
    marks = np.zeros(8, dtype=MARK_DTYPE)

    def put(row: int, schema_id: int, body: bytes) -> None:
        marks[row]["payload_type"] = PAYLOAD_EXT
        marks[row]["payload"] = len(blob)
        blob.extend(np.array([schema_id], dtype="<u8").tobytes() + np.array([len(body), 0], dtype="<u4").tobytes())
        blob.extend(body)

    def vec(values: list[int], *, claimed: int | None = None) -> bytes:
        n = len(values) if claimed is None else claimed
        return np.array([n], dtype="<u8").tobytes() + np.array(values, dtype="<i8").tobytes()

    put(0, array_schema, vec([1, 2, 3, 4]))
    put(1, array_schema, vec([5, 6, 7, 8]))
    put(2, array_schema, vec([9, 9]))
    put(3, array_schema, vec([1, 2], claimed=3)[:-8] + b"\x00" * 8)  # same size as row 2, claims 3: truncated
    put(4, 1 << 40, vec([1]))  # unknown schema
    put(5, 15, np.arange(4, dtype=np.int32).tobytes())  # a predefined type as the schema id
    put(6, 15, np.arange(4, 8, dtype=np.int32).tobytes())
    batch = NvtxBatch(pid=1, ranges=np.zeros(0, dtype=RANGE_DTYPE), marks=marks, strings=strings,
                      blob=np.frombuffer(bytes(blob), dtype=np.uint8))
    rows = np.arange(8)
    grouped = batch.mark_arrays(rows)
    single = [batch.mark_array(int(i)) for i in rows]
    assert [None if a is None else a.tolist() for a in grouped] == [None if a is None else a.tolist() for a in single]
    assert [None if a is None else a.dtype for a in grouped] == [None if a is None else a.dtype for a in single]
    assert single[0] is not None and single[0].tolist() == [1, 2, 3, 4]
    assert single[3] is None and single[4] is None and single[7] is None
