"""agent/metrics.py: every declared family is served over a real HTTP scrape with the values set."""

from __future__ import annotations

import socket
import threading
import urllib.request

import pytest
from cpu_burn import burn_thread_cpu
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from moescope import errors
from moescope.agent import metrics as m
from moescope.agent import routing_health as rh
from moescope.procfs import name_thread


def _labels_for(spec: m.MetricSpec, i: int) -> dict[str, str]:
    return {label: f"{label}{i}" for label in spec.labels}


def scrape(port: int) -> dict[str, Metric]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_declared_family_is_scraped_with_its_value(served: tuple[m.Metrics, int]) -> None:
    metrics, port = served
    expected: dict[str, float] = {}
    for i, spec in enumerate(m.METRICS):
        if spec.name == "moescope_build_info":
            continue
        labels = _labels_for(spec, i)
        value = float(i + 2)
        if spec.kind == "counter":
            metrics.inc(spec.name, value, **labels)
        elif spec.kind == "gauge":
            metrics.set(spec.name, value, **labels)
        else:
            metrics.observe(spec.name, value / 100, **labels)
        expected[spec.name] = value
    families = scrape(port)
    for spec in m.METRICS:
        assert spec.name in families, f"{spec.name} missing from /metrics"
        family = families[spec.name]
        assert family.type == spec.kind
        assert family.documentation == spec.help
    for i, spec in enumerate(m.METRICS):
        if spec.name not in expected:
            continue
        labels = _labels_for(spec, i)
        samples = {
            s.name: s for s in families[spec.name].samples if all(s.labels.get(k) == v for k, v in labels.items())
        }
        if spec.kind == "counter":
            value = samples[f"{spec.name}_total"].value
            if spec.name == "moescope_agent_cpu_seconds":  # refreshed from getrusage on scrape
                assert value >= expected[spec.name]
                continue
            assert value == expected[spec.name]
        elif spec.kind == "gauge":
            if spec.name == "moescope_agent_resident_memory_bytes":
                assert samples[spec.name].value > 1_000_000  # real RSS, not the value set
                continue
            assert samples[spec.name].value == expected[spec.name]
        else:
            assert samples[f"{spec.name}_count"].value == 1
            assert samples[f"{spec.name}_sum"].value == pytest.approx(expected[spec.name] / 100)
    build = [s for s in families["moescope_build_info"].samples if s.name == "moescope_build_info"]
    assert [(s.labels, s.value) for s in build] == [({"version": "9.9.9"}, 1.0)]


def test_table_names_are_unique_and_prometheus_valid() -> None:
    import re

    names = [spec.name for spec in m.METRICS]
    assert len(names) == len(set(names))
    for spec in m.METRICS:
        # moescope_* families, and the GenAI semantic conventions' gen_ai_server_* ones
        assert re.fullmatch(r"(moescope|gen_ai_server)_[a-z0-9_]+", spec.name), spec.name
        assert not spec.name.endswith("_total")
        assert (spec.kind == "histogram") == bool(spec.buckets)
        assert spec.max_series >= 1
        if spec.unit:
            assert spec.name.endswith("_" + spec.unit), spec.name


def test_no_hand_written_metric_objects() -> None:
    from moescope.compiled import source_path

    source = source_path(m.__name__).read_text()  # (the module may be compiled: its file is a .so)
    for ctor in ("Gauge(", "Counter(", "Histogram("):
        assert source.count(ctor) == 1, f"{ctor} should appear only in the generator"


def test_expert_labels_bounded_with_other() -> None:
    metrics = m.Metrics(max_layers=2, max_experts_per_layer=2)
    metrics.record_expert_counts(layer=0, tokens={0: 5, 1: 9, 2: 7, 3: 0}, dropped={2: 3, 1: 1})
    metrics.record_expert_counts(layer=0, tokens={0: 100, 1: 1}, dropped={})
    metrics.record_expert_counts(layer=1, tokens={4: 1}, dropped=None)
    metrics.record_expert_counts(layer=2, tokens={4: 6, 5: 2}, dropped={5: 1})
    get = metrics.get
    # Layer 0, first step: experts 1 (9) and 2 (7) are the hottest and fill both slots.
    assert get("moescope_expert_tokens", layer="0", expert="1") == 10
    assert get("moescope_expert_tokens", layer="0", expert="2") == 7
    assert get("moescope_expert_tokens", layer="0", expert="other") == 105
    assert get("moescope_expert_dropped_tokens", layer="0", expert="2") == 3
    assert get("moescope_expert_dropped_tokens", layer="0", expert="1") == 1
    assert get("moescope_expert_tokens", layer="1", expert="4") == 1
    # A third layer is past max_layers: summed into layer="other".
    assert get("moescope_expert_tokens", layer="other", expert="other") == 8
    assert get("moescope_expert_dropped_tokens", layer="other", expert="other") == 1


def test_series_bound_drops_are_counted() -> None:
    spec = m.MetricSpec("moescope_test_bounded", "gauge", "test", labels=("k",), max_series=2)
    drop = next(s for s in m.METRICS if s.name == "moescope_agent_metric_series_dropped")
    metrics = m.Metrics(specs=(spec, drop))
    for k in "abcd":
        metrics.set("moescope_test_bounded", 1.0, k=k)
    assert metrics.get("moescope_test_bounded", k="a") == 1.0
    assert metrics.get("moescope_agent_metric_series_dropped", metric="moescope_test_bounded") == 2
    with pytest.raises(ValueError):
        metrics.set("moescope_test_bounded", 1.0, wrong="x")


