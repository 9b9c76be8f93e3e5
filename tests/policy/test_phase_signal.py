"""Latency rules on a phase of the requests' breakdown: config shape and errors, and the default
rules set on the seed's phases acting on the live phase window (agent/outputs/windows.py) through
the real engine."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from phase_requests import MS, ModelRequest, joined
from policy_helpers import PERIOD_S, records

from moescope.agent.outputs.windows import SIGNALS_REUSE_NS, WindowsOutput
from moescope.agent.policy.audit import AuditLog
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.engine import PolicyEngine
from moescope.agent.policy.rules import SIGNALS
from moescope.errors import ConfigError

RULE_HEAD = '[rules.my_rule]\ncomparison = ">"\nfire = 100.0\nclear = 50.0\ncooldown_s = 1.0\naction = "alert"\n'


def policy_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("phase", "signal"),
    [("inference", "request_phase_inference_p99_ms"), ("prefill", "request_phase_prefill_p99_ms"),
     ("load", "request_phase_expert_load_p99_ms"), ("expert_load", "request_phase_expert_load_p99_ms"),
     ("queue", "request_phase_queue_p99_ms"), ("routing", "request_phase_routing_p99_ms")],
)
def test_phase_key_selects_that_phase_signal(tmp_path: Path, phase: str, signal: str) -> None:
    path = policy_file(tmp_path, RULE_HEAD + f'signal = "request_phase_p99_ms"\nphase = "{phase}"\nwindow_evals = 2\n'
                       "clear_window_evals = 1\n")
    spec = load_policy(path).rule("my_rule")
    assert spec.signal == signal
    assert SIGNALS[spec.signal].unit == "ms"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('signal = "request_phase_p99_ms"\nphase = "gpu"\n',
         "rule 'my_rule': key 'phase': unknown phase 'gpu' (known: receive, queue, prefill, decode, write, "
         "inference, expert_load, routing, load (= expert_load))"),
        ('signal = "request_phase_p99_ms"\n', "rule 'my_rule': missing key 'phase' for signal 'request_phase_p99_ms'"),
        ('signal = "step_p99_ms"\nphase = "prefill"\n',
         "rule 'my_rule': key 'phase': only signal 'request_phase_p99_ms' takes a phase (signal is 'step_p99_ms')"),
        ('signal = "request_phase_p99_ms"\nphase = 3\n', "rule 'my_rule': key 'phase': expected a string, got integer"),
        ('signal = "phase_p99"\n',
         "key 'signal': unknown signal 'phase_p99' (known: request_phase_p99_ms, step_p99_ms"),
    ],
)
def test_bad_phase_config_is_one_clear_line(tmp_path: Path, body: str, message: str) -> None:
    path = policy_file(tmp_path, RULE_HEAD + body + "window_evals = 1\nclear_window_evals = 1\n")
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# The seed's reading of the two latency rules, as a user file writes it (docs/policy.md).
SEED_PHASES = '[rules.fp16_fallback]\nphase = "inference"\n[rules.expert_load_slow]\nphase = "load"\n'


def test_defaults_keep_step_and_load_signals_and_a_phase_alone_selects_the_phase_signal(tmp_path: Path) -> None:
    defaults = load_policy()
    assert defaults.rule("fp16_fallback").signal == "step_p99_ms"
    assert defaults.rule("expert_load_slow").signal == "expert_load_p99_ms"
    assert defaults.rule("slo_latency").signal == "request_p99_ms"
    config = load_policy(policy_file(tmp_path, SEED_PHASES))
    assert config.rule("fp16_fallback").signal == "request_phase_inference_p99_ms"
    assert config.rule("expert_load_slow").signal == "request_phase_expert_load_p99_ms"
    assert config.rule("fp16_fallback").fire == defaults.rule("fp16_fallback").fire == 430.0
    # any phase on a default rule
    path = policy_file(tmp_path, '[rules.fp16_fallback]\nphase = "decode"\n')
    assert load_policy(path).rule("fp16_fallback").signal == "request_phase_decode_p99_ms"


class Clock:
    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def run_engine(shape: ModelRequest, rules: tuple[str, ...], *, evaluations: int, policy: Path) -> AuditLog:
    """Requests of ``shape`` finish every 100 ms into the real windows; the real engine (dry-run)
    evaluates the windows' signals every sample period."""
    loaded = load_policy(policy)
    config = dataclasses.replace(loaded, rules=tuple(loaded.rule(r) for r in rules))
    audit = AuditLog()
    engine = PolicyEngine(config, audit=audit, dry_run=True)
    clock = Clock(1_000 * 1_000 * MS)
    windows = WindowsOutput(clock=clock)
    fd = 0
    for _ in range(evaluations):
        for _ in range(2):
            fd += 1
            event = joined(shape, start_ns=clock.now_ns, fd=fd)
            clock.now_ns = event.record.end_ns  # the request just finished
            windows.export([event])
        clock.now_ns += int(PERIOD_S * 1000) * MS
        engine.evaluate(windows.signals())
    assert engine.wait_idle(5.0)
    return audit


