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
    (RUNTIME + ["--port", "99999"], "python -m moescope.examples.moe_runtime", "a port is 0 to 65535, got 99999"),
    (LOADGEN + ["--concurrency", "x"], "python -m moescope.examples.moe_runtime.loadgen", "invalid int value: 'x'"),
])
def test_an_unreadable_flag_is_one_line_and_exit_2(argv: list[str], prog: str, words: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: ") and words in lines[0], lines[0]
    assert lines[0].endswith(f"(see {prog} --help)"), lines[0]


HF_SERVER = [sys.executable, "-m", "moescope.examples.hf_server"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--arch", "qwen3_moe", "--tiny", "--hidden", "3"],
     "hf_server: error: --hidden must be a multiple of 8 (4 attention heads of an even width), got 3"),
    (["--arch", "mixtral", "--tiny", "--top-k", "9", "--experts", "8"],
     "hf_server: error: --top-k 9 is more than --experts 8"),
    (["--model", "/nonexistent/x"], "hf_server: error: --model /nonexistent/x: no such directory"),
])
def test_the_transformers_server_refuses_a_shape_it_cannot_serve_in_one_line(extra: list[str], message: str) -> None:
    """A transformers user trial: --hidden 3 was a ZeroDivisionError, --top-k past --experts served
    and answered every request 500, a missing model directory was 'Repo id must be in the form ...'."""
    result = subprocess.run([*HF_SERVER, "--port", "0", *extra], capture_output=True, text=True, timeout=300,
                            cwd=REPO)
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [message], result.stderr
