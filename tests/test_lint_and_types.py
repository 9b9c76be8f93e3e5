"""Lint and type gates: `ruff check` and `mypy`, configured in pyproject.toml, report nothing.

mypy cannot follow the editable install's import hook (setup.py maps agent/ to moescope.agent, ...),
so this builds a tree of symlinks under build/mypy-tree that names every file by the module name it
is imported under at run time, and points mypy at it (pyproject.toml: mypy_path, files). mypy
reports paths inside the tree; the failure message maps them back to the repository's files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moescope.compiled import NAMESPACED_FOLDERS  # the folders setup.py installs as subpackages

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / "build" / "mypy-tree"
# mypy and ruff are slow enough to need more than the suite's default per-test timeout on a cold cache.
GATE_TIMEOUT_S = 600
MYPY_LOCATION = re.compile(r"^(?P<path>[^:\s]+\.py)(?P<rest>:\d+:.*)$")


def venv_tool(name: str) -> Path:
    """The tool installed beside this interpreter (the venv's), or a failure naming the fix."""
    tool = Path(sys.executable).parent / name
    if not tool.exists():
        pytest.fail(f"{name} is not installed in {tool.parent}: run `make setup`", pytrace=False)
    return tool


def link(target: Path, link_path: Path) -> None:
    link_path.parent.mkdir(parents=True, exist_ok=True)
    link_path.symlink_to(os.path.relpath(target, link_path.parent))


def build_module_tree(tree: Path) -> None:
    """Symlinks named as each file is imported: moescope.* per setup.py; tests as pytest imports them
    (a folder with __init__.py under its `tests.` name, a folder without one on sys.path itself)."""
    if tree.exists():
        shutil.rmtree(tree)
    package = tree / "moescope"
    for entry in sorted((REPO / "moescope").iterdir()):
        if entry.suffix == ".py" or (entry / "__init__.py").exists():
            link(entry, package / entry.name)
    for name in NAMESPACED_FOLDERS:
        link(REPO / name, package / name)
    tests = REPO / "tests"
    for folder in [tests, *sorted(p for p in tests.iterdir() if p.is_dir() and not p.name.startswith("."))]:
        if folder != tests and (folder / "__init__.py").exists():
            link(folder, tree / "tests" / folder.name)
            continue
        for module in sorted(folder.glob("*.py")):
            # conftest.py exists in several folders: each keeps its folder's name to stay distinct
            named = tree / module.relative_to(REPO) if module.name == "conftest.py" else tree / module.name
            link(module, named)
    link(REPO / "benchmarks", tree / "benchmarks")
    for module in sorted((REPO / "dashboards").glob("*.py")):
        link(module, tree / "dashboards" / module.name)
    link(REPO / "setup.py", tree / "setup.py")


def repo_paths(report: str) -> str:
    """mypy's report with each path in the tree replaced by the repository file it links to."""
    lines = []
    for line in report.splitlines():
        found = MYPY_LOCATION.match(line)
        if found:
            real = Path(os.path.realpath(REPO / found["path"]))
            line = f"{real.relative_to(REPO) if real.is_relative_to(REPO) else real}{found['rest']}"
        lines.append(line)
    return "\n".join(lines)


def run_gate(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=GATE_TIMEOUT_S, check=False
    )


@pytest.mark.timeout(GATE_TIMEOUT_S)
def test_ruff_reports_nothing() -> None:
    ruff = venv_tool("ruff")
    result = run_gate([str(ruff), "check", "--no-fix", "--output-format", "concise", "."])
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(GATE_TIMEOUT_S)
def test_mypy_reports_nothing() -> None:
    mypy = venv_tool("mypy")
    build_module_tree(TREE)
    # The incremental cache (.mypy_cache/, gitignored) keeps a rerun to seconds.
    result = run_gate([str(mypy), "--cache-dir", str(REPO / ".mypy_cache")])
    report = repo_paths(result.stdout + result.stderr)
    assert result.returncode == 0, f"mypy found problems:\n{report}"
