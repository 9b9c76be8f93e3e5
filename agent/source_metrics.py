"""Per-collector self-metrics from each source's `health()`, node_exporter's pair:

    moescope_agent_collector_duration_seconds{collector}  the last run's duration
    moescope_agent_collector_success{collector}           1 if the last run succeeded, else 0

Sources sharing a name (one NVTX ring per target) are one series: the longest last run, and a
success only when all of them succeeded. A source that has not run yet has no series.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from moescope.agent.metrics import Metrics
from moescope.collectors.registry import Source, SourceHealth, merge_health

log = logging.getLogger(__name__)

DURATION_METRIC = "moescope_agent_collector_duration_seconds"
SUCCESS_METRIC = "moescope_agent_collector_success"


def publish_source_health(metrics: Metrics, sources: Iterable[Source]) -> None:
    """Set both gauges for every source; run on the daemon thread (where sources are polled)."""
    by_name: dict[str, list[SourceHealth]] = {}
    for source in sources:
        try:
            health = source.health()
        except Exception as exc:  # one source's health must not break the publish hook
            log.debug("source %s: health() failed: %s", getattr(source, "name", "?"), exc)
            continue
        by_name.setdefault(source.name, []).append(health)
    for name, healths in by_name.items():
        merged = merge_health(healths)
        if merged.last_duration_ns is not None:
            metrics.set(DURATION_METRIC, merged.last_duration_ns / 1e9, collector=name)
        if merged.last_success is not None:
            metrics.set(SUCCESS_METRIC, 1.0 if merged.last_success else 0.0, collector=name)
