"""The policy engine seen from the rest of the agent: the TUI's `Policy` snapshot, Prometheus metrics
and an OpenTelemetry span per action. The daemon wires these:

    audit.add_hook(metrics_hook(metrics))          # moescope_policy_actions{rule,action,outcome}
    audit.add_hook(tracer_hook(tracer))            # one 'moe.policy.<intent>' span per record
    every tick: publish_rule_metrics(engine, metrics); snapshot.policy = policy_snapshot(engine)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from moescope.agent.policy.audit import AuditHook, AuditRecord
from moescope.agent.policy.engine import PolicyEngine
from moescope.agent.policy.rules import SIGNALS, InstanceView
from moescope.agent.state import ActionRecord, Policy, RuleState, RuleStatus

# The engine's states on the TUI's four (clearing is still firing: the action is in effect).
TUI_STATES: dict[str, RuleState] = {
    "armed": "armed",
    "pending": "pending",
    "firing": "firing",
    "clearing": "firing",
    "cooling": "cooling",
}
# ... and on the metric's label values (agent/metrics.py POLICY_STATES).
METRIC_STATES = {"armed": "ok", "pending": "pending", "firing": "firing", "clearing": "firing", "cooling": "cooldown"}
SEVERITY = {"firing": 0, "clearing": 1, "pending": 2, "cooling": 3, "armed": 4}


class MetricsSink(Protocol):
    def inc(self, name: str, amount: float, **labels: str) -> None: ...
    def set(self, name: str, value: float, **labels: str) -> None: ...
    def set_policy_state(self, *, rule: str, state: str) -> None: ...
    def set_counter_total(self, name: str, total: float, **labels: str) -> None: ...


# The attribute values an audit record's span carries (a subset of OpenTelemetry's AttributeValue).
SpanAttributeValue = str | bool | int | float


class SpanLike(Protocol):
    """The part of an OpenTelemetry span the hook uses."""

    def add_event(self, name: str, attributes: Mapping[str, SpanAttributeValue] | None = None) -> None: ...
    def end(self) -> None: ...


class TracerLike(Protocol):
    """The part of an OpenTelemetry tracer the hook uses: `attributes` by keyword."""

    def start_span(self, name: str, *, attributes: Mapping[str, SpanAttributeValue] | None = None) -> SpanLike: ...


def instance_name(view: InstanceView) -> str:
    return view.rule if not view.target else f"{view.rule}[{','.join(str(t) for t in view.target)}]"


def outcome_label(rec: AuditRecord) -> str:
    """What happened, in one word: the outcome, or the decision when nothing was sent."""
    return rec.decision if rec.decision not in ("fire", "revert") else rec.outcome


def rule_statuses(engine: PolicyEngine) -> list[RuleStatus]:
    out: list[RuleStatus] = []
    specs = {spec.name: spec for spec in engine.rules}
    for view in engine.views():
        spec = specs[view.rule]
        if view.state == "cooling" and spec.cooldown_s > 0:
            progress = 1.0 - min(1.0, view.cooldown_left_s / spec.cooldown_s)
        else:
            progress = view.progress
        in_effect = view.state in ("firing", "clearing")
        upward = spec.comparison in (">", ">=")
        out.append(
            RuleStatus(
                name=instance_name(view),
                state=TUI_STATES[view.state],
                progress=progress,
                signal=spec.signal,
                value=None if math.isnan(view.last_value) else view.last_value,
                threshold=view.clear if in_effect else view.fire,
                unit=SIGNALS[spec.signal].unit,
                # While in effect the rule watches for the opposite crossing.
                comparison=("<" if upward else ">") if in_effect else (">" if upward else "<"),
            )
        )
    return out


def recent_actions(engine: PolicyEngine, *, limit: int = 20) -> list[ActionRecord]:
    out = []
    for rec in engine.audit.recent(limit):
        detail = rec.plan if not rec.error else f"{rec.plan}: {rec.error}"
        out.append(
            ActionRecord(
                at_unix_s=rec.ts_unix_s,
                rule=rec.rule if not rec.target else f"{rec.rule}[{','.join(str(t) for t in rec.target)}]",
                action=f"{rec.intent} {rec.action}",
                outcome=outcome_label(rec),
                latency_ms=rec.latency_ms if rec.commands else None,
                detail=detail,
            )
        )
    return out


def policy_snapshot(engine: PolicyEngine, *, actions: int = 20) -> Policy:
    return Policy(rules=rule_statuses(engine), recent_actions=recent_actions(engine, limit=actions),
                  actions_total=engine.audit.total())


def metrics_hook(metrics: MetricsSink) -> AuditHook:
    def hook(rec: AuditRecord) -> None:
        metrics.inc("moescope_policy_actions", 1.0, rule=rec.rule, action=rec.action, outcome=outcome_label(rec))

    return hook


def publish_rule_metrics(engine: PolicyEngine, metrics: MetricsSink) -> None:
    """Per rule: the most severe state over its instances, and its signal's most extreme value;
    and the engine's decision counts (a suppression past the first of its window is not audited)."""
    for decision, count in sorted(engine.decisions.items()):
        metrics.set_counter_total("moescope_policy_decisions", float(count), decision=decision)
    views = engine.views()
    for spec in engine.rules:
        mine = [v for v in views if v.rule == spec.name]
        state = min((v.state for v in mine), key=SEVERITY.__getitem__, default="armed")
        metrics.set_policy_state(rule=spec.name, state=METRIC_STATES[state])
        values = [v.last_value for v in mine if not math.isnan(v.last_value)]
        if values:
            extreme = max(values) if spec.comparison in (">", ">=") else min(values)
            metrics.set("moescope_policy_rule_signal", extreme, rule=spec.name)


def tracer_hook(tracer: TracerLike) -> AuditHook:
    """One short span per audit record, named after the intent, carrying the record as attributes
    and a 'moe.policy.action' event (Jaeger lists them under the agent's service)."""

    def hook(rec: AuditRecord) -> None:
        attrs = rec.span_attributes()
        span = tracer.start_span(f"moe.policy.{rec.intent}", attributes=attrs)
        try:
            span.add_event("moe.policy.action", attributes=attrs)
        finally:
            span.end()

    return hook
