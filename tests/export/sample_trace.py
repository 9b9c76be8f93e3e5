"""A small two-request trace built with SpanFactory, and what a receiver must see for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from opentelemetry.trace import SpanContext, SpanKind

from moescope.agent.export import SpanEvent, SpanFactory, SpanLink

T0_NS = 1_764_400_000_000_000_000  # 2025-11-29T07:06:40Z: a fixed wall-clock base


@dataclass(frozen=True)
class Expected:
    name: str
    parent: str | None  # expected parent span name (same trace), None for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links_to: tuple[str, ...] = ()  # names of linked spans
    events: tuple[tuple[str, int, dict[str, Any]], ...] = ()


def emit_sample(factory: SpanFactory, *, t0_ns: int = T0_NS) -> tuple[dict[str, SpanContext], list[Expected]]:
    """Request A and B batched in one step; the step lives in A's trace and links to B's server span."""
    ctx: dict[str, SpanContext] = {}
    server_a_attrs = {
        "network.peer.address": "127.0.0.1",
        "network.peer.port": np.int64(50123),
        "http.request.body.size": 321,
        "http.response.body.size": 4567,
        "moe.request.key": 7,
    }
    server_b_attrs = {"network.peer.address": "127.0.0.1", "network.peer.port": 50124, "moe.request.key": 8}
    a = factory.start("POST /generate", start_ns=t0_ns, kind=SpanKind.SERVER, attributes=server_a_attrs)
    b = factory.start("POST /generate B", start_ns=t0_ns + 1_000, kind=SpanKind.SERVER, attributes=server_b_attrs)
    ctx["A"], ctx["B"] = a.get_span_context(), b.get_span_context()
    ctx["queue"] = factory.record("queue wait", start_ns=t0_ns + 10, end_ns=t0_ns + 2_000_000, parent=ctx["A"])
    step_attrs = {
        "moe.step.tokens": 24,
        "moe.step.gini": 0.125,
        "moe.step.router.entropy_normalized": float("nan"),  # undefined: must be absent
        "moe.requests": [7, 8],
        "moe.expert.tokens": np.array([10, 0, 14, 0], dtype=np.int64),
        "moe.flags": [True, False],
        "moe.device": "cpu",
        "moe.ignored": None,
    }
    step = factory.start(
        "moe.step",
        start_ns=t0_ns + 2_000_000,
        parent=ctx["A"],
        attributes=step_attrs,
        links=[SpanLink(ctx["B"], {"moe.link": "batched request"})],
    )
    ctx["step"] = step.get_span_context()
    ctx["layer"] = factory.record(
        "moe.layer",
        start_ns=t0_ns + 2_100_000,
        end_ns=t0_ns + 5_000_000,
        parent=ctx["step"],
        attributes={"moe.layer": 0},
    )
    ctx["router"] = factory.record(
        "moe.router",
        start_ns=t0_ns + 2_100_000,
        end_ns=t0_ns + 2_400_000,
        parent=ctx["layer"],
        attributes={"moe.router.entropy_bits": 1.75, "moe.layer": 0},
        events=[SpanEvent("moe.expert.dropped", t0_ns + 2_300_000, {"moe.expert": 2, "moe.tokens": 3})],
    )
    factory.end(step, end_ns=t0_ns + 6_000_000, attributes={"moe.step.gini_max": 0.25})
    factory.end(a, end_ns=t0_ns + 7_000_000)
    factory.end(b, end_ns=t0_ns + 7_500_000, error="client went away")
    expected = [
        Expected("POST /generate", None, 2, t0_ns, t0_ns + 7_000_000,
                 {**server_a_attrs, "network.peer.port": 50123}),
        Expected("POST /generate B", None, 2, t0_ns + 1_000, t0_ns + 7_500_000, server_b_attrs),
        Expected("queue wait", "POST /generate", 1, t0_ns + 10, t0_ns + 2_000_000, {}),
        Expected("moe.step", "POST /generate", 1, t0_ns + 2_000_000, t0_ns + 6_000_000,
                 {"moe.step.tokens": 24, "moe.step.gini": 0.125, "moe.requests": [7, 8],
                  "moe.expert.tokens": [10, 0, 14, 0], "moe.flags": [True, False], "moe.device": "cpu",
                  "moe.step.gini_max": 0.25},
                 links_to=("POST /generate B",)),
        Expected("moe.layer", "moe.step", 1, t0_ns + 2_100_000, t0_ns + 5_000_000, {"moe.layer": 0}),
        Expected("moe.router", "moe.layer", 1, t0_ns + 2_100_000, t0_ns + 2_400_000,
                 {"moe.router.entropy_bits": 1.75, "moe.layer": 0},
                 events=(("moe.expert.dropped", t0_ns + 2_300_000, {"moe.expert": 2, "moe.tokens": 3}),)),
    ]
    return ctx, expected


def check_received(spans: list[Any], expected: list[Expected], *, resource: dict[str, Any]) -> None:
    """Spans (FlatSpan-like) equal the expectation exactly: names, tree, kinds, times, attributes, links."""
    assert sorted(s.name for s in spans) == sorted(e.name for e in expected)
    by_name = {s.name: s for s in spans}
    by_id = {s.span_id: s for s in spans}
    for e in expected:
        s = by_name[e.name]
        assert s.kind == e.kind, e.name
        assert (s.start_ns, s.end_ns) == (e.start_ns, e.end_ns), e.name
        assert s.attributes == e.attributes, e.name
        parent = by_id[s.parent_span_id].name if s.parent_span_id else None
        assert parent == e.parent, e.name
        if parent is not None:
            assert s.trace_id == by_id[s.parent_span_id].trace_id
        linked = tuple(by_id[link[1]].name for link in s.links)
        assert linked == e.links_to, e.name
        assert [(ev[0], ev[1], ev[2]) for ev in s.events] == list(e.events), e.name
        for key, value in resource.items():
            assert s.resource[key] == value
    # The step is in A's trace and reachable from B's trace through its link.
    step = by_name["moe.step"]
    assert step.trace_id == by_name["POST /generate"].trace_id != by_name["POST /generate B"].trace_id
    assert step.links[0][0] == by_name["POST /generate B"].trace_id
    assert step.links[0][2] == {"moe.link": "batched request"}
    assert by_name["POST /generate B"].status_code == 2  # ERROR
