"""The policy config loader under hostile files: TOML documents built from the loader's own
vocabulary with wrong types, absurd numbers and unknown keys; mutations of the packaged defaults;
random text and random bytes. The loader returns a valid PolicyConfig or raises ConfigError with
one printable line naming the file; never any other exception."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from fuzzing import fuzz
from hypothesis import event, given
from hypothesis import strategies as st

from moescope.agent.policy.config import ENGINE_KEYS, RULE_KEYS, PolicyConfig, default_policy_text, load_policy
from moescope.agent.policy.rules import ACTIONS, COMPARISONS, SIGNALS
from moescope.errors import ConfigError


def toml_value(value: Any) -> str:
    """A TOML literal (inline tables and arrays for containers)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value == math.inf else "-inf" if value == -math.inf else repr(value))
        )
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings share JSON's escapes
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def toml_document(tree: dict[str, dict[str, Any]]) -> str:
    lines = []
    for table, body in tree.items():
        lines.append(f"[{table}]")
        lines.extend(f"{json.dumps(k)} = {toml_value(v)}" for k, v in body.items())
    return "\n".join(lines) + "\n"


numbers = st.one_of(
    st.integers(-5, 5000), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1 << 63, -(1 << 63) - 1, 10**30, 1e308, 5e-324, 0.0, -0.0]),
)
scalars = st.one_of(numbers, st.booleans(), st.text(max_size=12),
                    st.sampled_from([*SIGNALS, *ACTIONS, *COMPARISONS, "fp16", "fp32", "int8", ""]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
keys_of_rules = st.sampled_from([*RULE_KEYS, "window", "unknown", "args.precision", "\n", "é"])
rule_bodies = st.dictionaries(keys_of_rules, values, max_size=10)
arg_tables = st.dictionaries(st.sampled_from(["precision", "revert_precision", "target_ratio", "max_experts",
                                              "penalty", "experts", "bogus"]), values, max_size=3)


@st.composite
def documents(draw: st.DrawFn) -> str:
    tree: dict[str, dict[str, Any]] = {}
    if draw(st.booleans()):
        tree["engine"] = draw(st.dictionaries(st.sampled_from([*ENGINE_KEYS, "bogus"]), values, max_size=5))
    for name in draw(st.lists(st.sampled_from(["fp16_fallback", "expert_offload", "mine", "x y", "a\nb", "\x1b[2J"]),
                              max_size=3, unique=True)):
        body = draw(rule_bodies)
        if draw(st.booleans()):  # mostly-plausible rules reach the deeper checks
            body.setdefault("signal", draw(st.sampled_from(list(SIGNALS))))
            body.setdefault("comparison", draw(st.sampled_from(list(COMPARISONS))))
            body.setdefault("action", draw(st.sampled_from(list(ACTIONS))))
            for key in ("fire", "clear", "cooldown_s"):
                body.setdefault(key, draw(numbers))
            body.setdefault(draw(st.sampled_from(["window_s", "window_evals"])), draw(numbers))
            body.setdefault(draw(st.sampled_from(["clear_window_s", "clear_window_evals"])), draw(numbers))
            body["args"] = draw(arg_tables)
        tree[f"rules.{json.dumps(name)}"] = body
    if draw(st.booleans()):
        tree[draw(st.sampled_from(["extra", "rules", "engine.x"]))] = draw(
            st.dictionaries(st.text(max_size=4), values, max_size=2)
        )
    return toml_document(tree)


@st.composite
def mutated_defaults(draw: st.DrawFn) -> str:
    lines = default_policy_text().splitlines()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["drop", "dup", "garbage", "cut"]))
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "garbage":
            lines[i] = draw(st.text(max_size=30))
        else:
            lines[i] = lines[i][: draw(st.integers(0, max(len(lines[i]) - 1, 0)))]
    return "\n".join(lines) + "\n"


def check(data: bytes) -> None:
    with tempfile.NamedTemporaryFile(suffix=".toml") as f:
        f.write(data)
        f.flush()
        try:
            config = load_policy(Path(f.name))
        except ConfigError as exc:
            message = str(exc)
            assert message.isprintable(), message  # one line, no terminal control characters
            assert message.startswith(f.name + ":") or message.startswith("<defaults"), message
            event("ConfigError")
            return
    assert isinstance(config, PolicyConfig)
    event("valid config")
    assert config.sample_period_ms > 0 and config.max_actions > 0
    for rule in config.rules:
        assert rule.signal in SIGNALS and rule.action in ACTIONS and rule.comparison in COMPARISONS
        assert math.isfinite(rule.fire) and math.isfinite(rule.clear) and rule.cooldown_s >= 0
        assert 1 <= rule.window_evals < 1 << 63 and 1 <= rule.clear_window_evals < 1 << 63


@fuzz(300)
@given(documents())
def test_structured_documents(text: str) -> None:
    check(text.encode("utf-8", "surrogatepass"))


@fuzz(150)
@given(mutated_defaults())
def test_mutated_defaults(text: str) -> None:
    check(text.encode("utf-8", "surrogatepass"))


@fuzz(150)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
                 st.integers(1, 20000).map(lambda n: b"a = " + b"[" * n + b"]" * n),
                 st.integers(1, 20000).map(lambda n: b"a = " + b"{b = " * n + b"1" + b"}" * n)))
def test_random_bytes(data: bytes) -> None:
    check(data)
