"""The trace join end to end: real IngressRecord/StepEvent inputs -> Pipeline -> real OTel SDK export
(OTLP gRPC to an in-test receiver, or the OTLP-JSON file default) -> assertions on what arrived."""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from otlp_receiver import FlatSpan, GrpcOtlpReceiver

from moescope.agent.export import ExportFlags, Tracing, build_tracing, resolve_export_config
from moescope.agent.export.store import StoredSpan, TraceStore
from moescope.agent.pipeline import Pipeline, resource_attributes
from moescope.collectors.moe_convention import LayerEvent, StepEvent
from moescope.probes.ingress.loader import IngressRecord

from .scenario import (
    EPOCH_OFFSET_NS,
    MEMORY,
    NUM_EXPERTS,
    NUM_LAYERS,
    PRECISION,
    RETENTION_NS,
    FakeClock,
    Scenario,
    build_step,
    feed,
    feed_linked_steps,
    main_scenario,
    record,
    ref_layer,
    ref_step,
)

SERVER, INTERNAL = 2, 1  # OTLP SpanKind values
PHASE_SPANS = ["receive", "queue wait", "prefill", "decode", "response write"]
STATUS_UNSET, STATUS_ERROR = 0, 2
OFF = EPOCH_OFFSET_NS


def approx_attrs(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Same keys; floats equal to 1e-9 relative, everything else exactly."""
    assert set(actual) == set(expected), f"{where}: keys differ: {set(actual) ^ set(expected)}"
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, float | np.floating):
            assert got == pytest.approx(float(want), rel=1e-9, abs=1e-12), f"{where}: {key}"
        else:
            assert got == want and type(got) is type(want), f"{where}: {key}: {got!r} != {want!r}"


def run_scenario(tracing: Tracing, scenario: Scenario, *, detail: str) -> Pipeline:
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, clock=clock, step_retention_ns=RETENTION_NS, epoch_offset_ns=OFF,
                        span_detail=detail)
    feed(scenario, pipeline, clock)
    return pipeline


def subtree_size(step: StepEvent, detail: str = "expert") -> int:
    if detail == "layer":
        return 1 + len(step.layers)
    return 1 + sum(1 + (layer.router is not None) + len(layer.loads) + len(layer.ffns) for layer in step.layers)


def folded_layer(layer: LayerEvent) -> dict[str, Any]:
    """--span-detail layer: the child spans' facts as layer attributes, built from the events."""
    r = layer.router
    assert r is not None and layer.ffns
    out: dict[str, Any] = {
        "moe.precision": PRECISION[layer.layer],
        "moe.layer.router.duration_ms": (r.end_ns - r.start_ns) / 1e6,
        "moe.layer.ffn.experts": [f.expert for f in layer.ffns],
        "moe.layer.ffn.tokens": [f.tokens for f in layer.ffns],
        "moe.layer.ffn.duration_ms": [(f.end_ns - f.start_ns) / 1e6 for f in layer.ffns],
    }
    if layer.loads:
        out["moe.layer.load.experts"] = [ev.expert for ev in layer.loads]
        out["moe.layer.load.bytes"] = [ev.bytes_moved for ev in layer.loads]
        out["moe.layer.load.duration_ms"] = [(ev.end_ns - ev.start_ns) / 1e6 for ev in layer.loads]
    return out


def step_attributes(step: StepEvent) -> dict[str, Any]:
    out: dict[str, Any] = {
        "moe.step.tokens": step.tokens,
        "moe.step.batch_size": len(set(step.requests)),
        "moe.step.layers": len(step.layers),
        "process.pid": step.pid,
        "thread.id": step.tid,
    }
    if step.requests:
        out["moe.step.requests"] = sorted(set(step.requests))
    return out


def check_step_subtree(
    step: StepEvent, span: FlatSpan, children: dict[str, list[FlatSpan]], where: str, *, detail: str
) -> None:
    """The owner's full subtree: timing, routing-health attributes, layer/router/load/FFN spans."""
    assert (span.start_ns, span.end_ns) == (step.start_ns + OFF, step.end_ns + OFF), where
    assert span.links == [], where
    # the device sample at the step boundary (host memory signal: no GPU here)
    assert span.events == [
        (
            "moe.device.sample",
            step.start_ns + OFF,
            {
                "moe.device": MEMORY.scope,
                "moe.device.memory.source": MEMORY.source,
                "moe.device.memory.used_bytes": MEMORY.used_bytes,
                "moe.device.memory.total_bytes": MEMORY.total_bytes,
                "moe.device.memory.used_ratio": pytest.approx(3 / 8),
            },
        )
    ], where
    layers = sorted(children[span.span_id], key=lambda s: s.start_ns)
    assert [s.name for s in layers] == ["moe.layer"] * NUM_LAYERS, where
    for layer, lspan in zip(step.layers, layers, strict=True):
        lw = f"{where} layer {layer.layer}"
        assert (lspan.start_ns, lspan.end_ns) == (layer.start_ns + OFF, layer.end_ns + OFF), lw
        assert layer.router is not None, lw  # every scenario layer routes
        if detail == "layer":
            want = {"moe.layer": layer.layer, **ref_layer(layer.router, NUM_EXPERTS), **folded_layer(layer)}
            approx_attrs(lspan.attributes, want, lw)
            assert children[lspan.span_id] == [], lw
            continue
        approx_attrs(lspan.attributes, {"moe.layer": layer.layer, **ref_layer(layer.router, NUM_EXPERTS)}, lw)
        kids = children[lspan.span_id]
        assert all(k.trace_id == span.trace_id and not children[k.span_id] for k in kids), lw
        routers = [k for k in kids if k.name == "moe.router"]
        loads = sorted((k for k in kids if k.name == "moe.expert.load"), key=lambda s: s.start_ns)
        ffns = sorted((k for k in kids if k.name == "moe.expert.ffn"), key=lambda s: s.start_ns)
        assert len(routers) + len(loads) + len(ffns) == len(kids), lw
        r = layer.router
        assert r is not None and len(routers) == 1, lw
        assert (routers[0].start_ns, routers[0].end_ns) == (r.start_ns + OFF, r.end_ns + OFF), lw
        approx_attrs(
            routers[0].attributes,
            {
                "moe.layer": layer.layer,
                "moe.router.entropy_bits": r.entropy_bits,
                "moe.router.entropy_normalized": r.entropy_bits / np.log2(NUM_EXPERTS),
                "moe.tokens.routed": sum(r.tokens.values()),
                "moe.tokens.dropped": sum(r.dropped.values()),
            },
            lw,
        )
        assert len(loads) == len(layer.loads), lw
        for ev, s in zip(layer.loads, loads, strict=True):
            assert (s.start_ns, s.end_ns) == (ev.start_ns + OFF, ev.end_ns + OFF), lw
            approx_attrs(
                s.attributes,
                {"moe.layer": layer.layer, "moe.expert": ev.expert, "moe.expert.load.bytes": ev.bytes_moved},
                lw,
            )
        assert len(ffns) == len(layer.ffns) and len(ffns) > 0, lw
        for ffn, s in zip(layer.ffns, ffns, strict=True):
            assert (s.start_ns, s.end_ns) == (ffn.start_ns + OFF, ffn.end_ns + OFF), lw
            approx_attrs(
                s.attributes,
                {
                    "moe.layer": layer.layer,
                    "moe.expert": ffn.expert,
                    "moe.expert.ffn.tokens": ffn.tokens,
                    "moe.precision": PRECISION[layer.layer],
                },
                lw,
            )


def ref_breakdown(rec: IngressRecord, steps: list[StepEvent]) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The server span's breakdown attributes and the phase spans' (start, end), recomputed from the
    scenario (records without last_read_ns, steps without per-request tokens): receive runs to the
    first step, queue is empty, prefill is the first step, one output token per step."""
    steps = sorted(steps, key=lambda s: s.start_ns)
    start, end = rec.start_ns, rec.end_ns
    first = min(max(steps[0].start_ns, start), end)
    prefill_end = min(max(steps[0].end_ns, first), end)
    last_end = max(s.end_ns for s in steps)
    decode_end = min(max(last_end, prefill_end), end)
    edges = [start, first, first, prefill_end, decode_end, end]
    wire = steps[0].end_ns <= rec.first_response_ns <= last_end
    ttft_at = rec.first_response_ns if wire else prefill_end
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.usage.output_tokens": len(steps),
        "moe.request.output_tokens_reported": False,
        "moe.request.ttft_ms": (ttft_at - start) / 1e6,
        "moe.request.ttft_source": "wire" if wire else "step",
        "moe.request.expert_load_ms": sum(ld.end_ns - ld.start_ns for s in steps for la in s.layers
                                          for ld in la.loads) / 1e6,
        "moe.request.routing_ms": sum(la.router.end_ns - la.router.start_ns for s in steps for la in s.layers
                                      if la.router is not None) / 1e6,
    }
    for phase, (a, b) in zip(("receive", "queue", "prefill", "decode", "write"), zip(edges, edges[1:]), strict=True):
        attrs[f"moe.request.phase.{phase}_ms"] = (b - a) / 1e6
    if len(steps) >= 2:
        attrs["moe.request.tpot_ms"] = (end - ttft_at) / (len(steps) - 1) / 1e6
    return attrs, list(zip(edges, edges[1:]))


def check_received(spans: list[FlatSpan], scenario: Scenario, pipeline: Pipeline, *, detail: str) -> None:
    by_trace: dict[str, list[FlatSpan]] = defaultdict(list)
    children: dict[str, list[FlatSpan]] = defaultdict(list)
    by_id: dict[str, FlatSpan] = {}
    for s in spans:
        assert s.span_id not in by_id, "duplicate span id"
        by_id[s.span_id] = s
        by_trace[s.trace_id].append(s)
        if s.parent_span_id:
            children[s.parent_span_id].append(s)
        assert s.end_ns >= s.start_ns
        assert s.dropped_links == 0 and s.dropped_attributes == 0

    # No orphans: one root per trace, every parent is a span of the same trace.
    for trace_id, members in by_trace.items():
        roots = [s for s in members if s.parent_span_id is None]
        assert len(roots) == 1, f"trace {trace_id}: {len(roots)} roots"
        for s in members:
            if s.parent_span_id is not None:
                parent = by_id.get(s.parent_span_id)
                assert parent is not None and parent.trace_id == trace_id, f"orphan {s.name} in {trace_id}"

    # One server span per request, kernel timing and peer attributes exactly.
    servers = [s for s in spans if s.name == "http.server.request"]
    assert len(servers) == len(scenario.records)
    server_of: dict[str, FlatSpan] = {}
    for name, rec in scenario.records.items():
        matches = [
            s for s in servers
            if s.attributes["process.pid"] == rec.tgid and s.attributes["moe.request.key"] == rec.fd
            and s.start_ns == rec.start_ns + OFF
        ]
        assert len(matches) == 1, name
        srv = server_of[name] = matches[0]
        assert srv.parent_span_id is None and srv.kind == SERVER, name
        assert srv.end_ns == rec.end_ns + OFF, name
        assert srv.status_code == (STATUS_UNSET if rec.answered else STATUS_ERROR), name
        want: dict[str, Any] = {
            "network.transport": "tcp",
            "network.protocol.name": "http",
            "network.peer.address": rec.peer_addr,
            "network.peer.port": rec.peer_port,
            "http.request.size": rec.bytes_in,
            "http.response.size": rec.bytes_out,
            "moe.request.key": rec.fd,
            "moe.connection.generation": rec.generation,
            "process.pid": rec.tgid,
            "thread.id": rec.tid,
            "moe.request.steps": len(scenario.served_by[name]),
        }
        if rec.answered:
            want["moe.request.time_to_first_byte_ms"] = (rec.first_response_ns - rec.start_ns) / 1e6
        if scenario.served_by[name]:
            want.update(ref_breakdown(rec, [scenario.steps[s] for s in scenario.served_by[name]])[0])
        approx_attrs(srv.attributes, want, name)

    # Each request's trace: its five phase spans and the steps it owns as subtrees; the prefill span
    # links to the owner span of its first step when another trace owns it, decode to the rest's.
    owner_span: dict[str, FlatSpan] = {}
    for name in scenario.arrival_order():  # owners come first in arrival order: links can be checked
        rec, srv = scenario.records[name], server_of[name]
        mine = [scenario.steps[s] for s in scenario.served_by[name]]
        kids = children[srv.span_id]
        phases = sorted((k for k in kids if k.name in PHASE_SPANS),
                        key=lambda s: (s.start_ns, PHASE_SPANS.index(s.name)))
        step_spans = sorted((k for k in kids if k.name == "moe.step"), key=lambda s: s.start_ns)
        assert len(phases) + len(step_spans) == len(kids), name
        if not mine:
            assert kids == [], name
            continue
        # the phases tile the server span in order (the scenario's records have no last_read_ns:
        # receive runs to the first step, as the queue wait did before, and the queue is empty)
        assert [k.name for k in phases] == PHASE_SPANS, name
        edges = ref_breakdown(rec, mine)[1]
        assert [(k.start_ns, k.end_ns) for k in phases] == [(a + OFF, b + OFF) for a, b in edges], name
        assert all(k.kind == INTERNAL and children[k.span_id] == [] for k in phases), name
        owned = sorted(s for s in scenario.served_by[name] if scenario.owner_of(s) == name)
        assert [(s.start_ns, s.end_ns) for s in step_spans] == sorted(
            (scenario.steps[s].start_ns + OFF, scenario.steps[s].end_ns + OFF) for s in owned
        ), name
        want_links: dict[str, list[tuple[str, str, dict[str, Any]]]] = {"prefill": [], "decode": []}
        by_start = sorted(scenario.served_by[name], key=lambda s: scenario.steps[s].start_ns)
        for i, step_name in enumerate(by_start):
            step = scenario.steps[step_name]
            where = f"{name}/{step_name}"
            if scenario.owner_of(step_name) == name:
                span = next(s for s in step_spans if s.start_ns == step.start_ns + OFF)
                approx_attrs(span.attributes, {**step_attributes(step), **ref_step(step, NUM_EXPERTS)}, where)
                check_step_subtree(step, span, children, where, detail=detail)
                owner_span[step_name] = span
            else:
                owner = owner_span[step_name]
                assert owner.trace_id != srv.trace_id, where
                want_links["prefill" if i == 0 else "decode"].append((owner.trace_id, owner.span_id,
                                                                      {"moe.link": "step.owner"}))
        for phase in phases:
            assert phase.links == want_links.get(phase.name, []), (name, phase.name)
            assert "moe.phase.steps_unlinked" not in phase.attributes, (name, phase.name)
    assert sorted(owner_span) == scenario.joined_steps()

    # Steps no request claimed: their own traces after expiry, marked and complete.
    step_roots = [s for s in spans if s.name == "moe.step" and s.parent_span_id is None]
    assert sorted(s.start_ns for s in step_roots) == sorted(scenario.steps[n].start_ns + OFF for n in scenario.unjoined)
    for name in scenario.unjoined:
        step = scenario.steps[name]
        span = next(s for s in step_roots if s.start_ns == step.start_ns + OFF)
        approx_attrs(
            span.attributes, {**step_attributes(step), **ref_step(step, NUM_EXPERTS), "moe.step.unjoined": True}, name
        )
        check_step_subtree(step, span, children, name, detail=detail)
    assert len(by_trace) == len(scenario.records) + len(scenario.unjoined)

    # Counts: what arrived is what the pipeline says it made, and both equal the scenario's count.
    links = sum(len(v) for v in scenario.served_by.values()) - len(scenario.joined_steps())
    assert sum(len(s.links) for s in spans) == links
    expected_spans = (
        len(scenario.records)
        + 5 * sum(1 for v in scenario.served_by.values() if v)  # phase spans
        + sum(subtree_size(scenario.steps[n], detail) for n in (*scenario.joined_steps(), *scenario.unjoined))
    )
    assert len(spans) == expected_spans
    assert pipeline.stats() == {
        "requests": len(scenario.records),
        "requests_unanswered": sum(not r.answered for r in scenario.records.values()),
        "requests_joined": sum(1 for v in scenario.served_by.values() if v),
        "steps": len(scenario.steps),
        "steps_joined": len(scenario.joined_steps()),
        "steps_unjoined": len(scenario.unjoined),
        "steps_evicted_overflow": 0,
        "step_trees_dropped_overflow": 0,
        "step_trees_released_unread": 0,  # every subtree kept (the default budget is far above this)
        "step_links": links,
        "owner_subtrees": len(scenario.joined_steps()),
        "spans": expected_spans,
        "telemetry_samples": 1,
        "experts_grown": 1,  # E learned once, from the first moe.layer payload
        "layers_bad_routing": 0,
        "buffered_steps": 0,
        "buffered_layers": 0,
        "buffered_tree_bytes": 0,
        "runtime_states": 1,  # the runtime's stats record (per-layer precision)
        "records_unknown": 0,
        "output_errors": 0,
        # the scenario is far under the layer-span budget: every subtree kept, none sampled out
        "layer_subtrees_kept_budget": len(scenario.steps),
        "layer_subtrees_kept_slow": 0,
        "layer_subtrees_sampled_out": 0,
    }


def test_scenario_over_otlp_grpc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    scenario = main_scenario()
    resource = resource_attributes([os.getpid()])
    with GrpcOtlpReceiver() as rx:
        config = resolve_export_config(ExportFlags(endpoint=rx.endpoint, state_dir=str(tmp_path)), env={})
        tracing = build_tracing(config, resource_attributes=resource)
        pipeline = run_scenario(tracing, scenario, detail="expert")  # the full tree over gRPC
        stats = tracing.shutdown(timeout_s=30)
        spans = rx.spans()
    assert stats.dropped == 0 and stats.failed == 0 and stats.exported == len(spans)
    assert {s.scope for s in spans} == {"moescope"}
    res = spans[0].resource
    assert all(s.resource == res for s in spans)
    assert res["service.name"] == "moe-serving" and res["host.name"] == socket.gethostname()
    assert res["process.pid"] == os.getpid()
    with open(f"/proc/{os.getpid()}/comm", encoding="utf-8") as f:
        assert res["process.executable.name"] == f.read().strip()
    check_received(spans, scenario, pipeline, detail="expert")


def stored_to_flat(s: StoredSpan) -> FlatSpan:
    return FlatSpan(
        name=s.name, trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent_span_id or None, kind=s.kind,
        start_ns=s.start_ns, end_ns=s.end_ns, attributes=s.attributes,
        links=[(link.trace_id, link.span_id, dict(link.attributes)) for link in s.links],
        events=[(e.name, e.time_ns, dict(e.attributes)) for e in s.events],
        status_code=s.status_code, resource=s.resource, scope=s.scope,
    )


def test_scenario_through_the_file_default(tmp_path: Path) -> None:
    scenario = main_scenario(seed=7)
    config = resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={})
    assert config.otlp is None
    tracing = build_tracing(config, resource_attributes={"service.name": "moe-file"})
    pipeline = run_scenario(tracing, scenario, detail="layer")  # the default detail, to the file store
    stats = tracing.shutdown(timeout_s=30)
    store = TraceStore.load(config.traces_dir)
    assert store.bad_lines == 0
    spans = [stored_to_flat(s) for t in store.trace_ids() for s in store.spans(t)]
    assert stats.dropped == 0 and stats.exported == len(spans)
    check_received(spans, scenario, pipeline, detail="layer")


def _memory_tracing(tmp_path: Path) -> Tracing:
    # the file default in a temp dir: a real provider/processor/exporter, read back via the store
    return build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path)), env={}))


def _read(tracing: Tracing) -> list[FlatSpan]:
    tracing.shutdown(timeout_s=30)
    store = TraceStore.load(tracing.config.traces_dir)
    return [stored_to_flat(s) for t in store.trace_ids() for s in store.spans(t)]


def test_overflow_eviction_is_counted(tmp_path: Path) -> None:
    """Past max_buffered_steps the oldest step goes: counted as overflow, and as unjoined when no
    request had claimed it; a later request then finds none of its evicted steps."""
    rng = np.random.default_rng(1)
    tracing = _memory_tracing(tmp_path)
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, clock=clock, max_buffered_steps=2, epoch_offset_ns=OFF)
    steps = [
        build_step(rng, pid=1, tid=1, start_ms=10 + 10 * i, end_ms=15 + 10 * i, keys=[3], tokens=4) for i in range(4)
    ]
    for s in steps:
        clock.now_ns = s.end_ns
        pipeline.on_steps([s])
    rec = record(pid=1, tid=1, fd=3, generation=1, seq=1, peer=("127.0.0.1", 1), start_ms=0, end_ms=60,
                 bytes_in=1, bytes_out=1)
    pipeline.on_request(rec)
    pipeline.expire(flush=True)
    stats = pipeline.stats()
    assert stats["steps_evicted_overflow"] == 2
    assert stats["steps_unjoined"] == 2 and stats["steps_joined"] == 2 and stats["buffered_steps"] == 0
    spans = _read(tracing)
    server = next(s for s in spans if s.name == "http.server.request")
    assert server.attributes["moe.request.steps"] == 2
    mine = sorted(s.start_ns for s in spans if s.name == "moe.step" and s.trace_id == server.trace_id)
    assert mine == [steps[2].start_ns + OFF, steps[3].start_ns + OFF]
    # the overflow-evicted steps are dropped (counted), not exported as unjoined traces
    assert not [s for s in spans if s.name == "moe.step" and s.parent_span_id is None]
    assert len(spans) == stats["spans"]


def test_phase_spans_link_at_most_the_slowest_steps(tmp_path: Path) -> None:
    """A long generation stays O(1) spans: the batch-mate's decode span links to at most
    MAX_STEP_LINKS of the steps another trace owns, the slowest, in time order, and counts the rest."""
    from moescope.agent.outputs.traces import MAX_STEP_LINKS

    tracing = _memory_tracing(tmp_path)
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, clock=clock, epoch_offset_ns=OFF)
    n = MAX_STEP_LINKS + 4
    steps = feed_linked_steps(pipeline, clock, n)
    stats = pipeline.stats()
    spans = _read(tracing)
    owner_trace = next(s for s in spans if s.name == "http.server.request" and s.attributes["moe.request.key"] == 3)
    owned = {s.start_ns: s for s in spans if s.name == "moe.step" and s.trace_id == owner_trace.trace_id}
    assert len(owned) == n  # the first request owns every step
    server = next(s for s in spans if s.name == "http.server.request" and s.attributes["moe.request.key"] == 4)
    mine = [s for s in spans if s.trace_id == server.trace_id]
    assert server.attributes["moe.request.steps"] == n and not [s for s in mine if s.name == "moe.step"]
    phase = {s.name: s for s in mine if s.parent_span_id == server.span_id}
    link = {"moe.link": "step.owner"}
    prefill_owner = owned[steps[0].start_ns + OFF]
    assert phase["prefill"].links == [(prefill_owner.trace_id, prefill_owner.span_id, link)]
    assert "moe.phase.steps_unlinked" not in phase["prefill"].attributes
    decode = steps[1:]
    slowest = sorted(sorted(decode, key=lambda s: s.end_ns - s.start_ns, reverse=True)[:MAX_STEP_LINKS],
                     key=lambda s: s.start_ns)
    want = [(owned[s.start_ns + OFF].trace_id, owned[s.start_ns + OFF].span_id, link) for s in slowest]
    assert phase["decode"].links == want
    assert phase["decode"].attributes["moe.phase.steps_unlinked"] == len(decode) - MAX_STEP_LINKS
    assert all(not s.links for name, s in phase.items() if name not in ("prefill", "decode"))
    assert stats["step_links"] == 1 + MAX_STEP_LINKS and len(spans) == stats["spans"]
    # the owner's trace links to nothing: its steps are its own children
    assert not [s for s in spans if s.trace_id == owner_trace.trace_id and s.links]


def test_buffered_layer_trees_are_bounded_too(tmp_path: Path) -> None:
    """Steps waiting for their requests hold their layer trees: past max_buffered_layers the oldest
    trees go (counted as step_trees_dropped_overflow) even below the step bound, their steps stay
    for their request (spans without a layer subtree, the health taken before the tree went), and
    a claimed step's tree stops counting."""
    rng = np.random.default_rng(4)
    tracing = _memory_tracing(tmp_path)
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, clock=clock, max_buffered_layers=2 * NUM_LAYERS, epoch_offset_ns=OFF)
    steps = [
        build_step(rng, pid=1, tid=1, start_ms=10 + 10 * i, end_ms=15 + 10 * i, keys=[3], tokens=4) for i in range(4)
    ]
    for s in steps:
        clock.now_ns = s.end_ns
        pipeline.on_steps([s])
    stats = pipeline.stats()
    assert stats["step_trees_dropped_overflow"] == 2 and stats["steps_evicted_overflow"] == 0
    assert stats["buffered_steps"] == 4 and stats["buffered_layers"] == 2 * NUM_LAYERS
    pipeline.on_request(record(pid=1, tid=1, fd=3, generation=1, seq=1, peer=("127.0.0.1", 1), start_ms=0,
                               end_ms=60, bytes_in=1, bytes_out=1))
    assert pipeline.stats()["buffered_layers"] == 0  # all claimed by their only request: trees let go
    pipeline.expire(flush=True)
    assert pipeline.stats()["buffered_steps"] == 0
    spans = _read(tracing)
    server = next(s for s in spans if s.name == "http.server.request")
    assert server.attributes["moe.request.steps"] == 4  # every step still found its request
    by_start = {s.start_ns: s for s in spans if s.name == "moe.step" and s.trace_id == server.trace_id}
    assert sorted(by_start) == [s.start_ns + OFF for s in steps]
    for i, step in enumerate(steps):
        span = by_start[step.start_ns + OFF]
        children = [s for s in spans if s.parent_span_id == span.span_id]
        dropped = i < 2
        assert bool(span.attributes.get("moe.step.layers_sampled_out")) is dropped
        assert (not children) is dropped
        assert span.attributes["moe.expert_load.gini"] == span.attributes["moe.expert_load.gini"]  # taken, not NaN


