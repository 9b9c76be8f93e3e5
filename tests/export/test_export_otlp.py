"""Trace export over real OTLP gRPC and HTTP to in-test receivers, the file default, and fault paths."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from opentelemetry.trace import SpanKind
from otlp_receiver import FlatSpan, GrpcOtlpReceiver, HttpOtlpReceiver
from sample_trace import check_received, emit_sample

from moescope.agent.export import ExportFlags, ExportStats, build_tracing, resolve_export_config
from moescope.agent.export.otlp_proto import NativeHttpSpanExporter
from moescope.agent.export.processor import BoundedBatchSpanProcessor
from moescope.agent.export.setup import build_otlp_exporter
from moescope.agent.export.store import StoredSpan, TraceStore
from moescope.agent.metrics import Metrics

RESOURCE = {"service.name": "moe-target", "process.pid": 4242, "host.name": "testhost"}


def to_flat(s: StoredSpan) -> FlatSpan:
    return FlatSpan(
        name=s.name, trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent_span_id or None, kind=s.kind,
        start_ns=s.start_ns, end_ns=s.end_ns, attributes=s.attributes,
        links=[(link.trace_id, link.span_id, link.attributes) for link in s.links],
        events=[(e.name, e.time_ns, e.attributes) for e in s.events],
        status_code=s.status_code, resource=s.resource, scope=s.scope,
    )


@pytest.mark.parametrize("encoded_by", ["worker", "main loop"])
def test_grpc_export_is_received_exactly(tmp_path: Path, encoded_by: str) -> None:
    metrics = Metrics()
    with GrpcOtlpReceiver() as rx:
        config = resolve_export_config(ExportFlags(endpoint=rx.endpoint, state_dir=str(tmp_path)), env={})
        assert config.otlp is not None and config.otlp.protocol == "grpc" and config.otlp.insecure
        tracing = build_tracing(config, resource_attributes=RESOURCE, metrics=metrics)
        assert tracing.describe() == f"traces: OTLP/grpc to {rx.endpoint} (from --otlp-endpoint)"
        _, expected = emit_sample(tracing.factory)
        if encoded_by == "main loop":  # the agent's daemon does this once a round (observe.py)
            assert tracing.processor.encode_queued() == 6
        stats = tracing.shutdown(timeout_s=30)
        spans = rx.spans()
    # Exactly the spans we made: the export itself is not traced.
    assert len(spans) == len(expected) == 6
    check_received(spans, expected, resource=RESOURCE)
    assert {s.scope for s in spans} == {"moescope"}
    assert (stats.accepted, stats.exported, stats.failed, stats.dropped) == (6, 6, 0, 0)
    assert metrics.get("moescope_export_spans", outcome="exported") == 6
    assert metrics.get("moescope_export_spans_dropped", reason="queue_full") == 0
    assert not any(tmp_path.rglob("*.jsonl"))  # an endpoint means no file


@pytest.mark.parametrize("encoded_by", ["worker", "main loop"])
def test_http_export_is_received_exactly(tmp_path: Path, encoded_by: str) -> None:
    """OTLP/HTTP: the natively encoded body parses at a real receiver into exactly the spans made."""
    with HttpOtlpReceiver() as rx:
        base = rx.endpoint.removesuffix("/v1/traces")  # (the flag is a base URL: v1/traces appended)
        config = resolve_export_config(ExportFlags(endpoint=base, protocol="http/protobuf", state_dir=str(tmp_path)),
                                       env={})
        assert config.otlp is not None and config.otlp.protocol == "http/protobuf"
        tracing = build_tracing(config, resource_attributes=RESOURCE)
        assert isinstance(tracing.exporter, NativeHttpSpanExporter)
        _, expected = emit_sample(tracing.factory)
        if encoded_by == "main loop":
            assert tracing.processor.encode_queued() == 6
        stats = tracing.shutdown(timeout_s=30)
        spans = rx.spans()
    assert len(spans) == len(expected) == 6
    check_received(spans, expected, resource=RESOURCE)
    assert (stats.accepted, stats.exported, stats.failed, stats.dropped) == (6, 6, 0, 0)


def test_http_export_from_environment(tmp_path: Path) -> None:
    with HttpOtlpReceiver() as rx:
        base = rx.endpoint.removesuffix("/v1/traces")
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": base,  # generic: v1/traces appended
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=moe%20scope,authorization=Bearer%20t0k",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-ignored=1",  # signal-specific wins
            "MOESCOPE_STATE_DIR": str(tmp_path),
        }
        config = resolve_export_config(ExportFlags(), env=env)
        assert config.otlp is not None and config.otlp.endpoint == rx.endpoint
        tracing = build_tracing(config, resource_attributes=RESOURCE)
        _, expected = emit_sample(tracing.factory)
        stats = tracing.shutdown(timeout_s=30)
        spans, headers = rx.spans(), rx.headers
    check_received(spans, expected, resource=RESOURCE)
    assert stats.exported == 6 and stats.dropped == 0
    assert headers and all(h["x-tenant"] == "moe scope" and h["authorization"] == "Bearer t0k" for h in headers)
    assert all("x-ignored" not in h for h in headers)


def test_file_default_equals_what_grpc_received(tmp_path: Path) -> None:
    """One provider, two processors: the same spans to gRPC and to the file; both read back equal."""
    with GrpcOtlpReceiver() as rx:
        config = resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={})
        assert config.otlp is None and config.traces_dir == tmp_path / "traces"
        assert "no OTLP endpoint configured" in config.describe() and str(tmp_path / "traces") in config.describe()
        tracing = build_tracing(config, resource_attributes=RESOURCE)
        grpc_config = resolve_export_config(ExportFlags(endpoint=rx.endpoint), env={})
        assert grpc_config.otlp is not None
        grpc_processor = BoundedBatchSpanProcessor(
            build_otlp_exporter(grpc_config.otlp), max_queue_spans=64, max_batch_spans=8, schedule_delay_ms=50
        )
        tracing.provider.add_span_processor(grpc_processor)
        _, expected = emit_sample(tracing.factory)
        _, expected2 = emit_sample(tracing.factory, t0_ns=2_000_000_000_000_000_000)
        stats = tracing.shutdown(timeout_s=30)
        from moescope.agent.export.processor import Deadline

        grpc_stats = grpc_processor.shutdown_within(Deadline(30))
        received = rx.spans()
    assert stats.exported == grpc_stats.exported == 12
    store = TraceStore.load(tmp_path / "traces")
    assert store.bad_lines == 0
    stored = [to_flat(s) for t in store.trace_ids() for s in store.spans(t)]
    key = lambda s: s.span_id  # noqa: E731
    assert sorted(stored, key=key) == sorted(received, key=key)
    summaries = store.summaries()
    assert len(summaries) == 4  # A and B traces of both samples
    t1 = 2_000_000_000_000_000_000
    assert [(s.root_name, s.span_count, s.start_ns, s.duration_ns) for s in summaries[:2]] == [
        ("POST /generate B", 1, t1 + 1_000, 7_499_000),  # B started 1 us after A: newest first
        ("POST /generate", 5, t1, 7_000_000),
    ]


def test_processor_counts_queue_full_drops(tmp_path: Path) -> None:
    with GrpcOtlpReceiver() as rx:
        rx.hold()  # the first export blocks until released
        config = resolve_export_config(
            ExportFlags(endpoint=rx.endpoint, queue_spans=4, timeout_ms=60_000), env={}
        )
        metrics = Metrics()
        tracing = build_tracing(config, resource_attributes=RESOURCE, metrics=metrics)
        try:
            offered = 50
            for i in range(offered):
                tracing.factory.record(f"s{i}", start_ns=1_000 + i, end_ns=2_000 + i)
            mid = tracing.stats()
            # At most one batch in flight plus a full queue got in; every other span was dropped and counted.
            assert mid.dropped_queue_full >= offered - 8
            assert mid.accepted + mid.dropped_queue_full == offered
        finally:
            rx.release()
        stats = tracing.shutdown(timeout_s=30)
        received = rx.span_count()
    assert stats.accepted + stats.dropped_queue_full == offered
    assert stats.exported == received == stats.accepted
    assert stats.failed == 0 and stats.dropped_shutdown == 0
    assert metrics.get("moescope_export_spans_dropped", reason="queue_full") == stats.dropped_queue_full


def test_unavailable_backend_is_logged_not_raised_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    with GrpcOtlpReceiver() as rx:
        rx.set_unavailable(True)
        # A short export timeout bounds the SDK's retries with backoff.
        config = resolve_export_config(ExportFlags(endpoint=rx.endpoint, timeout_ms=1_500), env={})
        tracing = build_tracing(config, resource_attributes=RESOURCE)
        with caplog.at_level(logging.WARNING):
            for i in range(3):
                tracing.factory.record(f"lost{i}", start_ns=10, end_ns=20)  # never raises
            assert tracing.force_flush(timeout_s=60)
        assert rx.refused >= 1
        first = tracing.stats()
        assert (first.failed, first.exported) == (3, 0)
        assert any("failed to export 3 spans" in r.getMessage() for r in caplog.records)
        rx.set_unavailable(False)
        tracing.factory.record("kept", start_ns=30, end_ns=40)
        stats = tracing.shutdown(timeout_s=30)
        names = [s.name for s in rx.spans()]
    assert names == ["kept"]
    assert (stats.exported, stats.failed, stats.dropped) == (1, 3, 0)


def test_shutdown_deadline_holds_with_a_stuck_backend() -> None:
    with GrpcOtlpReceiver() as rx:
        rx.hold()
        config = resolve_export_config(ExportFlags(endpoint=rx.endpoint, timeout_ms=120_000), env={})
        tracing = build_tracing(config, resource_attributes=RESOURCE)
        for i in range(10):
            tracing.factory.record(f"s{i}", start_ns=1, end_ns=2)
        done = threading.Event()
        result: list[ExportStats] = []

        def stop() -> None:
            result.append(tracing.shutdown(timeout_s=1.0))
            done.set()

        threading.Thread(target=stop, daemon=True).start()
        # Generous bound: shutdown must return on its own while the backend still holds (not released).
        assert done.wait(60), "shutdown did not honour its deadline"
        rx.release()
    stats = result[0]
    assert stats.accepted == 10
    assert stats.exported + stats.failed + stats.dropped_shutdown + stats.queued == 10
    assert stats.exported == 0
    tracing.factory.record("late", start_ns=1, end_ns=2)  # after shutdown: counted, not raised
    assert tracing.stats().dropped_shutdown == stats.dropped_shutdown + 1


def test_links_beyond_sdk_default_are_kept() -> None:
    from moescope.agent.export import SpanLink

    with GrpcOtlpReceiver() as rx:
        tracing = build_tracing(resolve_export_config(ExportFlags(endpoint=rx.endpoint), env={}))
        servers = [tracing.factory.record(f"r{i}", start_ns=1, end_ns=5, kind=SpanKind.SERVER) for i in range(300)]
        tracing.factory.record("moe.step", start_ns=2, end_ns=4, links=[SpanLink(c) for c in servers])
        tracing.shutdown(timeout_s=30)
        step = next(s for s in rx.spans() if s.name == "moe.step")
    assert len(step.links) == 300 and step.dropped_links == 0
