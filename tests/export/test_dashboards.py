"""dashboards/: valid JSON, unique panel ids, every PromQL metric name is one agent/metrics.py exports,
and the compose/provisioning files parse and point at each other."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import DASH, all_panels, load_dashboards, promql_metric_names

from moescope.agent import metrics as m


def test_promql_name_parser() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(foo_bucket{a="b,c}"}[$__rate_interval])))'
    ) == {"foo_bucket"}
    assert promql_metric_names("0.586 * log2(moescope_experts)") == {"moescope_experts"}
    assert promql_metric_names("max by (rule) (x{state=\"a\"}) + 2 * max by (rule) (y)") == {"x", "y"}
    assert promql_metric_names("a / on(device) group_left(link) b offset 5m") == {"a", "b"}
    assert promql_metric_names("-rate(z_total[1m])") == {"z_total"}


def test_dashboards_are_valid_with_unique_ids() -> None:
    uids = set()
    for dashboard in load_dashboards():
        assert dashboard["uid"] not in uids
        uids.add(dashboard["uid"])
        ids = [p["id"] for p in all_panels(dashboard)]
        assert len(ids) == len(set(ids)), dashboard["title"]
        for panel in all_panels(dashboard):
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
            if panel["type"] != "row":
                assert panel["targets"], panel["title"]
                refs = [t["refId"] for t in panel["targets"]]
                assert len(refs) == len(set(refs))


def test_every_queried_metric_is_exported() -> None:
    exported = m.exported_sample_names()
    queried: set[str] = set()
    for dashboard in load_dashboards():
        for panel in all_panels(dashboard):
            for target in panel.get("targets", []):
                if target.get("datasource", {}).get("type") == "prometheus":
                    names = promql_metric_names(target["expr"])
                    assert names, target["expr"]
                    unknown = names - exported
                    assert not unknown, f"{panel['title']}: {sorted(unknown)} not exported by agent/metrics.py"
                    queried |= names
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                inner = re.search(r"label_values\((\w+)", variable["definition"])
                assert inner and inner.group(1) in exported
    # The dashboards cover each area the issue names.
    for needed in ("moescope_request_duration_seconds_bucket", "moescope_router_entropy_normalized",
                   "moescope_expert_load_gini", "moescope_expert_tokens_total", "moescope_device_memory_used_bytes",
                   "moescope_nvlink_transmit_bytes_total", "moescope_policy_actions_total",
                   "moescope_agent_cpu_seconds_total", "moescope_agent_events_dropped_total",
                   "moescope_export_spans_dropped_total",
                   # the LLM-serving view (issue 17): where the time goes, TTFT, TPOT, tokens
                   "moescope_request_phase_seconds_bucket", "moescope_request_phase_seconds_sum",
                   "gen_ai_server_time_to_first_token_seconds_bucket",
                   "gen_ai_server_time_per_output_token_seconds_bucket",
                   "gen_ai_server_request_duration_seconds_bucket", "moescope_request_tokens_total"):
        assert needed in queried, needed


def test_healthy_bands_match_design() -> None:
    serving = next(d for d in load_dashboards() if d["uid"] == "moescope-serving")
    panels = {p["title"]: p for p in all_panels(serving)}
    entropy = panels["Router entropy / log2(E)"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["value"], s["color"]) for s in entropy] == [
        (None, "red"), (pytest.approx(7.5 / 14, abs=1e-3), "yellow"), (pytest.approx(8.2 / 14, abs=1e-3), "green"),
        (pytest.approx(8.7 / 14, abs=1e-3), "blue")]
    gini = panels["Expert-load Gini per layer (latest step)"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["value"], s["color"]) for s in gini] == [
        (None, "blue"), (0.08, "green"), (0.12, "yellow"), (0.15, "red")
    ]
    assert panels["Tokens per expert (heatmap)"]["type"] == "heatmap"


def test_generated_dashboards_are_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("dash_generate", DASH / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    for path, text in module.rendered_files().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run python dashboards/generate.py"


def load_yaml_json(path: Path) -> dict[str, Any]:
    """These YAML files are written as JSON (plus full-line # comments) so the stdlib can check them."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
    return json.loads("\n".join(lines))


def test_compose_and_provisioning_fit_together() -> None:
    compose = load_yaml_json(DASH / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"jaeger", "prometheus", "grafana"}
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for service in services.values():
        assert ":" in service["image"] and not service["image"].endswith(":latest")  # pinned
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DASH / source).exists(), volume
    prom = load_yaml_json(DASH / "prometheus" / "prometheus.yml")
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"127.0.0.1:{m.DEFAULT_METRICS_PORT}"]
    sources = load_yaml_json(DASH / "grafana" / "provisioning" / "datasources" / "moescope.yml")["datasources"]
    uids = {s["uid"]: s["type"] for s in sources}
    assert uids == {"prometheus": "prometheus", "jaeger": "jaeger"}
    for dashboard in load_dashboards():
        for panel in all_panels(dashboard):
            for ds in [panel.get("datasource")] + [t.get("datasource") for t in panel.get("targets", [])]:
                if ds:
                    assert uids.get(ds["uid"]) == ds["type"], panel["title"]
    providers = load_yaml_json(DASH / "grafana" / "provisioning" / "dashboards" / "moescope.yml")["providers"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert providers[0]["options"]["path"] in mounted
    assert (DASH / mounted[providers[0]["options"]["path"]]).resolve() == (DASH / "grafana" / "dashboards").resolve()
