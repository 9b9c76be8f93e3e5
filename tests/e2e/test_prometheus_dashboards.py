"""A real Prometheus scrapes the agent's /metrics during a loaded run; the docs and dashboards are held to it.

One run (module fixture) of: `agent start --metrics-port P --nvml-library FAKE -- python -m
moescope.examples.moe_runtime <small model, fewer resident experts than L*E>` with the policy on;
the fake NVML (tests/e2e/fake_nvml_live.c: 2 GPUs, 4 NVLink links each, memory at 93 %, moving
counters) so the GPU-only families have samples and the default memory_alert rule acts; the load
generator running the whole time; Debian's `prometheus` (scripts/setup.sh installs it; its own
service is never used) started here with its own config, a 1 s scrape interval, storage in a temp
dir and a free port on 127.0.0.1. Once Prometheus has scraped the loaded agent several times:

* every metric family named by docs/traces-and-metrics.md, docs/telemetry.md, README.md, the shipped
  dashboards and agent/metrics.py's METRICS has samples in Prometheus (`/api/v1/series`);
* every PromQL query of the shipped dashboards (each panel target, each query variable), with the
  Grafana variables substituted as Grafana would, returns data through `/api/v1/query_range`
  (range targets) or `/api/v1/query` (instant targets).

Each test fails with the full list of what has no data. Waits are bounded; nothing asserts on speed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import PromTarget, load_dashboards, prometheus_targets, promql_metric_names, query_variables

from moescope.agent import metrics as m

from .harness import (
    PYTHON,
    REPO,
    WAIT_S,
    Proc,
    agent_argv,
    free_port,
    runtime_argv,
    wait_nvtx_attached,
    wait_runtime_ready,
)

SCRAPE_INTERVAL_S = 1
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 x scrape interval); with
# $__interval at the scrape interval (a 15 min panel ~1000 px wide) that is 4 x scrape interval.
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"
GRAFANA_INTERVAL = f"{SCRAPE_INTERVAL_S}s"
MIN_LOADED_SCRAPES = 6  # scrapes of the loaded agent before anything is checked
# how long a family or query without data is retried (load still running); generous for a loaded
# 2-core machine, and only spent when something is still missing
DATA_WAIT_S = 60.0
# Fewer resident experts than L*E (2*8): the others are loaded on demand, so moe.expert.load ranges
# (and the expert-load panels) exist.
RUNTIME_EXTRA = ["--resident-capacity-experts", "6"]
LOADGEN_DURATION_S = 300  # longer than any run: the fixture stops it
DOCS = (REPO / "docs" / "traces-and-metrics.md", REPO / "docs" / "telemetry.md", REPO / "README.md")
FAKE_NVML_SOURCE = Path(__file__).resolve().parent / "fake_nvml_live.c"


# ---------------------------------------------------------------------------- what is named where
def family_series_name(name: str) -> str:
    """The series to look for: a histogram's base name (as docs write it) has only _bucket/_sum/_count."""
    spec = m.SPECS.get(name)
    return f"{name}_count" if spec is not None and spec.kind == "histogram" else name


def named_families() -> dict[str, set[str]]:
    """Series name -> where it is named (a doc file, a dashboard, agent/metrics.py)."""
    named: dict[str, set[str]] = {}
    for doc in DOCS:
        for name in re.findall(r"\bmoescope_[a-z0-9_]*[a-z0-9]", doc.read_text(encoding="utf-8")):
            named.setdefault(family_series_name(name), set()).add(str(doc.relative_to(REPO)))
    for dashboard in load_dashboards():
        for target in prometheus_targets(dashboard):
            for name in promql_metric_names(target.expr):
                named.setdefault(name, set()).add(f"dashboard {dashboard['title']}")
        for variable in query_variables(dashboard):
            selector, _ = label_values_query(variable["definition"])
            for name in promql_metric_names(selector):
                named.setdefault(name, set()).add(f"dashboard {dashboard['title']}")
    for spec in m.METRICS:
        named.setdefault(family_series_name(spec.sample_name()), set()).add("agent/metrics.py")
    return named


def label_values_query(definition: str) -> tuple[str, str]:
    """(selector, label) of a Grafana ``label_values(selector, label)`` variable query."""
    found = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", definition)
    assert found, f"query variable not of the form label_values(selector, label): {definition!r}"
    return found.group(1), found.group(2)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable interpolation ($name, ${name}, [[name]]) for the variables the dashboards use."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            raise AssertionError(
                f"dashboard variable ${name} has no test value: add one to the substitutions ({expr!r})"
            )
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", one, expr)


