"""`agent start --nvtx-records FILE`: every captured NVTX range and mark as one JSON line.

For any instrumented program, not only MoE runtimes: the lines carry the names, domains and
categories as the producer registered them, CLOCK_MONOTONIC ns, kernel thread ids, nesting (`uid`,
`parent_uid`, `depth`) and payloads decoded by their type. Payload types the agent cannot decode
(EXT, unknown) are written as null with their type number; the collector counts them too.
"""

from __future__ import annotations

import json
import struct
from typing import IO, Any

from moescope import errors
from moescope.collectors.nvtx import (
    KIND_PUSH,
    KIND_START,
    PAYLOAD_DOUBLE,
    PAYLOAD_FLOAT,
    PAYLOAD_I32,
    PAYLOAD_I64,
    PAYLOAD_U32,
    PAYLOAD_U64,
    NvtxBatch,
)

KIND_NAMES = {KIND_PUSH: "push", KIND_START: "start"}  # push/pop ranges, start/end ranges


def decode_payload(raw: int, payload_type: int) -> int | float | None:
    """The 8 payload bytes as the producer's type: ints signed/unsigned, floats as double."""
    raw &= (1 << 64) - 1
    if payload_type in (PAYLOAD_U64, PAYLOAD_U32):
        return raw
    if payload_type in (PAYLOAD_I64, PAYLOAD_I32):
        return raw - (1 << 64) if raw >= 1 << 63 else raw
    if payload_type in (PAYLOAD_DOUBLE, PAYLOAD_FLOAT):
        return struct.unpack("<d", raw.to_bytes(8, "little"))[0]
    return None


class NvtxRecordsSink:
    """Writes NvtxCollector batches as JSON lines; `chain` makes a per-collector sink."""

    def __init__(self, path: str) -> None:
        try:
            self._file: IO[str] = open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise errors.UsageError(f"cannot write --nvtx-records {path}: {exc.strerror}") from exc
        self.lines = 0

    def chain(self, then: Any) -> Any:
        """A sink for one collector: write the batch, then hand it on (e.g. to the MoE parser)."""

        def sink(batch: NvtxBatch) -> None:
            self.write(batch)
            then(batch)

        return sink

    def write(self, batch: NvtxBatch) -> None:
        strings = batch.strings
        out = []
        for r in batch.ranges:
            out.append({
                "type": "range",
                "kind": KIND_NAMES.get(int(r["kind"]), int(r["kind"])),
                "pid": batch.pid,
                "tid": int(r["tid"]),
                "domain": strings.domains.get(int(r["domain_id"])) or None,
                "name": strings.name(int(r["string_id"])),
                "category": strings.categories.get((int(r["domain_id"]), int(r["category"])), int(r["category"])),
                "payload": decode_payload(int(r["payload"]), int(r["payload_type"])),
                "payload_type": int(r["payload_type"]),
                "start_ns": int(r["start_ns"]),
                "end_ns": int(r["end_ns"]),
                "depth": int(r["depth"]),
                "uid": int(r["uid"]),
                "parent_uid": int(r["parent_uid"]),
                "range_id": int(r["range_id"]),
            })
        for m in batch.marks:
            out.append({
                "type": "mark",
                "pid": batch.pid,
                "tid": int(m["tid"]),
                "domain": strings.domains.get(int(m["domain_id"])) or None,
                "name": strings.name(int(m["string_id"])),
                "category": strings.categories.get((int(m["domain_id"]), int(m["category"])), int(m["category"])),
                "payload": decode_payload(int(m["payload"]), int(m["payload_type"])),
                "payload_type": int(m["payload_type"]),
                "ts_ns": int(m["ts_ns"]),
                "parent_uid": int(m["parent_uid"]),
            })
        if out:
            self._file.write("".join(json.dumps(o, separators=(",", ":")) + "\n" for o in out))
            self._file.flush()
            self.lines += len(out)

    def close(self) -> None:
        self._file.close()
