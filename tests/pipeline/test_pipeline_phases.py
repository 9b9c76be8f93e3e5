"""The LLM-serving view through the real join: IngressRecord + StepEvent (+ the runtime's stats) in,
the server span's gen_ai.* / moe.request.* attributes, the phase child spans and the
gen_ai_server_* / moescope_request_phase / token metrics out, against numbers written by hand
from the inputs (docs/traces-and-metrics.md "Where the time goes")."""

from __future__ import annotations

import math
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.export.store import StoredSpan, TraceStore
from moescope.agent.metrics import (
    GENAI_REQUEST_DURATION_BUCKETS_S,
    GENAI_TPOT_BUCKETS_S,
    GENAI_TTFT_BUCKETS_S,
    Metrics,
)
from moescope.agent.outputs.metrics import MetricsOutput, bucket_counts
from moescope.agent.pipeline import Pipeline
from moescope.agent.policy.actuator import PROTOCOL, CommandFailed, RuntimeState
from moescope.collectors.moe_convention import StepEvent
from moescope.probes.ingress.loader import F_NO_RESPONSE, IngressRecord

from .scenario import FakeClock, build_step, runtime_state

MS = 1_000_000
T0 = 9_000_000_000_000
OFF = 1_760_000_000_000_000_000
PID, TID = 4321, 4322
MODEL = "moe-ref-4x16"
PHASE_NAMES = ["receive", "queue wait", "prefill", "decode", "response write"]


def at(ms: float) -> int:
    return T0 + int(round(ms * MS))


def record(*, fd: int, start_ms: float, last_read_ms: float, first_ms: float, end_ms: float,
           answered: bool = True) -> IngressRecord:
    return IngressRecord(
        tgid=PID, tid=TID, fd=fd, generation=1, seq=1, family=int(socket.AF_INET), peer_addr="127.0.0.1",
        peer_port=40000 + fd, start_ns=at(start_ms), first_response_ns=at(first_ms) if answered else 0,
        end_ns=at(end_ms), bytes_in=300, bytes_out=900 if answered else 0,
        flags=0 if answered else F_NO_RESPONSE, last_read_ns=at(last_read_ms),
    )


def steps_of_batch(rng: np.random.Generator) -> list[StepEvent]:
    """A batch of fd 5 (streamed) and fd 6 (answered at the end): prefill, then two decode steps;
    the v2 `moe.step.requests` vector reports each request's tokens per step."""
    spans = [(10, 20), (22, 26), (27, 31)]
    tokens: list[dict[int, tuple[int, int]]] = [{5: (17, 1), 6: (9, 1)}, {5: (0, 1), 6: (0, 1)}, {5: (0, 1), 6: (0, 2)}]
    out = []
    for (s, e), per_request in zip(spans, tokens, strict=True):
        step = build_step(rng, pid=PID, tid=TID + 1, start_ms=s - 1000, end_ms=e - 1000, keys=[5, 6], tokens=4,
                          load_layer=1)
        # build_step's times are scenario-relative: move the step onto this test's clock
        shift = at(s) - step.start_ns
        step = shifted(step, shift)
        step.request_tokens = per_request
        out.append(step)
    return out


def shifted(step: StepEvent, shift: int) -> StepEvent:
    layers = []
    for layer in step.layers:
        router = layer.router
        assert router is not None
        layers.append(replace(
            layer, start_ns=layer.start_ns + shift, end_ns=layer.end_ns + shift,
            router=replace(router, start_ns=router.start_ns + shift, end_ns=router.end_ns + shift),
            loads=[replace(ld, start_ns=ld.start_ns + shift, end_ns=ld.end_ns + shift) for ld in layer.loads],
            ffns=[replace(f, start_ns=f.start_ns + shift, end_ns=f.end_ns + shift) for f in layer.ffns],
        ))
    return StepEvent(step.pid, step.tid, step.start_ns + shift, step.end_ns + shift, step.tokens, step.requests,
                     step.request_tokens, layers, step.device_time_us)