def fired(audit: AuditLog) -> list[str]:
    return sorted({r.rule for r in records(audit, intent="fire")})


def test_inference_p99_over_430_ms_fires_fp16_but_a_long_queue_does_not(tmp_path: Path) -> None:
    rules = ("fp16_fallback", "slo_latency", "expert_load_slow")
    policy = policy_file(tmp_path, SEED_PHASES)
    slow_gpu = ModelRequest(prefill_ms=120.0, decode_steps=40, decode_step_ms=10.0)  # inference 520 ms
    assert fired(run_engine(slow_gpu, rules, evaluations=5, policy=policy)) == ["fp16_fallback"]
    # the same total (~900 ms) spent queueing: the SLO fires, the GPU fallback does not
    queued = ModelRequest(queue_ms=800.0, prefill_ms=40.0, decode_steps=6, decode_step_ms=10.0)
    assert fired(run_engine(queued, rules, evaluations=60, policy=policy)) == ["slo_latency"]


def test_load_p99_over_200_ms_three_times_prewarms(tmp_path: Path) -> None:
    rules = ("fp16_fallback", "expert_load_slow")
    policy = policy_file(tmp_path, SEED_PHASES)
    loading = ModelRequest(prefill_ms=60.0, decode_steps=7, decode_step_ms=35.0, load_ms_per_step=30.0)  # load 240
    audit = run_engine(loading, rules, evaluations=3, policy=policy)
    assert [(r.rule, r.decision) for r in records(audit, intent="fire")] == [("expert_load_slow", "dry-run")]
    assert run_engine(loading, rules, evaluations=2, policy=policy).recent() == []  # two evaluations: not yet


def test_signals_reuse_their_window_fields_only_while_no_data_came_and_briefly() -> None:
    """The policy asks every 200 ms; between the main loop's rounds only the windows' ends move, so
    signals(reuse_ns=...) hands back what it computed less than reuse_ns and a tenth of the window
    ago while no data came in, and computes afresh on new data, for other wanted fields, or past
    that; without reuse_ns (every other reader) the windows as they stand."""
    window_ns = 2_000 * MS  # (reuse: under 200 ms, a tenth of it)
    REUSE = SIGNALS_REUSE_NS
    shape = ModelRequest(prefill_ms=40.0, decode_steps=2, decode_step_ms=10.0)
    wanted = frozenset({"request_p99_ms"})

    def one_request() -> tuple[WindowsOutput, Clock, int, float]:
        """Windows holding one request; the clock 50 ms before it leaves them; its latency."""
        clock = Clock(1_000 * 1_000 * MS)
        windows = WindowsOutput(window_ns=window_ns, clock=clock)
        event = joined(shape, start_ns=clock.now_ns, fd=1)
        windows.export([event])
        clock.now_ns = event.record.end_ns + window_ns - 50 * MS
        return windows, clock, clock.now_ns, (event.record.end_ns - event.record.start_ns) / 1e6

    windows, clock, computed_ns, latency_ms = one_request()
    assert windows.signals(wanted=wanted, reuse_ns=REUSE).request_p99_ms == latency_ms
    clock.now_ns = computed_ns + 100 * MS  # the request has left the window 50 ms ago
    assert windows.signals(wanted=wanted, reuse_ns=REUSE).request_p99_ms == latency_ms  # reused: no data since
    assert math.isnan(windows.signals(wanted=wanted).request_p99_ms)  # (not asked to reuse: as they stand)
    clock.now_ns = computed_ns + 200 * MS
    assert math.isnan(windows.signals(wanted=wanted, reuse_ns=REUSE).request_p99_ms)  # 200 ms on: afresh
    late = joined(shape, start_ns=clock.now_ns, fd=2)
    clock.now_ns = late.record.end_ns
    windows.export([late])  # new data: the next call computes afresh, however soon
    late_ms = (late.record.end_ns - late.record.start_ns) / 1e6
    assert windows.signals(wanted=wanted, reuse_ns=REUSE).request_p99_ms == late_ms

    windows, clock, computed_ns, latency_ms = one_request()
    assert windows.signals(wanted=wanted, reuse_ns=REUSE).request_p99_ms == latency_ms
    clock.now_ns = computed_ns + 100 * MS
    other = wanted | {"step_p99_ms"}
    assert math.isnan(windows.signals(wanted=other, reuse_ns=REUSE).request_p99_ms)  # other fields: afresh
