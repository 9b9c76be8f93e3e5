"""The agent's close: every step the join still holds goes out as a trace (unjoined steps wait up to
120 s for their requests, so a short run holds them all), a chunk at a time with the trace export
drained between (agent/observe.py ExportDrain), so that they do not overflow the export queue and
get dropped in one burst at exit. Real pipeline, real SDK spans, the real OTLP-JSON file export."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moescope.agent.export import ExportFlags, build_tracing, resolve_export_config
from moescope.agent.observe import ExportDrain
from moescope.agent.pipeline import Pipeline

from .test_layer_sampling import MS, v2_step

QUEUE_SPANS = 256  # far fewer than the held steps' spans
STEPS = 1000  # no request claims them: each becomes its own trace at the close


def _close(tmp_path: Path, *, drain: bool) -> tuple[int, int, int]:
    """(spans offered, exported, dropped because the queue was full) of one pipeline's close."""
    tracing = build_tracing(resolve_export_config(ExportFlags(state_dir=str(tmp_path), queue_spans=QUEUE_SPANS),
                                                  env={}))
    rng = np.random.default_rng(5)
    steps = [v2_step(rng, index=i, duration_ns=2 * MS, period_ns=5 * MS, layers=4) for i in range(STEPS)]
    pipeline = Pipeline(spans=tracing.factory, epoch_offset_ns=0, clock=lambda: steps[-1].end_ns,
                        layer_spans_per_s=0)
    for step in steps:
        pipeline.on_steps([step])
    assert pipeline.join.stats()["buffered_steps"] == STEPS  # all held for their requests
    pipeline.shutdown(between=ExportDrain(tracing.force_flush, budget_s=120) if drain else None)
    stats = tracing.shutdown(timeout_s=60)
    assert stats.failed == 0 and stats.dropped_shutdown == 0, stats
    return stats.accepted + stats.dropped_queue_full, stats.exported, stats.dropped_queue_full


def test_the_closing_flush_drains_the_export_between_chunks(tmp_path: Path) -> None:
    offered, exported, dropped = _close(tmp_path / "drained", drain=True)
    assert offered >= STEPS and dropped == 0 and exported == offered


def test_without_the_drain_the_same_close_overflows_the_queue(tmp_path: Path) -> None:
    # what the close did before: the same steps at once, the queue overflowing (counted)
    offered, exported, dropped = _close(tmp_path / "at-once", drain=False)
    assert dropped > 0 and exported + dropped == offered


def test_the_drain_gives_up_once_its_budget_is_spent_or_a_flush_does_not_finish() -> None:
    calls: list[float] = []
    now = [0.0]

    def flush(timeout_s: float) -> bool:
        calls.append(timeout_s)
        now[0] += 1.0
        return len(calls) < 3  # the third flush does not finish: the backend is stalled

    drain = ExportDrain(flush, budget_s=10.0, clock=lambda: now[0])
    for _ in range(5):
        drain()
    assert len(calls) == 3 and drain.gave_up
    spent = ExportDrain(lambda _t: True, budget_s=0.0, clock=lambda: 0.0)
    spent()
    assert spent.gave_up and spent.calls == 0