def test_many_experts_put_top16_on_layer_spans(tmp_path: Path) -> None:
    """Above 64 experts a layer span carries the 16 hottest experts instead of E-long arrays."""
    num_experts = 512
    rng = np.random.default_rng(2)
    tracing = _memory_tracing(tmp_path)
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, clock=clock, epoch_offset_ns=OFF)
    step = build_step(rng, pid=1, tid=1, start_ms=10, end_ms=20, keys=[], tokens=8)
    counts = rng.permutation(np.arange(1, 41))  # distinct counts: the top 16 is unambiguous
    experts = rng.choice(num_experts, size=counts.size, replace=False)
    for layer in step.layers:
        layer.num_experts = num_experts
        assert layer.router is not None
        layer.router.tokens = {int(e): int(c) for e, c in zip(experts, counts, strict=True)}
        layer.router.dropped = {}
    clock.now_ns = step.end_ns
    pipeline.on_steps([step])
    pipeline.expire(flush=True)
    spans = _read(tracing)
    layers = [s for s in spans if s.name == "moe.layer"]
    assert len(layers) == NUM_LAYERS
    order = np.argsort(-counts, kind="stable")[:16]
    for s in layers:
        assert s.attributes["moe.layer.experts"] == num_experts
        assert "moe.expert.tokens" not in s.attributes
        assert s.attributes["moe.expert.top_ids"] == [int(experts[i]) for i in order]
        assert s.attributes["moe.expert.top_tokens"] == [int(counts[i]) for i in order]
        full = np.zeros(num_experts)
        full[experts] = counts
        n = full.sum()
        assert s.attributes["moe.expert_load.gini"] == pytest.approx(
            np.abs(full[:, None] - full[None, :]).sum() / (2 * num_experts * n), rel=1e-9
        )
        router = step.layers[s.attributes["moe.layer"]].router
        assert router is not None
        assert s.attributes["moe.router.entropy_normalized"] == pytest.approx(router.entropy_bits / 9.0, rel=1e-12)


