"""Each default rule on the real engine with synthetic Signals: window, exactly-once, hysteresis,
cooldown, no flapping, NaN, rate limit. Dry-run mode: decisions are recorded, nothing is sent
(actuation against the real runtime is in test_actuation.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import threading
from pathlib import Path
from typing import Any, Unpack

import pytest
from cpu_burn import burn_thread_cpu
from policy_helpers import PERIOD_S, EngineKeys, Feeder, levels, records

from moescope.agent.policy.actuator import CommandResult
from moescope.agent.policy.audit import AuditLog, AuditRecord
from moescope.agent.policy.config import PolicyConfig, load_policy
from moescope.agent.policy.engine import POLICY_WORK_PARTS, PolicyEngine, PolicyLoop
from moescope.agent.policy.rules import ACTIONS, COMPARISONS, TIME_EPS_S, Intent, RuleInstance, Signals, State
from moescope.errors import UsageError

DEFAULTS = load_policy()
RULES = [spec.name for spec in DEFAULTS.rules]


def only(rule: str, **engine: Unpack[EngineKeys]) -> PolicyConfig:
    return dataclasses.replace(DEFAULTS, rules=(DEFAULTS.rule(rule),), **engine)


def feeder(rule: str, **engine: Unpack[EngineKeys]) -> tuple[Feeder, AuditLog]:
    audit = AuditLog()
    config = only(rule, **engine)
    return Feeder(PolicyEngine(config, audit=audit, dry_run=True), config.rule(rule)), audit


def fire_it(f: Feeder) -> float:
    """Feed the firing value for exactly the window; return the time of the fire."""
    f.feed([levels(f.spec).hi] * f.spec.window_evals)
    return round(f.t_s - PERIOD_S, 9)


@pytest.mark.parametrize("rule", RULES)
def test_below_window_no_action(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    for _ in range(3):
        f.feed([lv.hi] * (f.spec.window_evals - 1))
        f.feed([lv.mid])  # the dead band breaks the window: progress starts over
    f.feed([lv.just_under] * 20)
    assert records(audit) == []
    assert all(v.state in ("armed", "pending") and not v.applied for v in f.engine.views())


@pytest.mark.parametrize("rule", RULES)
def test_exactly_the_window_fires_exactly_once(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    f.feed([lv.hi] * (f.spec.window_evals - 1))
    assert records(audit) == []
    f.feed([lv.hi])
    fired = records(audit)
    assert len(fired) == 1
    rec = fired[0]
    assert (rec.rule, rec.intent, rec.action) == (rule, "fire", f.spec.action)
    if f.spec.action == "alert":
        assert (rec.decision, rec.outcome) == ("fire", "alert")
    else:
        assert (rec.decision, rec.outcome, rec.commands, rec.dry_run) == ("dry-run", "not-sent", [], True)
    assert rec.window_values == [lv.hi] * min(f.spec.window_evals, 50)
    assert (rec.value, rec.threshold, rec.window) == (lv.hi, f.spec.fire, f.spec.window_text)
    # Held far past the window and the cooldown: still one action.
    f.feed([lv.hi] * (f.spec.window_evals * 3 + round(f.spec.cooldown_s / PERIOD_S)))
    assert len(records(audit)) == 1
    view = next(v for v in f.engine.views() if v.rule == rule)
    assert (view.state, view.applied, view.fired_total) == ("firing", True, 1)


@pytest.mark.parametrize("rule", RULES)
def test_clear_window_reverts_exactly_once(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    fired_t = fire_it(f)
    f.skip_to(fired_t + f.spec.cooldown_s + 1.0)
    f.feed([lv.lo] * (f.spec.clear_window_evals - 1))
    assert records(audit, intent="revert") == []
    f.feed([lv.lo])
    reverted = records(audit, intent="revert")
    assert len(reverted) == 1
    rec = reverted[0]
    # Alerts and prefetch have nothing to undo: clearing is recorded, nothing would be sent.
    no_command = not ACTIONS[f.spec.action].revert_sends_commands
    expected = ("revert", "cleared") if no_command else ("dry-run", "not-sent")
    assert (rec.decision, rec.outcome) == expected
    assert (rec.threshold, rec.window) == (f.spec.clear, f.spec.clear_window_text)
    f.feed([lv.lo] * 50)
    assert len(records(audit)) == 2


@pytest.mark.parametrize("rule", RULES)
def test_cooldown_holds_the_revert(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    fired_t = fire_it(f)
    f.feed([lv.lo] * (round(max(f.spec.cooldown_s, f.spec.clear_window_evals * PERIOD_S) / PERIOD_S) + 5))
    (rec,) = records(audit, intent="revert")
    earliest = fired_t + max(f.spec.cooldown_s, f.spec.clear_window_evals * PERIOD_S)
    assert rec.t_s == pytest.approx(earliest, abs=1e-6)


@pytest.mark.parametrize("rule", RULES)
def test_refire_waits_for_cooldown_after_revert(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    fired_t = fire_it(f)
    f.skip_to(fired_t + f.spec.cooldown_s + 1.0)
    f.feed([lv.lo] * f.spec.clear_window_evals)
    (revert,) = records(audit, intent="revert")
    n = round(f.spec.cooldown_s / PERIOD_S) + f.spec.window_evals + 5
    f.feed([lv.hi] * n)
    fires = records(audit, intent="fire")
    assert len(fires) == 2
    assert fires[1].t_s >= revert.t_s + f.spec.cooldown_s - 1e-6
    # Held high since the revert: fires as soon as the cooldown ends (the window was already full).
    assert fires[1].t_s == pytest.approx(revert.t_s + max(f.spec.cooldown_s, f.spec.window_evals * PERIOD_S), abs=1e-6)


@pytest.mark.parametrize("rule", RULES)
def test_borderline_oscillation_does_not_flap(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    f.feed([lv.just_over, lv.just_under] * 150)  # 60 s around the fire threshold
    fires = records(audit, intent="fire")
    assert len(fires) == (1 if f.spec.window_evals == 1 else 0)
    assert records(audit, intent="revert") == []  # just under fire is not past clear
    if not fires:
        fire_it(f)
    f.feed([lv.lo, lv.mid] * 400)  # 160 s around the clear threshold, past every cooldown
    assert len(records(audit, intent="fire")) == 1
    assert len(records(audit, intent="revert")) == (1 if f.spec.clear_window_evals == 1 else 0)


@pytest.mark.parametrize("rule", RULES)
def test_nan_holds_state_and_never_fires(rule: str) -> None:
    f, audit = feeder(rule)
    lv = levels(f.spec)
    f.feed([math.nan] * 100)
    assert records(audit) == []
    f.feed([lv.hi] * (f.spec.window_evals - 1) + [math.nan] * 30)
    assert records(audit) == []
    f.feed([lv.hi])  # the window resumes where it stopped
    assert len(records(audit, intent="fire")) == 1
    f.skip_to(f.t_s + f.spec.cooldown_s + 1.0)
    f.feed([math.nan] * 300)
    assert len(records(audit)) == 1


def test_per_target_instances_are_independent() -> None:
    f, audit = feeder("expert_monopoly")
    lv = levels(f.spec)
    for _ in range(f.spec.window_evals):
        f.engine.evaluate(Signals(t_s=f.t_s, expert_load_gini={0: lv.hi, 1: lv.mid, 2: lv.hi}))
        f.t_s = round(f.t_s + PERIOD_S, 9)
    assert sorted(r.target for r in records(audit)) == [[0], [2]]
    assert {(v.target, v.state) for v in f.engine.views()} == {((0,), "firing"), ((2,), "firing")}


def test_rate_limit_suppresses_once_then_lets_through() -> None:
    f, audit = feeder("expert_queue_soft_limit", max_actions=2, rate_window_s=10.0)
    t0 = f.t_s
    hot = {(0, 1): 80.0, (0, 2): 90.0, (1, 5): 70.0}
    for _ in range(60):  # 12 s, all three held over the limit
        f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens=hot))
        f.t_s = round(f.t_s + PERIOD_S, 9)
    decisions = [(r.decision, r.target, r.t_s) for r in records(audit)]
    assert decisions[:3] == [
        ("dry-run", [0, 1], t0),
        ("dry-run", [0, 2], t0),
        ("suppressed-by-rate-limit", [1, 5], t0),
    ]
    # Audited once while suppressed, then sent when the 10 s window frees a slot.
    assert len(decisions) == 4
    assert decisions[3][:2] == ("dry-run", [1, 5])
    assert decisions[3][2] == pytest.approx(t0 + 10.0, abs=1e-6)


def test_targets_are_stepped_in_order_whatever_order_the_snapshot_has() -> None:
    # A rule's targets are stepped sorted, those with an instance and those whose value fires alike:
    # which of several firing experts a rate limit lets through does not depend on the order a
    # signal source built its dict in.
    f, audit = feeder("expert_queue_soft_limit", max_actions=2, rate_window_s=10.0)
    f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens={(1, 5): 70.0, (0, 2): 90.0, (0, 1): 80.0}))
    assert [(r.decision, r.target) for r in records(audit)] == [
        ("dry-run", [0, 1]), ("dry-run", [0, 2]), ("suppressed-by-rate-limit", [1, 5])]
    f.t_s = round(f.t_s + PERIOD_S, 9)
    # the instances held (the two penalties; the suppressed one re-armed and went) step on values
    # under the fire threshold too; (0, 0) neither fires nor is held
    f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens={(1, 5): 30.0, (0, 2): 30.0, (0, 1): 10.0, (0, 0): 5.0}))
    assert {tuple(v.target): v.last_value for v in f.engine.views()} == {(0, 1): 10.0, (0, 2): 30.0}


def test_per_expert_values_already_targets_are_read_as_they_are() -> None:
    # A per-expert signal is read five times a second, at 58 x 256 experts a mapping of up to 14,848:
    # one the agent's sources made ({(int, int): float}) is read as it is; any other is converted.
    import numpy as np

    made = {(0, 1): 80.0, (2, 3): 0.0, (1, 0): math.nan}
    assert Signals(t_s=0.0, expert_queue_tokens=made).targets("expert_queue_tokens") is made
    assert Signals(t_s=0.0).targets("expert_queue_tokens") == {}
    other = {(np.int64(0), 1): np.float64(80.0), (2, True): 7, (1, 1): True, (3, 2): 2.5}
    got = Signals(t_s=0.0, expert_queue_tokens=other).targets("expert_queue_tokens")  # type: ignore[arg-type]
    assert got == {(0, 1): 80.0, (2, 1): 7.0, (1, 1): 1.0, (3, 2): 2.5} and got is not other
    assert all(type(v) is float for v in got.values())
    assert all(type(part) is int for key in got for part in key)
    for odd in ({(0, 1.0): 1.0}, {(0, 1): 1}, {(0, 1): False}):
        converted = Signals(t_s=0.0, expert_queue_tokens=odd).targets("expert_queue_tokens")  # type: ignore[arg-type]
        assert converted is not odd and converted == {(0, 1): float(next(iter(odd.values())))}
    with pytest.raises(ValueError):  # a key not of two parts: refused (the engine counts it in bad_signals)
        Signals(t_s=0.0, expert_queue_tokens={(0, 1, 2): 1.0}).targets("expert_queue_tokens")  # type: ignore[dict-item]


def test_a_vouched_per_expert_mapping_is_read_without_its_type_check() -> None:
    # The runtime's queue signal is made of checked ints and floats (stats_source._queue) and vouched
    # for: read as it is with no pass over its 14,848 entries at 58 x 256; what nobody vouched for (or
    # no longer: only the newest VOUCHED_HELD are held) is checked and converted as ever.
    from moescope.agent.policy import rules

    odd: dict[tuple[int, int], Any] = {(0, 1): 1}  # an int value: converted when checked
    assert rules.vouch_expert_values(odd) is odd
    assert Signals(t_s=0.0, expert_queue_tokens=odd).targets("expert_queue_tokens") is odd
    for _ in range(rules.VOUCHED_HELD):
        rules.vouch_expert_values({})
    got = Signals(t_s=0.0, expert_queue_tokens=odd).targets("expert_queue_tokens")
    assert got == {(0, 1): 1.0} and got is not odd and type(got[(0, 1)]) is float


def test_a_per_target_rule_follows_at_most_max_targets_the_furthest_past_its_threshold_first(
        caplog: pytest.LogCaptureFixture) -> None:
    # Thousands of experts over the queue limit at DeepSeek-V3's shape: a rule follows max_targets of
    # them, the deepest queues first; the others are counted, and start once the rule has room.
    f, audit = feeder("expert_queue_soft_limit", max_targets=3)
    queues = {(0, e): 60.0 + e for e in range(8)} | {(1, 0): 99.0, (1, 1): 10.0}
    with caplog.at_level(logging.WARNING, logger="moescope.agent.policy.engine"):
        f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens=queues))
    assert [r.getMessage() for r in caplog.records] == [
        "policy: expert_queue_soft_limit has 9 new targets past its threshold and room for 3 (max_targets 3): "
        "3 more started (the furthest past its threshold), 6 skipped (counted as skipped-target-cap; logged once)"]
    followed = {tuple(v.target) for v in f.engine.views()}
    assert followed == {(1, 0), (0, 7), (0, 6)}  # 99, 67, 66 tokens
    assert sorted(r.target for r in records(audit)) == [[0, 6], [0, 7], [1, 0]]  # (dry-run penalties)
    assert f.engine.decisions["skipped-target-cap"] == 6
    f.t_s = round(f.t_s + PERIOD_S, 9)
    f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens=queues))  # no room: the same three
    assert {tuple(v.target) for v in f.engine.views()} == followed
    assert f.engine.decisions["skipped-target-cap"] == 12
    # the three clear and revert (after the 5 s cooldown), their instances go (after the next), and
    # the next deepest start
    quiet = {**queues, (1, 0): 0.0, (0, 7): 0.0, (0, 6): 0.0}
    for _ in range(80):
        f.t_s = round(f.t_s + PERIOD_S, 9)
        f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens=quiet))
    assert {tuple(v.target) for v in f.engine.views()} == {(0, 5), (0, 4), (0, 3)}
    # three followed (now quiet, in their revert's cooldown) and two new over the limit: no room
    quiet = {(0, 5): 0.0, (0, 4): 0.0, (0, 3): 0.0, (2, 0): 70.0, (2, 1): 80.0}
    skipped = f.engine.decisions["skipped-target-cap"]
    for _ in range(10):
        f.t_s = round(f.t_s + PERIOD_S, 9)
        f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens=quiet))
        assert len(f.engine.views()) <= 3
    assert f.engine.decisions["skipped-target-cap"] > skipped


def test_a_rule_firing_low_follows_the_lowest_values_first() -> None:
    f, _ = feeder("router_collapse", max_targets=2)
    ratios = {0: 0.5, 1: 0.2, 2: 0.9, 3: 0.1, 4: 0.4}  # four under the 0.536 threshold
    f.engine.evaluate(Signals(t_s=f.t_s, router_entropy_ratio=ratios))
    assert {tuple(v.target) for v in f.engine.views()} == {(3,), (1,)}
    assert f.engine.decisions["skipped-target-cap"] == 2


def test_a_burst_of_per_expert_instances_audits_one_suppression_per_rule_and_window() -> None:
    # 20 experts over the soft limit, 2 actions per 10 s: instances come and go (a penalty dry-run
    # re-arms after its cooldown), each would start a streak; the audit keeps one suppression per
    # rule per rate window and the engine still counts every one of them.
    f, audit = feeder("expert_queue_soft_limit", max_actions=2, rate_window_s=10.0)
    hot = {(0, e): 80.0 + e for e in range(20)}
    for _ in range(150):  # 30 s held
        f.engine.evaluate(Signals(t_s=f.t_s, expert_queue_tokens=hot))
        f.t_s = round(f.t_s + PERIOD_S, 9)
    suppressed = [r.t_s for r in records(audit) if r.decision == "suppressed-by-rate-limit"]
    sent = [r for r in records(audit) if r.decision == "dry-run"]
    assert len(sent) == 6  # 2 per window, 3 windows
    assert 1 <= len(suppressed) <= 3 and all(b - a >= 10.0 - 1e-6 for a, b in zip(suppressed, suppressed[1:]))
    assert f.engine.decisions["suppressed-by-rate-limit"] > 18 * 3  # every other expert, every window
    assert f.engine.decisions["dry-run"] == len(sent)


def test_alerts_are_not_rate_limited() -> None:
    config = dataclasses.replace(
        DEFAULTS, rules=(DEFAULTS.rule("router_collapse"),), max_actions=1, rate_window_s=60.0
    )
    audit = AuditLog()
    engine = PolicyEngine(config, audit=audit, dry_run=True)
    spec = config.rule("router_collapse")
    for i in range(spec.window_evals):
        engine.evaluate(Signals(t_s=i * PERIOD_S, router_entropy_ratio={0: 0.3, 1: 0.3, 2: 0.3}))
    assert [(r.decision, r.outcome) for r in audit.recent()] == [("fire", "alert")] * 3


def test_engine_without_actuator_needs_dry_run() -> None:
    with pytest.raises(UsageError, match="unless --dry-run"):
        PolicyEngine(DEFAULTS, audit=AuditLog())


def test_audit_file_is_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "policy.jsonl"
    audit = AuditLog(path=path)
    f = Feeder(PolicyEngine(only("fp16_fallback"), audit=audit, dry_run=True), DEFAULTS.rule("fp16_fallback"))
    seen: list[AuditRecord] = []
    audit.add_hook(seen.append)
    fire_it(f)
    f.feed([math.nan])
    audit.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and len(seen) == 1
    body = json.loads(lines[0])
    assert body["rule"] == "fp16_fallback" and body["decision"] == "dry-run" and body["plan"] == "set_precision fp16"
    assert body["window_values"] == [levels(f.spec).hi] * 3
    attrs = seen[0].span_attributes()
    assert attrs["moe.policy.rule"] == "fp16_fallback" and attrs["moe.policy.dry_run"] is True
    assert audit.counts() == {("fp16_fallback", "dry-run", "not-sent"): 1}


def test_an_audit_line_holds_every_field_of_its_record_and_its_commands() -> None:
    # to_json writes the record's own values (no deep copy): the same text as a dataclasses.asdict
    # of it, NaN as null, a command's request and answer as their JSON
    commands = [CommandResult({"cmd": "set_router_penalty", "args": {"layer": 1, "expert": [2]}},
                              {"ok": True, "result": {"penalty": -0.3}}, 1.25),
                CommandResult({"cmd": "offload_expert"}, None, 2.0, "timeout")]
    rec = AuditRecord(ts_unix_s=1.5, t_s=math.nan, rule="r", target=[1, 2], signal="s", value=math.nan,
                      comparison=">", threshold=50.0, window="1 sample", window_values=[51.0, 2.5], intent="fire",
                      action="router_penalty", decision="sent", outcome="done", plan="p", commands=commands,
                      latency_ms=3.0, error=None, dry_run=False)
    want = dataclasses.asdict(rec)
    want.update(t_s=None, value=None)
    assert json.loads(rec.to_json()) == want and list(json.loads(rec.to_json())) == list(want)


def test_malformed_snapshot_is_counted_and_holds_state() -> None:
    f, audit = feeder("expert_queue_soft_limit")
    # Deliberately mistyped (a 1-tuple key, a string value): what a buggy signal source could send.
    f.engine.evaluate(Signals(t_s=0.0, expert_queue_tokens={(0,): 80.0}))  # type: ignore[dict-item]  # malformed on purpose
    f.engine.evaluate(Signals(t_s=0.2, expert_queue_tokens={(0, 1): "lots"}))  # type: ignore[dict-item]  # malformed on purpose
    assert f.engine.bad_signals == 2 and records(audit) == []
    f.engine.evaluate(Signals(t_s=0.4, expert_queue_tokens={(0, 1): 80.0}))
    assert len(records(audit)) == 1


def test_policy_loop_runs_on_its_own_thread_and_survives_a_failing_source() -> None:
    config = only("slo_latency")
    audit = AuditLog()
    engine = PolicyEngine(config, audit=audit, dry_run=True)
    calls = {"n": 0}
    done = threading.Event()

    def source() -> Signals | None:
        calls["n"] += 1
        n = calls["n"]
        if n == 2:
            raise RuntimeError("pipeline hiccup")
        if n == 3:
            return None
        if n > config.rule("slo_latency").window_evals + 3:
            done.set()
        return Signals(t_s=n * PERIOD_S, request_p99_ms=900.0)

    loop = PolicyLoop(engine, source, period_s=0.001)
    loop.start()
    try:
        assert done.wait(60)
    finally:
        loop.stop()
    assert loop.source_errors == 1 and loop.skipped >= 1
    assert [(r.rule, r.outcome) for r in audit.recent()] == [("slo_latency", "alert")]


def test_policy_loop_runs_its_after_period_hook_on_each_wake_up_and_survives_its_failures() -> None:
    engine = PolicyEngine(only("slo_latency"), audit=AuditLog(), dry_run=True)
    evaluated: list[int] = []
    hooked: list[int] = []
    done = threading.Event()

    def source() -> Signals:
        evaluated.append(len(evaluated))
        return Signals(t_s=len(evaluated) * PERIOD_S, request_p99_ms=10.0)

    def after() -> None:  # the main loop's ring peek, in the agent
        hooked.append(len(evaluated))
        if len(hooked) == 2:
            raise OSError("a ring went away")
        if len(hooked) >= 6:
            done.set()

    loop = PolicyLoop(engine, source, period_s=0.001, after_period=after)
    loop.start()
    try:
        assert done.wait(60)
    finally:
        loop.stop()
    # after each evaluation, on the same wake-up; one failure counted, apart from the source's
    assert hooked[:6] == [1, 2, 3, 4, 5, 6]
    assert loop.after_errors == 1 and loop.source_errors == 0



def test_policy_loop_counts_its_cpu_by_part_of_a_wake_up() -> None:
    """PolicyLoop.cpu_ns: the thread's CPU split into the signals, the evaluation and the peeks
    (moescope_agent_work_cpu_seconds{thread="policy"}), each part its own: a part that burns 2 ms
    a wake-up counts at least that, one that does nothing stays under it."""
    burned = {"signals": 0, "evaluate": 0, "peeks": 0}
    done = threading.Event()

    class Engine:
        def evaluate(self, signals: object) -> None:
            burn_thread_cpu(2_000_000)
            burned["evaluate"] += 1

    def source() -> Signals:
        burn_thread_cpu(2_000_000)
        burned["signals"] += 1
        return Signals(t_s=0.0)

    def after() -> None:
        burned["peeks"] += 1
        if burned["peeks"] >= 5:
            done.set()

    loop = PolicyLoop(Engine(), source, period_s=0.001, after_period=after)
    assert loop.cpu_ns == dict.fromkeys(POLICY_WORK_PARTS, 0)
    loop.start()
    try:
        assert done.wait(60)
    finally:
        loop.stop()
    cpu = dict(loop.cpu_ns)
    assert list(cpu) == list(POLICY_WORK_PARTS)
    assert cpu["signals"] >= 2_000_000 * burned["signals"] > 0
    assert cpu["evaluate"] >= 2_000_000 * burned["evaluate"] > 0
    # the peeks did nothing: well under what one burning part took, though counted on each wake-up
    assert 0 < cpu["peeks"] < 2_000_000 * burned["peeks"]


def _reference_step(inst: RuleInstance, value: float, t_s: float) -> Intent | None:
    """RuleInstance.step as specified (docs/policy.md), through the spec's condition methods: the
    engine's step resolves the comparisons once and must move the same way."""
    if math.isnan(value):
        return None
    inst.last_value, inst.last_t_s = value, t_s
    spec = inst.spec
    if inst.state in (State.ARMED, State.PENDING, State.COOLING):
        if spec.fire_condition(value):
            inst.count += 1
            inst.window_values.append(value)
        else:
            inst.count = 0
            inst.window_values.clear()
            inst.suppressed_streak = 0
        if t_s + TIME_EPS_S < inst.cooldown_until_s:
            inst.state = State.COOLING
            return None
        if inst.count >= spec.window_evals and not inst.in_flight:
            inst.state = State.PENDING
            return Intent.FIRE
        inst.state = State.PENDING if inst.count else State.ARMED
        return None
    if spec.clear_condition(value):
        inst.clear_count += 1
        inst.window_values.append(value)
    else:
        inst.clear_count = 0
        inst.window_values.clear()
        inst.suppressed_streak = 0
    inst.state = State.CLEARING if inst.clear_count else State.FIRING
    if inst.clear_count >= spec.clear_window_evals and t_s + TIME_EPS_S >= inst.cooldown_until_s and not inst.in_flight:
        return Intent.REVERT
    return None


