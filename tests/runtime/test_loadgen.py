"""The load generator as a real process against a real runtime, in every scenario."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tests.runtime.conftest import REPO, RunningServer

# Small model: 16 experts of 98304 B (fp32) + 529664 B of other weights. 4 resident at start
# (0.59 of this budget); all 16 resident would be 1.34: traffic with cache-on-load crosses it.
MEMORY_ARGS = ("--initial-resident-experts", "4", "--cache-on-load", "--device-memory-budget-bytes", "1572864")


def loadgen(server: RunningServer, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url",
                          f"http://127.0.0.1:{server.port}", "--max-tokens", "4", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def test_every_scenario(start_server: Callable[..., RunningServer], tmp_path: Any) -> None:
    server = start_server(*MEMORY_ARGS)
    memory = loadgen(server, "--scenario", "memory", "--concurrency", "4", "--duration-s", "3",
                     "--control-socket", server.socket_path)
    assert memory["failures"] == 0 and memory["ok"] > 0
    assert memory["memory"]["start_used_ratio"] < 1.0 < memory["memory"]["max_used_ratio"]
    assert memory["memory"]["crossed_budget"] is True and memory["memory"]["control_errors"] == []
    assert memory["server"]["expert_loads"] > 0

    balanced = loadgen(server, "--scenario", "balanced", "--concurrency", "4", "--requests", "24")
    hotspot = loadgen(server, "--scenario", "hotspot", "--concurrency", "4", "--requests", "24",
                      "--json-out", str(tmp_path / "hot.json"))
    assert json.loads((tmp_path / "hot.json").read_text()) == hotspot
    for summary in (balanced, hotspot):
        assert summary["requests"] == summary["ok"] == 24 and summary["failures"] == 0
        assert summary["mode"] == "closed" and summary["throughput_rps"] > 0
        lat = summary["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert summary["server"]["multi_request_steps"] > 0
    # Repeating one character concentrates routing (k=2: a layer's busiest expert gets at most 0.5).
    assert hotspot["server"]["hottest_expert_token_share"] > balanced["server"]["hottest_expert_token_share"] + 0.1

    burst = loadgen(server, "--scenario", "burst", "--concurrency", "8", "--requests", "16",
                    "--burst-size", "8", "--burst-interval-s", "0.3")
    assert burst["ok"] == 16 and burst["mode"] == "open" and burst["server"]["max_batch_requests"] > 1
    rate = loadgen(server, "--scenario", "uniform", "--concurrency", "2", "--requests", "6", "--rate", "20")
    assert rate["ok"] == 6 and rate["mode"] == "open" and rate["rate_per_s"] == 20
    long = loadgen(server, "--scenario", "long", "--concurrency", "2", "--requests", "4")
    assert long["ok"] == 4 and long["failures"] == 0


def test_unreachable_server_is_a_one_line_error() -> None:
    out = subprocess.run([sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", "http://127.0.0.1:9",
                          "--requests", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.startswith("loadgen: error: cannot reach") and out.stderr.count("\n") == 1
