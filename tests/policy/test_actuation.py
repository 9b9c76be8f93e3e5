"""The real engine acting on the real reference runtime over its control socket (no mocks): every
check reads the runtime's own `stats` through the runtime's own client."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Unpack

import pytest
from peer_probe import connect_as_nobody
from policy_helpers import PERIOD_S, EngineKeys, Feeder, RuntimeProc, SignalValues, StartRuntime, levels

from moescope.agent.policy.actuator import Actuator, CommandFailed, ControlConnection
from moescope.agent.policy.audit import AuditLog
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.engine import PolicyEngine
from moescope.agent.policy.rules import Signals

DEFAULTS = load_policy()
EXPERT_BYTES = 3 * 32 * 64 * 4  # SMALL_MODEL: one fp32 SwiGLU expert (w1, w3, w2)
# Memory budget making the runtime's own used/total 0.97 with all 16 experts resident.
HOT_BUDGET = ("--device-memory-budget-bytes", "644618")

MakeEngine = Callable[..., tuple[PolicyEngine, AuditLog, Actuator]]


@pytest.fixture
def make_engine() -> Iterator[MakeEngine]:
    engines: list[PolicyEngine] = []

    def make(
        rt: RuntimeProc,
        *rules: str,
        dry_run: bool = False,
        state_path: Path | None = None,
        **engine_keys: Unpack[EngineKeys],
    ) -> tuple[PolicyEngine, AuditLog, Actuator]:
        config = dataclasses.replace(DEFAULTS, rules=tuple(DEFAULTS.rule(r) for r in rules), **engine_keys)
        actuator = Actuator.for_config(rt.socket_path, config)
        audit = AuditLog()
        engine = PolicyEngine(config, audit=audit, actuator=actuator, dry_run=dry_run, state_path=state_path)
        engines.append(engine)
        return engine, audit, actuator

    try:
        yield make
    finally:
        for engine in engines:
            engine.close(timeout_s=30.0)


def per_expert(stats: dict[str, Any], key: str) -> dict[tuple[int, int], Any]:
    return {(layer["layer"], e): v for layer in stats["layers"] for e, v in enumerate(layer[key])}


def test_fp16_fallback_and_revert_change_runtime_precision(
    start_runtime: StartRuntime, make_engine: MakeEngine
) -> None:
    rt = start_runtime()
    engine, audit, actuator = make_engine(rt, "fp16_fallback")
    assert engine.start() is True
    assert audit.recent() == []  # nothing to take over
    f = Feeder(engine, engine.config.rule("fp16_fallback"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi] * 2)
    assert rt.stats()["precision"]["default"] == "fp32"
    assert actuator.commands_sent == 1  # the start's stats
    f.feed([lv.hi])
    assert rt.stats()["precision"] == {"default": "fp16", "counts": {"fp32": 0, "bf16": 0, "fp16": 16}}
    (rec,) = audit.recent()
    assert (rec.intent, rec.decision, rec.outcome, rec.error) == ("fire", "fire", "ok", None)
    assert [c.request["cmd"] for c in rec.commands] == ["stats", "set_precision"]
    assert rec.commands[1].request["args"] == {"precision": "fp16"}
    assert rec.commands[1].answer is not None and rec.commands[1].answer["result"]["precision"] == "fp16"
    assert rec.latency_ms > 0 and all(c.latency_ms > 0 for c in rec.commands)
    f.feed([lv.hi] * 20 + [lv.lo] * (f.spec.clear_window_evals - 1))
    assert rt.stats()["precision"]["default"] == "fp16"
    assert len(audit.recent()) == 1
    f.feed([lv.lo])
    assert rt.stats()["precision"] == {"default": "fp32", "counts": {"fp32": 16, "bf16": 0, "fp16": 0}}
    revert = audit.recent()[-1]
    assert (revert.intent, revert.decision, revert.outcome) == ("revert", "revert", "ok")
    assert revert.commands[-1].request == {"id": 2, "cmd": "set_precision", "args": {"precision": "fp32"}}
    assert actuator.commands_sent == 5


def test_offload_coldest_until_below_target_then_restore(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime(*HOT_BUDGET)
    for prompt in ("the quick brown fox", "jumps over", "the lazy dog"):
        rt.complete(prompt)
    before = rt.stats()
    mem = before["memory"]["devices"]["cpu"]
    assert mem["used_ratio"] > 0.95
    # Independently: the coldest resident experts, fewest tokens first, enough to get under 0.90.
    need_bytes = mem["used_bytes"] - 0.90 * mem["budget_bytes"]
    k = math.ceil(need_bytes / EXPERT_BYTES)
    last, total = per_expert(before, "last_step_tokens"), per_expert(before, "tokens")
    expected = sorted(total, key=lambda e: (last[e], total[e], e))[:k]
    engine, audit, _ = make_engine(rt, "expert_offload")
    assert engine.start() is True
    f = Feeder(engine, engine.config.rule("expert_offload"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi] * (f.spec.window_evals - 1))
    assert rt.stats()["memory"]["devices"]["cpu"]["resident_experts"] == 16
    f.feed([lv.hi])
    after = rt.stats()
    tier, dtype = per_expert(after, "tier"), per_expert(after, "dtype")
    assert sorted(e for e, t in tier.items() if t == "host") == sorted(expected)
    assert all(dtype[e] == "fp16" for e in expected)
    assert after["memory"]["devices"]["cpu"]["used_ratio"] < 0.90
    (rec,) = audit.recent()
    assert rec.outcome == "ok"
    assert [c.request["cmd"] for c in rec.commands] == ["stats"] + ["offload_expert"] * k
    f.skip_to(f.t_s + f.spec.cooldown_s)
    f.feed([lv.lo] * f.spec.clear_window_evals)
    restored = rt.stats()
    assert set(per_expert(restored, "tier").values()) == {"device"}
    assert set(per_expert(restored, "dtype").values()) == {"fp32"}
    assert restored["memory"]["devices"]["cpu"]["used_ratio"] == mem["used_ratio"]
    revert = audit.recent()[-1]
    assert (revert.intent, revert.outcome) == ("revert", "ok")
    assert [c.request["cmd"] for c in revert.commands] == ["stats"] + ["restore_expert"] * k


def test_router_penalty_set_and_removed(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime()
    engine, audit, _ = make_engine(rt, "expert_queue_soft_limit")
    engine.start()
    f = Feeder(engine, engine.config.rule("expert_queue_soft_limit"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi])
    penalties = per_expert(rt.stats(), "penalty")
    assert penalties[(1, 3)] == pytest.approx(0.3)
    assert [e for e, p in penalties.items() if p != 0] == [(1, 3)]
    f.feed([lv.mid] * 40)  # dead band: penalty stays
    assert per_expert(rt.stats(), "penalty")[(1, 3)] == pytest.approx(0.3)
    f.feed([lv.lo])
    assert set(per_expert(rt.stats(), "penalty").values()) == {0.0}
    assert [(r.intent, r.outcome) for r in audit.recent()] == [("fire", "ok"), ("revert", "ok")]
    assert audit.recent()[0].commands[-1].request["args"] == {"layer": 1, "expert": 3, "penalty": 0.3}


def test_monopoly_moves_hottest_expert_to_least_loaded_device_and_back(
    start_runtime: StartRuntime, make_engine: MakeEngine
) -> None:
    rt = start_runtime("--devices", "cpu,cpu:1")
    for prompt in ("aaaaaaaaaaaaaaaa", "abababababab", "zzzz"):
        rt.complete(prompt)
    before = rt.stats()
    last, total = per_expert(before, "last_step_tokens"), per_expert(before, "tokens")
    hottest = max(((1, e) for e in range(8)), key=lambda x: (last[x], total[x], -x[1]))
    assert per_expert(before, "device")[hottest] == "cpu"
    engine, audit, _ = make_engine(rt, "expert_monopoly")
    engine.start()
    f = Feeder(engine, engine.config.rule("expert_monopoly"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi] * f.spec.window_evals)
    devices = per_expert(rt.stats(), "device")
    assert devices[hottest] == "cpu:1"
    assert [e for e, d in devices.items() if d != "cpu"] == [hottest]
    f.skip_to(f.t_s + f.spec.cooldown_s)
    f.feed([lv.lo] * f.spec.clear_window_evals)
    assert set(per_expert(rt.stats(), "device").values()) == {"cpu"}
    fire, revert = audit.recent()
    assert fire.commands[-1].request["args"] == {"layer": 1, "expert": hottest[1], "device": "cpu:1"}
    assert revert.commands[-1].request["args"] == {"layer": 1, "expert": hottest[1], "device": "cpu"}
    assert (fire.outcome, revert.outcome) == ("ok", "ok")


def test_slow_loads_prefetch_host_experts(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime("--resident-capacity-experts", "16", "--initial-resident-experts", "10")
    assert list(per_expert(rt.stats(), "tier").values()).count("host") == 6
    engine, audit, _ = make_engine(rt, "expert_load_slow")
    engine.start()
    f = Feeder(engine, engine.config.rule("expert_load_slow"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi] * f.spec.window_evals)
    assert list(per_expert(rt.stats(), "tier").values()).count("host") == 2
    (rec,) = audit.recent()
    assert rec.outcome == "ok" and rec.commands[-1].request["args"] == {"count": 4}
    f.skip_to(f.t_s + f.spec.cooldown_s)
    f.feed([lv.lo])
    assert [(r.intent, r.outcome, len(r.commands)) for r in audit.recent()][-1] == ("revert", "cleared", 0)


def test_refused_command_is_recorded_and_retried_once_per_cooldown(
    start_runtime: StartRuntime, make_engine: MakeEngine
) -> None:
    rt = start_runtime()
    engine, audit, actuator = make_engine(rt, "expert_queue_soft_limit")
    engine.start()
    f = Feeder(engine, engine.config.rule("expert_queue_soft_limit"), sync=True)
    lv = levels(f.spec)
    n = 300  # 60 s held over the limit on an expert the runtime does not have
    f.feed([lv.hi] * n, target=(0, 99))
    recs = audit.recent()
    per_cooldown = round(f.spec.cooldown_s / PERIOD_S)
    assert len(recs) == len(range(0, n, per_cooldown)) == 12
    for rec in recs:
        assert (rec.target, rec.decision, rec.outcome) == ([0, 99], "fire", "refused")
        answer = rec.commands[-1].answer
        assert answer is not None and answer["ok"] is False and answer["error"]
        assert rec.error is not None and "refused" in rec.error
    assert [r.t_s for r in recs] == pytest.approx([f.t_s - n * PERIOD_S + i * 5.0 for i in range(12)])
    assert actuator.commands_sent == 1 + 2 * 12
    assert set(per_expert(rt.stats(), "penalty").values()) == {0.0}


def test_runtime_killed_is_recorded_unreachable_without_a_storm(
    start_runtime: StartRuntime, make_engine: MakeEngine
) -> None:
    rt = start_runtime()
    engine, audit, actuator = make_engine(rt, "fp16_fallback")
    assert engine.start() is True
    rt.kill()
    f = Feeder(engine, engine.config.rule("fp16_fallback"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi] * 300)  # 60 s
    recs = audit.recent()
    # Window closes at the 3rd sample; one attempt per 30 s cooldown after that.
    assert [(r.outcome, r.t_s) for r in recs] == [
        ("unreachable", pytest.approx(1000.4)),
        ("unreachable", pytest.approx(1030.4)),
    ]
    assert all("unreachable" in (r.error or "") for r in recs)
    assert actuator.commands_sent == 1
    view = engine.views()[0]
    assert view.state in ("cooling", "pending") and not view.applied


def test_hung_runtime_times_out_without_blocking_evaluation(
    start_runtime: StartRuntime, make_engine: MakeEngine
) -> None:
    rt = start_runtime()
    engine, audit, _ = make_engine(rt, "fp16_fallback", command_timeout_ms=3000.0, late_answer_ms=1000.0)
    assert engine.start() is True
    os.kill(rt.proc.pid, signal.SIGSTOP)  # alive, socket open, never answers
    try:
        f = Feeder(engine, engine.config.rule("fp16_fallback"))
        lv = levels(f.spec)
        f.feed([lv.hi] * 3)
        # evaluate() returned while the command hangs on the stopped runtime.
        assert engine.in_flight() == 1
        assert engine.wait_idle(60)
        (rec,) = audit.recent()
        assert (rec.decision, rec.outcome) == ("fire", "timeout")
        assert rec.error is not None and "no answer within 3000 ms (nor 1000 ms later)" in rec.error
        f.sync = True
        f.feed([lv.hi] * 150)  # 30 s: one more attempt when the cooldown ends, not one per evaluation
        assert [r.outcome for r in audit.recent()] == ["timeout", "timeout"]
    finally:
        os.kill(rt.proc.pid, signal.SIGCONT)
    f.feed([lv.hi] * 150)  # the runtime answers again: the next attempt succeeds
    assert [r.outcome for r in audit.recent()] == ["timeout", "timeout", "ok"]
    assert rt.stats()["precision"]["default"] == "fp16"


def test_a_revert_answered_past_the_timeout_is_late_and_the_rule_follows_the_runtime(
    start_runtime: StartRuntime, make_engine: MakeEngine
) -> None:
    """A user trial (58 x 256 experts, a 1 s command timeout): set_precision back to fp32 answered
    in 1.8 s, the audit said `timeout`, the runtime had reverted and the rule stayed firing over
    it, never to fire again. Here the runtime is stopped while the revert is sent and let go after
    the timeout: its answer is awaited, the outcome is `late`, and the rule is no longer firing."""
    rt = start_runtime()
    engine, audit, actuator = make_engine(rt, "fp16_fallback", command_timeout_ms=1000.0, late_answer_ms=30000.0)
    assert engine.start() is True
    f = Feeder(engine, engine.config.rule("fp16_fallback"), sync=True)
    lv = levels(f.spec)
    f.feed([lv.hi] * 3 + [lv.lo] * (f.spec.clear_window_evals - 1))
    assert rt.stats()["precision"]["default"] == "fp16"
    f.sync = False
    os.kill(rt.proc.pid, signal.SIGSTOP)
    try:
        f.feed([lv.lo])  # the revert: its stats read waits on the stopped runtime
        assert engine.in_flight() == 1
        time.sleep(2.5)  # past the 1 s timeout
        assert engine.in_flight() == 1  # still awaiting the answer
    finally:
        os.kill(rt.proc.pid, signal.SIGCONT)
    assert engine.wait_idle(60)
    revert = audit.recent()[-1]
    assert (revert.intent, revert.decision, revert.outcome, revert.error) == ("revert", "revert", "late", None)
    assert [c.request["cmd"] for c in revert.commands] == ["stats", "set_precision"]
    assert revert.commands[0].latency_ms > 1000.0 and revert.commands[0].error is None
    assert rt.stats()["precision"]["default"] == "fp32"
    (view,) = engine.views()
    assert view.state not in ("firing", "clearing") and not view.applied  # as the runtime is
    f.sync = True
    f.feed([lv.lo] * 10 + [lv.hi] * 3 * 60)  # and it fires again when the step p99 does
    assert [r.outcome for r in audit.recent()] == ["ok", "late", "ok"]
    assert rt.stats()["precision"]["default"] == "fp16"


def test_restart_reads_state_and_never_applies_twice(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime(*HOT_BUDGET)
    rules = ("fp16_fallback", "expert_offload", "expert_queue_soft_limit")
    hot: SignalValues = {"step_p99_ms": 500.0, "device_memory_used_ratio": 0.99, "expert_queue_tokens": {(1, 3): 80.0}}
    cool: SignalValues = {"step_p99_ms": 100.0, "device_memory_used_ratio": 0.5, "expert_queue_tokens": {(1, 3): 0.0}}
    state_path = rt.workdir / "policy-state.json"
    first, audit1, _ = make_engine(rt, *rules, state_path=state_path)
    first.start()
    t = 0.0
    for i in range(30):
        # Offload first: fp16 halves the experts' bytes, after which there would be nothing to offload.
        values: SignalValues = {**hot, "step_p99_ms": 500.0 if i >= 25 else math.nan}
        first.evaluate(Signals(t_s=t, **values))
        assert first.wait_idle(60)
        t += PERIOD_S
    assert sorted((r.rule, r.outcome) for r in audit1.recent()) == [
        ("expert_offload", "ok"), ("expert_queue_soft_limit", "ok"), ("fp16_fallback", "ok"),
    ]
    applied = rt.stats()
    assert applied["precision"]["default"] == "fp16"
    offloaded = sorted(e for e, tier in per_expert(applied, "tier").items() if tier == "host")
    assert len(offloaded) == 2
    first.close()  # the agent goes away; the runtime keeps its state

    owned = json.loads(state_path.read_text())["applied"]
    assert sorted(e["rule"] for e in owned) == sorted(rules)
    second, audit2, actuator2 = make_engine(rt, *rules, state_path=state_path)
    assert second.start() is True
    taken = sorted((r.rule, r.target, r.outcome) for r in audit2.recent())
    assert taken == [
        ("expert_offload", [], "already-applied"),
        ("expert_queue_soft_limit", [1, 3], "already-applied"),
        ("fp16_fallback", [], "already-applied"),
    ]
    t = 0.0
    for _ in range(60):  # still hot: the second agent sends nothing
        second.evaluate(Signals(t_s=t, **hot))
        assert second.wait_idle(60)
        t += PERIOD_S
    assert actuator2.commands_sent == 1
    assert len(audit2.recent()) == 3
    for _ in range(160):  # cool for 32 s: the second agent reverts what the first applied
        second.evaluate(Signals(t_s=t, **cool))
        assert second.wait_idle(60)
        t += PERIOD_S
    reverts = sorted((r.rule, r.decision, r.outcome) for r in audit2.recent() if r.intent == "revert")
    # fp16 and the restore clear at the same evaluation: both touch weights, so the restore waits one.
    assert reverts == [
        ("expert_offload", "revert", "ok"),
        ("expert_offload", "suppressed-by-conflict", "not-sent"),
        ("expert_queue_soft_limit", "revert", "ok"),
        ("fp16_fallback", "revert", "ok"),
    ]
    final = rt.stats()
    assert final["precision"]["default"] == "fp32"
    assert set(per_expert(final, "tier").values()) == {"device"}
    assert set(per_expert(final, "penalty").values()) == {0.0}
    assert json.loads(state_path.read_text())["applied"] == []


def test_fire_on_state_already_in_effect_sends_nothing(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime()
    rt.call("set_precision", {"precision": "fp16"})
    engine, audit, actuator = make_engine(rt, "fp16_fallback")  # not started: no take-over
    f = Feeder(engine, engine.config.rule("fp16_fallback"), sync=True)
    f.feed([levels(f.spec).hi] * 3)
    (rec,) = audit.recent()
    assert (rec.decision, rec.outcome) == ("fire", "already-applied")
    assert [c.request["cmd"] for c in rec.commands] == ["stats"]
    assert actuator.commands_sent == 1
    assert rt.stats()["counters"]["precision_changes"] == 1


def test_conflicting_weight_actions_are_serialised(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime(*HOT_BUDGET)
    engine, audit, _ = make_engine(rt, "expert_offload", "fp16_fallback")
    engine.start()
    t = 0.0
    for i in range(25):  # both windows close at the 25th evaluation
        step = 500.0 if i >= 22 else math.nan
        engine.evaluate(Signals(t_s=t, step_p99_ms=step, device_memory_used_ratio=0.99))
        if i < 24:
            assert engine.wait_idle(60)
        t += PERIOD_S
    # The offload is in flight (or just finished) and holds the weights claim: fp16 was suppressed.
    assert [(r.rule, r.decision) for r in audit.recent() if r.rule == "fp16_fallback"] == [
        ("fp16_fallback", "suppressed-by-conflict")
    ]
    assert engine.wait_idle(60)
    engine.evaluate(Signals(t_s=t, step_p99_ms=500.0, device_memory_used_ratio=0.99))
    assert engine.wait_idle(60)
    assert sorted((r.rule, r.decision, r.outcome) for r in audit.recent()) == [
        ("expert_offload", "fire", "ok"),
        ("fp16_fallback", "fire", "ok"),
        ("fp16_fallback", "suppressed-by-conflict", "not-sent"),
    ]
    stats = rt.stats()
    assert stats["precision"]["default"] == "fp16"
    assert list(per_expert(stats, "tier").values()).count("host") == 2


def test_dry_run_sends_nothing(start_runtime: StartRuntime, make_engine: MakeEngine) -> None:
    rt = start_runtime(*HOT_BUDGET)
    before = rt.stats()
    engine, audit, actuator = make_engine(rt, *(r.name for r in DEFAULTS.rules), dry_run=True)
    assert engine.start() is False
    hot = Signals(
        t_s=0.0, step_p99_ms=900.0, device_memory_used_ratio=0.99, expert_load_p99_ms=300.0, request_p99_ms=900.0,
        expert_queue_tokens={(0, 1): 80.0}, expert_load_gini={1: 0.3}, router_entropy_ratio={0: 0.2},
    )
    cool = Signals(
        t_s=0.0, step_p99_ms=100.0, device_memory_used_ratio=0.5, expert_load_p99_ms=10.0, request_p99_ms=100.0,
        expert_queue_tokens={(0, 1): 0.0}, expert_load_gini={1: 0.05}, router_entropy_ratio={0: 0.9},
    )
    t = 0.0
    for signals in [hot] * 100 + [cool] * 400:
        engine.evaluate(dataclasses.replace(signals, t_s=t))
        t += PERIOD_S
    assert engine.wait_idle(5)
    assert actuator.commands_sent == 0
    recs = audit.recent()
    fired = sorted(r.rule for r in recs if r.intent == "fire")
    assert fired == sorted(r.name for r in DEFAULTS.rules)
    assert sorted(r.rule for r in recs if r.intent == "revert") == fired
    assert {r.decision for r in recs} == {"dry-run", "fire", "revert"}  # alerts keep fire/revert
    assert all(r.commands == [] and r.dry_run for r in recs)
    after = rt.stats()
    for key in ("penalty", "device", "tier", "dtype"):
        assert per_expert(after, key) == per_expert(before, key)
    assert after["precision"] == before["precision"]


def test_control_connection_from_another_uid_is_refused(start_runtime: StartRuntime) -> None:
    rt = start_runtime("--control-socket-mode", "0666")
    os.chmod(rt.workdir, 0o755)  # let uid 65534 reach the socket file: the runtime's peer check decides

    reply = json.loads(connect_as_nobody(rt.socket_path))
    assert reply["ok"] is False and "not permitted" in reply["error"]
    assert rt.call("ping")["protocol"] == "moescope-control/1"  # root is served
    os.chmod(rt.socket_path, 0o600)  # the default mode: the file itself keeps other uids out
    assert connect_as_nobody(rt.socket_path) == "EACCES"


def test_unsupported_command_is_told_from_a_refusal_and_keeps_the_connection(
    start_runtime: StartRuntime,
) -> None:
    """The transformers server cannot migrate an expert (its experts are one fused tensor): it
    answers "unsupported: ...", which the actuator reports as outcome "unsupported" (the engine
    then never sends that action again) while an out-of-range penalty stays "refused"; neither
    breaks the connection."""
    rt = start_runtime(hf=True)
    with ControlConnection(rt.socket_path, timeout_s=10.0) as conn:
        with pytest.raises(CommandFailed) as unsupported:
            conn.call("migrate_expert", {"layer": 0, "expert": 1, "device": "cpu"})
        assert unsupported.value.outcome == "unsupported" and "unsupported:" in str(unsupported.value)
        with pytest.raises(CommandFailed) as refused:
            conn.call("set_router_penalty", {"layer": 0, "expert": 99, "penalty": 1.0})
        assert refused.value.outcome == "refused"
        assert "unsupported" not in str(refused.value)
        assert conn.call("ping")["capabilities"]  # still usable, and it says what it can do