def routing_and_load_ns(steps: list[StepEvent]) -> tuple[int, int]:
    routing = sum(layer.router.end_ns - layer.router.start_ns for s in steps for layer in s.layers if layer.router)
    load = sum(ld.end_ns - ld.start_ns for s in steps for layer in s.layers for ld in layer.loads)
    return routing, load


def run(tmp_path: Path, *, model: str | None) -> tuple[list[StoredSpan], Metrics, list[StepEvent], list[StepEvent]]:
    rng = np.random.default_rng(3)
    batch = steps_of_batch(rng)
    # fd 7: a v1 producer (moe.request marks only): tokens unreported, one per step
    solo = [shifted(s, at(t) - s.start_ns) for s, t in zip(
        [build_step(rng, pid=PID, tid=TID + 1, start_ms=0, end_ms=5, keys=[7], tokens=2) for _ in range(2)],
        (50, 60), strict=True)]
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={}))
    metrics = Metrics()
    clock = FakeClock(at(0))
    pipeline = Pipeline(spans=tracing.factory, metrics=metrics, clock=clock, epoch_offset_ns=OFF)
    state = runtime_state({0: "fp32"})
    pipeline.sink(replace(state, model=model))
    for step in [*batch, *solo]:
        clock.now_ns = step.end_ns
        pipeline.on_steps([step])
    # fd 5 streamed its first token at 21 ms (after prefill ended at 20, before the last step at 31)
    pipeline.sink(record(fd=5, start_ms=0, last_read_ms=3, first_ms=21, end_ms=32))
    # fd 6 wrote its whole answer after the last step
    pipeline.sink(record(fd=6, start_ms=1, last_read_ms=1, first_ms=33, end_ms=34))
    pipeline.sink(record(fd=7, start_ms=45, last_read_ms=46, first_ms=66, end_ms=67))
    # fd 8: no step carried it (GET /stats): no breakdown, no phases
    pipeline.sink(record(fd=8, start_ms=70, last_read_ms=70, first_ms=71, end_ms=72))
    pipeline.expire(flush=True)
    pipeline.flush_metrics()
    tracing.shutdown(timeout_s=30)
    store = TraceStore.load(tracing.config.traces_dir)
    assert store.bad_lines == 0
    spans = [s for t in store.trace_ids() for s in store.spans(t)]
    assert len(spans) == pipeline.stats()["spans"]  # the trace output's count is what was exported
    return spans, metrics, batch, solo


def server_of(spans: list[StoredSpan], fd: int) -> StoredSpan:
    (server,) = [s for s in spans if s.name == "http.server.request" and s.attributes["moe.request.key"] == fd]
    return server


def phase_children(spans: list[StoredSpan], server: StoredSpan) -> list[StoredSpan]:
    kids = [s for s in spans if s.parent_span_id == server.span_id and s.name != "moe.step"]
    return sorted(kids, key=lambda s: (s.start_ns, PHASE_NAMES.index(s.name)))


def check_phases(spans: list[StoredSpan], server: StoredSpan, want_ms: dict[str, float]) -> None:
    """Attributes as expected, and the five child spans tile the server span in phase order."""
    got = {phase: server.attributes[f"moe.request.phase.{phase}_ms"] for phase in want_ms}
    assert got == pytest.approx(want_ms, abs=1e-9)
    assert sum(got.values()) == pytest.approx((server.end_ns - server.start_ns) / 1e6, abs=1e-9)
    kids = phase_children(spans, server)
    assert [k.name for k in kids] == PHASE_NAMES
    edges = [server.start_ns] + [k.end_ns for k in kids]
    assert [k.start_ns for k in kids] == edges[:-1] and edges[-1] == server.end_ns
    assert [(k.end_ns - k.start_ns) / 1e6 for k in kids] == pytest.approx(list(want_ms.values()), abs=1e-9)


