"""Compile the agent's hot path with mypyc into build/compiled/ (moescope/compiled.py loads it).

    .venv/bin/python scripts/compile_hot.py            # build if the sources changed (make setup runs this)
    .venv/bin/python scripts/compile_hot.py --force    # build again
    .venv/bin/python scripts/compile_hot.py --check    # exit 0 if the build matches the sources, 1 if not

mypy derives a module's name from its folder, and setup.py maps agent/ to moescope.agent (and so
on), so the sources are first copied into build/compiled-src/ laid out as they are imported
(moescope/agent/join.py, ...). mypyc type-checks them, writes C, and setuptools compiles it; the
extension modules and mypyc's shared library land in a fresh folder that replaces build/compiled/
whole, with a manifest holding the digest of the sources (moescope/compiled.py refuses a build
whose digest no longer matches). Takes ~2-3 minutes on this 2-vCPU VM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from moescope import compiled

SOURCE_TREE = compiled.REPO / "build" / "compiled-src"
C_DIR = compiled.REPO / "build" / "compiled-c"
# mypy options for the compile (the project's own gate, tests/test_lint_and_types.py, checks the
# same files strictly): third-party packages without types are Any; the `_native: ModuleType | None`
# then `import ... as _native` fallback pattern is fine at run time.
MYPY_OPTIONS = ("--ignore-missing-imports", "--disable-error-code", "no-redef", "--python-version", "3.11")


def up_to_date(opt_level: str | None = None) -> bool:
    """Whether build/compiled/ matches the sources (moescope.compiled's own check) and, given one,
    was built at ``opt_level`` (a build from before the level was recorded was at -O2)."""
    _, files = compiled.check_build(compiled.BUILD_DIR, obey_switch=False)
    if not files or opt_level is None:
        return bool(files)
    try:
        manifest = json.loads((compiled.BUILD_DIR / compiled.MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("opt_level", "2")) == opt_level


def copy_sources(tree: Path) -> None:
    """Every .py/.pyi file of the package, laid out by the module it is imported as."""
    if tree.exists():
        shutil.rmtree(tree)
    package = tree / "moescope"
    folders = [(compiled.REPO / "moescope", package)]
    folders += [(compiled.REPO / top, package / top) for top in compiled.NAMESPACED_FOLDERS]
    for source, target in folders:
        for path in source.rglob("*"):
            if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
                continue
            out = target / path.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)


# gcc -O3, mypyc's own default. At the reference load it measured level with -O2 (the agent's
# threads' CPU, 15 agent_ab pairs: median 0.973, 8 of 15 below 1), while -Os cost 7 % more (5 of 5
# pairs): the agent's code runs mostly cold, and smaller code is not cheaper cold (docs/benchmarks.md,
# "The hot path at gcc -O3").
DEFAULT_OPT_LEVEL = "3"


def build(opt_level: str = DEFAULT_OPT_LEVEL) -> None:
    from mypyc.build import mypycify  # the venv's mypy (a test dependency: make setup installs it)
    from setuptools import setup

    digest = compiled.sources_digest()
    copy_sources(SOURCE_TREE)
    staging = Path(tempfile.mkdtemp(prefix="compiled-", dir=compiled.REPO / "build"))
    temp = Path(tempfile.mkdtemp(prefix="compiled-temp-", dir=compiled.REPO / "build"))
    here = Path.cwd()
    try:
        os.chdir(SOURCE_TREE)  # mypyc names modules from the paths it is given, relative to here
        paths = [str(Path(*name.split(".")).with_suffix(".py")) for name in compiled.HOT_MODULES]
        extensions = mypycify([*MYPY_OPTIONS, *paths], opt_level=opt_level, debug_level="0",
                              group_name=compiled.GROUP, target_dir=str(C_DIR))
        setup(name="moescope-hot", ext_modules=extensions, script_args=[
            "-q", "build_ext", "--build-lib", str(staging), "--build-temp", str(temp), "--parallel", "2"])
    finally:
        os.chdir(here)
        shutil.rmtree(temp, ignore_errors=True)
    suffix = compiled.abi_tag()
    modules: dict[str, str] = {}
    for name in (*compiled.HOT_MODULES, compiled.SHARED_LIBRARY):
        rel = Path(*name.split(".")).with_name(name.split(".")[-1] + suffix)
        if not (staging / rel).is_file():
            shutil.rmtree(staging, ignore_errors=True)
            raise SystemExit(f"compile_hot: mypyc built no {rel}")
        modules[name] = str(rel)
    manifest = {"abi": suffix, "sources_sha256": digest, "modules": modules, "opt_level": opt_level,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (staging / compiled.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    old = compiled.BUILD_DIR.with_name("compiled-old")
    shutil.rmtree(old, ignore_errors=True)
    if compiled.BUILD_DIR.exists():
        compiled.BUILD_DIR.rename(old)
    staging.rename(compiled.BUILD_DIR)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="build even if build/compiled/ matches the sources")
    parser.add_argument("--check", action="store_true",
                        help="only say whether the build matches the sources and --opt-level")
    parser.add_argument("--opt-level", choices=("0", "1", "2", "3", "s"), default=DEFAULT_OPT_LEVEL,
                        help=f"the C compiler's -O (default {DEFAULT_OPT_LEVEL}; 0 builds in about half the time, "
                             "for trying a change)")
    args = parser.parse_args(argv)
    fresh = up_to_date(args.opt_level)
    if args.check:
        print(f"compile_hot: {'up to date' if fresh else 'out of date'}")
        return 0 if fresh else 1
    if fresh and not args.force:
        print(f"compile_hot: build/compiled/ matches the sources (-O{args.opt_level})")
        return 0
    t0 = time.monotonic()
    print(f"compile_hot: compiling {len(compiled.HOT_MODULES)} modules with mypyc (~2-3 min)", flush=True)
    build(args.opt_level)
    if not up_to_date():
        print("compile_hot: the sources changed during the build; run it again", file=sys.stderr)
        return 1
    print(f"compile_hot: built in {time.monotonic() - t0:.0f} s -> {compiled.BUILD_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
