"""moescope: eBPF/NVTX observability and policy for Mixture-of-Experts serving.

One import namespace for everything the distribution installs. The top-level folders of the
repository map onto it (setup.py): ``agent/`` is ``moescope.agent`` (the root daemon and its
commands), ``collectors/`` is ``moescope.collectors``, ``probes/`` is ``moescope.probes``,
``examples/`` is ``moescope.examples`` (the reference runtime). Modules in this folder are neutral:
both the agent and a serving process may import them, and they import neither.

Importing ``moescope`` is cheap and has no side effects on the serving process:
``moescope.instrument`` (moescope/hf/, observing a PyTorch / transformers MoE model) is imported,
with torch, only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from moescope.hf import Instrumentation, instrument

__all__ = ["Instrumentation", "instrument"]


def __getattr__(name: str) -> Any:
    # lazy: `import moescope` must not import torch (the agent imports moescope too)
    if name in ("instrument", "Instrumentation"):
        from moescope import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'moescope' has no attribute {name!r}")