def test_span_attributes_and_phase_spans(tmp_path: Path) -> None:
    spans, _, batch, _ = run(tmp_path, model=MODEL)
    routing, load = routing_and_load_ns(batch)
    assert load > 0 and routing > 0

    streamed = server_of(spans, 5)
    check_phases(spans, streamed, {"receive": 3, "queue": 7, "prefill": 10, "decode": 11, "write": 1})
    a = streamed.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (17, 3)
    assert a["moe.request.output_tokens_reported"] is True
    assert (a["moe.request.ttft_source"], a["moe.request.ttft_ms"]) == ("wire", pytest.approx(21.0))
    assert a["moe.request.tpot_ms"] == pytest.approx((32 - 21) / 2)
    # of which: the batch's router and expert-load time in the request's steps
    assert a["moe.request.routing_ms"] == pytest.approx(routing / 1e6)
    assert a["moe.request.expert_load_ms"] == pytest.approx(load / 1e6)

    whole = server_of(spans, 6)  # started at 1 ms, read in one go
    check_phases(spans, whole, {"receive": 0, "queue": 9, "prefill": 10, "decode": 11, "write": 3})
    b = whole.attributes
    assert (b["gen_ai.usage.input_tokens"], b["gen_ai.usage.output_tokens"]) == (9, 4)
    assert (b["moe.request.ttft_source"], b["moe.request.ttft_ms"]) == ("step", pytest.approx(19.0))
    assert b["moe.request.tpot_ms"] == pytest.approx((34 - 20) / 3)
    # the second batch-mate counts the same steps' time (summed once per step when buffered)
    assert b["moe.request.expert_load_ms"] == pytest.approx(load / 1e6)

    v1 = server_of(spans, 7)
    check_phases(spans, v1, {"receive": 1, "queue": 4, "prefill": 5, "decode": 10, "write": 2})
    c = v1.attributes
    assert "gen_ai.usage.input_tokens" not in c  # not reported: left out, not 0
    assert c["gen_ai.usage.output_tokens"] == 2 and c["moe.request.output_tokens_reported"] is False
    assert (c["moe.request.ttft_source"], c["moe.request.ttft_ms"]) == ("step", pytest.approx(10.0))

    plain = server_of(spans, 8)
    assert not [k for k in plain.attributes if k.startswith(("gen_ai.", "moe.request.phase"))]
    assert not [s for s in spans if s.parent_span_id == plain.span_id]


