"""The policy engine: every sample period it steps each rule instance with a `Signals` snapshot and
turns their intents into actions — rate-limited, serialised against conflicting in-flight actions,
sent on worker threads (the evaluation never waits on the socket), and audited.

    engine = PolicyEngine(load_policy(path), audit=AuditLog(path=...), actuator=Actuator(sock, timeout_s=2))
    engine.start()                      # reads the runtime's state and takes over what is in effect
    loop = PolicyLoop(engine, pipeline.policy_signals, period_s=0.2); loop.start()
    ... engine.views() for the TUI, engine.audit.recent() for the trail ...
    loop.stop(); engine.close()
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from moescope.agent.policy.actuator import (
    LATE_POLL_S,
    ActionOutcome,
    Actuator,
    CommandFailed,
    RuntimeState,
    describe_plan,
)
from moescope.agent.policy.audit import AuditLog, AuditRecord, now_unix_s
from moescope.agent.policy.config import PolicyConfig
from moescope.agent.policy.rules import (
    ACTIONS,
    COMPARISONS,
    TIME_EPS_S,
    InstanceView,
    Intent,
    RuleInstance,
    RuleSpec,
    Signals,
    State,
    Target,
    TargetKind,
    fires_upward,
)
from moescope.errors import UsageError
from moescope.procfs import name_thread

__all__ = ["PolicyEngine", "PolicyLoop", "Signals"]

log = logging.getLogger(__name__)

# Actions that rebuild or move expert weights are serialised with each other (never offload and
# restore, or migrate and offload, at once); a penalty claims only its own expert.
WEIGHTS_CLAIM = "weights:*"


def action_claims(spec: RuleSpec, target: Target) -> frozenset[str]:
    if spec.action == "router_penalty":
        return frozenset({f"penalty:{target[0]}:{target[1]}"})
    if spec.action == "alert":
        return frozenset()
    return frozenset({WEIGHTS_CLAIM})


@dataclass(slots=True)
class _Decision:
    inst: RuleInstance
    intent: Intent
    t_s: float
    decided_mono_s: float
    value: float
    window_values: list[float]
    claims: frozenset[str]


class PolicyEngine:
    def __init__(
        self,
        config: PolicyConfig,
        *,
        audit: AuditLog,
        actuator: Actuator | None = None,
        dry_run: bool = False,
        state_path: Path | str | None = None,
        max_workers: int = 4,
    ) -> None:
        if actuator is None and not dry_run:
            raise UsageError("policy engine: an actuator (control socket) is needed unless --dry-run")
        self.config = config
        self.audit = audit
        self.actuator = actuator
        self.dry_run = dry_run
        # What this agent applied and has not reverted, with what a revert needs: survives restarts.
        self.state_path = Path(state_path) if state_path is not None else None
        self.state_write_errors = 0
        # Re-entrant: audit hooks run on the evaluating thread and may read views().
        self._lock = threading.RLock()
        self._enabled: tuple[PolicyConfig, tuple[RuleSpec, ...]] | None = None  # (config, its enabled rules)
        self._instances: dict[tuple[str, Target], RuleInstance] = {}
        self._claims: Counter[str] = Counter()
        self._dispatch_t_s: deque[float] = deque()
        self._futures: set[Future[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="moescope-policy")
        self._last_t_s = math.nan
        self.evaluations = 0
        self.bad_signals = 0
        self.decisions: Counter[str] = Counter()  # every decision, audited or not
        self._unsupported_actions: set[str] = set()  # actions the runtime answered "unsupported" to
        # rule -> engine time of its last audited rate-limit suppression (see _suppress)
        self._rate_limit_audited_t_s: dict[str, float] = {}
        self.runtime_state_read = False
        self._target_cap_logged = False
        for spec in self.rules:
            if spec.target_kind is TargetKind.GLOBAL:
                self._instances[(spec.name, ())] = RuleInstance(spec, ())

    @property
    def rules(self) -> tuple[RuleSpec, ...]:
        """The enabled rules, made once per config (both frozen; read every period)."""
        config = self.config
        held = self._enabled
        if held is None or held[0] is not config:
            held = self._enabled = (config, tuple(s for s in config.rules if s.enabled))
        return held[1]

    # ---- start: read the runtime's state first ---------------------------------------------------

    def start(self) -> bool:
        """Read the runtime's state and take over actions already in effect, so none is applied
        twice. Returns False (logged) when the runtime cannot be read; actions still check state."""
        if self.dry_run or self.actuator is None:
            return False
        try:
            state = self.actuator.read_state()
        except CommandFailed as exc:
            log.warning("policy: cannot read the runtime's state at start: %s", exc)
            return False
        with self._lock:
            self._adopt(state)
            self.runtime_state_read = True
        return True

    def _load_owned(self) -> dict[tuple[str, Target], dict[str, Any]]:
        """The state file's record of what an earlier agent applied (empty when absent or unreadable)."""
        if self.state_path is None or not self.state_path.exists():
            return {}
        try:
            body = json.loads(self.state_path.read_text(encoding="utf-8"))
            return {(str(e["rule"]), tuple(int(x) for x in e["target"])): dict(e["context"]) for e in body["applied"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("policy: ignoring unreadable state file %s: %s", self.state_path, exc)
            return {}

    def _save_owned(self) -> None:
        """Persist what is applied (called under the lock after every change); never raises."""
        if self.state_path is None or self.dry_run:
            return
        applied = [
            {"rule": name, "target": list(target), "context": inst.context}
            for (name, target), inst in sorted(self._instances.items())
            if inst.applied and ACTIONS[inst.spec.action].sends_commands
        ]
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_name(self.state_path.name + ".tmp")
            tmp.write_text(json.dumps({"version": 1, "applied": applied}, indent=1), encoding="utf-8")
            os.replace(tmp, self.state_path)
        except OSError as exc:
            self.state_write_errors += 1
            if self.state_write_errors == 1:
                log.warning("policy: cannot write state file %s: %s (counting further failures)", self.state_path, exc)

    def _adopt(self, state: RuntimeState) -> None:
        """Take over what the runtime shows in effect. The runtime's state decides what is in effect;
        the state file (when there is one) adds what a revert needs (previous precision, origins)."""
        owned = self._load_owned()
        for spec in self.rules:
            adopted: list[tuple[Target, dict[str, Any], str]] = []
            if spec.action == "set_precision":
                want, back = spec.args["precision"], spec.args["revert_precision"]
                context = owned.get((spec.name, ()), {"previous": back})
                if state.precision_default == want and context.get("previous") != want:
                    adopted.append(((), context, f"runtime already runs {want}"))
            elif spec.action == "router_penalty":
                for (layer, expert), penalty in sorted(state.penalty.items()):
                    if penalty > 0:
                        adopted.append(((layer, expert), {}, f"penalty {penalty:g} already set"))
            elif spec.action == "offload_coldest":
                recorded = owned.get((spec.name, ()), {}).get("offloaded", [])
                still = [x for x in recorded if state.tier.get((int(x[0]), int(x[1]))) == "host"]
                if not still:
                    still = [[layer, expert, None] for layer, expert in state.offloaded_by_policy()]
                if still:
                    adopted.append(((), {"offloaded": still}, f"{len(still)} experts already offloaded"))
            elif spec.action == "migrate_hottest":
                for (name, target), context in sorted(owned.items()):
                    if name == spec.name and len(target) == 1:
                        where = state.device.get((target[0], int(context.get("expert", -1))))
                        if where is not None and where == context.get("to"):
                            adopted.append((target, context, f"expert {context['expert']} still on {where}"))
            for target, context, why in adopted:
                inst = self._instance(spec, target)
                if inst.applied:
                    continue
                inst.adopt(context)
                self._record(
                    _Decision(inst, Intent.FIRE, math.nan, time.monotonic(), math.nan, [], frozenset()),
                    decision="fire",
                    outcome="already-applied",
                    plan=f"taken over at start: {why}",
                )
        self._save_owned()

    # ---- evaluation ------------------------------------------------------------------------------

    def _instance(self, spec: RuleSpec, target: Target) -> RuleInstance:
        key = (spec.name, target)
        inst = self._instances.get(key)
        if inst is None:
            inst = self._instances[key] = RuleInstance(spec, target)
        return inst

    def evaluate(self, signals: Signals) -> None:
        """Step every rule with one snapshot. Never blocks on the runtime; never raises for bad data."""
        decided_mono_s = time.monotonic()
        t_s = signals.t_s
        with self._lock:
            self.evaluations += 1
            self._last_t_s = t_s
            live: dict[str, list[Target]] = {}  # rule -> the targets it has an instance for
            for name, target in self._instances:
                live.setdefault(name, []).append(target)
            for spec in self.rules:
                try:
                    values = signals.targets(spec.signal)
                except (TypeError, ValueError, AttributeError, IndexError) as exc:
                    # A malformed snapshot from the pipeline: this rule holds its state, counted.
                    self.bad_signals += 1
                    if self.bad_signals == 1:
                        log.warning("policy: malformed %s in snapshot: %s (counting further)", spec.signal, exc)
                    continue
                # The targets stepped, in order: those with an instance, and those whose value fires
                # (NaN never does); a target with neither is passed over. One comparison a target in
                # a comprehension: a busy runtime's queue signal holds every expert of the model.
                fires, at = COMPARISONS[spec.comparison], spec.fire
                firing = [target for target, value in values.items() if fires(value, at)]
                held = live.get(spec.name)
                if len(firing) + (len(held) if held else 0) > self.config.max_targets:
                    firing = self._capped(spec, firing, held or [], values)
                stepped = sorted({*firing, *(t for t in held if t in values)} if held else firing)
                name, instances, armed = spec.name, self._instances, State.ARMED
                for target in stepped:
                    value = values[target]
                    inst = instances.get((name, target))
                    if inst is None:
                        # Per-target instances exist only while something is happening to them.
                        if math.isnan(value) or not spec.fire_condition(value):
                            continue
                        inst = self._instance(spec, target)
                    intent = inst.step(value, t_s)
                    if intent is not None:
                        self._act(inst, intent, t_s, decided_mono_s)
                    if (
                        target
                        and inst.state is armed
                        and not inst.applied
                        and not inst.in_flight
                        and inst.count == 0
                        and t_s + TIME_EPS_S >= inst.cooldown_until_s
                    ):
                        del instances[(name, target)]

    def _capped(self, spec: RuleSpec, firing: list[Target], held: list[Target],
                values: Mapping[Target, float]) -> list[Target]:
        """The firing targets a rule may follow this evaluation: those it follows already, and new
        ones up to ``max_targets`` instances in all, the furthest past the fire threshold first
        (ties by target). The others are counted (``skipped-target-cap``) and logged once; they
        start when they are still firing after the rule has room."""
        following = set(held)
        new = [target for target in firing if target not in following]
        room = max(self.config.max_targets - len(following), 0)
        if len(new) <= room:
            return firing
        sign = -1.0 if fires_upward(spec.comparison) else 1.0
        started = heapq.nsmallest(room, new, key=lambda target: (sign * values[target], target))
        skipped = len(new) - room
        self.decisions["skipped-target-cap"] += skipped
        if not self._target_cap_logged:
            self._target_cap_logged = True
            # (a user trial read "0 new ones started, the furthest past its threshold, 8 skipped":
            # with every slot taken, say that instead)
            started_text = (f"{room} more started (the furthest past its threshold)" if room
                            else f"all {len(following)} slots taken")
            log.warning("policy: %s has %d new targets past its threshold and room for %d (max_targets %d): %s, "
                        "%d skipped (counted as skipped-target-cap; logged once)",
                        spec.name, len(new), room, self.config.max_targets, started_text, skipped)
        return [target for target in firing if target in following] + started

    def _rate_limited(self, t_s: float) -> bool:
        while self._dispatch_t_s and self._dispatch_t_s[0] <= t_s - self.config.rate_window_s + TIME_EPS_S:
            self._dispatch_t_s.popleft()
        return len(self._dispatch_t_s) >= self.config.max_actions

    def _act(self, inst: RuleInstance, intent: Intent, t_s: float, decided_mono_s: float) -> None:
        spec = inst.spec
        action = ACTIONS[spec.action]
        claims = inst.claims
        if claims is None:  # (a held condition retries every evaluation: made once per instance)
            claims = inst.claims = action_claims(spec, inst.target)
        fire = intent is Intent.FIRE
        if fire and spec.action in self._unsupported_actions:
            # the runtime said it cannot do this action: counted, never sent or audited again
            self.decisions["skipped-unsupported"] += 1
            return
        sends = action.sends_commands if fire else (action.revert_sends_commands and spec.revert and inst.applied)
        if sends:
            # suppressed before the decision record is made: under a burst most are only counted
            held = self._claims
            if held and any(held.get(claim, 0) > 0 for claim in claims):
                self._suppress(inst, intent, t_s, decided_mono_s, claims, "suppressed-by-conflict")
                return
            if self._rate_limited(t_s):
                self._suppress(inst, intent, t_s, decided_mono_s, claims, "suppressed-by-rate-limit")
                return
        d = _Decision(inst, intent, t_s, decided_mono_s, inst.last_value, list(inst.window_values), claims)
        if not sends:
            if fire:  # an alert: raised, no command
                inst.mark_fired(t_s)
                inst.applied = True
                self._record(d, decision="fire", outcome="alert")
            else:
                inst.mark_reverted(t_s)
                self._record(d, decision="revert", outcome="cleared")
            return
        self._dispatch_t_s.append(t_s)
        if self.dry_run:
            if fire:
                inst.mark_fired(t_s)
                inst.applied = True
            else:
                inst.mark_reverted(t_s)
            self._record(d, decision="dry-run", outcome="not-sent")
            return
        if fire:
            inst.mark_fired(t_s)
        inst.in_flight = True
        self._claims.update(d.claims)
        context = dict(inst.context)
        future = self._executor.submit(self._run_action, d, context)
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)

    def _suppress(self, inst: RuleInstance, intent: Intent, t_s: float, decided_mono_s: float,
                  claims: frozenset[str], decision: str) -> None:
        # Audit the first of a streak only: a held condition retries every evaluation. A rate-limit
        # suppression is audited at most once per rule per rate window as well: per-target rules
        # (a penalty per expert) come and go by the dozen under a burst, and each new instance
        # starts a streak (one soak: 6557 such records against 349 actions). All are counted in
        # `decisions` (moescope_policy_decisions{decision}).
        audit = inst.suppressed_streak == 0
        if audit and decision == "suppressed-by-rate-limit":
            last = self._rate_limit_audited_t_s.get(inst.spec.name)
            if last is not None and t_s - last < self.config.rate_window_s - TIME_EPS_S:
                audit = False
            else:
                self._rate_limit_audited_t_s[inst.spec.name] = t_s
        if audit:
            d = _Decision(inst, intent, t_s, decided_mono_s, inst.last_value, list(inst.window_values), claims)
            self._record(d, decision=decision, outcome="not-sent")
        else:
            self.decisions[decision] += 1
        inst.suppressed_streak += 1

    def _run_action(self, d: _Decision, context: dict[str, Any]) -> None:
        assert self.actuator is not None
        inst = d.inst
        try:
            out = self.actuator.run(d.intent, inst.spec, inst.target, context)
        except Exception as exc:  # a bug in a planner must not kill the worker or leave the claim held
            log.exception("policy: action %s for %s failed", inst.spec.action, inst.spec.name)
            out = ActionOutcome("internal-error", describe_plan(d.intent, inst.spec, inst.target), error=repr(exc))
            out.ack_mono_s = time.monotonic()
        with self._lock:
            inst.in_flight = False
            self._claims.subtract(d.claims)
            if out.outcome == "unsupported":
                self._unsupported_actions.add(inst.spec.action)
            if d.intent is Intent.FIRE:
                if out.done:
                    inst.applied = True
                    inst.context = out.context
                else:
                    inst.mark_fire_failed(d.t_s)
            elif out.done:
                inst.mark_reverted(d.t_s)
            else:
                inst.context = out.context or inst.context
                inst.mark_revert_failed(d.t_s)
            self._save_owned()
        self._record(
            d,
            decision=d.intent.value,
            outcome=out.outcome,
            plan=out.plan,
            commands=out.commands,
            latency_ms=(out.ack_mono_s - d.decided_mono_s) * 1000.0,
            error=out.error,
        )

    def _record(self, d: _Decision, *, decision: str, outcome: str, plan: str | None = None, **extra: Any) -> None:
        spec = d.inst.spec
        self.decisions[decision] += 1
        self.audit.record(
            AuditRecord(
                ts_unix_s=now_unix_s(),
                t_s=d.t_s,
                rule=spec.name,
                target=list(d.inst.target),
                signal=spec.signal,
                value=d.value,
                comparison=spec.comparison,
                threshold=spec.fire if d.intent is Intent.FIRE else spec.clear,
                window=spec.window_text if d.intent is Intent.FIRE else spec.clear_window_text,
                window_values=d.window_values[-50:],
                intent=d.intent.value,
                action=spec.action,
                decision=decision,
                outcome=outcome,
                plan=plan if plan is not None else describe_plan(d.intent, spec, d.inst.target),
                dry_run=self.dry_run,
                **extra,
            )
        )

    # ---- views for the TUI, shutdown ---------------------------------------------------------------

    def views(self) -> list[InstanceView]:
        with self._lock:
            now_s = self._last_t_s if not math.isnan(self._last_t_s) else 0.0
            return [inst.view(now_s) for _, inst in sorted(self._instances.items(), key=lambda kv: kv[0])]

    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for inst in self._instances.values() if inst.in_flight)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait for every in-flight action to finish (tests, shutdown). True when idle."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = list(self._futures)
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            wait_futures(pending, timeout=left)

    def close(self, timeout_s: float = 10.0) -> None:
        if not self.wait_idle(timeout_s) and self.actuator is not None:
            # commands still awaiting a late answer end as timeouts now (their workers would hold
            # the interpreter's exit for up to late_answer_ms)
            self.actuator.cancel_late_waits()
            self.wait_idle(2 * LATE_POLL_S)
        self._executor.shutdown(wait=False, cancel_futures=True)


