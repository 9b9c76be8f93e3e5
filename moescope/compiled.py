"""The agent's hot path compiled to C with mypyc, used only where it matches the sources.

The agent's per-step and per-request work (the NVTX parser, the join, the trace, metric and window
outputs, the span factory and its encoders' Python side, the policy loop) is typed Python. mypyc
compiles those modules, unchanged, into C extension modules (``scripts/compile_hot.py``, run by
``make setup``): the same code with native calls and attribute access, ~17 % less CPU on the
agent's main thread beside the reference runtime, a quarter less on the offline replay
(docs/benchmarks.md, "The hot path compiled with mypyc").

The compiled modules are not written next to their sources. They live in
``build/compiled/`` with a manifest that records a digest of the sources they were built from, and
``install()`` (called by ``moescope.agent`` and ``moescope.collectors`` before any of their modules
is imported) puts a finder on ``sys.meta_path`` that loads them **only if every source still has
that digest** — all of them or none: mypyc's modules call each other natively, so a compiled
module must never meet a pure-Python copy of another. An edited source (or a build for another
Python, or ``MOESCOPE_COMPILED=0``) leaves the agent on its pure-Python modules, which behave
the same; ``status()`` says which and why, and ``agent start`` prints it.

Importing this module reads no file; ``install()`` reads the manifest and hashes the sources
(~0.5 MB, once per process).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# The modules compiled (mypyc's group: they call each other natively). Each must be imported only
# through moescope.agent or moescope.collectors, whose __init__ installs the finder first.
# (agent/metrics.py is in: its `inc` takes its amount without a default, since mypyc 2.4 cannot
# write the text signature of a default before **labels, and its server thread is not `_thread`,
# which mypyc names `__thread` in C, a GCC keyword.) Left out: agent/observe.py (agent/start.py
# subclasses its Observers, and a compiled class takes no interpreted subclass); collectors/nvtx.py
# (its ring reader deletes attributes to drop its views, which a compiled class does not allow, and
# its cost is the ring reads, not Python; tried again on 2026-12-06: its tests also call its methods
# on stand-in objects, which compiled methods refuse); the neutral modules under moescope/ (a
# serving process imports them without the finder, so they could meet compiled modules as
# pure-Python copies), except moescope.latency: the windows' and the trace sampler's quantiles,
# ~12 interpreted calls a request; a process that imports it before the finder (the load
# generator, a probe module first) gets install()'s "off": the whole group in Python, never mixed.
HOT_MODULES: tuple[str, ...] = (
    "moescope.agent.daemon",
    "moescope.agent.export.otlp_json",
    "moescope.agent.export.processor",
    "moescope.agent.export.spans",
    "moescope.agent.join",
    "moescope.agent.metrics",
    "moescope.agent.outputs.kernel_requests",
    "moescope.agent.outputs.metrics",
    "moescope.agent.outputs.traces",
    "moescope.agent.outputs.windows",
    "moescope.agent.pipeline",
    "moescope.agent.policy.engine",
    "moescope.agent.policy.rules",
    "moescope.agent.policy.stats_source",
    "moescope.agent.request_phases",
    "moescope.agent.routing_health",
    "moescope.collectors.moe_convention",
    "moescope.latency",
)
GROUP = "moescope.hot"  # mypyc's shared library for the group: the module moescope.hot__mypyc
SHARED_LIBRARY = f"{GROUP}__mypyc"
ENV_SWITCH = "MOESCOPE_COMPILED"  # "0": the pure-Python modules, whatever is built
MANIFEST_NAME = "manifest.json"

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO / "build" / "compiled"
# The top-level folders that install as subpackages of moescope (setup.py's NAMESPACED_FOLDERS).
NAMESPACED_FOLDERS = ("agent", "collectors", "probes", "examples")

_status: str | None = None


def source_path(module: str, repo: Path = REPO) -> Path:
    """The file a moescope module is imported from in this checkout (setup.py's folder mapping)."""
    parts = module.split(".")
    if parts[0] != "moescope" or len(parts) < 2:
        raise ValueError(f"not a moescope module: {module}")
    if parts[1] in NAMESPACED_FOLDERS:
        return repo.joinpath(*parts[1:-1], parts[-1] + ".py")
    return repo.joinpath("moescope", *parts[1:-1], parts[-1] + ".py")


def sources_digest(modules: Sequence[str] = HOT_MODULES, repo: Path = REPO) -> str:
    """One SHA-256 over the modules' names and source bytes, in order (what a build was made from)."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(module.encode() + b"\0")
        digest.update(source_path(module, repo).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def abi_tag() -> str:
    """What a built extension is tied to: this interpreter's extension suffix."""
    return str(sysconfig.get_config_var("EXT_SUFFIX") or "")


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds exactly the compiled modules (and their shared library) at their built files."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def check_build(build_dir: Path, *, obey_switch: bool = True) -> tuple[str, dict[str, Path]]:
    """(status, module -> built file): the files only when the build matches the sources (and,
    with ``obey_switch``, MOESCOPE_COMPILED is not 0)."""
    if obey_switch and os.environ.get(ENV_SWITCH, "1") == "0":
        return f"off ({ENV_SWITCH}=0)", {}
    manifest_path = build_dir / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return "off (not built: `make setup` builds it)", {}
    except (OSError, ValueError) as exc:
        return f"off (unreadable manifest {manifest_path}: {exc})", {}
    if not isinstance(manifest, dict) or manifest.get("abi") != abi_tag():
        return f"off (built for another Python: {manifest.get('abi') if isinstance(manifest, dict) else '?'})", {}
    built = manifest.get("modules")
    if not isinstance(built, dict) or sorted(built) != sorted((*HOT_MODULES, SHARED_LIBRARY)):
        return "off (the build names other modules than this checkout compiles: `make setup` rebuilds it)", {}
    files = {name: build_dir / str(rel) for name, rel in built.items()}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        return f"off (built file missing: {missing[0]})", {}
    try:  # (last: the one check that reads every source)
        digest = sources_digest()
    except OSError as exc:
        return f"off (a source is unreadable: {exc})", {}
    if manifest.get("sources_sha256") != digest:
        return "off (sources changed since the build: `make setup` rebuilds it)", {}
    return f"on ({len(HOT_MODULES)} modules, mypyc)", files


def install(build_dir: Path = BUILD_DIR) -> str:
    """Load the compiled hot path from here on if it matches the sources (once per process; later
    calls return the first answer). Must run before any HOT_MODULES module is imported; where one
    already is (pure Python), nothing is installed: the group is all or nothing."""
    global _status
    if _status is not None:
        return _status
    status, files = check_build(build_dir)
    if files:
        early = [name for name in HOT_MODULES if name in sys.modules]
        if early:
            status, files = f"off ({early[0]} was imported before the finder)", {}
    if files:
        sys.meta_path.insert(0, _CompiledFinder(files))
    _status = status
    return status


def status() -> str:
    """``on (...)`` or ``off (why)``; "not installed" before install() ran in this process."""
    return _status if _status is not None else "off (not installed in this process)"