def histogram(metrics: Metrics, name: str, **labels: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative (le, count) per bucket, _sum, _count) of one series, read from the registry."""
    buckets: list[tuple[float, float]] = []
    total = count = math.nan
    for family in metrics.registry.collect():
        for sample in family.samples:
            own = {k: v for k, v in sample.labels.items() if k != "le"}
            if own != labels:
                continue
            if sample.name == f"{name}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == f"{name}_sum":
                total = sample.value
            elif sample.name == f"{name}_count":
                count = sample.value
    return buckets, total, count


def test_metric_samples(tmp_path: Path) -> None:
    _, metrics, batch, solo = run(tmp_path, model=MODEL)
    labels = {"gen_ai_operation_name": "text_completion", "gen_ai_request_model": MODEL}
    for name, bounds, values_ms in (
        ("gen_ai_server_request_duration_seconds", GENAI_REQUEST_DURATION_BUCKETS_S, [32, 33, 22]),
        ("gen_ai_server_time_to_first_token_seconds", GENAI_TTFT_BUCKETS_S, [21, 19, 10]),
        # fd 7 has two (inferred) tokens: (67 - 55) / 1
        ("gen_ai_server_time_per_output_token_seconds", GENAI_TPOT_BUCKETS_S, [5.5, 14 / 3, 12]),
    ):
        buckets, total, count = histogram(metrics, name, **labels)
        assert [le for le, _ in buckets] == [*bounds, math.inf], name  # the conventions' advisory bounds
        assert count == 3 and total == pytest.approx(sum(values_ms) / 1e3), name
        for le, cumulative in buckets:
            assert cumulative == sum(v / 1e3 <= le for v in values_ms), (name, le)
    phases_ms = {"receive": [3, 0, 1], "queue": [7, 9, 4], "prefill": [10, 10, 5], "decode": [11, 11, 10],
                 "write": [1, 3, 2]}
    for phase, values in phases_ms.items():
        _, total, count = histogram(metrics, "moescope_request_phase_seconds", phase=phase)
        assert count == 3 and total == pytest.approx(sum(values) / 1e3), phase
    routing, load = routing_and_load_ns(batch)
    solo_routing, solo_load = routing_and_load_ns(solo)
    assert solo_load == 0 < solo_routing
    # both batch-mates count the whole batch's router and load time; fd 7 its own steps'
    _, total, count = histogram(metrics, "moescope_request_phase_seconds", phase="expert_load")
    assert count == 3 and total == pytest.approx(2 * load / 1e9)
    _, total, count = histogram(metrics, "moescope_request_phase_seconds", phase="routing")
    assert count == 3 and total == pytest.approx((2 * routing + solo_routing) / 1e9)
    assert metrics.get("moescope_request_tokens", direction="input") == 17 + 9  # fd 7 reported none
    assert metrics.get("moescope_request_tokens", direction="output") == 3 + 4 + 2


def test_model_unknown_without_stats_model(tmp_path: Path) -> None:
    spans, metrics, _, _ = run(tmp_path, model=None)
    a = server_of(spans, 5).attributes
    assert "gen_ai.request.model" not in a and "gen_ai.response.model" not in a
    _, _, count = histogram(metrics, "gen_ai_server_request_duration_seconds",
                            gen_ai_operation_name="text_completion", gen_ai_request_model="unknown")
    assert count == 3


def test_unanswered_request_has_phases_but_no_gen_ai_latency(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    metrics = Metrics()
    clock = FakeClock(at(0))
    pipeline = Pipeline(spans=None, metrics=metrics, clock=clock, epoch_offset_ns=OFF)
    step = build_step(rng, pid=PID, tid=TID, start_ms=0, end_ms=4, keys=[5], tokens=2)
    step = shifted(step, at(5) - step.start_ns)
    pipeline.on_steps([step])
    pipeline.sink(record(fd=5, start_ms=0, last_read_ms=1, first_ms=0, end_ms=12, answered=False))
    pipeline.flush_metrics()
    _, _, count = histogram(metrics, "moescope_request_phase_seconds", phase="write")
    assert count == 1
    _, _, count = histogram(metrics, "gen_ai_server_request_duration_seconds",
                            gen_ai_operation_name="text_completion", gen_ai_request_model="unknown")
    assert math.isnan(count)  # no series: only successful responses count (the conventions' rule)


def test_held_observations_land_in_the_buckets_one_by_one_would() -> None:
    """The output holds breakdown values until a flush and adds them bucketed: on the bounds, below
    the first, past the last, the cumulative counts are those of the `le` rule, and the sum exact."""
    bounds = GENAI_TTFT_BUCKETS_S
    values = [0.0, *bounds, *(b * 1.0001 for b in bounds), 0.0005, 99.0, 0.04]
    assert bucket_counts(bounds, values)[-1] == 2  # 10.0001 and 99 are past the last bound
    metrics = Metrics()
    out = MetricsOutput(metrics)
    pending = out._pending_observations
    labels = (("gen_ai_operation_name", "text_completion"), ("gen_ai_request_model", "m"))
    for v in values:
        pending.add("gen_ai_server_time_to_first_token_seconds", v, labels)
    metrics.refresh()  # the registry's refresh hooks flush the held values
    buckets, total, count = histogram(metrics, "gen_ai_server_time_to_first_token_seconds", **dict(labels))
    assert count == len(values) and total == pytest.approx(sum(values))
    assert buckets == [(le, sum(v <= le for v in values)) for le in (*bounds, math.inf)]
    assert pending.held == 0


def stats_reply(**extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"devices": ["cpu"], "primary_device": "cpu", "layers": 0, "experts": 0}
    config.update(extra.pop("config", {}))
    return {"protocol": PROTOCOL, "config": config, "layers": [], "precision": {"default": "fp32"},
            "memory": {"devices": {}, "expert_bytes_fp32": 0}, **extra}


def test_a_narrowed_state_carries_the_placement_only_for_the_same_shape() -> None:
    def reply(*, layers: int, version: int | bool | None, placement: bool, queued: int = 0) -> dict[str, Any]:
        rows = [{"layer": i, "queue_depth": [i, queued], **({"precision": ["fp16", "fp32"], "tier": ["device"] * 2,
                                                           "device": ["cpu"] * 2, "dtype": ["fp16", "fp32"],
                                                           "offloaded": [False, True]} if placement else {})}
                for i in range(layers)]
        return stats_reply(config={"layers": layers, "experts": 2}, layers=rows, placement_version=version)

    whole = RuntimeState.from_stats(reply(layers=2, version=4, placement=True))
    assert whole.placement_version == 4 and whole.precision[(1, 0)] == "fp16" and whole.offloaded == {
        (0, 0): False, (0, 1): True, (1, 0): False, (1, 1): True}
    narrow = RuntimeState.from_stats(reply(layers=2, version=4, placement=False, queued=7), previous=whole)
    assert narrow.precision is whole.precision and narrow.offloaded is whole.offloaded
    assert narrow.queue_depth == {(0, 0): 0, (0, 1): 7, (1, 0): 1, (1, 1): 7} and narrow.tokens == {}
    assert narrow.placement_version == 4 and narrow.same_view(whole) and narrow != whole
    # another shape, or nothing held: no placement, and no version (the next poll asks for it)
    for previous in (None, RuntimeState.from_stats(reply(layers=3, version=4, placement=True))):
        bare = RuntimeState.from_stats(reply(layers=2, version=4, placement=False), previous=previous)
        assert bare.placement_version is None and bare.precision == {} and bare.offloaded is None
    # sparse fields fill their dense ones (an expert left out is 0); a bad pair is a protocol error
    rows = [{"layer": 0, "queue_depth_sparse": [[1, 60]], "penalty_sparse": [[0, 0.3]]}, {"layer": 1}]
    sparse = RuntimeState.from_stats(stats_reply(config={"layers": 2, "experts": 2}, layers=rows))
    assert sparse.queue_depth == {(0, 1): 60} and sparse.penalty == {(0, 0): 0.3}
    for bad in ([[2, 1]], [[-1, 1]], [[True, 1]], [["0", 1]], [[0]], [3], [[0, "x"]]):
        rows = [{"layer": 0, "queue_depth_sparse": bad}]
        with pytest.raises(CommandFailed) as failed:
            RuntimeState.from_stats(stats_reply(config={"layers": 1, "experts": 2}, layers=rows))
        assert failed.value.outcome == "protocol-error", bad
    # a version that is not an int (a bool, absent) is no version: whole-state equality decides
    for odd in (True, None):
        state = RuntimeState.from_stats(reply(layers=2, version=odd, placement=True))
        assert state.placement_version is None and not state.same_view(narrow)


def test_runtime_state_model_from_stats() -> None:
    assert RuntimeState.from_stats(stats_reply(model="qwen-moe")).model == "qwen-moe"
    assert RuntimeState.from_stats(stats_reply(config={"model": "from-config"})).model == "from-config"
    assert RuntimeState.from_stats(stats_reply(model="top", config={"model": "cfg"})).model == "top"
    for absent in (stats_reply(), stats_reply(model=""), stats_reply(model=7), stats_reply(model=None)):
        assert RuntimeState.from_stats(absent).model is None
