"""Load and validate policy rules from TOML: the packaged defaults, overridden key by key by a user file.

Every problem is one ConfigError line naming the file, the rule and the key. The file is data only:
signals, comparisons and actions are names looked up in fixed tables (agent/policy/rules.py).
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from moescope.agent.phase_table import PHASE_ALIASES, PHASE_ROWS, canonical_phase
from moescope.agent.policy.rules import (
    ACTIONS,
    COMPARISONS,
    PHASE_SIGNAL,
    SIGNALS,
    ArgSpec,
    RuleSpec,
    fires_upward,
    phase_signal_name,
)
from moescope.errors import ConfigError, one_line

DEFAULT_POLICY_NAME = "default_policy.toml"

ENGINE_KEYS: Mapping[str, tuple[type, str]] = {
    "sample_period_ms": (int, "evaluation period"),
    "max_actions": (int, "at most this many command-sending actions per rate window"),
    "rate_window_s": (float, "rate-limit window"),
    "command_timeout_ms": (float, "deadline for one control-socket command"),
    "late_answer_ms": (float, "past command_timeout_ms, how much longer a sent command's answer is awaited "
                              "(outcome `late` when it comes): a timed-out command may still have been carried out"),
    "max_targets": (int, "a per-layer or per-expert rule follows at most this many targets at once, the "
                         "furthest past its fire threshold first"),
}

RULE_KEYS: Mapping[str, type] = {
    "description": str,
    "enabled": bool,
    "signal": str,
    "phase": str,  # with signal = "request_phase_p99_ms": which phase of the requests' breakdown
    "comparison": str,
    "fire": float,
    "window_s": float,
    "window_evals": int,
    "clear": float,
    "clear_window_s": float,
    "clear_window_evals": int,
    "cooldown_s": float,
    "action": str,
    "revert": bool,
    "args": dict,
}
REQUIRED_RULE_KEYS = ("signal", "comparison", "fire", "clear", "cooldown_s", "action")
WINDOW_PAIRS = (("window_s", "window_evals"), ("clear_window_s", "clear_window_evals"))
# TOML integers are 64-bit; Python's tomllib does not enforce it, so the loader does.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    sample_period_ms: int
    max_actions: int
    rate_window_s: float
    command_timeout_ms: float
    rules: tuple[RuleSpec, ...]
    sources: tuple[str, ...]  # files read, defaults first
    # per rule, at most this many per-target instances at once (the furthest past the fire threshold
    # first): at 58 x 256 experts a busy runtime has thousands of experts over the queue limit
    max_targets: int = 64
    # past command_timeout_ms, a sent command's answer is still awaited this long (outcome "late")
    late_answer_ms: float = 30_000.0

    @property
    def sample_period_s(self) -> float:
        return self.sample_period_ms / 1000.0

    def rule(self, name: str) -> RuleSpec:
        for spec in self.rules:
            if spec.name == name:
                return spec
        raise KeyError(name)


def default_policy_text() -> str:
    return resources.files("moescope.agent.policy").joinpath(DEFAULT_POLICY_NAME).read_text(encoding="utf-8")


def _type_name(value: object) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "table", list: "array"}.get(
        type(value), type(value).__name__
    )


def _check_type(where: str, value: object, kind: type) -> Any:
    """Return value as `kind`, or raise ConfigError. bool is never a number; an int is a float."""
    expected = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a table"}[kind]
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}: expected {expected}, got boolean {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"{where}: integer out of the 64-bit range")
    if kind is float and isinstance(value, int | float):
        if not math.isfinite(float(value)):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: expected {expected}, got {_type_name(value)} {value!r}")
    return value


def _parse(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per nested array/inline table
        raise ConfigError(f"{source}: not valid TOML: arrays or tables nested too deeply") from None


def _merge(defaults: dict[str, Any], user: dict[str, Any], user_source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Overlay the user file on the defaults; returns the merged tree and which file each rule came from."""
    for key in user:
        if key not in ("engine", "rules"):
            raise ConfigError(f"{user_source}: unknown top-level key '{key}' (expected [engine] or [rules.NAME])")
    merged_engine = dict(defaults.get("engine", {}))
    user_engine = user.get("engine", {})
    _check_type(f"{user_source}: [engine]", user_engine, dict)
    merged_engine.update(user_engine)
    merged_rules: dict[str, dict[str, Any]] = {name: dict(body) for name, body in defaults.get("rules", {}).items()}
    rule_sources = {name: "" for name in merged_rules}
    user_rules = user.get("rules", {})
    _check_type(f"{user_source}: [rules]", user_rules, dict)
    for name, body in user_rules.items():
        _check_type(f"{user_source}: rule '{name}'", body, dict)
        base = merged_rules.get(name, {})
        if "signal" in body and "phase" not in body:
            base.pop("phase", None)  # a new signal drops the default's phase (it may not take one)
        if "phase" in body and "signal" not in body:
            base["signal"] = PHASE_SIGNAL  # a phase alone selects the phase signal
        for pair in WINDOW_PAIRS:
            if any(k in body for k in pair):  # the user's window form replaces the default's
                for k in pair:
                    base.pop(k, None)
        if "args" in body and "args" in base and isinstance(body["args"], dict):
            body = {**body, "args": {**base["args"], **body["args"]}}
        merged_rules[name] = {**base, **body}
        rule_sources[name] = user_source
    return {"engine": merged_engine, "rules": merged_rules}, rule_sources


