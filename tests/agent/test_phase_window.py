"""The live phase window (agent/outputs/windows.py) against the table computed independently here
from the same requests' breakdowns: nearest-rank per phase, share of the summed durations, TTFT,
TPOT, tokens/s; the same span of time as the request window; requests without a breakdown left out."""

from __future__ import annotations

import math
import random

import pytest
from phase_requests import MS, ModelRequest, joined, model_request

from moescope.agent.join import RequestJoined
from moescope.agent.outputs.windows import PhaseWindow, WindowsOutput
from moescope.agent.phase_table import PHASE_ROWS, Phases
from moescope.agent.request_phases import RequestBreakdown

WINDOW_NS = 10_000 * MS


def rank(values: list[float], q: float) -> float:
    """Nearest rank, written out: the ceil(q*n)-th smallest (at least the first)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def expected(bs: list[RequestBreakdown]) -> dict[str, object]:
    per_phase = {
        "receive": [b.receive_ns for b in bs], "queue": [b.queue_ns for b in bs],
        "prefill": [b.prefill_ns for b in bs], "decode": [b.decode_ns for b in bs], "write": [b.write_ns for b in bs],
        "inference": [b.prefill_ns + b.decode_ns for b in bs], "expert_load": [b.expert_load_ns for b in bs],
        "routing": [b.routing_ns for b in bs],
    }
    total = sum(b.end_ns - b.start_ns for b in bs)
    tpots = [b.tpot_ns / 1e6 for b in bs if b.tpot_ns is not None]
    return {
        "rows": {p: (rank([v / 1e6 for v in vs], 0.5), rank([v / 1e6 for v in vs], 0.99), sum(vs) / total)
                 for p, vs in per_phase.items()},
        "ttft": (rank([b.ttft_ns / 1e6 for b in bs], 0.5), rank([b.ttft_ns / 1e6 for b in bs], 0.99)),
        "tpot": (rank(tpots, 0.5), rank(tpots, 0.99)) if tpots else (None, None),
        "output_tokens": sum(b.output_tokens for b in bs),
    }


def check(table: Phases, bs: list[RequestBreakdown], *, window_ns: int = WINDOW_NS) -> None:
    want = expected(bs)
    assert table.requests == len(bs)
    assert [r.phase for r in table.rows] == list(PHASE_ROWS)
    rows = want["rows"]
    assert isinstance(rows, dict)
    for row in table.rows:
        p50, p99, share = rows[row.phase]
        assert (row.p50_ms, row.p99_ms) == (p50, p99), row.phase
        assert row.share == pytest.approx(share, rel=1e-12), row.phase
    assert (table.ttft_p50_ms, table.ttft_p99_ms) == want["ttft"]
    assert (table.tpot_p50_ms, table.tpot_p99_ms) == want["tpot"]
    assert table.output_tokens == want["output_tokens"]
    assert table.output_tokens_per_s == pytest.approx(table.output_tokens / (window_ns / 1e9))
    five = sum(r.share or 0.0 for r in table.rows if r.phase in PHASE_ROWS[:5])
    assert five == pytest.approx(1.0, rel=1e-12)  # the five phases are the whole duration


class Clock:
    def __init__(self) -> None:
        self.now_ns = 5_000_000 * MS

    def __call__(self) -> int:
        return self.now_ns


def test_window_equals_the_table_over_the_same_requests() -> None:
    rng = random.Random(17)
    clock = Clock()
    windows = WindowsOutput(clock=clock, window_ns=WINDOW_NS)
    assert windows.phases_panel().requests == 0 and windows.phases_panel().rows == []
    fed: list[RequestJoined] = []
    for i in range(400):
        shape = ModelRequest(
            receive_ms=rng.uniform(0.05, 2.0), queue_ms=rng.expovariate(1 / 20), prefill_ms=rng.uniform(20, 200),
            decode_steps=rng.randrange(0, 30), decode_step_ms=rng.uniform(5, 15), write_ms=rng.uniform(0.1, 3),
            load_ms_per_step=rng.choice([0.0, 0.5, 8.0]), routing_ms_per_step=rng.uniform(0, 1),
            input_tokens=rng.choice([None, rng.randrange(1, 500)]), streamed=rng.random() < 0.5,
        )
        event = joined(shape, start_ns=clock.now_ns, fd=i + 3)
        clock.now_ns = event.record.end_ns + int(rng.uniform(0, 80) * MS)
        windows.export([event])
        fed.append(event)
        if i % 37 == 0 or i == 399:
            inside = [e.breakdown for e in fed if e.record.end_ns > clock.now_ns - WINDOW_NS and e.breakdown]
            table = windows.phases_panel()
            check(table, inside)
            signals = windows.signals()
            assert signals.request_phase_inference_p99_ms == table.row("inference").p99_ms  # type: ignore[union-attr]
            assert signals.request_phase_expert_load_p99_ms == table.row("expert_load").p99_ms  # type: ignore[union-attr]
            assert signals.request_ttft_p99_ms == table.ttft_p99_ms
            # the same requests as the kernel request window
            assert windows.panels()[0].latency_p99_ms == table.duration_p99_ms
    # input tokens: only the requests that reported them
    last = [e.breakdown for e in fed if e.record.end_ns > clock.now_ns - WINDOW_NS and e.breakdown]
    reported = [b.input_tokens for b in last if b.input_tokens is not None]
    assert windows.phases_panel().input_tokens == (sum(reported) if reported else None)
    # the window empties after its span of time
    clock.now_ns += WINDOW_NS
    empty = windows.phases_panel()
    assert empty.requests == 0 and empty.rows == []
    assert math.isnan(windows.signals().request_phase_inference_p99_ms)


def test_requests_without_a_breakdown_do_not_count() -> None:
    clock = Clock()
    windows = WindowsOutput(clock=clock, window_ns=WINDOW_NS)
    event = joined(ModelRequest(), start_ns=clock.now_ns)
    plain = RequestJoined(record=event.record._replace(fd=99), steps=(), first_claims=())  # /stats: no step
    clock.now_ns = event.record.end_ns
    windows.export([event, plain])
    assert windows.panels()[0].latency_p99_ms is not None
    table = windows.phases_panel()
    assert table.requests == 1
    assert event.breakdown is not None
    check(table, [event.breakdown])


def test_rows_grow_compact_and_stay_bounded() -> None:
    """The row store's growth, compaction and bound keep exactly the window's requests (while under
    the bound) and then at most max_samples of the newest, counted."""
    rng = random.Random(9)
    window = PhaseWindow(duration_ns=2_000 * MS, max_samples=64, initial_rows=4)
    made: list[RequestBreakdown] = []
    t = 1_000_000 * MS
    for i in range(600):
        shape = ModelRequest(prefill_ms=rng.uniform(5, 50), decode_steps=rng.randrange(0, 5),
                             input_tokens=rng.choice([None, 7]))
        _, b = model_request(shape, start_ns=t, fd=i)
        made.append(b)
        window.add(b)
        t = b.end_ns - int(rng.uniform(0, 40) * MS) if i < 400 else b.end_ns - int(48 * MS)  # then denser
        if i % 23 == 0:
            now = made[-1].end_ns
            inside = [x for x in made if x.end_ns > now - 2_000 * MS]
            if window.overflow_evictions == 0:
                check(window.table(now), inside, window_ns=2_000 * MS)
            else:
                kept = window.table(now).requests
                assert kept <= 64
                check(window.table(now), inside[-kept:], window_ns=2_000 * MS)
    assert window.overflow_evictions > 0  # the dense part went past the bound
