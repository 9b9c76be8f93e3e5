"""The compiled hot path (moescope/compiled.py, scripts/compile_hot.py): loaded only when it matches
the sources, all modules or none; under `make test` it must be loaded, so the suite runs the code the
agent runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from moescope import compiled

REPO = Path(__file__).resolve().parents[2]


def _manifest(build: Path, **changes: object) -> None:
    modules = {name: f"{name}.so" for name in (*compiled.HOT_MODULES, compiled.SHARED_LIBRARY)}
    manifest: dict[str, object] = {"abi": compiled.abi_tag(), "sources_sha256": compiled.sources_digest(),
                                   "modules": modules}
    manifest.update(changes)
    build.mkdir(parents=True, exist_ok=True)
    for rel in modules.values():
        (build / rel).write_bytes(b"")
    (build / compiled.MANIFEST_NAME).write_text(json.dumps(manifest))


def _module_files(env: dict[str, str]) -> dict[str, str]:
    """Where a fresh interpreter loads each hot module from, and the status it reports."""
    code = ("import json, importlib, moescope.agent; from moescope import compiled; "
            "files = {m: importlib.import_module(m).__file__ for m in compiled.HOT_MODULES}; "
            "files['status'] = compiled.status(); print(json.dumps(files))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    files: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return files


def test_make_test_runs_the_compiled_modules() -> None:
    """Under `make test` the build must match the sources and be what this suite imported."""
    if os.environ.get("MOESCOPE_REQUIRE_BPF") != "1":
        pytest.skip("only under `make test`, which builds the hot path first (scripts/setup.sh)")
    import moescope.agent.join as join  # (moescope.agent installs the finder: whatever ran before)

    assert compiled.status().startswith("on"), f"compiled hot path {compiled.status()}"
    assert Path(join.__file__ or "").is_relative_to(compiled.BUILD_DIR), join.__file__


def test_a_fresh_process_loads_every_module_from_one_place() -> None:
    """All compiled or all Python (mypyc's modules call each other natively: never a mix), and the
    switch turns it off."""
    files = _module_files(dict(os.environ))
    status = files.pop("status")
    suffixes = {Path(f).suffix for f in files.values()}
    if status.startswith("on"):
        assert suffixes == {".so"} and all(Path(f).is_relative_to(compiled.BUILD_DIR) for f in files.values())
    else:
        assert suffixes == {".py"}, status
    off = _module_files({**os.environ, compiled.ENV_SWITCH: "0"})
    assert off.pop("status") == f"off ({compiled.ENV_SWITCH}=0)"
    assert {Path(f).suffix for f in off.values()} == {".py"}
    assert all(Path(f).is_relative_to(REPO) and "build" not in Path(f).parts for f in off.values())


def test_a_build_that_matches_is_taken(tmp_path: Path) -> None:
    _manifest(tmp_path)
    status, files = compiled.check_build(tmp_path)
    assert status.startswith("on") and set(files) == {*compiled.HOT_MODULES, compiled.SHARED_LIBRARY}
    assert files["moescope.agent.join"] == tmp_path / "moescope.agent.join.so"


@pytest.mark.parametrize(("changes", "why"), [
    ({"sources_sha256": "0" * 64}, "sources changed since the build"),
    ({"abi": ".cpython-39-x86_64-linux-gnu.so"}, "built for another Python"),
    ({"modules": {"moescope.agent.join": "x.so"}}, "the build names other modules"),
])
def test_a_build_that_does_not_match_is_refused(tmp_path: Path, changes: dict[str, object], why: str) -> None:
    _manifest(tmp_path, **changes)
    status, files = compiled.check_build(tmp_path)
    assert files == {} and status.startswith("off") and why in status, status


def test_a_missing_or_broken_build_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert compiled.check_build(tmp_path / "none") == ("off (not built: `make setup` builds it)", {})
    _manifest(tmp_path)
    (tmp_path / "moescope.agent.join.so").unlink()
    status, files = compiled.check_build(tmp_path)
    assert files == {} and "built file missing" in status
    (tmp_path / compiled.MANIFEST_NAME).write_text("{not json")
    status, files = compiled.check_build(tmp_path)
    assert files == {} and "unreadable manifest" in status
    shutil.rmtree(tmp_path)
    _manifest(tmp_path)
    monkeypatch.setenv(compiled.ENV_SWITCH, "0")
    assert compiled.check_build(tmp_path) == (f"off ({compiled.ENV_SWITCH}=0)", {})


def test_the_source_digest_follows_every_byte(tmp_path: Path) -> None:
    """A copy of the sources digests the same; one byte changed in one module changes it."""
    for name in compiled.HOT_MODULES:
        target = compiled.source_path(name, tmp_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(compiled.source_path(name), target)
    assert compiled.sources_digest(repo=tmp_path) == compiled.sources_digest()
    edited = compiled.source_path("moescope.agent.join", tmp_path)
    edited.write_bytes(edited.read_bytes() + b"\n")
    assert compiled.sources_digest(repo=tmp_path) != compiled.sources_digest()


def test_source_paths_follow_the_package_mapping() -> None:
    assert compiled.source_path("moescope.agent.join") == REPO / "agent" / "join.py"
    assert compiled.source_path("moescope.collectors.nvtx") == REPO / "collectors" / "nvtx.py"
    assert compiled.source_path("moescope.latency") == REPO / "moescope" / "latency.py"
    with pytest.raises(ValueError, match="not a moescope module"):
        compiled.source_path("agent.join")


def test_a_hot_module_imported_before_the_finder_keeps_every_one_python() -> None:
    """A hot module already loaded as Python: the group stays Python (never a mix)."""
    code = ("import sys, types; sys.modules['moescope.agent.join'] = types.ModuleType('moescope.agent.join'); "
            "from moescope import compiled; print(compiled.install()); print(compiled.install())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first == second  # once per process
    built, _ = compiled.check_build(compiled.BUILD_DIR)
    if built.startswith("on"):
        assert first == "off (moescope.agent.join was imported before the finder)"
    else:
        assert first == built


def _compile_hot() -> ModuleType:
    """scripts/compile_hot.py as a module (a script, not in a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_hot_under_test", REPO / "scripts" / "compile_hot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_build_at_another_opt_level_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`compile_hot.py` (what `make setup` runs) rebuilds a matching build made at another -O: a
    machine built before the default moved ends up with the default's build. The finder itself takes
    any level."""
    hot = _compile_hot()
    monkeypatch.setattr(compiled, "BUILD_DIR", tmp_path)
    _manifest(tmp_path)  # no level recorded: the -O2 builds before the level was
    assert hot.up_to_date() and hot.up_to_date("2") and not hot.up_to_date("3")
    _manifest(tmp_path, opt_level="3")
    assert hot.up_to_date("3") and not hot.up_to_date("2")
    assert hot.DEFAULT_OPT_LEVEL == "3"
    assert compiled.check_build(tmp_path)[0].startswith("on")
    _manifest(tmp_path, opt_level="3", sources_sha256="0" * 64)
    assert not hot.up_to_date("3")
