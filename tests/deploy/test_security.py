"""Nothing the agent reads from configuration can run code (docs/security.md, "Configuration is data").

A scan of the agent's sources for the ways Python turns text into code, and the real loaders fed
hostile input: a policy file naming Python as a signal or an action, eBPF options that must reach
the kernel program as typed integers only.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_files import REPO

from moescope import errors
from moescope.agent.policy.config import load_policy
from moescope.probes.ingress.loader import IngressOptions, cflags

SCANNED = ("agent", "collectors", "probes")
# Calls that turn text into code, by their dotted name; modules whose import alone is suspect.
CODE_FROM_TEXT_CALLS = {
    "eval", "exec", "compile", "__import__", "os.system", "os.popen", "yaml.load",
    "importlib.import_module", "runpy.run_path", "runpy.run_module", "code.interact",
}
CODE_FROM_TEXT_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "runpy"}
# Each allowed hit imports a module named by the code itself, never a name that came from input:
# the CLI's constant command table, and the collector registry's walk of its own package's module
# files (pkgutil) to let each collector register.
ALLOWED = {
    ("agent/cli.py", "importlib.import_module(module_name)"),
    ("collectors/registry.py", "importlib.import_module(module)"),
}


def dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def code_from_text(tree: ast.AST) -> list[str]:
    """Source snippets of every text-to-code construct in `tree`."""
    hits: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if dotted(node.func) in CODE_FROM_TEXT_CALLS:
                hits.append(ast.unparse(node))
            for keyword in node.keywords:
                if keyword.arg == "shell" and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                ):
                    hits.append(ast.unparse(node))
        elif isinstance(node, ast.Import):
            hits.extend(f"import {a.name}" for a in node.names if a.name.split(".")[0] in CODE_FROM_TEXT_MODULES)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in CODE_FROM_TEXT_MODULES:
            hits.append(f"from {node.module} import ...")
    return hits


def test_the_scan_finds_what_it_looks_for() -> None:
    sample = "import pickle\neval(x)\nsubprocess.run(c, shell=True)\nimportlib.import_module(n)\n"
    assert len(code_from_text(ast.parse(sample))) == 4


def test_no_code_from_text_in_the_agent() -> None:
    hits: set[tuple[str, str]] = set()
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            for snippet in code_from_text(ast.parse(path.read_text(encoding="utf-8"))):
                hits.add((str(path.relative_to(REPO)), snippet))
    assert hits <= ALLOWED, f"text-to-code call in the agent: {sorted(hits - ALLOWED)}"


def evil_policy(tmp_path: Path, *, signal: str, action: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(
        "[rules.evil]\n"
        f"signal = {signal!r}\n"
        'comparison = ">"\nfire = 1.0\nwindow_evals = 1\nclear = 0.5\nclear_window_evals = 1\n'
        "cooldown_s = 1.0\n"
        f"action = {action!r}\n"
    )
    return path


@pytest.mark.parametrize(
    ("signal", "action"),
    [
        ("__import__('os').system('touch {marker}')", "alert"),
        ("request_p99_ms", "__import__('os').system('touch {marker}')"),
        ("request_p99_ms", "os.system"),
    ],
)
def test_policy_names_are_looked_up_never_evaluated(tmp_path: Path, signal: str, action: str) -> None:
    marker = tmp_path / "ran"
    path = evil_policy(tmp_path, signal=signal.format(marker=marker), action=action.format(marker=marker))
    with pytest.raises(errors.ConfigError) as caught:
        load_policy(path)
    assert "unknown" in str(caught.value)
    assert "\n" not in str(caught.value)
    # and through the command line: one line, exit 2, nothing ran
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "agent"), "policy", "show", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == errors.ConfigError.exit_code
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_ebpf_options_reach_the_program_as_typed_integers_only() -> None:
    flags = cflags(IngressOptions())
    defines = [f for f in flags if f.startswith("-D")]
    assert defines, flags
    for flag in defines:
        assert re.fullmatch(r"-D[A-Z][A-Z0-9_]*=\d+", flag), flag
    assert all(f.startswith(("-D", "-I")) for f in flags), flags
