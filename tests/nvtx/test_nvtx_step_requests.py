"""moe.step.requests (moe/v2.1) end to end on a real producer: the PyPI `nvtx` package sends int64
vectors through the real injection library; the parser's per-request tokens and request keys equal
what was sent, hostile vectors are counted and leave their steps intact, and the whole-batch
(column-wise) path gives exactly the per-event path's steps and counts on the same batches."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nvtx_helpers import (
    HERE,
    Producer,
    drain_until_finished,
    kill_group,
    parse_steps,
    plain,
    producer_env,
)

from moescope.collectors.moe_convention import StepEvent
from moescope.collectors.nvtx import NvtxBatch, NvtxCollector

STEP_REQUESTS_PRODUCER = HERE / "step_requests_producer.py"
V2_PRODUCER = HERE / "moe_v2_producer.py"
STEPS, LAYERS = 12, 3


@pytest.fixture
def record(tmp_path: Path, ring_dir: Path) -> Iterator[Any]:
    """Runs a producer script under the injection library; returns its drained batches and its log."""
    started: list[subprocess.Popen[str]] = []

    def run(script: Path, *args: str, batch_records: int) -> tuple[list[NvtxBatch], dict[str, Any]]:
        log_path = tmp_path / f"producer-{len(started)}.json"
        proc = subprocess.Popen([sys.executable, str(script), "--log", str(log_path), *args],
                                env=producer_env(ring_dir, pythonpath=True),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        producer = Producer(proc=proc, log_path=log_path, ring_dir=ring_dir)
        producer.expect_line("ready")
        batches: list[NvtxBatch] = []
        collector = NvtxCollector(producer.pid, sink=batches.append, directory=ring_dir, batch_records=batch_records)
        try:
            producer.go()
            drain_until_finished(collector)
            assert producer.wait() == 0
            assert collector.stats()["dropped_ring_full"] == 0
        finally:
            collector.close()
        return batches, producer.log()

    try:
        yield run
    finally:
        for proc in started:
            kill_group(proc)


def _assert_paths_agree(batches: list[NvtxBatch]) -> tuple[list[StepEvent], dict[str, int]]:
    fast_steps, fast_stats = parse_steps(batches, fast=True)
    slow_steps, slow_stats = parse_steps(batches, fast=False)
    assert slow_stats["steps_columnar"] == slow_stats["steps_layer_columns"] == 0
    path_counts = ("steps_columnar", "steps_layer_columns")
    assert {k: v for k, v in fast_stats.items() if k not in path_counts} == {
        k: v for k, v in slow_stats.items() if k not in path_counts}
    assert plain(fast_steps) == plain(slow_steps)
    return fast_steps, fast_stats


@pytest.mark.parametrize("batch_records", [61, 1 << 16])
def test_step_requests_equal_what_was_sent(record: Any, batch_records: int) -> None:
    batches, truth = record(STEP_REQUESTS_PRODUCER, "--steps", str(STEPS), "--layers", str(LAYERS),
                            batch_records=batch_records)
    steps, stats = _assert_paths_agree(batches)
    sent, hostile = truth["steps"], truth["hostile"]
    assert len(steps) == len(sent) + len(hostile)
    if batch_records == 61:  # steps split over batches: both paths were taken
        assert 0 < stats["steps_columnar"] < len(steps)
    else:  # the whole run in one batch: every step column-wise but the one with two vectors
        assert len(batches) <= 2 and stats["steps_columnar"] == len(steps) - 1
    for got, want in zip(steps[: len(sent)], sent, strict=True):
        tokens = {k: (i, o) for k, i, o in zip(want["keys"], want["input"], want["output"], strict=True)}
        assert got.request_tokens == tokens
        # the marks first, then the vector's keys not marked: each key once
        assert got.requests == want["marks"] + [k for k in want["keys"] if k not in want["marks"]]
        assert len(got.layers) == LAYERS and all(layer.router is not None and layer.router.has_routing
                                                 for layer in got.layers)
    bad = steps[len(sent):]
    # length 7, a float vector, negative tokens: counted and left out; two vectors: the first counts
    assert [s.request_tokens for s in bad] == [None, None, None, {101: (5, 1)}]
    assert [s.requests for s in bad] == [[555], [555], [555], [555, 101]]
    assert all(len(s.layers) == LAYERS for s in bad)  # their steps and layers kept
    if batch_records != 61:  # one batch, these three column-wise: a key in several steps is one int object
        assert bad[0].requests[0] is bad[1].requests[0] is bad[2].requests[0]
    assert stats["malformed_vectors"] == 3 and stats["misplaced"] == 1
    assert stats["orphans"] == stats["unknown_names"] == stats["malformed_payloads"] == 0


@pytest.mark.parametrize("args", [("--routing", "layer"), ("--routing", "step"), ("--hostile",)])
def test_column_wise_steps_equal_the_per_event_path(record: Any, args: tuple[str, ...]) -> None:
    """The reference runtime's v2 instrumentation (routing per layer or per step, loads, experts
    times) and its hostile vectors: the two paths agree on every field and every count."""
    batches, _truth = record(V2_PRODUCER, "--convention", "v2", "--layers", "4", "--experts", "32", "--steps", "8",
                             *args, batch_records=1 << 16)
    steps, stats = _assert_paths_agree(batches)
    assert steps and stats["steps_columnar"] == len(steps)
    if "--hostile" in args:
        assert stats["malformed_vectors"] == 3
    else:
        assert stats["routing_vectors"] > 0 and any(layer.loads for s in steps for layer in s.layers)
