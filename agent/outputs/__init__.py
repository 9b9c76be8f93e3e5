"""Outputs of the join (agent/join.py): each receives every ``JoinEvent`` through one small
interface (``export(batch)``, ``force_flush()``, ``shutdown(deadline_ns)``, ``stats()``).

- ``TraceOutput`` (traces.py): one trace per request, step subtrees, unjoined steps' own traces;
- ``MetricsOutput`` (metrics.py): Prometheus families for requests, steps, routing and devices;
- ``WindowsOutput`` (windows.py): the sliding windows that the policy's signals and the live
  view's panels both read, so the two can never disagree.

A new output is a class with those methods, registered with ``RequestJoin.add_output``.
"""

from moescope.agent.outputs.metrics import MetricsOutput
from moescope.agent.outputs.traces import (
    DEFAULT_LAYER_SPANS_PER_S,
    DEFAULT_SPAN_DETAIL,
    SPAN_DETAILS,
    LayerSampler,
    TraceOutput,
)
from moescope.agent.outputs.windows import DEFAULT_WINDOW_NS, WindowsOutput

__all__ = [
    "DEFAULT_LAYER_SPANS_PER_S", "DEFAULT_SPAN_DETAIL", "DEFAULT_WINDOW_NS", "SPAN_DETAILS", "LayerSampler",
    "MetricsOutput", "TraceOutput", "WindowsOutput",
]
