"""RuntimeStatsSignals against the real runtime; every value recomputed here from the runtime's stats."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from policy_helpers import StartRuntime

from moescope.agent.policy.stats_source import RuntimeStatsSignals
from moescope.stats_page import PEAK_BUCKET_NS

PEAKS_HELD_S = 2 * PEAK_BUCKET_NS / 1e9  # a queue's peak is held 200-400 ms (docs/control-protocol.md)


def gini_by_pairs(counts: list[int]) -> float:
    """Gini as the mean absolute difference over all pairs / (2 * mean): the textbook definition."""
    n, total = len(counts), sum(counts)
    return sum(abs(a - b) for a in counts for b in counts) / (2 * n * total)


def tokens(stats: dict[str, Any]) -> dict[int, list[int]]:
    return {layer["layer"]: list(layer["tokens"]) for layer in stats["layers"]}


def test_signals_from_runtime_stats(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    now = {"t": 100.0}
    source = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0, clock=lambda: now["t"])
    try:
        first = source()
        before = rt.stats()
        assert first.t_s == 100.0
        assert first.device_memory_used_ratio == before["memory"]["devices"]["cpu"]["used_ratio"]
        assert first.expert_load_gini == {} and first.expert_queue_tokens == {}  # baseline only
        assert math.isnan(first.step_p99_ms) and math.isnan(first.request_p99_ms)
        for prompt in ("hello world", "mixture of experts", "zzzz"):
            rt.complete(prompt)
        rt.call("set_router_penalty", {"layer": 1, "expert": 2, "penalty": 0.3})
        time.sleep(PEAKS_HELD_S)  # the prompts' queues are held as peaks this long: past them
        now["t"] = 101.0
        second = source()
        after = rt.stats()
        for layer in (0, 1):
            delta = [a - b for a, b in zip(tokens(after)[layer], tokens(before)[layer], strict=True)]
            assert second.expert_load_gini[layer] == pytest.approx(gini_by_pairs(delta))
            entropy = after["layers"][layer]["entropy_bits"] / math.log2(8)
            assert second.router_entropy_ratio[layer] == pytest.approx(entropy)
        # Idle: no queue anywhere, but the penalised expert is reported (at 0) so its rule can clear.
        assert second.expert_queue_tokens == {(1, 2): 0.0}
        now["t"] = 112.0  # past the 10 s window: no tokens in it, so no Gini (no data, not 0)
        third = source()
        assert all(math.isnan(g) for g in third.expert_load_gini.values())
        rt.kill()
        fourth = source()
        assert source.poll_errors == 1 and math.isnan(fourth.device_memory_used_ratio)
    finally:
        source.close()


def test_without_routing_only_queues_and_memory_are_read(start_runtime: StartRuntime) -> None:
    # The agent turns routing off while NVTX supplies it: the poll still reads queues and memory.
    rt = start_runtime()
    now = {"t": 100.0}
    source = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0, clock=lambda: now["t"])
    source.with_routing = False
    try:
        source()
        rt.complete("hello world")
        rt.call("set_router_penalty", {"layer": 0, "expert": 3, "penalty": 0.3})
        time.sleep(PEAKS_HELD_S)
        now["t"] = 101.0
        signals = source()
        assert signals.expert_load_gini == {} and signals.router_entropy_ratio == {}
        assert signals.expert_queue_tokens == {(0, 3): 0.0}
        assert signals.device_memory_used_ratio == rt.stats()["memory"]["devices"]["cpu"]["used_ratio"]
        # turned back on: the next poll is a new baseline, the one after has routing again
        source.with_routing = True
        now["t"] = 102.0
        assert source().expert_load_gini == {}
        rt.complete("mixture of experts")
        now["t"] = 103.0
        assert set(source().expert_load_gini) == {0, 1}
    finally:
        source.close()