def _window_evals(where: str, body: Mapping[str, Any], pair: tuple[str, str], period_ms: int) -> tuple[int, str]:
    seconds_key, evals_key = pair
    if seconds_key in body and evals_key in body:
        raise ConfigError(f"{where}: give '{seconds_key}' or '{evals_key}', not both")
    if evals_key in body:
        evals = _check_type(f"{where}: key '{evals_key}'", body[evals_key], int)
        if evals < 1:
            raise ConfigError(f"{where}: key '{evals_key}': must be >= 1 evaluation, got {evals}")
        return evals, f"{evals} evaluation{'s' if evals != 1 else ''}"
    if seconds_key in body:
        seconds = _check_type(f"{where}: key '{seconds_key}'", body[seconds_key], float)
        if seconds <= 0:
            raise ConfigError(f"{where}: key '{seconds_key}': must be > 0 seconds, got {seconds:g}")
        # A duration is that many consecutive sample periods with data (at least one).
        evals_float = seconds * 1000.0 / period_ms
        if not evals_float <= INT64_MAX:  # also catches inf
            raise ConfigError(f"{where}: key '{seconds_key}': {seconds:g} s is too long")
        return max(1, round(evals_float)), f"{seconds:g} s"
    raise ConfigError(f"{where}: missing key '{seconds_key}' (or '{evals_key}')")


def _validate_args(where: str, action: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    specs: Mapping[str, ArgSpec] = ACTIONS[action].args
    out: dict[str, Any] = {}
    for key in raw:
        if key not in specs:
            known = ", ".join(sorted(specs)) or "none"
            raise ConfigError(f"{where}: key 'args.{key}': unknown argument for action '{action}' (known: {known})")
    for key, spec in specs.items():
        if key not in raw:
            out[key] = spec.default
            continue
        value = _check_type(f"{where}: key 'args.{key}'", raw[key], spec.kind)
        if spec.choices and value not in spec.choices:
            raise ConfigError(f"{where}: key 'args.{key}': {value!r} is not one of {', '.join(spec.choices)}")
        if spec.minimum is not None and value < spec.minimum:
            raise ConfigError(f"{where}: key 'args.{key}': must be >= {spec.minimum:g}, got {value!r}")
        if spec.maximum is not None and value > spec.maximum:
            raise ConfigError(f"{where}: key 'args.{key}': must be <= {spec.maximum:g}, got {value!r}")
        out[key] = value
    return out


PHASE_NAMES_TEXT = ", ".join((*PHASE_ROWS, *(f"{a} (= {c})" for a, c in PHASE_ALIASES.items())))


def _rule_signal(where: str, values: Mapping[str, Any]) -> str:
    """The signal the rule reads: its `signal`, or for request_phase_p99_ms the chosen phase's own."""
    signal = values["signal"]
    phase = values.get("phase")
    if signal == PHASE_SIGNAL:
        if phase is None:
            raise ConfigError(f"{where}: missing key 'phase' for signal '{PHASE_SIGNAL}' (one of {PHASE_NAMES_TEXT})")
        chosen = canonical_phase(phase)
        if chosen is None:
            raise ConfigError(f"{where}: key 'phase': unknown phase '{phase}' (known: {PHASE_NAMES_TEXT})")
        return phase_signal_name(chosen)
    if signal not in SIGNALS:
        known = ", ".join((PHASE_SIGNAL, *SIGNALS))
        raise ConfigError(f"{where}: key 'signal': unknown signal '{signal}' (known: {known})")
    if phase is not None:
        raise ConfigError(f"{where}: key 'phase': only signal '{PHASE_SIGNAL}' takes a phase (signal is '{signal}')")
    return str(signal)


def _validate_named_rule(name: str, body: Mapping[str, Any], source: str, period_ms: int,
                         default_names: Sequence[str]) -> RuleSpec:
    """_validate_rule; a new rule missing keys whose name is close to a default rule's is likely that
    rule misspelt (`[rules.fp16_fallbak]` said only "missing key 'signal'"): the error says so."""
    try:
        return _validate_rule(name, body, source, period_ms)
    except ConfigError as exc:
        close = difflib.get_close_matches(name, default_names, n=1) if name not in default_names else []
        if close and "missing key" in exc.message:
            raise ConfigError(f"{exc.message} (a new rule needs every key; did you mean [rules.{close[0]}]?)") from None
        raise


def _validate_rule(name: str, body: Mapping[str, Any], source: str, period_ms: int) -> RuleSpec:
    where = f"{source}: rule '{name}'"
    for key in body:
        if key not in RULE_KEYS:
            raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(RULE_KEYS)})")
    for key in REQUIRED_RULE_KEYS:
        if key not in body:
            raise ConfigError(f"{where}: missing key '{key}'")
    values = {key: _check_type(f"{where}: key '{key}'", value, RULE_KEYS[key]) for key, value in body.items()}
    signal = _rule_signal(where, values)
    comparison = values["comparison"]
    if comparison not in COMPARISONS:
        raise ConfigError(f"{where}: key 'comparison': unknown comparison '{comparison}' (use > >= < <=)")
    action = values["action"]
    if action not in ACTIONS:
        raise ConfigError(f"{where}: key 'action': unknown action '{action}' (known: {', '.join(ACTIONS)})")
    wanted = ACTIONS[action].target
    have = SIGNALS[signal].target
    if wanted is not None and wanted is not have:
        raise ConfigError(
            f"{where}: key 'action': '{action}' acts on a {wanted.value} target "
            f"but signal '{signal}' is per {have.value}"
        )
    fire, clear = values["fire"], values["clear"]
    if fires_upward(comparison) and clear > fire:
        raise ConfigError(
            f"{where}: key 'clear': {clear:g} is above fire {fire:g}; a rule firing on '{comparison}' clears below it"
        )
    if not fires_upward(comparison) and clear < fire:
        raise ConfigError(
            f"{where}: key 'clear': {clear:g} is below fire {fire:g}; a rule firing on '{comparison}' clears above it"
        )
    if values["cooldown_s"] < 0:
        raise ConfigError(f"{where}: key 'cooldown_s': must be >= 0 seconds, got {values['cooldown_s']:g}")
    window_evals, window_text = _window_evals(where, values, WINDOW_PAIRS[0], period_ms)
    clear_evals, clear_text = _window_evals(where, values, WINDOW_PAIRS[1], period_ms)
    args = _validate_args(where, action, values.get("args", {}))
    return RuleSpec(
        name=name,
        enabled=values.get("enabled", True),
        signal=signal,
        comparison=comparison,
        fire=fire,
        window_evals=window_evals,
        window_text=window_text,
        clear=clear,
        clear_window_evals=clear_evals,
        clear_window_text=clear_text,
        cooldown_s=values["cooldown_s"],
        action=action,
        args=args,
        revert=values.get("revert", True),
        description=values.get("description", ""),
    )



