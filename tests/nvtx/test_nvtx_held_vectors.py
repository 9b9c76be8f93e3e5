"""Held vectors end to end: a 0-d numpy
array of dtype [("values", T, (n,))] bound once to its attributes object and refilled in place
reaches the collector intact, through the real nvtx package, the real library and the real ring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from nvtx_helpers import WAIT_S, Capture, drain_until_finished

from moescope.collectors.nvtx import PAYLOAD_EXT, NvtxCollector, injection_library_path

PRODUCER = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_scale_producer.py"


def test_held_step_vectors_decode_like_set_ones(ring_dir: Path) -> None:
    decoded: dict[str, list[list[float]]] = {}
    for vectors in ("set", "held"):
        env = dict(os.environ, NVTX_INJECTION64_PATH=str(injection_library_path()), MOESCOPE_NVTX_DIR=str(ring_dir))
        proc = subprocess.Popen([sys.executable, str(PRODUCER), "--layers", "4", "--experts", "16", "--top-k", "2",
                                 "--convention", "v2-compact", "--steps-per-s", "50", "--duration-s", "0.2",
                                 "--vectors", vectors], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        capture = Capture()
        try:
            assert proc.stdout is not None and proc.stdin is not None
            pid = json.loads(proc.stdout.readline())["pid"]
            collector = NvtxCollector(pid, sink=capture, directory=ring_dir, drain_period_ns=1_000_000)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            json.loads(proc.stdout.readline())
            proc.stdin.write("\n")
            proc.stdin.flush()
            drain_until_finished(collector)
            assert proc.wait(timeout=WAIT_S) == 0
            collector.close()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)
        rows = sorted(((int(m["ts_ns"]), b, m) for b in capture.batches for m in b.marks
                       if int(m["payload_type"]) == PAYLOAD_EXT), key=lambda x: x[0])
        arrays = [b.payload_array(m) for _, b, m in rows]
        assert all(a is not None for a in arrays), "a vector did not decode"
        decoded[vectors] = [a.tolist() for a in arrays if a is not None]
    assert len(decoded["held"]) == len(decoded["set"]) == 2 * 10  # routing + entropy, 10 steps
    assert decoded["held"] == decoded["set"]
    assert all(len(v) in (4 * 2 * 16, 4) for v in decoded["held"])
    assert np.isfinite(np.concatenate([np.asarray(v, dtype=float) for v in decoded["held"]])).all()
