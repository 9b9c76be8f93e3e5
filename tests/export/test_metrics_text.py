"""agent/metrics.py TextExposition: /metrics written with kept line heads, byte for byte what
prometheus_client's generate_latest writes for the same registry, served over a real HTTP scrape."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from moescope.agent import metrics as m

VALUES = [0.0, -0.0, 1.0, -1.0, 0.1, 1e-7, 2.5e-300, 5e-324, 123456.0, 1234567.0, 9999999.0, 10000000.0,
          123456789.125, 1e16, 1.5e22, -1.5e22, -123456789.0, 1.7976931348623157e308, math.inf, -math.inf,
          math.nan, 3, 2**53 + 1.0]


@pytest.mark.parametrize("value", VALUES)
def test_values_are_written_as_the_reference_client_writes_them(value: float) -> None:
    assert m.text_float(float(value)) == floatToGoString(value)


def _every_family(metrics: m.Metrics) -> None:
    """A value in each declared family, some label values hostile (quotes, backslashes, newlines)."""
    hostile = ['a"b', "c\\d", "e\nf", "ünï", ""]
    for i, spec in enumerate(m.METRICS):
        if spec.name == "moescope_build_info":
            continue
        for j, text in enumerate(hostile[: 1 + i % 3]):
            labels = {label: f"{label}{i}{text}" for label in spec.labels}
            value = VALUES[(i + j) % len(VALUES)]
            if spec.kind == "counter":
                metrics.inc(spec.name, abs(value) if math.isfinite(value) else 1.0, **labels)
            elif spec.kind == "gauge":
                metrics.set(spec.name, value, **labels)
            else:
                metrics.observe(spec.name, abs(value) / 100 if math.isfinite(value) else 0.5, **labels)


def test_the_agents_registry_reads_the_same_as_generate_latest() -> None:
    metrics = m.Metrics(version="9.9.9")
    _every_family(metrics)
    metrics.refresh_self()
    exposition = m.TextExposition(metrics.registry)
    first = exposition.render()
    assert first == generate_latest(metrics.registry)
    # the heads kept from the first scrape, new values: still the same bytes
    _every_family(metrics)
    metrics.set("moescope_agent_resident_memory_bytes", 7.0)
    assert exposition.render() == generate_latest(metrics.registry)
    assert b"_created" not in first  # (off in the agent's process: 998 -> 704 lines at the reference load)
    families = {f.name for f in text_string_to_metric_families(first.decode())}
    assert {spec.name for spec in m.METRICS} <= families


class _Odd(Collector):
    """Families the agent does not make but a registry may hold: OpenMetrics-only samples, names
    outside the legacy alphabet, timestamps, label sets that change from scrape to scrape."""

    def __init__(self) -> None:
        self.round = 0

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily("odd_gauge", "help with \\ and\nnewline", labels=["k"])
        for i in range(50):
            g.add_metric([f"r{self.round}-{i}"], float(i), timestamp=1700000000.25 if i % 7 == 0 else None)
        yield g
        weird = Metric("9weird.name-x", "weird", "gauge")
        weird.add_sample("9weird.name-x", {"la.bel": "v", "0k": "w"}, 1.0)
        yield weird
        hist = Metric("gh", "a gauge histogram", "gaugehistogram")
        hist.add_sample("gh_bucket", {"le": "+Inf"}, 3.0)
        hist.add_sample("gh_gcount", {}, 3.0)
        hist.add_sample("gh_gsum", {}, 1.5)
        yield hist
        for kind in ("info", "stateset", "unknown", "summary"):
            fam = Metric(f"k_{kind}", kind, kind)
            fam.add_sample(f"k_{kind}" + ("_info" if kind == "info" else ""), {"x": "1"}, 1.0)
            yield fam


def test_odd_families_and_changing_series_read_the_same() -> None:
    registry = CollectorRegistry(auto_describe=False)
    Counter("plain", "a counter", registry=registry).inc(3)
    Gauge("g", "g", ["a", "b"], registry=registry).labels("1", "2").set(4.5)
    Histogram("h", "h", ["l"], registry=registry).labels("x").observe(0.2)
    odd = _Odd()
    registry.register(odd)
    exposition = m.TextExposition(registry)
    sizes = []
    for r in range(60):  # each round 50 label values not seen before: the kept heads stay bounded
        odd.round = r
        expected = generate_latest(registry)
        assert exposition.render() == expected
        lines = sum(1 for line in expected.decode().splitlines() if not line.startswith("#"))
        assert len(exposition._heads) <= 2 * lines + 1024
        sizes.append(len(exposition._heads))
    assert any(b < a for a, b in zip(sizes, sizes[1:], strict=False))  # (the bound was reached: heads let go)
    assert exposition.render() == generate_latest(registry)


def _get(port: int, path: str, **headers: str) -> tuple[str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], resp.read().decode()


def test_a_scrape_asking_for_openmetrics_gets_the_text_format(served: tuple[m.Metrics, int]) -> None:
    metrics, port = served
    _every_family(metrics)
    kind, text = _get(port, "/metrics", Accept="application/openmetrics-text;version=1.0.0,text/plain;q=0.3",
                      **{"Accept-Encoding": "gzip"})
    assert kind == m.TEXT_CONTENT_TYPE
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["moescope_build_info"].samples[0].labels["version"] == "9.9.9"
    assert "_created" not in text
    assert not text.startswith("\x1f")  # (uncompressed)


def test_a_scrape_takes_the_families_it_names(served: tuple[m.Metrics, int]) -> None:
    metrics, port = served
    metrics.inc("moescope_requests", 2.0)
    metrics.observe("moescope_step_duration_seconds", 0.01)
    _, text = _get(port, "/metrics?name[]=moescope_requests_total&name[]=moescope_step_duration_seconds_count")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"moescope_requests", "moescope_step_duration_seconds"}
    assert families["moescope_requests"].samples[0].value == 2.0
    _, text = _get(port, "/metrics?name[]=no_such_metric")
    assert text == ""
