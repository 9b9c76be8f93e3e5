"""The moe.* convention parser on a real producer: the reference runtime's instrumentation module
driven with known values in a process loading the injection library."""

from __future__ import annotations

from collections.abc import Callable

from nvtx_helpers import HERE, Producer, drain_until_finished

from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import NvtxCollector

REPO = HERE.parent.parent


def test_steps_layers_router_experts_from_a_real_producer(start_producer: Callable[..., Producer]) -> None:
    steps: list[StepEvent] = []
    parser = MoeConventionParser(sink=steps.extend)
    producer = start_producer("--mode", "moe", "--rounds", "12", extra_env={"PYTHONPATH": str(REPO)})
    producer.expect_line("ready")
    collector = NvtxCollector(producer.pid, sink=parser, directory=producer.ring_dir, batch_records=97)
    try:
        producer.go()
        drain_until_finished(collector)  # small batches: parents and children land in different ones
        assert producer.wait() == 0
        cstats = collector.stats()
    finally:
        collector.close()
    truth = producer.log()["steps"]
    assert cstats["batches"] > 10 and cstats["dropped_ring_full"] == 0
    assert len(steps) == len(truth) == 12
    for got, want in zip(steps, truth, strict=True):
        assert got.pid == producer.pid and got.tid == want["tid"]
        assert want["t0"] <= got.start_ns < got.end_ns <= want["t1"]
        assert got.tokens == want["tokens"]
        assert got.requests == want["requests"]
        assert [layer.layer for layer in got.layers] == [0, 1, 2]
        for layer, wl in zip(got.layers, want["layers"], strict=True):
            assert got.start_ns <= layer.start_ns < layer.end_ns <= got.end_ns
            assert layer.num_experts == len(wl["tokens"])  # moe/v1: E is the moe.layer payload
            router = layer.router
            assert router is not None and router.layer == wl["layer"]
            assert router.entropy_bits == wl["entropy"]
            assert router.tokens == {int(k): v for k, v in wl["tokens"].items()}
            assert router.dropped == {int(k): v for k, v in wl["dropped"].items()}
            assert {e.expert: e.bytes_moved for e in layer.loads} == {int(k): v for k, v in wl["loads"].items()}
            assert [(f.expert, f.tokens) for f in layer.ffns] == [(int(k), v) for k, v in wl["ffns"].items()]
            assert all(layer.start_ns <= f.start_ns < f.end_ns <= layer.end_ns for f in layer.ffns)
            assert router.end_ns <= min([ld.start_ns for ld in layer.loads] + [f.start_ns for f in layer.ffns])
    stats = parser.stats()
    # the violations step 1 carries: counted, not crashed, not invented into the events
    assert stats["unknown_names"] == 1  # moe.bogus
    assert stats["malformed_payloads"] == 1  # moe.request with a double
    assert stats["malformed_categories"] == 1  # moe.layer without a layer
    assert stats["misplaced"] == 1  # moe.expert.tokens directly under a step
    assert stats["steps"] == 12 and stats["layers"] == 12 * 3 + 1
    assert stats["pending_parents"] == 0 and stats["orphans"] == 0
