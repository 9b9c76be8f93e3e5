"""The injection ABI itself: CORE and CORE2 callbacks, ASCII/wide/registered messages, every payload
type, malformed attributes, idempotent init; and the Python mirror of the ring layout."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from nvtx_helpers import HERE, Capture, close_harness, drain_until_finished

import moescope.collectors.nvtx as nv
from moescope.collectors.nvtx import NvtxCollector, injection_library_path

REPO = HERE.parent.parent


def test_python_mirror_matches_the_c_layout() -> None:
    lib = ctypes.CDLL(str(injection_library_path()))
    fn = lib.moescope_nvtx_layout
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32]
    fn.restype = ctypes.c_uint32
    n = fn(None, 0)
    out = (ctypes.c_uint64 * n)()
    assert fn(out, n) == n
    c = list(out)
    r = nv.RECORD_DTYPE.fields
    assert r is not None
    mirror = [
        nv.MAGIC, nv.VERSION, nv.HEADER_BYTES, c[3], nv.RECORD_BYTES, nv.STRING_ENTRY_BYTES,
        nv.OFF_MAGIC, nv.OFF_VERSION, nv.OFF_HEADER_BYTES, nv.OFF_RECORD_BYTES, nv.OFF_CAPACITY,
        nv.OFF_RING_OFFSET, nv.OFF_STRINGS_OFFSET, nv.OFF_STRINGS_BYTES, nv.OFF_PID, nv.OFF_CREATED_NS,
        nv.OFF_CONSUMER_ATTACHED, nv.OFF_CONSUMER_PID, nv.OFF_CONSUMER_HEARTBEAT_NS, nv.OFF_ATTACH_COUNT,
        nv.OFF_PRODUCER_EXITED, nv.OFF_HEAD, nv.OFF_TAIL, nv.OFF_STRINGS_USED, nv.OFF_STRINGS_COUNT,
        nv.OFF_COUNTERS, nv.COUNTERS,
        *(r[name][1] for name in ("seq", "ts_ns", "payload", "range_id", "tid", "domain_id", "string_id",
                                  "category", "color", "kind", "payload_type", "flags", "level")),
        0, 4, 6, 8, 12, 16,  # string entry: entry_bytes, kind, flags, id, domain_id, text_bytes
        nv.MAX_STRING_BYTES,
        nv.OFF_BLOB_OFFSET, nv.OFF_BLOB_BYTES, nv.OFF_PAYLOAD_MAX_BYTES, nv.OFF_BLOB_HEAD, nv.OFF_BLOB_TAIL,
        nv.BLOB_ENTRY_BYTES, nv.SCHEMA_HEADER_BYTES, nv.SCHEMA_FIELD_BYTES,
        0, 8, 16, 24, 28, 32,  # schema: schema_id, flags, static_size, type, field_count, name_bytes
        0, 8, 16, 24, 32,  # schema field: flags, type, array_detail, offset, name_bytes
        nv.MAX_SCHEMAS, nv.MAX_SCHEMA_FIELDS,
    ]
    assert c == mirror
    assert nv.RECORD_DTYPE.itemsize == c[4]
    assert c[3] <= nv.HEADER_BYTES and nv.OFF_COUNTERS + 8 * nv.COUNTERS <= nv.OFF_BLOB_OFFSET
    assert len(nv.PRODUCER_COUNTERS) <= nv.COUNTERS


def test_core_and_core2_callbacks_through_the_abi(tmp_path: Path, ring_dir: Path) -> None:
    log_path = tmp_path / "abi.json"
    env = dict(os.environ, MOESCOPE_NVTX_DIR=str(ring_dir), NVTX_INJECTION64_PATH=str(injection_library_path()))
    proc = subprocess.Popen([sys.executable, str(HERE / "abi_harness.py"), "--log", str(log_path)], env=env,
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    capture = Capture()
    collector = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        collector = NvtxCollector(proc.pid, sink=capture, directory=ring_dir)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        collector.poll(0)
        thread_names = dict(collector.strings.thread_names)
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        drain_until_finished(collector)
        assert proc.wait(timeout=60) == 0
        stats = collector.stats()
    finally:
        close_harness(collector, proc)
    log = json.loads(log_path.read_text())
    strings = collector.strings
    assert log["init"] == [1, 1]  # idempotent: the second object is served by the same ring
    assert log["same_domain_twice"] is True
    assert log["versions_set"] == [3]
    assert log["resource"] is None
    assert thread_names == {log["tid"]: "abi-main"}
    abi_domain = strings.domain_id("abi")
    assert abi_domain is not None and abi_domain > 0
    assert strings.categories == {(0, 3): "default-cat", (abi_domain, 4): "abi-cat"}

    ranges = capture.ranges()
    by_name = {strings.name(int(r["string_id"])): r for r in ranges}
    assert set(by_name) == {"core.push", "wide.push", "core.start", "registered.w"}
    assert by_name["wide.push"]["parent_uid"] == by_name["core.push"]["uid"]
    assert by_name["core.start"]["range_id"] == log["range_id"]
    reg = by_name["registered.w"]
    assert (int(reg["domain_id"]), int(reg["category"]), int(reg["payload_type"])) == (abi_domain, 4, nv.PAYLOAD_I32)
    assert int(np.uint64(reg["payload"]).view(np.int64)) == -7
    assert all(int(r["tid"]) == log["tid"] for r in ranges)

    marks = capture.marks()
    names = [strings.name(int(m["string_id"])) for m in marks]
    assert names == ["core.mark", "core.mark", "wide \u00e9\u4e2d\U0001f600", "A\ufffd\ufffdB", "float.mark",
                     None, "ext.mark", None, None]
    assert marks["string_id"][0] == marks["string_id"][1]  # one text, sent once
    assert marks["parent_uid"][0] == by_name["core.push"]["uid"]
    float_mark = marks[4]
    assert float_mark["payload_type"] == nv.PAYLOAD_FLOAT
    assert nv.payload_as_float(marks["payload"][4:5], marks["payload_type"][4:5])[0] == 0.25
    assert marks["payload_type"][5] == nv.PAYLOAD_UNKNOWN
    assert marks["payload_type"][6] == nv.PAYLOAD_EXT_LOST and marks["payload"][6] == 0  # never followed
    assert (marks["category"][7], marks["string_id"][7], marks["payload_type"][7]) == (9, 0, 0)

    # push/pop return the nesting level (since the attach), -1 for a pop with nothing open
    assert log["levels"] == [0, 1, 1, 0, -1, 0, -1]
    assert stats["pop_without_push"] == 2
    assert stats["unknown_payloads"] == stats["unknown_payload_records"] == 1
    assert stats["ext_payloads"] == stats["ext_payload_records"] == stats["ext_payloads_lost"] == 1
    assert stats["ext_payload_malformed_dropped"] == 1
    assert stats["unknown_messages"] == 1 and stats["messages_lost"] == 1
    assert stats["bad_unicode"] == 1
    assert stats["unsupported_calls"] == 1
    strings_entries = [s for s in strings.strings.values() if s.startswith("A")]
    assert strings_entries == ["A\ufffd\ufffdB"]
