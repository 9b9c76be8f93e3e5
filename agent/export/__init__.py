"""Trace export: OTLP (gRPC or HTTP) via the OpenTelemetry SDK, or OTLP-JSON files when no backend.

    config = resolve_export_config(flags_from_args(args))    # flags > OTEL_EXPORTER_OTLP_* > file default
    tracing = build_tracing(config, resource_attributes={...}, metrics=metrics)
    print(tracing.describe())                                 # said at start
    ctx = tracing.factory.record("moe.step", start_ns=..., end_ns=..., parent=None, attributes={...})
    tracing.shutdown()                                        # one deadline for flush + exporter close

See README.md in this folder and docs/traces-and-metrics.md.
"""

from moescope.agent.export.config import (
    ExportConfig,
    ExportFlags,
    OtlpTarget,
    add_export_arguments,
    add_state_dir_argument,
    default_traces_dir,
    flags_from_args,
    resolve_export_config,
)
from moescope.agent.export.processor import BoundedBatchSpanProcessor, Deadline, ExportStats
from moescope.agent.export.setup import Tracing, build_tracing
from moescope.agent.export.spans import SpanEvent, SpanFactory, SpanLink, clean_attributes

__all__ = [
    "BoundedBatchSpanProcessor",
    "Deadline",
    "ExportConfig",
    "ExportFlags",
    "ExportStats",
    "OtlpTarget",
    "SpanEvent",
    "SpanFactory",
    "SpanLink",
    "Tracing",
    "add_export_arguments",
    "add_state_dir_argument",
    "build_tracing",
    "clean_attributes",
    "default_traces_dir",
    "flags_from_args",
    "resolve_export_config",
]
