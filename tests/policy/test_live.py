"""The whole loop on real signals: the load generator drives the reference runtime, the policy reads
the runtime's stats every 200 ms (RuntimeStatsSignals), the engine acts over the control socket.
Assertions are on what happened (records, runtime state), never on timing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from policy_helpers import REPO, RuntimeProc, StartRuntime

from moescope.agent.policy.actuator import Actuator
from moescope.agent.policy.audit import AuditLog
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.engine import PolicyEngine, PolicyLoop
from moescope.agent.policy.stats_source import RuntimeStatsSignals, queue_floor_for

TIMEOUT_MS = 10_000


def run_load(port: int, scenario: str, duration_s: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}",
         "--scenario", scenario, "--concurrency", "8", "--duration-s", str(duration_s)],
        cwd=REPO, capture_output=True, text=True, timeout=duration_s + 120,
    )
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


def live_engine(
    rt: RuntimeProc, policy_text: str, tmp_path: Path
) -> tuple[PolicyEngine, PolicyLoop, RuntimeStatsSignals]:
    path = tmp_path / "policy.toml"
    # Generous command and stats timeouts: the test asserts every read and action succeeded, and a
    # loaded 2-core machine can hold the runtime's answer past the production default (2 s).
    path.write_text(f"[engine]\ncommand_timeout_ms = {TIMEOUT_MS}\n\n{policy_text}")
    config = load_policy(path)
    engine = PolicyEngine(config, audit=AuditLog(path=tmp_path / "audit.jsonl"),
                          actuator=Actuator.for_config(rt.socket_path, config))
    assert engine.start()
    # the queues the rules can act on, as `agent start` reads them
    source = RuntimeStatsSignals(rt.socket_path, timeout_s=TIMEOUT_MS / 1000.0,
                                 queue_floor=queue_floor_for(config.rules))
    loop = PolicyLoop(engine, source, period_s=config.sample_period_s)
    loop.start()
    return engine, loop, source


def stop_live(engine: PolicyEngine, loop: PolicyLoop, source: RuntimeStatsSignals) -> None:
    loop.stop()
    engine.close()
    source.close()


def test_hotspot_penalises_queues_and_moves_the_monopolist(start_runtime: StartRuntime, tmp_path: Path) -> None:
    rt = start_runtime("--devices", "cpu,cpu:1")
    # The full default policy; only the monopoly window is shortened so the test stays short.
    engine, loop, source = live_engine(rt, "[rules.expert_monopoly]\nwindow_s = 2.0\n", tmp_path)
    try:
        # A queue over 50 is a prefill's, there from its layer's routing until the next step's; the
        # runtime holds it as a peak for 200-400 ms, so every 200 ms poll sees it (before the peaks
        # an 8 s run missed every one about once in 14; with them six 8 s runs each fired six
        # penalties, values 70-285). 16 s kept as margin on a loaded CI machine.
        summary = run_load(rt.http_port, "hotspot", 16.0)
        assert summary["failures"] == 0 and summary["ok"] > 0
        # Load is over: queues are empty, so every penalty comes off (after its 5 s cooldown).
        assert wait_for(lambda: all(p == 0 for layer in rt.stats()["layers"] for p in layer["penalty"])
                        and engine.in_flight() == 0, 60)
    finally:
        stop_live(engine, loop, source)
    recs = engine.audit.recent()
    penalties = [r for r in recs if r.rule == "expert_queue_soft_limit" and r.decision == "fire"]
    assert penalties and all(r.outcome == "ok" and r.value > 50 for r in penalties)
    assert all(r.commands[-1].request["cmd"] == "set_router_penalty" for r in penalties)
    removed = [r for r in recs if r.rule == "expert_queue_soft_limit" and r.decision == "revert"]
    assert sorted(tuple(r.target) for r in removed) == sorted(tuple(r.target) for r in penalties)
    moves = [r for r in recs if r.rule == "expert_monopoly" and r.decision == "fire"]
    assert moves and all(r.outcome == "ok" and r.value > 0.15 for r in moves)
    devices = {(layer["layer"], e): d for layer in rt.stats()["layers"] for e, d in enumerate(layer["device"])}
    for r in moves:  # still on the least-loaded device: Gini has no data without traffic, so it holds
        args = r.commands[-1].request["args"]
        assert devices[(args["layer"], args["expert"])] == args["device"] == "cpu:1"
    assert source.poll_errors == 0 and loop.source_errors == 0
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert len(lines) == len(recs)


def test_memory_pressure_offloads_coldest_experts(start_runtime: StartRuntime, tmp_path: Path) -> None:
    # 8 of 16 experts resident; on-demand loads stay resident, so traffic fills the budget to 0.97.
    rt = start_runtime("--initial-resident-experts", "8", "--cache-on-load", "--device-memory-budget-bytes", "644618")
    assert rt.stats()["memory"]["devices"]["cpu"]["used_ratio"] < 0.9
    # The default policy: memory_alert (> 0.92 for 3 s) fires first, expert_offload (> 0.95 for 5 s)
    # then brings memory under 0.90, which clears the alert.
    engine, loop, source = live_engine(rt, "", tmp_path)
    try:
        summary = run_load(rt.http_port, "balanced", 9.0)
        assert summary["failures"] == 0 and summary["ok"] > 0
        assert wait_for(lambda: engine.in_flight() == 0 and any(
            r.rule == "memory_alert" and r.intent == "revert" for r in engine.audit.recent()), 30)
    finally:
        stop_live(engine, loop, source)
    recs = engine.audit.recent()
    offloads = [r for r in recs if r.rule == "expert_offload" and r.decision == "fire"]
    assert len(offloads) == 1 and offloads[0].outcome == "ok" and offloads[0].value > 0.95
    sent = [c.request["args"] for c in offloads[0].commands if c.request["cmd"] == "offload_expert"]
    stats = rt.stats()
    host = sorted((layer["layer"], e) for layer in stats["layers"] for e, t in enumerate(layer["tier"]) if t == "host")
    assert sorted((a["layer"], a["expert"]) for a in sent) == host
    assert stats["memory"]["devices"]["cpu"]["used_ratio"] < 0.90
    alerts = [(r.intent, r.outcome) for r in recs if r.rule == "memory_alert"]
    assert alerts == [("fire", "alert"), ("revert", "cleared")]
