"""Generate the Grafana dashboards from one compact description (stdlib only).

    python dashboards/generate.py            # rewrite grafana/dashboards/*.json
    python dashboards/generate.py --check    # exit 1 if the committed JSON is out of date

Panels are declared below as data; the JSON Grafana wants (ids, grid positions, datasources,
thresholds) is derived, so ids are unique and every query is in one place for the test that checks
each PromQL metric name against agent/metrics.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "grafana" / "dashboards"
PROM = {"type": "prometheus", "uid": "prometheus"}
JAEGER = {"type": "jaeger", "uid": "jaeger"}
RATE = "$__rate_interval"

# Healthy bands (DESIGN.md): router entropy 8.2-8.7 bits at E=16384 -> /14 bits; collapse below 7.5 bits.
ENTROPY_COLLAPSE = 0.536
ENTROPY_BAND = (0.586, 0.621)
GINI_BAND = (0.08, 0.12)
GINI_MONOPOLY = 0.15


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    steps: tuple[tuple[float | None, str], ...] = ()  # thresholds: (value, color); first value None
    band: bool = False  # draw thresholds as coloured areas (healthy bands)
    minmax: tuple[float | None, float | None] = (None, None)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[dict[str, Any], ...] = ()


LAYER_VAR = {
    "name": "layer", "label": "layer", "type": "query", "datasource": PROM,
    "query": {"query": "label_values(moescope_expert_load_gini, layer)", "refId": "layer"},
    "definition": "label_values(moescope_expert_load_gini, layer)",
    "multi": True, "includeAll": True, "refresh": 2, "sort": 3,
    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
}
SERVICE_VAR = {
    "name": "service", "label": "traced service", "type": "textbox", "query": "moe-serving",
    "current": {"text": "moe-serving", "value": "moe-serving"},
}

ENTROPY_STEPS = ((None, "red"), (ENTROPY_COLLAPSE, "yellow"), (ENTROPY_BAND[0], "green"), (ENTROPY_BAND[1], "blue"))
GINI_STEPS = ((None, "blue"), (GINI_BAND[0], "green"), (GINI_BAND[1], "yellow"), (GINI_MONOPOLY, "red"))


def _latency_quantile(q: float, metric: str) -> Query:
    return Query(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))", f"p{round(q * 100)}")


# The seed's breakdown (issue 17): the five phases add up to each model request's kernel duration;
# expert_load and routing are parts of prefill + decode.
PHASE_METRIC = "moescope_request_phase_seconds"
SUM_PHASES = 'phase=~"receive|queue|prefill|decode|write"'


def _phase_quantile(q: float, window: str, *, instant: bool = False) -> Query:
    return Query(f"histogram_quantile({q}, sum by (le, phase) (rate({PHASE_METRIC}_bucket[{window}])))",
                 "{{phase}}" if not instant else f"p{round(q * 100)}", instant=instant)


PHASE_SHARE = Query(
    f"sum by (phase) (increase({PHASE_METRIC}_sum[$__range])) / ignoring(phase) group_left "
    f"sum(increase({PHASE_METRIC}_sum{{{SUM_PHASES}}}[$__range]))", "share", instant=True)


def _field_override(name: str, unit: str) -> dict[str, Any]:
    return {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}


PHASE_TABLE_EXTRA: dict[str, Any] = {
    "transformations": [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {
            "excludeByName": {"Time": True},
            "indexByName": {"phase": 0, "Value #A": 1, "Value #B": 2, "Value #C": 3},
            "renameByName": {"Value #A": "p50", "Value #B": "p99", "Value #C": "share of total"},
        }},
    ],
    "overrides": [_field_override("p50", "s"), _field_override("p99", "s"),
                  _field_override("share of total", "percentunit")],
}


SERVING = Dashboard(
    uid="moescope-serving",
    title="moescope — MoE serving",
    description=(
        "Requests (kernel-timed), MoE routing health, experts, devices and policy actions from the moescope agent."
    ),
    variables=(LAYER_VAR, SERVICE_VAR),
    rows=(
        Row("Requests", (
            Panel("Request rate", (Query(f"sum(rate(moescope_requests_total[{RATE}]))", "requests/s"),), unit="reqps",
                  width=6),
            Panel("Request latency (kernel: first byte in → last byte out)",
                  tuple(_latency_quantile(q, "moescope_request_duration_seconds") for q in (0.5, 0.9, 0.99)),
                  unit="s", width=10, steps=((None, "green"), (0.8, "yellow"), (0.87, "red")),
                  description="SLO rule slo_latency fires above 0.87 s p99 for 10 s (DESIGN.md)."),
            Panel("Queue wait p99", (_latency_quantile(0.99, "moescope_request_queue_wait_seconds"),), unit="s",
                  width=8),
            Panel("Bytes in / out", (
                Query(f"sum(rate(moescope_request_received_bytes_total[{RATE}]))", "in"),
                Query(f"sum(rate(moescope_response_sent_bytes_total[{RATE}]))", "out"),
            ), unit="Bps", width=8),
            Panel("Step latency (expert compute)",
                  tuple(_latency_quantile(q, "moescope_step_duration_seconds") for q in (0.5, 0.99)),
                  unit="s", width=8, steps=((None, "green"), (0.3, "yellow"), (0.43, "red")),
                  description="fp16_fallback fires when p99 > 430 ms for 3 evaluations."),
            Panel("Steps and tokens", (
                Query(f"sum(rate(moescope_steps_total[{RATE}]))", "steps/s"),
                Query(f"sum(rate(moescope_step_tokens_total[{RATE}]))", "tokens/s"),
            ), width=8),
            Panel("Recent traces", (Query("$service"),), kind="table", width=16, height=8,
                  description="Jaeger search for the traced service (set the 'traced service' variable).",
                  extra={"jaeger": True}),
            Panel("Steps per rank (producer pid)", (
                Query(f"sum by (pid) (rate(moescope_rank_steps_total[{RATE}]))", "{{pid}}"),
            ), width=8, height=8,
                  description="One series per producer process (expert-parallel rank), at most 64 pids; a rank "
                              "stepping slower than the others holds every all-to-all back."),
        )),
        Row("Where the time goes (model requests)", (
            Panel("Where the time goes: p50 / p99 / share of total over the range",
                  (_phase_quantile(0.5, "$__range", instant=True), _phase_quantile(0.99, "$__range", instant=True),
                   PHASE_SHARE),
                  kind="table", unit="s", width=10, height=9,
                  description="Per phase of the model requests (kernel first byte in → last byte out, cut at the "
                              "last request byte read, the first and last moe.step that carried the request): "
                              "receive + queue + prefill + decode + write = the request; expert_load and "
                              "routing are parts of prefill + decode. Quantiles from the histogram buckets "
                              "(interpolated); `agent report` gives the exact nearest-rank table.",
                  extra=PHASE_TABLE_EXTRA),
            Panel("Phase p99", (_phase_quantile(0.99, RATE),), unit="s", width=14, height=9,
                  description="fp16_fallback fires when inference (prefill + decode) p99 > 430 ms for 3 evaluations; "
                              "expert_load_slow when expert_load p99 > 200 ms (DESIGN.md, docs/policy.md)."),
            Panel("Time to first token (TTFT)",
                  tuple(_latency_quantile(q, "gen_ai_server_time_to_first_token_seconds") for q in (0.5, 0.99)),
                  unit="s", width=6,
                  description="gen_ai.server.time_to_first_token: the first token on the wire when streamed, "
                              "else the end of the prefill step."),
            Panel("Time per output token (TPOT)",
                  tuple(_latency_quantile(q, "gen_ai_server_time_per_output_token_seconds") for q in (0.5, 0.99)),
                  unit="s", width=6, description="gen_ai.server.time_per_output_token: after the first token."),
            Panel("Model request duration",
                  tuple(_latency_quantile(q, "gen_ai_server_request_duration_seconds") for q in (0.5, 0.99)),
                  unit="s", width=6, steps=((None, "green"), (0.8, "yellow"), (0.87, "red")),
                  description="gen_ai.server.request.duration: the kernel-measured duration of model requests."),
            Panel("Tokens per second", (
                Query(f"sum by (direction) (rate(moescope_request_tokens_total[{RATE}]))", "{{direction}}"),
            ), width=6, description="input (prompt) and output (generated) tokens of the model requests"),
        )),
        Row("Routing health", (
            Panel("Router entropy / log2(E)",
                  (Query("moescope_router_entropy_normalized{layer=~\"$layer\"}", "layer {{layer}}"),
                   Query("moescope_step_router_entropy_normalized", "step (token-weighted)")),
                  unit="percentunit", steps=ENTROPY_STEPS, band=True, minmax=(0.4, 0.8),
                  description="Healthy band 0.586–0.621 (8.2–8.7 bits at E=16384); router_collapse fires below "
                              "0.536 for 10 s."),
            Panel("Router entropy (bits) with the healthy band for this E",
                  (Query("moescope_router_entropy_bits{layer=~\"$layer\"}", "layer {{layer}}"),
                   Query(f"{ENTROPY_BAND[0]} * log2(moescope_experts)", "band low"),
                   Query(f"{ENTROPY_BAND[1]} * log2(moescope_experts)", "band high")),
                  unit="none", description="Band = 0.586·log2 E … 0.621·log2 E bits."),
            Panel("Expert-load Gini per layer (latest step)",
                  (Query("moescope_expert_load_gini{layer=~\"$layer\"}", "layer {{layer}}"),
                   Query("moescope_step_expert_load_gini_max", "worst layer")),
                  steps=GINI_STEPS, band=True, minmax=(0, 0.4),
                  description="Healthy band 0.08–0.12; expert_monopoly fires above 0.15 over 10 s."),
            Panel("Expert-load Gini per layer (policy window)",
                  (Query("moescope_expert_load_gini_window{layer=~\"$layer\"}", "layer {{layer}}"),),
                  steps=GINI_STEPS, band=True, minmax=(0, 0.4)),
            Panel("Busiest expert's share of tokens", (
                Query("moescope_expert_load_max_share{layer=~\"$layer\"}", "layer {{layer}}"),), unit="percentunit",
                width=8),
            Panel("Expert-load entropy / log2(E)", (
                Query("moescope_expert_load_entropy_normalized{layer=~\"$layer\"}", "layer {{layer}}"),),
                unit="percentunit", width=8),
            Panel("Dropped tokens (over capacity)", (
                Query(f"sum by (layer) (rate(moescope_expert_dropped_tokens_total{{layer=~\"$layer\"}}[{RATE}]))",
                      "layer {{layer}}"),), width=8),
        )),
        Row("Experts", (
            Panel("Tokens per expert (heatmap)", (
                Query(f"sum by (expert) (rate(moescope_expert_tokens_total{{layer=~\"$layer\"}}[{RATE}]))",
                      "{{expert}}"),), kind="heatmap", width=24, height=10,
                description="Experts past the per-layer label bound are summed into expert=\"other\"."),
            Panel("Expert weight loads", (
                _latency_quantile(0.99, "moescope_expert_load_duration_seconds"),
                Query(f"sum(rate(moescope_expert_load_bytes_total[{RATE}]))", "bytes/s"),
            ), unit="s", width=12, steps=((None, "green"), (0.1, "yellow"), (0.2, "red")),
                description="expert_load_slow fires when p99 > 200 ms for 3 evaluations.",
                extra={"right_axis_bytes": "bytes/s"}),
            Panel("Hottest experts (tokens/s)", (
                Query(f"topk(10, sum by (layer, expert) (rate(moescope_expert_tokens_total[{RATE}])))",
                      "L{{layer}} E{{expert}}", instant=True),), kind="bargauge", width=12),
        )),
        Row("Devices", (
            Panel("Device memory used / total", (
                Query("moescope_device_memory_used_bytes / moescope_device_memory_total_bytes", "device {{device}}"),),
                unit="percentunit", steps=((None, "green"), (0.90, "yellow"), (0.92, "orange"), (0.95, "red")),
                band=True, minmax=(0, 1),
                description="memory_alert above 92 % for 3 s; expert_offload above 95 % for 5 s."),
            Panel("Device memory used", (
                Query("moescope_device_memory_used_bytes", "used {{device}}"),
                Query("moescope_device_memory_total_bytes", "total {{device}}"),
                Query("moescope_target_memory_bytes", "target on {{device}}")), unit="bytes"),
            Panel("NVLink throughput per link", (
                Query(f"rate(moescope_nvlink_transmit_bytes_total[{RATE}])", "tx gpu{{device}} link{{link}}"),
                Query(f"-rate(moescope_nvlink_receive_bytes_total[{RATE}])", "rx gpu{{device}} link{{link}}"),
            ), unit="Bps", description="Transmit above the axis, receive below."),
            Panel("PCIe throughput", (
                Query("moescope_pcie_transmit_bytes_per_second", "tx gpu{{device}}"),
                Query("-moescope_pcie_receive_bytes_per_second", "rx gpu{{device}}"),
            ), unit="Bps"),
        )),
        Row("Policy", (
            Panel("Policy actions", (
                Query(f"sum by (rule, action, outcome) (increase(moescope_policy_actions_total[{RATE}]))",
                      "{{rule}} {{action}} {{outcome}}"),), kind="timeseries", unit="short",
                extra={"bars": True}),
            Panel("Rule state", (
                Query("max by (rule) (moescope_policy_rule_state{state=\"pending\"}) "
                      "+ 2 * max by (rule) (moescope_policy_rule_state{state=\"firing\"}) "
                      "+ 3 * max by (rule) (moescope_policy_rule_state{state=\"cooldown\"})", "{{rule}}"),),
                kind="state-timeline",
                description="0 ok, 1 pending, 2 firing, 3 cooldown.",
                extra={"mappings": [
                    {"type": "value", "options": {"0": {"text": "ok", "color": "green"},
                                                  "1": {"text": "pending", "color": "yellow"},
                                                  "2": {"text": "firing", "color": "red"},
                                                  "3": {"text": "cooldown", "color": "blue"}}}]}),
            Panel("Rule signals", (Query("moescope_policy_rule_signal", "{{rule}}"),), width=24),
        )),
    ),
)

AGENT = Dashboard(
    uid="moescope-agent",
    title="moescope — agent self-cost",
    description="What the moescope agent costs and whether it loses data: CPU, memory, events and drops per source.",
    rows=(
        Row("Cost", (
            Panel("Agent CPU (cores)", (Query(f"rate(moescope_agent_cpu_seconds_total[{RATE}])", "cpu"),),
                  unit="percentunit", steps=((None, "green"), (0.05, "red")),
                  description="Performance bar: ≤ 5 % of a core at reference load."),
            Panel("Agent resident memory", (Query("moescope_agent_resident_memory_bytes", "rss"),), unit="bytes",
                  steps=((None, "green"), (100e6, "red")), description="Performance bar: ≤ 100 MB."),
            Panel("Agent CPU by thread (cores)", (
                Query(f"sum by (thread) (rate(moescope_agent_thread_cpu_seconds_total[{RATE}]))", "{{thread}}"),),
                  unit="percentunit", description="main: the main loop; ms-policy: the policy's 200 ms wake-ups; "
                  "ms-export-*: the trace export."),
            Panel("Agent CPU by part (cores)", (
                Query(f"sum by (thread, part) (rate(moescope_agent_work_cpu_seconds_total[{RATE}]))",
                      "{{thread}} {{part}}"),),
                  unit="percentunit", description="The main loop by source (its poll and the sinks it feeds) and "
                  "round hook (requests: the request join and its traces); the policy thread by part of a "
                  "wake-up (wake, signals, evaluate, peeks)."),
        )),
        Row("Events", (
            Panel("Events/s per source", (
                Query(f"sum by (source) (rate(moescope_agent_events_total[{RATE}]))", "{{source}}"),)),
            Panel("Dropped events/s", (
                Query(f"sum by (source, reason) (rate(moescope_agent_events_dropped_total[{RATE}]))",
                      "{{source}} {{reason}}"),), steps=((None, "green"), (1e-9, "red"))),
            Panel("Collector duration", (Query("moescope_agent_collector_duration_seconds", "{{collector}}"),),
                  unit="s", width=8),
            Panel("Collector success", (Query("moescope_agent_collector_success", "{{collector}}"),),
                  kind="state-timeline", width=8),
            Panel("Metric updates dropped at series bounds", (
                Query(f"sum by (metric) (rate(moescope_agent_metric_series_dropped_total[{RATE}]))", "{{metric}}"),),
                width=8),
        )),
        Row("Trace export", (
            Panel("Spans exported / failed", (
                Query(f"sum by (outcome) (rate(moescope_export_spans_total[{RATE}]))", "{{outcome}}"),)),
            Panel("Spans dropped before export", (
                Query(f"sum by (reason) (rate(moescope_export_spans_dropped_total[{RATE}]))", "{{reason}}"),
                Query("moescope_export_queue_spans", "queued")), steps=((None, "green"), (1e-9, "red"))),
        )),
    ),
)

DASHBOARDS = (SERVING, AGENT)


def _target(query: Query, ref: int, panel: Panel) -> dict[str, Any]:
    if panel.extra.get("jaeger"):
        return {"datasource": JAEGER, "queryType": "search", "service": query.expr, "limit": 20,
                "refId": chr(ord("A") + ref)}
    target: dict[str, Any] = {"datasource": PROM, "expr": query.expr, "legendFormat": query.legend or "__auto",
                              "refId": chr(ord("A") + ref), "range": not query.instant, "instant": query.instant}
    if panel.kind == "heatmap":
        target["format"] = "time_series"
    if panel.kind == "table":
        target["format"] = "table"
    return target


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.minmax[0] is not None:
        defaults["min"] = panel.minmax[0]
    if panel.minmax[1] is not None:
        defaults["max"] = panel.minmax[1]
    steps = panel.steps or ((None, "green"),)
    defaults["thresholds"] = {"mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps]}
    if panel.extra.get("mappings"):
        defaults["mappings"] = panel.extra["mappings"]
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "bars" if panel.extra.get("bars") else "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "thresholdsStyle": {"mode": "area" if panel.band else ("line" if panel.steps else "off")},
        }
    out: dict[str, Any] = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": JAEGER if panel.extra.get("jaeger") else PROM,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
        "targets": [_target(q, i, panel) for i, q in enumerate(panel.queries)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }
    if panel.extra.get("transformations"):
        out["transformations"] = panel.extra["transformations"]
    out["fieldConfig"]["overrides"].extend(panel.extra.get("overrides", []))
    if panel.extra.get("right_axis_bytes"):
        out["fieldConfig"]["overrides"].append({
            "matcher": {"id": "byName", "options": panel.extra["right_axis_bytes"]},
            "properties": [{"id": "unit", "value": "Bps"}, {"id": "custom.axisPlacement", "value": "right"}],
        })
    if panel.kind == "heatmap":
        out["options"] = {"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges"},
                          "yAxis": {"axisPlacement": "left"}, "rowsFrame": {"layout": "auto"},
                          "tooltip": {"mode": "single", "yHistogram": False}, "legend": {"show": True}}
    if panel.kind == "bargauge":
        out["options"] = {"orientation": "horizontal", "displayMode": "gradient",
                          "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return out


def render(dashboard: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid = 1
    y = 0
    for row in dashboard.rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid += 1
        y += 1
        x = 0
        row_height = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, row_height = 0, y + row_height, 0
            panels.append(_panel_json(panel, pid, x, y))
            pid += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["moescope", "moe"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": list(dashboard.variables)},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def rendered_files() -> dict[Path, str]:
    return {OUT_DIR / f"{d.uid}.json": json.dumps(render(d), indent=2, ensure_ascii=False) + "\n" for d in DASHBOARDS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed dashboard is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered_files().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print("out of date: " + ", ".join(str(p) for p in stale) + " (run python dashboards/generate.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
