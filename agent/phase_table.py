"""The "where the time goes" table: per phase p50 / p99 / share of the total, TTFT, TPOT and tokens,
over a set of model requests (agent/request_phases.py breaks each one down).

One definition, two ways of getting the requests: the live window (agent/outputs/windows.py, over
the last 10 s of joined requests; the live view's panel and the policy's phase signals) and
``agent report`` (the server spans' ``moe.request.*`` attributes read back from the trace store or
an OTLP-JSON file). Both count only requests with a breakdown (that a ``moe.step`` carried).

- p50 / p99: ``moescope.latency`` nearest-rank of the per-request values (every request counts
  once per row, zeros included).
- share: sum of that phase over the requests / sum of their kernel-measured durations (so the five
  phases' shares add up to 1; the "of which" rows are parts of prefill + decode).
- tokens per second: the tokens of the requests in the window / the window's length.

``Phases`` / ``PhaseStat`` are the live-state snapshot's types for the panel (agent/state.py
decodes them like its own dataclasses). Imports nothing of the agent's pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from moescope.agent.request_phases import PHASES, RequestBreakdown
from moescope.latency import nearest_rank

INFERENCE = "inference"  # prefill + decode per request: the seed's "GPU inference"
OF_WHICH = (INFERENCE, "expert_load", "routing")  # rows that are parts of the sum, not terms of it
PHASE_ROWS: tuple[str, ...] = (*PHASES, *OF_WHICH)  # table order: the five phases, then "of which"
# What a policy rule or a config may call a phase: the rows, and the seed's word for expert load.
PHASE_ALIASES: Mapping[str, str] = {"load": "expert_load"}
PHASE_LABELS: Mapping[str, str] = {
    "receive": "receive", "queue": "queue", "prefill": "prefill", "decode": "decode", "write": "write",
    INFERENCE: "inference", "expert_load": "expert load", "routing": "routing",
}


def canonical_phase(name: str) -> str | None:
    """The row a phase name (or alias) selects, or None when it is not one."""
    name = PHASE_ALIASES.get(name, name)
    return name if name in PHASE_ROWS else None


@dataclass(frozen=True, slots=True)
class RequestPhases:
    """One model request's values for the table, in milliseconds (``phase_ms`` in PHASE_ROWS order)."""

    end_ns: int  # last byte written: where the request falls in a window
    duration_ms: float
    phase_ms: tuple[float, ...]
    ttft_ms: float
    ttft_source: str  # "wire" | "step"
    tpot_ms: float | None  # None below two output tokens
    input_tokens: int | None  # None when the producer does not report them
    output_tokens: int

    @classmethod
    def from_breakdown(cls, b: RequestBreakdown) -> RequestPhases:
        ns = b.phase_ns()
        parts = [ns[p] for p in PHASES] + [b.prefill_ns + b.decode_ns, b.expert_load_ns, b.routing_ns]
        return cls(
            end_ns=b.end_ns,
            duration_ms=b.duration_ns / 1e6,
            phase_ms=tuple(v / 1e6 for v in parts),
            ttft_ms=b.ttft_ns / 1e6,
            ttft_source=b.ttft_source,
            tpot_ms=None if b.tpot_ns is None else b.tpot_ns / 1e6,
            input_tokens=b.input_tokens,
            output_tokens=b.output_tokens,
        )


@dataclass(frozen=True, slots=True)
class PhaseStat:
    """One row: a phase's p50 / p99 (ms) and its share (0..1) of the summed request durations."""

    phase: str
    p50_ms: float | None = None
    p99_ms: float | None = None
    share: float | None = None


@dataclass(frozen=True, slots=True)
class Phases:
    """The table over a window (None: no model request in it)."""

    window_s: float | None = None
    requests: int = 0  # model requests (with a breakdown) in the window
    rows: list[PhaseStat] = field(default_factory=list)  # PHASE_ROWS order
    duration_p50_ms: float | None = None
    duration_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_wire: int = 0  # requests whose TTFT is their first response byte (streamed)
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    tpot_requests: int = 0  # requests with two or more output tokens (TPOT defined)
    input_tokens: int | None = None  # None: no request in the window reported its input tokens
    output_tokens: int = 0
    input_tokens_per_s: float | None = None
    output_tokens_per_s: float | None = None

    def row(self, phase: str) -> PhaseStat | None:
        return next((r for r in self.rows if r.phase == phase), None)


def _quantiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    return nearest_rank(ordered, 0.50), nearest_rank(ordered, 0.99)


def summarize(requests: Iterable[RequestPhases], *, window_s: float | None) -> Phases:
    """The table over ``requests`` (exact nearest-rank quantiles); tokens/s over ``window_s``."""
    items = list(requests)
    if not items:
        return Phases(window_s=window_s)
    total_ms = sum(r.duration_ms for r in items)
    rows = []
    for i, phase in enumerate(PHASE_ROWS):
        values = [r.phase_ms[i] for r in items]
        p50, p99 = _quantiles(values)
        share = sum(values) / total_ms if total_ms > 0 else None
        rows.append(PhaseStat(phase=phase, p50_ms=p50, p99_ms=p99, share=share))
    d50, d99 = _quantiles([r.duration_ms for r in items])
    t50, t99 = _quantiles([r.ttft_ms for r in items])
    tpots = [r.tpot_ms for r in items if r.tpot_ms is not None]
    o50, o99 = _quantiles(tpots)
    reported = [r.input_tokens for r in items if r.input_tokens is not None]
    input_tokens = sum(reported) if reported else None
    output_tokens = sum(r.output_tokens for r in items)
    span_s = window_s if window_s is not None and window_s > 0 else None
    return Phases(
        window_s=window_s,
        requests=len(items),
        rows=rows,
        duration_p50_ms=d50,
        duration_p99_ms=d99,
        ttft_p50_ms=t50,
        ttft_p99_ms=t99,
        ttft_wire=sum(1 for r in items if r.ttft_source == "wire"),
        tpot_p50_ms=o50,
        tpot_p99_ms=o99,
        tpot_requests=len(tpots),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        input_tokens_per_s=input_tokens / span_s if span_s is not None and input_tokens is not None else None,
        output_tokens_per_s=output_tokens / span_s if span_s is not None else None,
    )
