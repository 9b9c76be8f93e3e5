"""agent/source_metrics.py: each source's health() becomes moescope_agent_collector_duration_seconds
and moescope_agent_collector_success in the real prometheus_client exposition of `Metrics`."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_collector_registry import Counting, Failing

from moescope.agent.metrics import Metrics
from moescope.agent.source_metrics import DURATION_METRIC, SUCCESS_METRIC, publish_source_health
from moescope.collectors.registry import SampledSource, SourceHealth, merge_health


def exposed(metrics: Metrics, family: str) -> dict[str, float]:
    """collector label -> value, as a scrape would read it."""
    text = generate_latest(metrics.registry).decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for sample in fam.samples:
                out[sample.labels["collector"]] = sample.value
    return out


def _sampled(collector: Counting) -> SampledSource:
    return SampledSource(collector, emit=lambda _r: None)


def test_duration_and_success_per_source_read_back_from_the_exposition() -> None:
    ok, bad, idle = _sampled(Counting("ok")), _sampled(Failing("bad")), _sampled(Counting("idle"))
    ok.collect_once()
    bad.collect_once()
    metrics = Metrics()
    publish_source_health(metrics, [ok, bad, idle])
    durations = exposed(metrics, DURATION_METRIC)
    success = exposed(metrics, SUCCESS_METRIC)
    assert success == {"ok": 1.0, "bad": 0.0}  # a source that has not run yet has no series
    assert durations == {
        "ok": ok.collector_stats().last_duration_ns / 1e9,
        "bad": bad.collector_stats().last_duration_ns / 1e9,
    }
    assert all(value > 0 for value in durations.values())
    # the next run changes the series: the failing collector recovers
    bad.collector.collect = Counting("x").collect  # type: ignore[method-assign]  # the same collector recovers
    bad.collect_once()
    publish_source_health(metrics, [ok, bad, idle])
    assert exposed(metrics, SUCCESS_METRIC)["bad"] == 1.0


def test_sources_sharing_a_name_are_one_series() -> None:
    """One NVTX collector per target, all named "nvtx": one failing makes the series 0."""
    first, second = _sampled(Counting("ring")), _sampled(Failing("ring"))
    first.collect_once()
    second.collect_once()
    metrics = Metrics()
    publish_source_health(metrics, [first, second])
    assert exposed(metrics, SUCCESS_METRIC) == {"ring": 0.0}
    longest = max(first.collector_stats().last_duration_ns, second.collector_stats().last_duration_ns)
    assert exposed(metrics, DURATION_METRIC) == {"ring": longest / 1e9}


def test_merge_health() -> None:
    ok, failed, unknown = SourceHealth(5, True, None), SourceHealth(7, False, "E: x"), SourceHealth()
    assert merge_health([]) == SourceHealth()
    assert merge_health([unknown, ok]) == ok
    assert merge_health([ok, failed, unknown]) == SourceHealth(7, False, "E: x")
    assert merge_health([SourceHealth(9, True, None), failed]) == SourceHealth(9, False, "E: x")


class _BrokenHealth:
    """A source whose health() has a bug; the rest of the Source protocol is never called here."""

    name = "broken"

    def poll(self, now_ns: int) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {}

    def health(self) -> SourceHealth:
        raise RuntimeError("bug")

    def close(self) -> None:
        return None


def test_a_source_whose_health_raises_is_left_out() -> None:
    ok = _sampled(Counting("ok"))
    ok.collect_once()
    metrics = Metrics()
    publish_source_health(metrics, [_BrokenHealth(), ok])
    assert exposed(metrics, SUCCESS_METRIC) == {"ok": 1.0}
