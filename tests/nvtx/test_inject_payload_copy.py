"""The injection library's copy of EXT payload bytes into the blob region (inject.c copy_bytes): its
own vector loop where glibc's memcpy has a slow case (destination 0-63 bytes past the source modulo
4 KiB, from 2 KiB up) and memcpy elsewhere, with payloads split at the end of the region. Every
byte must arrive: the C harness (copy_harness.c) places each payload's source relative to its known
blob position, the real collector decodes every one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
from abi_harness import build_c_harness
from nvtx_helpers import WAIT_S, Capture, close_harness, drain_until_finished

from moescope.collectors.nvtx import PAYLOAD_EXT, NvtxCollector, injection_library_path

LENGTHS = (16, 509, 510, 511, 512, 1021, 1024, 4093, 16384, 29696, 51201)  # as copy_harness.c
GAPS = 9  # copy_harness.c: gaps[]
EVENTS = len(LENGTHS) * GAPS
BLOB_BYTES = 1 << 20  # the harness's payloads add up to ~3.8 MB: the region wraps several times


def test_payload_bytes_arrive_intact_through_both_copy_paths(tmp_path: Path, ring_dir: Path) -> None:
    exe = build_c_harness("copy_harness", tmp_path)
    env = dict(os.environ, MOESCOPE_NVTX_DIR=str(ring_dir), MOESCOPE_NVTX_BLOB_BYTES=str(BLOB_BYTES))
    env.pop("NVTX_INJECTION64_PATH", None)
    proc = subprocess.Popen([str(exe), str(injection_library_path()), str(EVENTS)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    capture = Capture()
    collector = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        # drained every millisecond, so the region's bytes are released well before it wraps
        collector = NvtxCollector(proc.pid, sink=capture, directory=ring_dir, drain_period_ns=1_000_000)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        drain_until_finished(collector)
        assert proc.wait(timeout=WAIT_S) == 0
        assert proc.stdout.read().strip() == "done"
        stats = collector.stats()
    finally:
        close_harness(collector, proc)

    marks = sorted(((int(m["ts_ns"]), batch, m) for batch in capture.batches for m in batch.marks
                    if int(m["payload_type"]) == PAYLOAD_EXT), key=lambda item: item[0])
    assert stats["ext_payloads"] == stats["ext_payloads_recorded"] == len(marks) == EVENTS
    assert stats["ext_payload_blob_full_dropped"] == 0 and stats["ext_payload_corrupt_dropped"] == 0
    for index, (_, batch, mark) in enumerate(marks):
        values = batch.payload_array(mark)
        expect = (index << 20) + np.arange(LENGTHS[index % len(LENGTHS)], dtype=np.int32)
        assert values is not None and values.dtype == np.int32, index
        assert np.array_equal(values, expect), f"event {index}: payload bytes differ"
