"""Package build: the pure-Python agent plus one native piece, the NVTX injection library.

The library is a plain C shared object (no Python API) that NVTX dlopen()s inside the serving
process; it is built here as an Extension so that `pip install -e .` (scripts/setup.sh) and wheel
builds both produce collectors/nvtx_inject/libmoescope_nvtx.so, where collectors/nvtx.py finds it.
Each top-level folder installs as a subpackage of `moescope` (see PACKAGE_DIR).
"""

from __future__ import annotations

import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NVTX_EXT_NAME = "moescope.collectors.nvtx_inject.libmoescope_nvtx"

# Everything installs under one import namespace, `moescope`: each top-level folder of the
# repository is a subpackage (agent/ -> moescope.agent, ...); nothing generic lands in site-packages.
NAMESPACED_FOLDERS = ("agent", "collectors", "probes", "examples")
PACKAGE_DIR = {"moescope": "moescope", **{f"moescope.{top}": top for top in NAMESPACED_FOLDERS}}
PACKAGES = ["moescope"] + [
    f"moescope.{pkg}" for pkg in find_packages(include=[f"{top}*" for top in NAMESPACED_FOLDERS])
]


class BuildNativeLibrary(build_ext):
    """build_ext that names the injection library `libmoescope_nvtx.so` (no Python ABI suffix):
    it is loaded by NVTX through an environment variable, never imported."""

    def get_ext_filename(self, fullname: str) -> str:
        filename = str(super().get_ext_filename(fullname))
        # called with the full dotted name and with its last part alone, depending on the step
        if NVTX_EXT_NAME.endswith(fullname):
            suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
            filename = filename[: -len(suffix)] + ".so"
        return filename

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name == NVTX_EXT_NAME:
            return []  # no PyInit_ symbol: this is not a Python module
        return list(super().get_export_symbols(ext))


nvtx_injection = Extension(
    NVTX_EXT_NAME,
    sources=["collectors/nvtx_inject/inject.c"],
    depends=["collectors/nvtx_inject/nvtx_abi.h", "collectors/nvtx_inject/ring_format.h"],
    extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=[nvtx_injection],
    cmdclass={"build_ext": BuildNativeLibrary},
)
