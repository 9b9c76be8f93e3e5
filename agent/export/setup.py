"""Build the trace pipeline: TracerProvider -> BoundedBatchSpanProcessor -> OTLP or file exporter.

The provider is never installed as the global one: nothing in the agent (or a library it uses)
can create spans in the target's traces by accident, and the agent's own work is never traced.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from moescope import errors
from moescope.agent.export.config import ExportConfig, OtlpTarget
from moescope.agent.export.file_exporter import OtlpJsonFileExporter
from moescope.agent.export.processor import BoundedBatchSpanProcessor, Deadline, ExportStats
from moescope.agent.export.spans import SpanFactory
from moescope.agent.metrics import Metrics

log = logging.getLogger(__name__)

INSTRUMENTATION_SCOPE = "moescope"
# A step batched with many requests carries one link per request; the SDK default (128) is low.
SPAN_LIMITS = SpanLimits(max_links=2048, max_span_attributes=512, max_event_attributes=128)


def agent_version() -> str:
    try:
        return importlib.metadata.version("moescope")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def build_otlp_exporter(target: OtlpTarget) -> SpanExporter:
    """The SDK's OTLP exporter for ``target`` with every setting passed explicitly."""
    timeout_s = target.timeout_ms / 1000.0
    try:
        if target.protocol == "grpc":
            # the SDK's exporter, its requests encoded natively (agent/export/otlp_proto.py)
            from moescope.agent.export.otlp_proto import NativeGrpcSpanExporter as GrpcExporter

            return GrpcExporter(
                endpoint=target.endpoint,
                insecure=target.insecure,
                headers=tuple(target.headers),
                timeout=timeout_s,
            )
        from moescope.agent.export.otlp_proto import NativeHttpSpanExporter as HttpExporter

        return HttpExporter(endpoint=target.endpoint, headers=dict(target.headers), timeout=timeout_s)
    except (ValueError, OSError) as exc:
        raise errors.ConfigError(f"cannot set up OTLP/{target.protocol} export to {target.endpoint}: {exc}") from exc


def build_exporter(config: ExportConfig) -> SpanExporter:
    if config.otlp is not None:
        return build_otlp_exporter(config.otlp)
    return OtlpJsonFileExporter(config.traces_dir, max_file_bytes=config.file_max_bytes, files_keep=config.files_keep)


def stats_to_metrics(metrics: Metrics, exporter: SpanExporter) -> Callable[[ExportStats], None]:
    """A hook that mirrors processor (and file exporter) counters into Prometheus families."""

    def publish(stats: ExportStats) -> None:
        metrics.set_counter_total("moescope_export_spans", stats.exported, outcome="exported")
        metrics.set_counter_total("moescope_export_spans", stats.failed, outcome="failed")
        metrics.set_counter_total("moescope_export_spans_dropped", stats.dropped_queue_full, reason="queue_full")
        metrics.set_counter_total("moescope_export_spans_dropped", stats.dropped_shutdown, reason="shutdown")
        if isinstance(exporter, OtlpJsonFileExporter):
            metrics.set_counter_total("moescope_export_spans_dropped", exporter.spans_too_large, reason="too_large")
        metrics.set("moescope_export_queue_spans", float(stats.queued))

    return publish


@dataclass(slots=True)
class Tracing:
    """The running trace pipeline. ``factory`` builds spans; ``shutdown`` flushes within one deadline."""

    config: ExportConfig
    provider: TracerProvider
    processor: BoundedBatchSpanProcessor
    exporter: SpanExporter
    factory: SpanFactory

    def describe(self) -> str:
        return self.config.describe()

    def stats(self) -> ExportStats:
        return self.processor.stats()

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return self.processor.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float | None = None) -> ExportStats:
        """Export what is queued and close, all within ``timeout_s`` (default from the config)."""
        deadline = Deadline(self.config.shutdown_timeout_ms / 1000.0 if timeout_s is None else timeout_s)
        stats = self.processor.shutdown_within(deadline)
        self.provider.shutdown()  # the processor is already closed: returns at once
        return stats


def build_tracing(
    config: ExportConfig,
    *,
    resource_attributes: Mapping[str, Any] | None = None,
    metrics: Metrics | None = None,
) -> Tracing:
    """Provider + bounded processor + exporter from a resolved config. Says where traces go (INFO)."""
    exporter = build_exporter(config)
    processor = BoundedBatchSpanProcessor(
        exporter,
        max_queue_spans=config.queue_spans,
        max_batch_spans=min(config.batch_spans, config.queue_spans),
        schedule_delay_ms=config.schedule_delay_ms,
        on_stats=stats_to_metrics(metrics, exporter) if metrics is not None else None,
        name="otlp" if config.otlp is not None else "file",
    )
    provider = TracerProvider(
        sampler=ALWAYS_ON,
        resource=Resource.create(dict(resource_attributes or {})),
        span_limits=SPAN_LIMITS,
        shutdown_on_exit=False,  # Tracing.shutdown owns the deadline
    )
    provider.add_span_processor(processor)
    tracer = provider.get_tracer(INSTRUMENTATION_SCOPE, agent_version())
    log.info("%s", config.describe())
    return Tracing(
        config=config, provider=provider, processor=processor, exporter=exporter, factory=SpanFactory(tracer)
    )
