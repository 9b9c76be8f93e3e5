"""Package build: the Python agent plus its native pieces, built here as Extensions so that
`pip install -e .` (scripts/setup.sh) and wheel builds both produce them where the code finds them.
Three are plain C shared objects (no Python API):
- collectors/nvtx_inject/libmoescope_nvtx.so, the NVTX injection library NVTX dlopen()s inside the
  serving process (collectors/nvtx.py);
- agent/native/libmoescope_health.so, the agent's per-row routing-health reductions, loaded with
  ctypes (agent/native/__init__.py);
- moescope/hf/libmoescope_hf.so, the transformers instrumentation's host step reductions, loaded
  with ctypes in the instrumented process (moescope/hf/native.py).
Two are CPython extension modules: agent/export/_otlp_span, the OTLP/JSON and OTLP protobuf span
encoders (agent/export/otlp_json.py, otlp_proto.py; the Python/SDK encoders where it is not built),
and moescope/_page_busy, the policy's read of a stats page and its busy experts (moescope/stats_page.py;
Python and numpy where it is not built).
Each top-level folder installs as a subpackage of `moescope` (see PACKAGE_DIR).
"""

from __future__ import annotations

import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NVTX_EXT_NAME = "moescope.collectors.nvtx_inject.libmoescope_nvtx"
HEALTH_EXT_NAME = "moescope.agent.native.libmoescope_health"
HF_EXT_NAME = "moescope.hf.libmoescope_hf"
PLAIN_LIBRARIES = (NVTX_EXT_NAME, HEALTH_EXT_NAME, HF_EXT_NAME)

# Everything installs under one import namespace, `moescope`: each top-level folder of the
# repository is a subpackage (agent/ -> moescope.agent, ...); nothing generic lands in site-packages.
NAMESPACED_FOLDERS = ("agent", "collectors", "probes", "examples")
PACKAGE_DIR = {"moescope": "moescope", **{f"moescope.{top}": top for top in NAMESPACED_FOLDERS}}
PACKAGES = ["moescope"] + [
    f"moescope.{pkg}" for pkg in find_packages(include=[f"{top}*" for top in NAMESPACED_FOLDERS])
]


class BuildNativeLibrary(build_ext):
    """build_ext that names the plain libraries `lib*.so` (no Python ABI suffix): they are loaded
    by NVTX through an environment variable or with ctypes, never imported."""

    def get_ext_filename(self, fullname: str) -> str:
        filename = str(super().get_ext_filename(fullname))
        # called with the full dotted name and with its last part alone, depending on the step
        if any(name.endswith(fullname) for name in PLAIN_LIBRARIES):
            suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
            filename = filename[: -len(suffix)] + ".so"
        return filename

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name in PLAIN_LIBRARIES:
            return []  # no PyInit_ symbol: this is not a Python module
        return list(super().get_export_symbols(ext))


nvtx_injection = Extension(
    NVTX_EXT_NAME,
    sources=["collectors/nvtx_inject/inject.c"],
    depends=["collectors/nvtx_inject/nvtx_abi.h", "collectors/nvtx_inject/ring_format.h"],
    extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
)

health_reductions = Extension(
    HEALTH_EXT_NAME,
    sources=["agent/native/routing_health.c"],
    extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["m"],
)

hf_step_fill = Extension(
    HF_EXT_NAME,
    sources=["moescope/hf/step_fill.c"],
    extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["m"],
)

# A CPython extension (a module, unlike the three above): OTLP/JSON text of finished spans on the
# agent's export thread (agent/export/otlp_json.py falls back to Python where it is not built).
otlp_span = Extension(
    "moescope.agent.export._otlp_span",
    sources=["agent/export/otlp_span.c", "agent/export/double_repr.c"],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra"],
    # a Python without its headers (some GPU images) still installs, with the Python encoder; `make
    # setup` requires the built module (scripts/setup.sh), so CI never runs without it
    optional=True,
)

# Another: moescope._page_busy, the policy's period read of a stats page (version check, seqlock
# copy) and its busy experts in one pass (moescope/stats_page.py falls back to Python and numpy
# where it is not built).
page_busy = Extension(
    "moescope._page_busy",
    sources=["moescope/_page_busy.c"],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra"],
    optional=True,
)

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=[nvtx_injection, health_reductions, hf_step_fill, otlp_span, page_busy],
    cmdclass={"build_ext": BuildNativeLibrary},
)