@pytest.mark.parametrize("comparison", sorted(COMPARISONS))
def test_an_instance_steps_as_its_rule_says_for_every_comparison(comparison: str) -> None:
    """Random values around both thresholds, NaN among them, fires and reverts applied as the engine
    does: the step and the reference move through the same states and return the same intents."""
    upward = comparison in (">", ">=")
    base = load_policy(None).rule("expert_queue_soft_limit")
    spec = dataclasses.replace(base, comparison=comparison, fire=50.0 if upward else 10.0,
                               clear=25.0 if upward else 30.0, window_evals=3, clear_window_evals=2, cooldown_s=1.0)
    rng = random.Random(comparison)
    fast, slow = RuleInstance(spec, (0, 1)), RuleInstance(spec, (0, 1))
    intents = set()
    for i in range(3000):
        t_s = i * PERIOD_S
        value = rng.choice([math.nan, 0.0, 10.0, 25.0, 30.0, 50.0, 90.0, rng.uniform(0, 100)])
        got, want = fast.step(value, t_s), _reference_step(slow, value, t_s)
        assert got == want, (i, value)
        for inst in (fast, slow):
            if got is Intent.FIRE:
                inst.mark_fired(t_s)
            elif got is Intent.REVERT:
                inst.mark_reverted(t_s)
        intents.add(got)
        assert (fast.state, fast.count, fast.clear_count, list(fast.window_values), fast.suppressed_streak) == (
            slow.state, slow.count, slow.clear_count, list(slow.window_values), slow.suppressed_streak), i
    assert intents == {None, Intent.FIRE, Intent.REVERT}


def test_policy_loop_stops_mid_wait_and_stops_twice() -> None:
    """stop() ends the loop's wait at once, whatever its period (an hour here), from any thread
    and more than once."""
    engine = PolicyEngine(only("slo_latency"), audit=AuditLog(), dry_run=True)
    waited = threading.Event()

    def source() -> Signals:
        waited.set()
        return Signals(t_s=0.0, request_p99_ms=10.0)

    loop = PolicyLoop(engine, source, period_s=3600.0)
    loop.start()
    assert waited.wait(60)  # its first evaluation made: the loop now waits out its hour
    stopper = threading.Thread(target=loop.stop, kwargs={"timeout_s": 60.0})
    stopper.start()
    loop.stop(timeout_s=60.0)
    stopper.join(60.0)
    assert not loop._loop_thread.is_alive() and not stopper.is_alive()