# ---------------------------------------------------------------------------- processes
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus not found: run scripts/setup.sh (it installs Debian's prometheus package)")
    return found


def build_live_nvml(out_dir: Path) -> Path:
    """Compile fake_nvml_live.c (the telemetry fake, configured at load) as out_dir/libnvidia-ml.so.1."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed to build the fake NVML library (apt-get install gcc)")
    target = out_dir / "libnvidia-ml.so.1"
    done = subprocess.run(
        [gcc, "-Wall", "-Wextra", "-Werror", "-O1", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1",
         "-o", str(target), str(FAKE_NVML_SOURCE)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"building the live fake NVML failed:\n{done.stderr}")
    return target


class PrometheusApi:
    """The HTTP API of the Prometheus this test started."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def _get(self, path: str, params: list[tuple[str, str]]) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=WAIT_S) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # a bad query answers 400 with the reason as JSON
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=5) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def instant(self, expr: str) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query", [("query", expr), ("time", f"{time.time():.3f}")])
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def range(self, expr: str, *, start_s: float, end_s: float) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query_range", [
            ("query", expr), ("start", f"{start_s:.3f}"), ("end", f"{end_s:.3f}"), ("step", GRAFANA_INTERVAL)])
        return list(data["result"])

    def series_names(self, names: list[str], *, start_s: float) -> set[str]:
        params = [("match[]", f'{{__name__="{n}"}}') for n in names] + [("start", f"{start_s:.3f}")]
        return {s["__name__"] for s in self._get("/api/v1/series", params)}

    def label_values(self, label: str, selector: str, *, start_s: float) -> list[str]:
        return list(self._get(f"/api/v1/label/{label}/values", [("match[]", selector), ("start", f"{start_s:.3f}")]))

    def scrapes(self, job: str) -> int:
        result = self.instant(f'count_over_time(up{{job="{job}"}}[1h])')
        return int(float(result[0]["value"][1])) if result else 0


def _finite_points(series: list[dict[str, Any]]) -> int:
    points = [s["value"] for s in series if "value" in s] + [v for s in series for v in s.get("values", [])]
    return sum(1 for _, value in points if math.isfinite(float(value)))


# ---------------------------------------------------------------------------- the run
@dataclass
class PromRun:
    named: dict[str, set[str]]
    families_without_samples: list[str]
    queries: list[tuple[PromTarget, str]]  # (target, expression as sent)
    queries_without_data: list[str]
    variable_values: dict[str, list[str]]
    output: str
    problems: list[str] = field(default_factory=list)


