"""The distribution installs one import namespace, and the reference runtime needs nothing of the agent.

A serving venv that installs moescope must not gain generic top-level modules (`agent`,
`examples`, ...) that collide with other distributions; and the workload must not depend on the
agent (the runtime keeps serving when the agent is absent or dies).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _source_tree(dest: Path) -> Path:
    """The files a fresh clone would have (tracked and not ignored), copied: building in place
    would leave build/ and egg-info behind in the checkout."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    tree = _source_tree(tmp / "src")
    out = tmp / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(tree)],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (built,) = out.glob("moescope-*.whl")
    return built


def test_the_wheel_installs_only_the_moescope_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert top == {"moescope"}, top
    # every folder arrived, with the native libraries, the span encoder module and the eBPF sources
    for path in (
        "moescope/agent/cli.py",
        "moescope/collectors/nvtx.py",
        "moescope/collectors/nvtx_inject/libmoescope_nvtx.so",
        "moescope/agent/native/libmoescope_health.so",
        "moescope/hf/libmoescope_hf.so",
        "moescope/probes/ingress/ingress.bpf.c",
        "moescope/probes/ingress/ingress.h",
        "moescope/examples/moe_runtime/runtime.py",
        "moescope/agent/policy/default_policy.toml",
        "moescope/errors.py",
    ):
        assert path in names, path
    assert any(n.startswith("moescope/agent/export/_otlp_span.") and n.endswith(".so") for n in names)
    with zipfile.ZipFile(wheel) as zf:
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "agent = moescope.agent.cli:entry" in entry_points


def test_the_reference_runtime_imports_nothing_of_the_agent() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import moescope.examples as ex\n"
        "for m in pkgutil.walk_packages(ex.__path__, 'moescope.examples.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'moescope.agent' or n.startswith('moescope.agent.'))\n"
        "print(len([n for n in sys.modules if n.startswith('moescope.examples.')]), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    imported = int(done.stdout.split()[0])
    assert imported >= 5, done.stdout  # the walk found the runtime's modules