def load_policy(path: Path | str | None = None) -> PolicyConfig:
    """The effective policy: packaged defaults, overridden by `path` when given."""
    try:
        return _load_policy(path)
    except ConfigError as exc:
        raise ConfigError(one_line(exc.message)) from None


def _load_policy(path: Path | str | None) -> PolicyConfig:
    default_source = f"<defaults {DEFAULT_POLICY_NAME}>"
    tree = _parse(default_policy_text(), default_source)
    sources = [default_source]
    rule_sources = {name: default_source for name in tree.get("rules", {})}
    default_names = tuple(rule_sources)
    if path is not None:
        user_source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{user_source}: cannot read policy file: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{user_source}: not valid TOML: not UTF-8 (byte {exc.start})") from None
        tree, touched = _merge(tree, _parse(text, user_source), user_source)
        rule_sources = {name: touched[name] or default_source for name in touched}
        sources.append(user_source)
    engine_source = sources[-1]
    engine = tree.get("engine", {})
    for key in engine:
        if key not in ENGINE_KEYS:
            raise ConfigError(f"{engine_source}: [engine]: unknown key '{key}' (known: {', '.join(ENGINE_KEYS)})")
    for key in ENGINE_KEYS:
        if key not in engine:
            raise ConfigError(f"{engine_source}: [engine]: missing key '{key}'")
    checked = {k: _check_type(f"{engine_source}: [engine]: key '{k}'", v, ENGINE_KEYS[k][0]) for k, v in engine.items()}
    for key, value in checked.items():
        if value <= 0:
            raise ConfigError(f"{engine_source}: [engine]: key '{key}': must be > 0, got {value!r}")
    period_ms = checked["sample_period_ms"]
    rules = tuple(
        _validate_named_rule(name, body, rule_sources[name], period_ms, default_names)
        for name, body in tree.get("rules", {}).items()
    )
    return PolicyConfig(
        sample_period_ms=period_ms,
        max_actions=checked["max_actions"],
        rate_window_s=checked["rate_window_s"],
        command_timeout_ms=checked["command_timeout_ms"],
        rules=rules,
        sources=tuple(sources),
        max_targets=checked["max_targets"],
        late_answer_ms=checked["late_answer_ms"],
    )