def _prometheus_config(path: Path, metrics_port: int) -> None:
    # Prometheus reads YAML; JSON is YAML.
    path.write_text(json.dumps({
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                   "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [{"job_name": "moescope", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }))


def _wait(check: Callable[[], bool], what: str, proc: Proc, *, timeout_s: float = WAIT_S) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not within {timeout_s} s:\n{proc.text()}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def prom_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromRun]:
    tmp = tmp_path_factory.mktemp("prometheus")
    nvml = build_live_nvml(tmp)
    prometheus = prometheus_binary()
    metrics_port, prom_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # traces to files under tmp
    agent = Proc(agent_argv(state_dir=tmp, extra=[
        "--metrics-port", str(metrics_port), "--nvml-library", str(nvml),
        "--policy-audit", str(tmp / "audit.jsonl"), "--policy-state-dir", str(tmp),
        "--", *runtime_argv(), *RUNTIME_EXTRA,
    ]), env=env)
    prom: Proc | None = None
    loadgen: Proc | None = None
    try:
        _prometheus_config(tmp / "prometheus.yml", metrics_port)
        prom = Proc([prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"])
        api = PrometheusApi(prom_port)
        target_pid = int(agent.wait_for_line(r"^agent: tracing pid (\d+)", stream="err").group(1))
        port = wait_runtime_ready(agent)
        wait_nvtx_attached(target_pid)
        _wait(api.ready, "prometheus ready", prom)
        loadgen = Proc([PYTHON, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}",
                        "--concurrency", "4", "--max-tokens", "3", "--seed", "7",
                        "--duration-s", str(LOADGEN_DURATION_S)])
        load_start_s = time.time()
        _wait(lambda: bool(api.instant("moescope_requests_total > 0")), "a scraped request", agent)
        loaded_from = api.scrapes("moescope")
        _wait(lambda: api.scrapes("moescope") >= loaded_from + MIN_LOADED_SCRAPES,
              f"{MIN_LOADED_SCRAPES} scrapes of the loaded agent", prom)
        assert loadgen.popen.poll() is None, f"the load generator stopped early:\n{loadgen.text()}"

        named = named_families()
        deadline = time.monotonic() + DATA_WAIT_S  # one retry budget for families and queries together
        missing_families = sorted(named)
        while True:
            seen = api.series_names(missing_families, start_s=load_start_s)
            missing_families = [n for n in missing_families if n not in seen]
            if not missing_families or time.monotonic() > deadline:
                break
            time.sleep(SCRAPE_INTERVAL_S)

        # Query variables first: their values fill the panel queries (All = every value, as a regex).
        values = {"__rate_interval": RATE_INTERVAL, "__interval": GRAFANA_INTERVAL,
                  "__range": "5m", "__range_s": "300"}
        variable_values: dict[str, list[str]] = {}
        problems: list[str] = []
        queries: list[tuple[PromTarget, str]] = []
        for dashboard in load_dashboards():
            for variable in query_variables(dashboard):
                selector, label = label_values_query(variable["definition"])
                got = api.label_values(label, selector, start_s=load_start_s)
                variable_values[variable["name"]] = got
                if not got:
                    problems.append(f"query variable ${variable['name']} ({variable['definition']}) has no values")
                # Grafana's All for a multi-value variable in =~: (v1|v2|...), each regex-escaped
                # and then escaped again for the PromQL string literal.
                alternatives = "|".join(re.escape(v).replace("\\", "\\\\") for v in got)
                values[variable["name"]] = f"({alternatives})" if got else "$^"
            for target in prometheus_targets(dashboard):
                queries.append((target, substitute(target.expr, values)))
        pending = list(queries)
        while True:
            now_s = time.time()
            still = []
            for target, expr in pending:
                result = (api.instant(expr) if target.instant
                          else api.range(expr, start_s=max(load_start_s, now_s - 60), end_s=now_s))
                if _finite_points(result) == 0:
                    still.append((target, expr))
            pending = still
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(SCRAPE_INTERVAL_S)
        yield PromRun(
            named=named, families_without_samples=missing_families,
            queries=queries,
            queries_without_data=[f"{t.where()}: {e}" for t, e in pending],
            variable_values=variable_values, output=agent.text(), problems=problems,
        )
    finally:
        for proc in (loadgen, prom):
            if proc is not None:
                proc.stop(timeout_s=10)
        agent.stop()


def test_every_named_family_and_every_dashboard_query_has_data(bpf: None, prom_run: PromRun) -> None:
    # One test, so that one failing run (also under -x) lists everything without data.
    assert len(prom_run.named) >= len(m.METRICS) and prom_run.queries, "nothing to check: no names or no queries"
    report = list(prom_run.problems)
    if prom_run.families_without_samples:
        report.append(f"{len(prom_run.families_without_samples)} of {len(prom_run.named)} metric families have no "
                      "samples in Prometheus:")
        report += [f"  {name} (named in {', '.join(sorted(prom_run.named[name]))})"
                   for name in prom_run.families_without_samples]
    if prom_run.queries_without_data:
        report.append(f"{len(prom_run.queries_without_data)} of {len(prom_run.queries)} dashboard queries return no "
                      f"data (variables: {prom_run.variable_values}, $__rate_interval = {RATE_INTERVAL}):")
        report += [f"  {line}" for line in prom_run.queries_without_data]
    if report:
        report += ["agent output (last 30 lines):", *prom_run.output.splitlines()[-30:]]
    assert not report, "\n".join(report)


def test_grafana_variables_are_substituted_as_grafana_does() -> None:
    values = {"__rate_interval": "4s", "layer": "(0|1)"}
    assert substitute('rate(x{layer=~"$layer"}[$__rate_interval])', values) == 'rate(x{layer=~"(0|1)"}[4s])'
    assert substitute("y[${__rate_interval}] + z{l=~\"[[layer]]\"}", values) == 'y[4s] + z{l=~"(0|1)"}'
    with pytest.raises(AssertionError, match=r"\$job has no test value"):
        substitute('up{job="$job"}', values)
    query = "label_values(moescope_expert_load_gini, layer)"
    assert label_values_query(query) == ("moescope_expert_load_gini", "layer")