def test_counter_from_cumulative_source_handles_reset() -> None:
    metrics = m.Metrics()
    metrics.set_counter_total("moescope_nvlink_transmit_bytes", 100, device="0", link="1")
    metrics.set_counter_total("moescope_nvlink_transmit_bytes", 250, device="0", link="1")
    metrics.set_counter_total("moescope_nvlink_transmit_bytes", 40, device="0", link="1")  # source reset
    assert metrics.get("moescope_nvlink_transmit_bytes", device="0", link="1") == 290


def test_layer_health_and_policy_state() -> None:
    metrics = m.Metrics()
    health = rh.layer_health(
        rh.LayerRouting.from_marks(layer=3, num_experts=4, tokens={0: 1, 1: 3}, router_entropy_bits=1.5)
    )
    metrics.set_layer_health(health)
    assert metrics.get("moescope_expert_load_gini", layer="3") == pytest.approx(health.load.gini)
    assert metrics.get("moescope_router_entropy_normalized", layer="3") == pytest.approx(0.75)
    metrics.set_policy_state(rule="fp16_fallback", state="firing")
    assert metrics.get("moescope_policy_rule_state", rule="fp16_fallback", state="firing") == 1.0
    assert metrics.get("moescope_policy_rule_state", rule="fp16_fallback", state="ok") == 0.0
    with pytest.raises(ValueError):
        metrics.set_policy_state(rule="x", state="bogus")


def test_port_in_use_is_a_usage_error() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        server = m.MetricsServer(m.Metrics(), port=holder.getsockname()[1])
        with pytest.raises(errors.UsageError, match="cannot serve /metrics"):
            server.start()
    finally:
        holder.close()


def test_default_bind_is_loopback() -> None:
    assert m.DEFAULT_METRICS_ADDR == "127.0.0.1"
    metrics = m.Metrics()
    server = m.MetricsServer(metrics, port=0)
    port = server.start()
    try:
        assert server._server is not None
        assert server._server.server_address[0] == "127.0.0.1"
        assert "moescope_requests" in scrape(port)
    finally:
        server.stop()


def test_step_health_gauges() -> None:
    metrics = m.Metrics()
    layers = [
        rh.layer_health(rh.LayerRouting.from_marks(layer=i, num_experts=4, tokens=t, router_entropy_bits=h))
        for i, (t, h) in enumerate([({0: 4, 1: 4}, 1.0), ({0: 8}, 0.5)])
    ]
    step = rh.step_health(layers)
    metrics.set_step_health(step)
    assert metrics.get("moescope_step_expert_load_gini") == pytest.approx((8 * 0.5 + 8 * 0.75) / 16)
    assert metrics.get("moescope_step_expert_load_gini_max") == pytest.approx(0.75)
    assert metrics.get("moescope_step_router_entropy_normalized") == pytest.approx((1.0 + 0.5) / 2 / 2)


def test_private_registry_not_global() -> None:
    from prometheus_client import REGISTRY, generate_latest

    m.Metrics().inc("moescope_requests", 1.0)
    assert b"moescope_requests" not in generate_latest(REGISTRY)



def test_thread_cpu_is_counted_by_thread_name_and_a_thread_that_exits_takes_nothing_back(
        served: tuple[m.Metrics, int]) -> None:
    """moescope_agent_thread_cpu_seconds, read from /proc at each scrape: a named thread's time under
    its name (the main thread as main), and what it used stays counted once it has gone."""
    _, port = served

    def threads() -> dict[str, float]:
        return {s.labels["thread"]: s.value for s in scrape(port)["moescope_agent_thread_cpu_seconds"].samples
                if s.name.endswith("_total")}

    def burner() -> None:
        name_thread("ms-test-burn")
        burn_thread_cpu(60_000_000)

    t = threading.Thread(target=burner)
    t.start()
    t.join(60)
    assert not t.is_alive()
    burn_thread_cpu(10_000_000)  # the main thread's own, since the scrape server started
    first = threads()
    # (the burner has exited before the first scrape: its time was never read while it ran)
    assert "ms-test-burn" not in first and first["main"] > 0, first

    seen: dict[str, float] = {}

    def burner_alive(started: threading.Event, go: threading.Event) -> None:
        name_thread("ms-test-burn")
        burn_thread_cpu(60_000_000)
        started.set()
        go.wait(60)

    started, go = threading.Event(), threading.Event()
    t = threading.Thread(target=burner_alive, args=(started, go))
    t.start()
    try:
        assert started.wait(60)
        seen = threads()
        assert seen["ms-test-burn"] >= 0.06 and seen["main"] >= first["main"], seen
    finally:
        go.set()
        t.join(60)
    after = threads()  # the thread is gone: its series keeps what it had
    assert after["ms-test-burn"] == seen["ms-test-burn"] and after["main"] >= seen["main"], (seen, after)


def test_work_cpu_parts_follow_their_owners_totals(served: tuple[m.Metrics, int]) -> None:
    metrics, port = served

    def work() -> dict[tuple[str, str], float]:
        return {(s.labels["thread"], s.labels["part"]): s.value
                for s in scrape(port)["moescope_agent_work_cpu_seconds"].samples if s.name.endswith("_total")}

    metrics.set_work_cpu("main", {"nvtx": 2_000_000_000, "requests": 500_000_000})
    metrics.set_work_cpu("policy", {"signals": 250_000_000})
    assert work() == {("main", "nvtx"): 2.0, ("main", "requests"): 0.5, ("policy", "signals"): 0.25}
    metrics.set_work_cpu("main", {"nvtx": 3_000_000_000, "requests": 500_000_000, "pacing": 1_000_000})
    assert work() == {("main", "nvtx"): 3.0, ("main", "requests"): 0.5, ("main", "pacing"): 0.001,
                      ("policy", "signals"): 0.25}