def test_default_epoch_offset_maps_monotonic_to_unix_time() -> None:
    import time

    before = time.time_ns() - time.monotonic_ns()
    pipeline = Pipeline(spans=None)
    after = time.time_ns() - time.monotonic_ns()
    # the two clocks' difference only drifts (NTP slew); a second is far more than any drift here
    assert (
        abs(pipeline.epoch_offset_ns - before) < 1_000_000_000 and abs(pipeline.epoch_offset_ns - after) < 1_000_000_000
    )
    assert resource_attributes([])["service.name"] in (os.environ.get("OTEL_SERVICE_NAME", "moe-serving"),)
    assert "process.pid" not in resource_attributes([])


def test_an_unclaimed_step_becomes_its_own_trace_only_after_retention(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tracing = _memory_tracing(tmp_path)
    clock = FakeClock()
    pipeline = Pipeline(spans=tracing.factory, clock=clock, step_retention_ns=RETENTION_NS, epoch_offset_ns=OFF,
                        span_detail="expert")
    step = build_step(rng, pid=1, tid=1, start_ms=10, end_ms=20, keys=[5], tokens=6)
    clock.now_ns = step.end_ns
    pipeline.on_steps([step])
    clock.now_ns = step.end_ns + RETENTION_NS  # still retained: a record for key 5 could claim it
    pipeline.on_steps([])
    assert pipeline.stats()["steps_unjoined"] == 0 and pipeline.stats()["spans"] == 0
    clock.now_ns += 1
    pipeline.on_steps([])
    stats = pipeline.stats()
    assert stats["steps_unjoined"] == 1 and stats["buffered_steps"] == 0 and stats["spans"] == subtree_size(step)
    # a record arriving now finds nothing to claim
    pipeline.on_request(record(pid=1, tid=1, fd=5, generation=1, seq=1, peer=("127.0.0.1", 2), start_ms=0,
                               end_ms=30, bytes_in=1, bytes_out=1))
    spans = _read(tracing)
    roots = [s for s in spans if s.parent_span_id is None]
    assert sorted(s.name for s in roots) == ["http.server.request", "moe.step"]
    step_root = next(s for s in roots if s.name == "moe.step")
    assert step_root.attributes["moe.step.unjoined"] is True
    assert (step_root.start_ns, step_root.end_ns) == (step.start_ns + OFF, step.end_ns + OFF)
    assert len([s for s in spans if s.trace_id == step_root.trace_id]) == subtree_size(step)
    server = next(s for s in roots if s.name == "http.server.request")
    assert server.attributes["moe.request.steps"] == 0
    assert [s for s in spans if s.trace_id == server.trace_id] == [server]
