"""A flag argparse cannot read is one line and exit 2, like every other bad input: for the agent
(its subcommands too), the reference runtime and its load generator. argparse's default prints the
whole usage first; --help is where that belongs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AGENT = [sys.executable, "-m", "moescope.agent"]
RUNTIME = [sys.executable, "-m", "moescope.examples.moe_runtime"]
LOADGEN = [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen"]


@pytest.mark.parametrize(("argv", "prog", "words"), [
    (AGENT + ["start", "--duration", "abc", "--", "true"], "agent start", "invalid float value: 'abc'"),
    (AGENT + ["top", "--interval", "soon"], "agent top", "invalid float value: 'soon'"),
    (AGENT + ["start", "--metrics-port", "99999", "--", "true"], "agent start", "a port is 0 to 65535, got 99999"),
    (AGENT + ["strat"], "agent", "invalid choice: 'strat'"),
    (RUNTIME + ["--layers", "many"], "python -m moescope.examples.moe_runtime", "invalid int value: 'many'"),
    (LOADGEN + ["--concurrency", "x"], "python -m moescope.examples.moe_runtime.loadgen", "invalid int value: 'x'"),
])
def test_an_unreadable_flag_is_one_line_and_exit_2(argv: list[str], prog: str, words: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: ") and words in lines[0], lines[0]
    assert lines[0].endswith(f"(see {prog} --help)"), lines[0]
