"""Policy config: the packaged defaults are DESIGN.md's table, and every bad file is one clear line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moescope.agent import policy_cmd
from moescope.agent.policy.config import load_policy
from moescope.errors import EXIT_USAGE, ConfigError

# DESIGN.md "Policy defaults", written out independently of default_policy.toml.
DESIGN_TABLE = {
    "fp16_fallback": ("step_p99_ms", ">", 430.0, 3, "set_precision", 300.0, 150),
    "expert_offload": ("device_memory_used_ratio", ">", 0.95, 25, "offload_coldest", 0.85, 150),
    "memory_alert": ("device_memory_used_ratio", ">", 0.92, 15, "alert", 0.90, 1),
    "expert_queue_soft_limit": ("expert_queue_tokens", ">", 50.0, 1, "router_penalty", 25.0, 1),
    "expert_monopoly": ("expert_load_gini", ">", 0.15, 50, "migrate_hottest", 0.12, 1),
    "router_collapse": ("router_entropy_ratio", "<", 0.536, 50, "alert", 0.586, 1),
    "expert_load_slow": ("expert_load_p99_ms", ">", 200.0, 3, "prefetch_hottest", 100.0, 1),
    "slo_latency": ("request_p99_ms", ">", 870.0, 50, "alert", 800.0, 1),
}


def test_defaults_are_designs_table() -> None:
    config = load_policy()
    assert config.sample_period_ms == 200
    assert [r.name for r in config.rules] == list(DESIGN_TABLE)
    for spec in config.rules:
        signal, cmp, fire, window_evals, action, clear, clear_evals = DESIGN_TABLE[spec.name]
        got = (
            spec.signal,
            spec.comparison,
            spec.fire,
            spec.window_evals,
            spec.action,
            spec.clear,
            spec.clear_window_evals,
        )
        assert got == (signal, cmp, fire, window_evals, action, clear, clear_evals), spec.name
        assert spec.enabled and spec.revert
    assert config.rule("expert_queue_soft_limit").args["penalty"] == -0.3
    assert config.rule("expert_offload").args["target_ratio"] == 0.90
    assert config.rule("fp16_fallback").args["precision"] == "fp16"
    # router_collapse: 7.5 bits at E=16384 is 7.5/14 of log2(E).
    assert round(7.5 / 14, 3) == config.rule("router_collapse").fire


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def test_user_file_overrides_key_by_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[engine]
sample_period_ms = 100
max_targets = 16
[rules.fp16_fallback]
fire = 500.0
window_s = 1.0
[rules.expert_queue_soft_limit.args]
penalty = -0.5
[rules.slo_latency]
enabled = false
""",
    )
    config = load_policy(path)
    assert (config.sample_period_ms, config.max_targets, config.max_actions) == (100, 16, 8)
    fp16 = config.rule("fp16_fallback")
    assert (fp16.fire, fp16.window_evals, fp16.window_text, fp16.clear) == (500.0, 10, "1 s", 300.0)
    # Durations are re-derived from the new sample period: 30 s at 100 ms.
    assert fp16.clear_window_evals == 300
    assert config.rule("expert_queue_soft_limit").args["penalty"] == -0.5
    assert config.rule("expert_queue_soft_limit").fire == 50.0
    assert config.rule("slo_latency").enabled is False
    assert config.sources[-1] == str(path)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[rules.fp16_fallback]\nfyre = 1.0\n", "rule 'fp16_fallback': unknown key 'fyre'"),
        ('[rules.fp16_fallback]\nfire = "high"\n', "rule 'fp16_fallback': key 'fire': expected a number, got string"),
        ("[rules.fp16_fallback]\nfire = true\n", "rule 'fp16_fallback': key 'fire': expected a number, got boolean"),
        (
            "[rules.fp16_fallback]\nwindow_evals = 2.5\n",
            "rule 'fp16_fallback': key 'window_evals': expected an integer",
        ),
        ("[rules.fp16_fallback]\nclear = 500.0\n", "rule 'fp16_fallback': key 'clear': 500 is above fire 430"),
        ("[rules.router_collapse]\nclear = 0.5\n", "rule 'router_collapse': key 'clear': 0.5 is below fire 0.536"),
        ("[rules.expert_offload]\nwindow_s = -5.0\n", "rule 'expert_offload': key 'window_s': must be > 0 seconds"),
        ("[rules.memory_alert]\nclear_window_s = -1\n", "rule 'memory_alert': key 'clear_window_s': must be > 0"),
        ("[rules.memory_alert]\nwindow_evals = 0\n", "rule 'memory_alert': key 'window_evals': must be >= 1"),
        ("[rules.memory_alert]\ncooldown_s = -1\n", "rule 'memory_alert': key 'cooldown_s': must be >= 0"),
        ('[rules.memory_alert]\naction = "reboot"\n', "rule 'memory_alert': key 'action': unknown action 'reboot'"),
        ('[rules.memory_alert]\nsignal = "cpu_temp"\n', "rule 'memory_alert': key 'signal': unknown signal 'cpu_temp'"),
        ('[rules.memory_alert]\ncomparison = "~"\n', "rule 'memory_alert': key 'comparison': unknown comparison '~'"),
        (
            '[rules.memory_alert]\naction = "router_penalty"\n',
            "rule 'memory_alert': key 'action': 'router_penalty' acts on a expert target",
        ),
        (
            "[rules.expert_queue_soft_limit.args]\npenalty = 0.3\n",
            "rule 'expert_queue_soft_limit': key 'args.penalty': must be <= 0",
        ),
        (
            '[rules.expert_queue_soft_limit.args]\ncmd = "rm -rf /"\n',
            "rule 'expert_queue_soft_limit': key 'args.cmd': unknown argument",
        ),
        ('[rules.fp16_fallback.args]\nprecision = "int4"\n', "key 'args.precision': 'int4' is not one of"),
        (
            '[rules.my_rule]\nsignal = "step_p99_ms"\ncomparison = ">"\nfire = 1.0\nclear = 0.5\naction = "alert"\n',
            "rule 'my_rule': missing key 'cooldown_s'",
        ),
        (
            '[rules.my_rule]\nsignal = "step_p99_ms"\ncomparison = ">"\nfire = 1.0\nclear = 0.5\naction = "alert"\n'
            "cooldown_s = 1\nwindow_s = 1\nwindow_evals = 2\nclear_window_evals = 1\n",
            "rule 'my_rule': give 'window_s' or 'window_evals', not both",
        ),
        ("[rules.fp16_fallbak]\nfire = 500.0\n",
         "rule 'fp16_fallbak': missing key 'signal' (a new rule needs every key; did you mean [rules.fp16_fallback]?)"),
        ("[engine]\nsample_period_ms = 0\n", "[engine]: key 'sample_period_ms': must be > 0"),
        ("[engine]\nmax_targets = 0\n", "[engine]: key 'max_targets': must be > 0"),
        ("[engine]\nturbo = true\n", "[engine]: unknown key 'turbo'"),
        ("[actions]\nx = 1\n", "unknown top-level key 'actions'"),
        ("[rules.fp16_fallback\n", "not valid TOML"),
    ],
)
def test_bad_files_fail_with_one_line_naming_file_rule_key(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message
    assert "\n" not in message
    assert info.value.exit_code == EXIT_USAGE


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read policy file"):
        load_policy(tmp_path / "nope.toml")


def run_show(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser()
    policy_cmd.add_arguments(parser)
    assert policy_cmd.run(parser.parse_args(argv)) == 0
    return capsys.readouterr().out


def test_policy_show_prints_effective_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_show(["show"], capsys)
    lines = out.splitlines()
    assert lines[1] == ("sample period 200 ms; rate limit 8 actions per 10 s; command timeout 2000 ms "
                        "(late answers awaited 30000 ms more); at most 64 targets a rule")
    row = next(line for line in lines if line.startswith("fp16_fallback"))
    assert row.split() == [
        "fp16_fallback", "step_p99_ms", "[global]", ">", "430", "3", "evaluations",
        "set_precision(precision=fp16,revert_precision=fp32)", "<", "300", "30", "s", "30", "s", "yes",
    ]
    path = write(tmp_path, "[rules.fp16_fallback]\nfire = 450.0\n")
    body = json.loads(run_show(["show", "--config", str(path), "--json"], capsys))
    fp16 = next(r for r in body["rules"] if r["name"] == "fp16_fallback")
    assert (fp16["fire"], fp16["clear"], fp16["window_evals"]) == (450.0, 300.0, 3)
    assert len(body["rules"]) == 8 and body["max_targets"] == 64


def test_policy_show_bad_file_raises_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[rules.fp16_fallback]\nclear = 999.0\n")
    parser = argparse.ArgumentParser()
    policy_cmd.add_arguments(parser)
    with pytest.raises(ConfigError, match="key 'clear'"):
        policy_cmd.run(parser.parse_args(["show", "--config", str(path)]))


@pytest.mark.parametrize("launch", [False, True])
def test_agent_start_refuses_a_bad_policy_file_before_anything_starts(tmp_path: Path, launch: bool) -> None:
    """The engine is built only once the runtime's control socket is found: a bad file used to be
    found then (or never, for a target without a socket), with the agent running on, policy off,
    exit 0. Now one line and exit 2 before any probe, target or launched command."""
    path = write(tmp_path, '[rules.fp16_fallback]\nfire = "high"\n')
    marker = tmp_path / "ran"
    target = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"] if launch else ["--pid", str(os.getpid())]
    result = subprocess.run([sys.executable, "-m", "moescope.agent", "start", "--policy", str(path), "--duration", "3",
                             *target], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [
        f"agent: error: {path}: rule 'fp16_fallback': key 'fire': expected a number, got string 'high'"], result.stderr
    assert not marker.exists()  # the command was never launched