# The parts of a policy wake-up whose CPU PolicyLoop.cpu_ns counts, in order.
POLICY_WORK_PARTS = ("wake", "signals", "evaluate", "peeks")


class Evaluator(Protocol):
    """What PolicyLoop drives: a PolicyEngine, or a stand-in with its ``evaluate``."""

    def evaluate(self, signals: Signals) -> object: ...


class PolicyLoop:
    """Calls engine.evaluate(source()) every period on its own thread (drift-free schedule).
    A source that raises or returns None is counted and skipped; the loop never stops on bad data.
    `after_period`, where given, runs after each evaluation on the same wake-up (the agent's main
    loop lends it its ring peeks: one thread woken per period, not two); its failures are counted
    apart and never stop the loop."""

    def __init__(
        self,
        engine: Evaluator,
        source: Callable[[], Signals | None],
        *,
        period_s: float,
        after_period: Callable[[], object] | None = None,
    ) -> None:
        self.engine = engine
        self.source = source
        self.period_s = period_s
        self.after_period = after_period
        self.source_errors = 0
        self.after_errors = 0
        self.skipped = 0
        # This thread's CPU (thread time, ns) by part of a wake-up: the signals (source), the
        # evaluation, the after-period hook (peeks), and the rest (waking, pacing): the agent's
        # summary and moescope_agent_work_cpu_seconds{thread="policy"}. Written here only.
        self.cpu_ns: dict[str, int] = dict.fromkeys(POLICY_WORK_PARTS, 0)
        # The loop sleeps on this lock, held until stop() releases it: a timed acquire is one C call,
        # where Event.wait runs threading.Condition's Python (~30 µs more a wake-up of a cold
        # thread on this VM; the loop wakes five times a second for its whole life)
        self._sleep = threading.Lock()
        self._sleep.acquire()
        self._stopped = False  # set once, under _stop_lock: stop() from two threads releases once
        self._stop_lock = threading.Lock()
        self._loop_thread = threading.Thread(target=self._run, name="moescope-policy-loop", daemon=True)

    def start(self) -> None:
        self._loop_thread.start()

    def _run(self) -> None:
        name_thread("ms-policy")  # what `top -H` and the agent's CPU-by-thread line show
        next_s = time.monotonic()
        cpu = self.cpu_ns
        clock = time.thread_time_ns
        t0 = clock()
        while not self._stopped:
            t1 = clock()
            cpu["wake"] += t1 - t0  # since the last wake-up's work: its sleep's wake and this loop
            t0 = t1
            try:
                signals = self.source()
                t1 = clock()
                cpu["signals"] += t1 - t0
                t0 = t1
                if signals is None:
                    self.skipped += 1
                else:
                    self.engine.evaluate(signals)
            except Exception as exc:  # a bug in the source or the engine must not stop the policy loop
                self.source_errors += 1
                if self.source_errors == 1:
                    log.exception("policy: evaluation failed: %s (counting further failures)", exc)
            t1 = clock()
            cpu["evaluate"] += t1 - t0  # (a source that raised: its time lands here)
            t0 = t1
            if self.after_period is not None:
                try:
                    self.after_period()
                except Exception as exc:
                    self.after_errors += 1
                    if self.after_errors == 1:
                        log.exception("policy: the after-period hook failed: %s (counting further failures)", exc)
                t1 = clock()
                cpu["peeks"] += t1 - t0
                t0 = t1
            next_s += self.period_s
            now_s = time.monotonic()
            if next_s < now_s:  # fell behind: skip the missed periods rather than bursting
                missed = math.ceil((now_s - next_s) / self.period_s)
                self.skipped += missed
                next_s += missed * self.period_s
            if self._sleep.acquire(timeout=max(0.0, next_s - now_s)):
                self._sleep.release()  # stop() released it: every later wait returns at once too

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._stop_lock:
            if not self._stopped:
                self._stopped = True
                self._sleep.release()
        self._loop_thread.join(timeout_s)
