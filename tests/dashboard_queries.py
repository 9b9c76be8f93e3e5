"""The shipped Grafana dashboards as data for tests: every panel, every PromQL target, every query
variable, and the metric names a PromQL expression uses (a small tokenizer, enough for our
dashboards). tests/export/test_dashboards.py checks them statically; tests/e2e runs them in a real
Prometheus."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASH = Path(__file__).resolve().parents[1] / "dashboards"

PROMQL_FUNCTIONS_AND_KEYWORDS = {
    "sum", "avg", "max", "min", "count", "topk", "bottomk", "quantile", "stddev", "stdvar", "group",
    "rate", "irate", "increase", "delta", "deriv", "histogram_quantile", "log2", "ln", "abs", "clamp_min",
    "clamp_max", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
    "unless", "label_values", "avg_over_time", "max_over_time", "min_over_time", "time", "vector", "scalar",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (a small tokenizer, enough for our dashboards)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([5m], [$__rate_interval])
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name in PROMQL_FUNCTIONS_AND_KEYWORDS:
            continue
        names.add(name)
    return names


def load_dashboards() -> list[dict[str, Any]]:
    files = sorted((DASH / "grafana" / "dashboards").glob("*.json"))
    assert len(files) >= 2
    return [json.loads(f.read_text(encoding="utf-8")) for f in files]


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


@dataclass(frozen=True)
class PromTarget:
    """One PromQL target of a dashboard panel."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool  # Grafana runs it as an instant query (else over the panel's time range)

    def where(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def prometheus_targets(dashboard: dict[str, Any]) -> list[PromTarget]:
    """Every Prometheus panel target of one dashboard (Jaeger targets left out)."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("type") == "prometheus":
                out.append(PromTarget(dashboard["title"], panel["title"], target["refId"], target["expr"],
                                      bool(target.get("instant"))))
    return out


def query_variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's template variables that Grafana fills from a Prometheus query."""
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
