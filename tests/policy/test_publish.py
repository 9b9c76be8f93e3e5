"""The engine's state as the TUI, Prometheus and OTel see it (real Metrics, real OTel SDK)."""

from __future__ import annotations

import dataclasses

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from policy_helpers import PERIOD_S

from moescope.agent.metrics import Metrics
from moescope.agent.policy.audit import AuditLog
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.engine import PolicyEngine
from moescope.agent.policy.publish import metrics_hook, policy_snapshot, publish_rule_metrics, tracer_hook
from moescope.agent.policy.rules import Signals

DEFAULTS = load_policy()


def engine_with(*rules: str) -> PolicyEngine:
    config = dataclasses.replace(DEFAULTS, rules=tuple(DEFAULTS.rule(r) for r in rules))
    return PolicyEngine(config, audit=AuditLog(), dry_run=True)


def test_policy_snapshot_for_the_tui() -> None:
    engine = engine_with("fp16_fallback", "memory_alert", "expert_queue_soft_limit")
    for i in range(3):
        engine.evaluate(Signals(t_s=i * PERIOD_S, step_p99_ms=500.0, device_memory_used_ratio=0.93,
                                expert_queue_tokens={(2, 7): 60.0}))
    snap = policy_snapshot(engine)
    rules = {r.name: r for r in snap.rules}
    assert set(rules) == {"fp16_fallback", "memory_alert", "expert_queue_soft_limit[2,7]"}
    fp16 = rules["fp16_fallback"]
    # Firing: it now watches for the clear crossing.
    assert (fp16.state, fp16.value, fp16.threshold, fp16.comparison, fp16.unit) == ("firing", 500.0, 300.0, "<", "ms")
    mem = rules["memory_alert"]
    assert (mem.state, mem.progress, mem.threshold, mem.comparison) == ("pending", 3 / 15, 0.92, ">")
    assert rules["expert_queue_soft_limit[2,7]"].state == "firing"
    actions = [(a.rule, a.action, a.outcome, a.latency_ms) for a in snap.recent_actions]
    assert actions == [
        ("expert_queue_soft_limit[2,7]", "fire router_penalty", "dry-run", None),
        ("fp16_fallback", "fire set_precision", "dry-run", None),
    ]
    assert snap.actions_total == 2
    assert len(policy_snapshot(engine, actions=1).recent_actions) == 1
    assert policy_snapshot(engine, actions=1).actions_total == 2  # every record, not the last few


def test_metrics_and_spans_per_record() -> None:
    engine = engine_with("router_collapse", "expert_queue_soft_limit")
    metrics = Metrics()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine.audit.add_hook(metrics_hook(metrics))
    engine.audit.add_hook(tracer_hook(provider.get_tracer("moescope.policy")))
    spec = engine.config.rule("router_collapse")
    for i in range(spec.window_evals):
        engine.evaluate(Signals(t_s=i * PERIOD_S, router_entropy_ratio={0: 0.4, 1: 0.7},
                                expert_queue_tokens={(0, 0): 30.0}))
    assert metrics.get("moescope_policy_actions", rule="router_collapse", action="alert", outcome="alert") == 1
    publish_rule_metrics(engine, metrics)
    assert metrics.get("moescope_policy_rule_state", rule="router_collapse", state="firing") == 1
    assert metrics.get("moescope_policy_rule_state", rule="router_collapse", state="ok") == 0
    assert metrics.get("moescope_policy_rule_signal", rule="router_collapse") == 0.4  # the lowest layer
    assert metrics.get("moescope_policy_decisions", decision="fire") == engine.decisions["fire"] == 1
    # 30 tokens: in the dead band, never fired, so no instance and an "ok" state.
    assert metrics.get("moescope_policy_rule_state", rule="expert_queue_soft_limit", state="ok") == 1
    (span,) = exporter.get_finished_spans()
    assert span.name == "moe.policy.fire"
    assert span.attributes is not None and span.attributes["moe.policy.rule"] == "router_collapse"
    assert span.attributes["moe.policy.target"] == "0" and span.attributes["moe.policy.value"] == 0.4
    assert [e.name for e in span.events] == ["moe.policy.action"]
