"""A separate agent-like process for the tests: attaches to --pid, prints "attached", then drains
until the target finishes (or until it is killed, which is what the tests do to it)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moescope.collectors.nvtx import NvtxBatch, NvtxCollector


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    received = 0

    def sink(batch: NvtxBatch) -> None:
        nonlocal received
        received += len(batch.ranges) + len(batch.marks)

    collector = NvtxCollector(args.pid, sink=sink, directory=Path(args.dir))
    print("attached", flush=True)
    try:
        while not collector.finished:
            collector.poll(time.monotonic_ns())
            time.sleep(0.001)
    finally:
        collector.close()
    print(f"received {received}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
