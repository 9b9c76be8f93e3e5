"""moescope: eBPF/NVTX observability and policy for Mixture-of-Experts serving.

One import namespace for everything the distribution installs. The top-level folders of the
repository map onto it (setup.py): ``agent/`` is ``moescope.agent`` (the root daemon and its
commands), ``collectors/`` is ``moescope.collectors``, ``probes/`` is ``moescope.probes``,
``examples/`` is ``moescope.examples`` (the reference runtime). Modules in this folder are neutral:
both the agent and a serving process may import them, and they import neither.

Importing ``moescope`` is cheap and has no side effects on the serving process.
"""

__version__ = "0.1.0"
