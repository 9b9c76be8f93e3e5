"""Per producer process (rank) step series: steps, tokens and step durations per pid through the real
pipeline, the unlabelled totals unchanged beside them, and the pid bound (MAX_RANK_SERIES) with the
updates past it dropped and counted."""

from __future__ import annotations

from moescope.agent.metrics import MAX_RANK_SERIES, STEP_BUCKETS_S, Metrics
from moescope.agent.pipeline import Pipeline
from moescope.collectors.moe_convention import StepBatch, StepEvent

NOW_NS = 50_000_000_000


def steps_for(pids_and_counts: dict[int, int], *, tokens: int = 64) -> StepBatch:
    steps = []
    for pid, count in pids_and_counts.items():
        for i in range(count):
            start = NOW_NS - 4_000_000_000 + i * 10_000_000
            duration_ns = (pid % 7 + 1) * 1_000_000 + i  # 1..7 ms, a distinct one per pid
            steps.append(StepEvent(pid=pid, tid=pid, start_ns=start, end_ns=start + duration_ns, tokens=tokens))
    return StepBatch(tuple(sorted(steps, key=lambda s: s.end_ns)))


def test_rank_series_count_each_pids_steps_tokens_and_durations() -> None:
    metrics = Metrics()
    pipeline = Pipeline(spans=None, metrics=metrics, clock=lambda: NOW_NS)
    counts = {4101: 30, 4102: 17, 4103: 1}
    pipeline.sink(steps_for(counts))
    for pid, n in counts.items():
        assert metrics.get("moescope_rank_steps", pid=str(pid)) == n
        assert metrics.get("moescope_rank_step_tokens", pid=str(pid)) == 64 * n
        assert metrics.get("moescope_rank_step_duration_seconds", pid=str(pid)) == n  # a histogram's count
    assert metrics.get("moescope_steps") == sum(counts.values())  # the aggregate family is unchanged
    assert metrics.get("moescope_step_tokens") == 64 * sum(counts.values())
    # pid 4102 (4102 % 7 = 0) steps 1 ms + i ns: only its first, exactly 1 ms, is in le="0.001"
    samples = {
        (s.labels["le"]): s.value
        for family in metrics.registry.collect() if family.name == "moescope_rank_step_duration_seconds"
        for s in family.samples if s.name.endswith("_bucket") and s.labels.get("pid") == "4102"
    }
    assert samples[str(0.001)] == 1 and samples[str(0.0025)] == 17 and len(samples) == len(STEP_BUCKETS_S) + 1
    assert metrics.get("moescope_agent_metric_series_dropped", metric="moescope_rank_steps") == 0


def test_pids_past_the_bound_are_dropped_and_counted() -> None:
    metrics = Metrics()
    pipeline = Pipeline(spans=None, metrics=metrics, clock=lambda: NOW_NS)
    pids = {1000 + i: 2 for i in range(MAX_RANK_SERIES + 3)}
    pipeline.sink(steps_for(pids))
    metrics.refresh()
    series = {
        s.labels["pid"]
        for family in metrics.registry.collect() if family.name == "moescope_rank_steps"
        for s in family.samples if s.name == "moescope_rank_steps_total"
    }
    assert len(series) == MAX_RANK_SERIES
    assert series == {str(1000 + i) for i in range(MAX_RANK_SERIES)}  # flushed in pid order: the lowest first
    assert metrics.get("moescope_agent_metric_series_dropped", metric="moescope_rank_steps") == 3
    assert metrics.get("moescope_steps") == 2 * len(pids)  # every step still in the aggregate
