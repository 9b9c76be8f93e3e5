"""Prometheus metrics: declared once in ``METRICS`` (a typed table) and generated from it.

Every family the agent exports is one ``MetricSpec`` row; ``Metrics`` builds the prometheus_client
objects from the table into its own ``CollectorRegistry`` (never the global one) and is the only way
to update them. ``MetricsServer`` serves ``/metrics`` on ``--metrics-port`` (default bind 127.0.0.1).

Cardinality is bounded twice:
* per-expert families (``layer``, ``expert`` labels) go through ``ExpertLabels``: at most
  ``max_layers`` layer values and ``max_experts_per_layer`` expert values per layer get their own
  series; while a layer has free slots, each recorded count (a flush's sums) admits its hottest
  experts not admitted yet (tokens descending, then expert ascending), and an admitted expert keeps
  its series for the agent's life (counters must stay monotonic).
  Every other expert is summed into ``expert="other"``, every other layer into ``layer="other"``,
  so no token is lost from the totals;
* every family has ``max_series``: a label set past it is not created, the update is dropped and
  counted in ``moescope_agent_metric_series_dropped_total{metric}``.
The label sets and their bounds are listed in docs/traces-and-metrics.md.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import resource
import selectors
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from moescope import __version__, errors, procfs
from moescope.agent.routing_health import CountVector, LayerHealth, LayerTable, StepHealth
from moescope.procfs import name_thread

log = logging.getLogger(__name__)

MetricKind = Literal["counter", "gauge", "histogram"]
# [layers, experts] counts as record_expert_matrix works on them (integers, or floats as given)
ExpertCounts = npt.NDArray[np.int64] | npt.NDArray[np.float64]
BoolMatrix = npt.NDArray[np.bool_]

DEFAULT_METRICS_PORT = 9464  # the port OpenTelemetry's Prometheus exporters conventionally use
DEFAULT_METRICS_ADDR = "127.0.0.1"
DEFAULT_MAX_LAYERS = 128
# Per-expert series per layer by default: the hottest few (DeepSeek-V3: 58 layers x 9 = 522 series
# per family, not 58 x 256 = 14,848); --metrics-experts raises it, up to every expert (opt-in).
DEFAULT_MAX_EXPERTS_PER_LAYER = 8
MAX_EXPERTS_PER_LAYER = 4096  # what --metrics-experts accepts (the largest E seen in the wild is 256)
OTHER = "other"

# Request latency: the policy thresholds (0.43 s fp16 fallback, 0.8/0.87 s SLO) are bucket bounds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.43, 0.5, 0.8, 0.87, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.43, 0.5, 1.0, 2.5)
LOAD_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
# Request phases (agent/request_phases.py) run from microseconds (receive) to seconds (decode); the
# policy's phase thresholds (0.2 s load, 0.43 s inference) are bounds, as for the request latency.
PHASE_BUCKETS_S = (0.0001, 0.0005, *LATENCY_BUCKETS_S)
# The GenAI semantic conventions' advisory bucket boundaries (ExplicitBucketBoundaries) for the
# server metrics, as in OpenTelemetry semantic conventions v1.41.0 docs/gen-ai/gen-ai-metrics.md.
GENAI_REQUEST_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                                    40.96, 81.92)
GENAI_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported family. ``name`` is the exposition base name (counters gain ``_total``)."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    buckets: tuple[float, ...] = ()
    max_series: int = 1  # bound on label sets; 1 for unlabelled families

    def sample_name(self) -> str:
        """The series name a query uses (``_total`` for counters, ``_bucket`` etc. for histograms)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


_L = DEFAULT_MAX_LAYERS
_X = (DEFAULT_MAX_LAYERS + 1) * (DEFAULT_MAX_EXPERTS_PER_LAYER + 1)  # Metrics() widens it for a larger bound
_DEV = 64  # GPUs per node, plus "host"
_LINKS = _DEV * 18  # NVLink links per GPU (18 on H100)
_RULES = 64
_SOURCES = 16
_REASONS = 8
_THREADS = 16  # the agent's threads by OS name (unnamed ones share the process's name)
_WORK_PARTS = 48  # the main loop's sources and hooks, the policy wake-up's parts
_MODELS = 16  # gen_ai_request_model values per operation: the runtimes' model names and "unknown"
# Producer processes (expert-parallel ranks) with per-pid step series: 8 ranks per node is the usual
# maximum, 64 leaves room for restarts (a restarted rank is a new pid; its old series stay, frozen).
MAX_RANK_SERIES = 64

METRICS: tuple[MetricSpec, ...] = (
    # --- requests (kernel-timed ingress) ---
    MetricSpec("moescope_request_duration_seconds", "histogram",
               "Request latency measured in the kernel: first request byte read to last response byte written "
               "(agent start: answered requests, from the probe's in-kernel histogram).",
               unit="seconds", buckets=LATENCY_BUCKETS_S),
    MetricSpec("moescope_request_queue_wait_seconds", "histogram",
               "Time from a request's first byte to the start of the first step that served it.",
               unit="seconds", buckets=LATENCY_BUCKETS_S),
    # --- LLM serving: where each joined request's time went (agent/request_phases.py) ---
    MetricSpec("gen_ai_server_request_duration_seconds", "histogram",
               "GenAI server request duration (gen_ai.server.request.duration): first request byte read to last "
               "response byte written, per answered request that model steps carried.",
               labels=("gen_ai_operation_name", "gen_ai_request_model"), unit="seconds",
               buckets=GENAI_REQUEST_DURATION_BUCKETS_S, max_series=_MODELS),
    MetricSpec("gen_ai_server_time_to_first_token_seconds", "histogram",
               "Time to first token (gen_ai.server.time_to_first_token): first request byte read to the first "
               "token on the wire when streamed, else to the end of the step that produced it.",
               labels=("gen_ai_operation_name", "gen_ai_request_model"), unit="seconds",
               buckets=GENAI_TTFT_BUCKETS_S, max_series=_MODELS),
    MetricSpec("gen_ai_server_time_per_output_token_seconds", "histogram",
               "Time per output token after the first (gen_ai.server.time_per_output_token), for two or more "
               "output tokens.",
               labels=("gen_ai_operation_name", "gen_ai_request_model"), unit="seconds",
               buckets=GENAI_TPOT_BUCKETS_S, max_series=_MODELS),
    MetricSpec("moescope_request_phase_seconds", "histogram",
               "A joined request's time per phase: receive, queue, prefill, decode, write (they sum to its "
               "kernel-measured duration), and expert_load, routing (parts of prefill + decode).",
               labels=("phase",), unit="seconds", buckets=PHASE_BUCKETS_S, max_series=7),
    MetricSpec("moescope_request_tokens", "counter",
               "Tokens of joined requests by direction: input as the runtime reports them (moe.step.requests), "
               "output as reported, else one per step.",
               labels=("direction",), max_series=2),
    MetricSpec("moescope_requests", "counter",
               "Requests completed, answered or not (under agent start: counted in the kernel, exact at any rate)."),
    MetricSpec("moescope_request_received_bytes", "counter", "Bytes read from client sockets (requests).",
               unit="bytes"),
    MetricSpec("moescope_response_sent_bytes", "counter", "Bytes written to client sockets (responses).",
               unit="bytes"),
    # --- MoE steps ---
    MetricSpec("moescope_steps", "counter", "MoE forward steps (moe.step ranges) completed."),
    MetricSpec("moescope_step_tokens", "counter", "Tokens in completed steps (moe.step payload)."),
    MetricSpec("moescope_step_duration_seconds", "histogram", "Duration of one moe.step range (expert compute).",
               unit="seconds", buckets=STEP_BUCKETS_S),
    # --- MoE steps per producer process (rank; bounded: MAX_RANK_SERIES pids, then dropped and counted) ---
    MetricSpec("moescope_rank_steps", "counter", "MoE forward steps completed, per producer process (pid).",
               labels=("pid",), max_series=MAX_RANK_SERIES),
    MetricSpec("moescope_rank_step_tokens", "counter", "Tokens in completed steps, per producer process (pid).",
               labels=("pid",), max_series=MAX_RANK_SERIES),
    MetricSpec("moescope_rank_step_duration_seconds", "histogram",
               "Duration of one moe.step range, per producer process (pid).",
               labels=("pid",), unit="seconds", buckets=STEP_BUCKETS_S, max_series=MAX_RANK_SERIES),
    MetricSpec("moescope_rank_nvtx_records_dropped", "counter",
               "NVTX records a producer process's ring lost (every drop reason summed), per pid.",
               labels=("pid",), max_series=MAX_RANK_SERIES),
    MetricSpec("moescope_expert_load_duration_seconds", "histogram",
               "Duration of moe.expert.load ranges (bringing a non-resident expert's weights in).",
               unit="seconds", buckets=LOAD_BUCKETS_S),
    MetricSpec("moescope_expert_load_bytes", "counter", "Bytes moved by moe.expert.load ranges.", unit="bytes"),
    # --- routing health, per layer (agent/routing_health.py has the formulas) ---
    MetricSpec("moescope_router_entropy_bits", "gauge", "Router mean token entropy of the latest step, bits.",
               labels=("layer",), unit="bits", max_series=_L + 1),
    MetricSpec("moescope_router_entropy_normalized", "gauge", "Router mean token entropy / log2(experts).",
               labels=("layer",), max_series=_L + 1),
    MetricSpec("moescope_expert_load_gini", "gauge", "Gini coefficient of tokens per expert, latest step.",
               labels=("layer",), max_series=_L + 1),
    MetricSpec("moescope_expert_load_gini_window", "gauge",
               "Gini coefficient of tokens per expert summed over the policy's sliding window.",
               labels=("layer",), max_series=_L + 1),
    MetricSpec("moescope_expert_load_entropy_bits", "gauge", "Entropy of the expert-load distribution, bits.",
               labels=("layer",), unit="bits", max_series=_L + 1),
    MetricSpec("moescope_expert_load_entropy_normalized", "gauge", "Expert-load entropy / log2(experts).",
               labels=("layer",), max_series=_L + 1),
    MetricSpec("moescope_expert_load_max_share", "gauge", "Share of the layer's tokens taken by its busiest expert.",
               labels=("layer",), max_series=_L + 1),
    MetricSpec("moescope_expert_load_cv", "gauge", "Coefficient of variation of tokens per expert.",
               labels=("layer",), max_series=_L + 1),
    MetricSpec("moescope_step_router_entropy_normalized", "gauge",
               "Token-weighted mean over layers of normalised router entropy, latest step."),
    MetricSpec("moescope_step_expert_load_gini", "gauge", "Token-weighted mean over layers of Gini, latest step."),
    MetricSpec("moescope_step_expert_load_gini_max", "gauge", "Highest per-layer Gini of the latest step."),
    MetricSpec("moescope_experts", "gauge", "Experts per MoE layer (E)."),
    # --- per expert (bounded: see ExpertLabels) ---
    MetricSpec("moescope_expert_tokens", "counter", "Tokens routed to an expert (before capacity).",
               labels=("layer", "expert"), max_series=_X),
    MetricSpec("moescope_expert_dropped_tokens", "counter", "Tokens over an expert's capacity (dropped/rerouted).",
               labels=("layer", "expert"), max_series=_X),
    # --- devices ---
    MetricSpec("moescope_device_memory_used_bytes", "gauge",
               "Device memory used; device is the GPU index, or 'host' for the no-GPU memory signal.",
               labels=("device",), unit="bytes", max_series=_DEV + 1),
    MetricSpec("moescope_device_memory_total_bytes", "gauge",
               "Device memory total; device is the GPU index, or 'host' for the no-GPU memory signal.",
               labels=("device",), unit="bytes", max_series=_DEV + 1),
    MetricSpec("moescope_target_memory_bytes", "gauge",
               "Target process memory: resident set, or GPU memory the process holds on a device.",
               labels=("device",), unit="bytes", max_series=_DEV + 1),
    MetricSpec("moescope_nvlink_transmit_bytes", "counter", "NVLink bytes transmitted per link.",
               labels=("device", "link"), unit="bytes", max_series=_LINKS),
    MetricSpec("moescope_nvlink_receive_bytes", "counter", "NVLink bytes received per link.",
               labels=("device", "link"), unit="bytes", max_series=_LINKS),
    MetricSpec("moescope_pcie_transmit_bytes_per_second", "gauge", "PCIe transmit throughput (NVML sample).",
               labels=("device",), max_series=_DEV),
    MetricSpec("moescope_pcie_receive_bytes_per_second", "gauge", "PCIe receive throughput (NVML sample).",
               labels=("device",), max_series=_DEV),
    # --- policy ---
    MetricSpec("moescope_policy_actions", "counter", "Policy actions by rule, action and outcome.",
               labels=("rule", "action", "outcome"), max_series=_RULES * 16),
    MetricSpec("moescope_policy_decisions", "counter",
               "Policy decisions by kind, audited or not (fire, revert, dry-run, suppressed-by-*).",
               labels=("decision",), max_series=16),
    MetricSpec("moescope_policy_rule_state", "gauge",
               "1 for the rule's current state (ok, pending, firing, cooldown), 0 for the others.",
               labels=("rule", "state"), max_series=_RULES * 4),
    MetricSpec("moescope_policy_rule_signal", "gauge", "Latest value of the signal a rule watches.",
               labels=("rule",), max_series=_RULES),
    # --- agent self-metrics ---
    MetricSpec("moescope_agent_events", "counter", "Events received per source (rate() gives events/s).",
               labels=("source",), max_series=_SOURCES),
    MetricSpec("moescope_agent_events_dropped", "counter", "Events dropped per source and reason.",
               labels=("source", "reason"), max_series=_SOURCES * _REASONS),
    MetricSpec("moescope_nvtx_anomalies", "counter",
               "NVTX events the moe convention's parser could not place, by reason (unknown_names, "
               "malformed_payloads, malformed_categories, misplaced, orphans, pending_overflow): counted, "
               "never raised.",
               labels=("reason",), max_series=8),
    MetricSpec("moescope_agent_events_sampled_out", "counter",
               "Events a source's sampling rule left out (counted, not lost: the ingress probe's requests are "
               "all in moescope_requests_total).",
               labels=("source",), max_series=_SOURCES),
    MetricSpec("moescope_agent_collector_duration_seconds", "gauge", "Duration of a collector's last run.",
               labels=("collector",), unit="seconds", max_series=_SOURCES),
    MetricSpec("moescope_agent_collector_success", "gauge", "1 if the collector's last run succeeded, else 0.",
               labels=("collector",), max_series=_SOURCES),
    MetricSpec("moescope_agent_cpu_seconds", "counter", "CPU time used by the agent process (user + system).",
               unit="seconds"),
    MetricSpec("moescope_agent_thread_cpu_seconds", "counter",
               "CPU time by agent thread, by its OS name (main: the main loop; ms-policy: the policy's wake-ups; "
               "ms-export-*: the trace export; ms-host, ms-state, ...), read from /proc at each scrape (a thread "
               "that starts and ends between two scrapes is not seen).",
               labels=("thread",), unit="seconds", max_series=_THREADS),
    MetricSpec("moescope_agent_work_cpu_seconds", "counter",
               "CPU time of the main loop by part (each source's poll with the sinks it feeds, each round hook) "
               "and of the policy thread by part of its wake-up (wake, signals, evaluate, peeks).",
               labels=("thread", "part"), unit="seconds", max_series=_WORK_PARTS),
    MetricSpec("moescope_agent_resident_memory_bytes", "gauge", "Resident set size of the agent process.",
               unit="bytes"),
    MetricSpec("moescope_agent_metric_series_dropped", "counter",
               "Metric updates dropped because a family reached its series bound.",
               labels=("metric",), max_series=64),
    MetricSpec("moescope_export_spans", "counter", "Spans handed to the trace exporter, by outcome.",
               labels=("outcome",), max_series=4),
    MetricSpec("moescope_export_spans_dropped", "counter", "Spans dropped before export, by reason.",
               labels=("reason",), max_series=4),
    MetricSpec("moescope_export_queue_spans", "gauge", "Spans waiting in the export queue."),
    MetricSpec("moescope_build_info", "gauge", "Always 1; the agent's version as a label.",
               labels=("version",), max_series=1),
    # --- network signals (kernel, probes/netsig) ---
    # port: a target's listening port (at most 1024 watched); netns: a target namespace's inode.
    MetricSpec("moescope_tcp_retransmits", "counter",
               "TCP data segments retransmitted on a target's listening port (tcp:tcp_retransmit_skb).",
               labels=("port",), max_series=1024),
    MetricSpec("moescope_tcp_synack_retransmits", "counter",
               "SYN-ACKs retransmitted by a target's listener (tcp:tcp_retransmit_synack).",
               labels=("port",), max_series=1024),
    MetricSpec("moescope_tcp_resets", "counter",
               "TCP resets on a target's listening port; direction sent or received (tcp:tcp_send_reset, "
               "tcp:tcp_receive_reset).",
               labels=("port", "direction"), max_series=2048),
    MetricSpec("moescope_tcp_connections_established", "counter",
               "TCP handshakes completed on a target's listening port (sock:inet_sock_set_state).",
               labels=("port",), max_series=1024),
    MetricSpec("moescope_listen_overflows", "counter",
               "Connections refused because a listener's accept queue was full, per target network namespace "
               "(TcpExt ListenOverflows).",
               labels=("netns",), max_series=64),
    MetricSpec("moescope_listen_drops", "counter",
               "SYNs and handshake ACKs dropped by listeners, overflows included, per target network namespace "
               "(TcpExt ListenDrops).",
               labels=("netns",), max_series=64),
    # --- end of network signals ---
)

SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}
assert len(SPECS) == len(METRICS), "duplicate metric name in METRICS"

POLICY_STATES = ("ok", "pending", "firing", "cooldown")

# The per-layer routing-health gauges and the LayerTable column each reads (set_layer_health's order).
LAYER_HEALTH_GAUGES = (
    ("moescope_router_entropy_bits", "router_entropy_bits"),
    ("moescope_router_entropy_normalized", "router_entropy_normalised"),
    ("moescope_expert_load_gini", "gini"),
    ("moescope_expert_load_entropy_bits", "entropy_bits"),
    ("moescope_expert_load_entropy_normalized", "entropy_normalised"),
    ("moescope_expert_load_max_share", "max_share"),
    ("moescope_expert_load_cv", "cv"),
)


def exported_sample_names() -> frozenset[str]:
    """Every series name a PromQL query may use (histograms: _bucket, _sum, _count)."""
    names: set[str] = set()
    for spec in METRICS:
        if spec.kind == "histogram":
            names.update({f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"})
        elif spec.kind == "counter":
            names.add(f"{spec.name}_total")
        else:
            names.add(spec.name)
    return frozenset(names)


def _build(spec: MetricSpec, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    if spec.kind == "counter":
        return Counter(spec.name, spec.help, labelnames=spec.labels, unit=spec.unit, registry=registry)
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.help, labelnames=spec.labels, unit=spec.unit, registry=registry)
    return Histogram(
        spec.name, spec.help, labelnames=spec.labels, unit=spec.unit, registry=registry, buckets=spec.buckets
    )


def _expert_counts(values: npt.ArrayLike, what: str) -> ExpertCounts:
    """A [layers, experts] count matrix as int64 (integers) or float64 (floats, as the dict path took them)."""
    counts = np.asarray(values)
    if counts.ndim != 2:
        raise ValueError(f"expert {what} must be a [layers, experts] matrix, got shape {counts.shape}")
    if counts.dtype.kind in "iub":
        return counts.astype(np.int64, copy=False)
    if counts.dtype.kind == "f":
        return counts.astype(np.float64, copy=False)
    raise ValueError(f"expert {what} must be numbers, got dtype {counts.dtype}")


def _wrong_kind(name: str, child: Counter | Gauge | Histogram, method: str) -> ValueError:
    return ValueError(f"{name}: a {type(child).__name__.lower()} has no {method}()")


@dataclass(slots=True)
class ExpertLabels:
    """Maps (layer, expert) to bounded label values: admitted experts keep their own series."""

    max_layers: int = DEFAULT_MAX_LAYERS
    max_experts_per_layer: int = DEFAULT_MAX_EXPERTS_PER_LAYER
    _layers: dict[int, set[int]] = field(default_factory=dict)
    # admission reads and grows a layer's set; a scrape's flush and the daemon's may run at once
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def layer_label(self, layer: int) -> str:
        if layer in self._layers:
            return str(layer)
        if len(self._layers) < self.max_layers:
            self._layers[layer] = set()
            return str(layer)
        return OTHER

    def admit(self, layer: int, tokens_by_expert: Mapping[int, int]) -> dict[int, str]:
        """Label value per expert for one step's counts; admits the step's hottest while slots remain."""
        experts = list(tokens_by_expert)
        counts = np.array([tokens_by_expert[e] for e in experts], dtype=np.int64).reshape(1, len(experts))
        _, own = self.admit_rows([layer], counts, experts=np.array(experts, dtype=np.int64))
        return {expert: (str(expert) if own[0, col] else OTHER) for col, expert in enumerate(experts)}

    def admit_rows(
        self, layers: Sequence[int], tokens: ExpertCounts, *, experts: CountVector | None = None
    ) -> tuple[list[str], BoolMatrix]:
        """Row ``r`` holds layer ``layers[r]``'s counts per expert (column ``c`` is expert
        ``experts[c]``, else ``c``). Rows are taken in order: a layer with free slots admits its
        experts with counts > 0 that are not admitted yet, hottest first (by tokens descending, then
        expert ascending). Returns each row's layer label and the mask of experts that have their
        own label after it (all False for a layer past ``max_layers``)."""
        rows, width = tokens.shape
        own = np.zeros((rows, width), dtype=bool)
        layer_labels: list[str] = []
        with self._lock:
            for row, layer in enumerate(layers):
                label = self.layer_label(layer)
                layer_labels.append(label)
                if label == OTHER:
                    continue
                admitted = self._layers[layer]
                if admitted:
                    if experts is None:
                        own[row, [e for e in admitted if 0 <= e < width]] = True
                    else:
                        own[row] = np.isin(experts, list(admitted))
                free = self.max_experts_per_layer - len(admitted)
                if free <= 0:
                    continue
                candidates = np.flatnonzero((tokens[row] > 0) & ~own[row])
                if not candidates.size:
                    continue
                ids = candidates if experts is None else experts[candidates]
                hottest = np.lexsort((ids, -tokens[row, candidates]))[:free]  # last key sorts first
                own[row, candidates[hottest]] = True
                admitted.update(ids[hottest].tolist())
        return layer_labels, own

    def expert_label(self, layer: int, expert: int) -> str:
        """The label an expert already has (``other`` unless it was admitted)."""
        return str(expert) if expert in self._layers.get(layer, ()) else OTHER


class Metrics:
    """The agent's metric families, generated from ``METRICS`` into a private registry."""

    def __init__(
        self,
        *,
        specs: Sequence[MetricSpec] = METRICS,
        max_layers: int = DEFAULT_MAX_LAYERS,
        max_experts_per_layer: int = DEFAULT_MAX_EXPERTS_PER_LAYER,
        version: str = __version__,  # moescope_build_info's label; "" leaves the family without a sample
    ) -> None:
        if not 0 <= max_experts_per_layer <= MAX_EXPERTS_PER_LAYER:
            raise ValueError(f"max_experts_per_layer must be 0..{MAX_EXPERTS_PER_LAYER}, got {max_experts_per_layer}")
        # No `_created` series: in the text format each counter and histogram series had a second,
        # gauge series beside it (its creation time), stored by Prometheus as series of their own:
        # 998 -> 704 lines a scrape at the reference load, 3,228 -> 1,990 at DeepSeek-V3 with eight
        # ranks. Process-wide in prometheus_client: the agent's process.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        # the per-expert families' safety bound follows the label bound (layer and expert "other" included)
        expert_series = (max_layers + 1) * (max_experts_per_layer + 1)
        specs = [
            replace(spec, max_series=max(spec.max_series, expert_series))
            if spec.labels == ("layer", "expert")
            else spec
            for spec in specs
        ]
        self._specs = {spec.name: spec for spec in specs}
        self._families = {spec.name: _build(spec, self.registry) for spec in specs}
        self._series: dict[str, set[tuple[str, ...]]] = {name: set() for name in self._specs}
        self._counter_totals: dict[tuple[str, tuple[str, ...]], float] = {}
        # (name, label values) -> the family's child: prometheus_client's labels() validates and
        # locks on every call; the pipeline makes ~100 labelled updates per step.
        self._children: dict[tuple[str, tuple[str, ...]], Counter | Gauge | Histogram] = {}
        self._expert_children: dict[str, dict[tuple[str, int | str], Counter | Gauge]] = {}
        # layer label -> its LAYER_HEALTH_GAUGES children, in that order (~400 sets a flush at L = 58)
        self._layer_gauges: dict[str, list[Gauge]] = {}
        self._lock = threading.Lock()
        self._threads_lock = threading.Lock()
        self._thread_cpu_s: dict[int, float] = {}  # tid -> its CPU seconds at the last scrape
        self._refresh_hooks: list[Callable[[], None]] = []
        self.expert_labels = ExpertLabels(max_layers=max_layers, max_experts_per_layer=max_experts_per_layer)
        self._zero_series_drops()
        if version and "moescope_build_info" in self._specs:
            self.set("moescope_build_info", 1.0, version=version)

    # --- generic, bounded updates -----------------------------------------------------------
    def _child(self, name: str, labels: Mapping[str, str]) -> Counter | Gauge | Histogram | None:
        spec = self._specs[name]
        try:  # same count and every declared name present: the same set, without building sets
            if len(labels) != len(spec.labels):
                raise KeyError(name)
            key = tuple(str(labels[label]) for label in spec.labels)
        except KeyError:
            raise ValueError(f"{name}: labels {sorted(labels)} != declared {list(spec.labels)}") from None
        if not spec.labels:
            return self._families[name]
        return self._keyed_child(name, key)

    def _keyed_child(self, name: str, key: tuple[str, ...]) -> Counter | Gauge | Histogram | None:
        """The child for label values ``key`` (in the family's declared order), None past max_series."""
        child = self._children.get((name, key))
        if child is not None:
            return child
        spec = self._specs[name]
        with self._lock:
            series = self._series[name]
            if key not in series:
                if len(series) >= spec.max_series:
                    self._count_series_drop(name)
                    return None
                series.add(key)
            child = self._children[(name, key)] = self._families[name].labels(*key)
        return child

    def _zero_series_drops(self) -> None:
        """A 0 series-drop count per labelled family from the start: a labelled counter has no sample
        until a label set is touched, and "no drops" must read as 0, not as no data."""
        drop = "moescope_agent_metric_series_dropped"
        if drop not in self._families:
            return
        series = self._series[drop]
        for spec in self._specs.values():
            if spec.labels and spec.name != drop and len(series) < self._specs[drop].max_series:
                series.add((spec.name,))
                self._families[drop].labels(spec.name)

    def _count_series_drop(self, name: str) -> None:
        drop = "moescope_agent_metric_series_dropped"
        if name == drop or drop not in self._families:
            return
        key = (name,)
        series = self._series[drop]
        if key in series or len(series) < self._specs[drop].max_series:
            series.add(key)
            family = self._families[drop]
            if isinstance(family, Histogram):
                raise _wrong_kind(drop, family, "inc")
            family.labels(name).inc()

    def inc(self, name: str, amount: float, **labels: str) -> None:
        # (amount has no default: mypyc 2.4 cannot write the text signature of a default before **labels)
        child = self._child(name, labels)
        if child is None:
            return
        if isinstance(child, Histogram):
            raise _wrong_kind(name, child, "inc")
        child.inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        child = self._child(name, labels)
        if child is None:
            return
        if not isinstance(child, Gauge):
            raise _wrong_kind(name, child, "set")
        child.set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        child = self._child(name, labels)
        if child is None:
            return
        if not isinstance(child, Histogram):
            raise _wrong_kind(name, child, "observe")
        child.observe(value)

    def observe_buckets(self, name: str, counts: Sequence[int], total: float, **labels: str) -> None:
        """Add counts already bucketed on the family's own bounds (``counts[i]`` values in bucket i,
        not cumulative, the last one +Inf) and their sum: an in-kernel histogram's delta."""
        child = self._child(name, labels)
        if child is None:
            return
        if not isinstance(child, Histogram):
            raise _wrong_kind(name, child, "observe")
        buckets = child._buckets  # prometheus_client keeps one (non-cumulative) value per bound
        if len(counts) != len(buckets):
            raise ValueError(f"{name}: {len(counts)} bucket counts for {len(buckets)} buckets")
        for value, count in zip(buckets, counts, strict=True):
            if count:
                value.inc(count)
        child._sum.inc(total)

    def set_counter_total(self, name: str, total: float, **labels: str) -> None:
        """Advance a counter to a cumulative ``total`` read from a source (NVLink, CPU time).

        A total below the last one means the source reset: the new total is added as is.
        """
        key = (name, tuple(str(labels[k]) for k in sorted(labels)))
        with self._lock:
            last = self._counter_totals.get(key, 0.0)
            self._counter_totals[key] = total
        delta = total - last if total >= last else total
        self.inc(name, max(delta, 0.0), **labels)  # inc(0) creates the series: a zero is visible

    # --- domain helpers ----------------------------------------------------------------------
    def record_expert_counts(
        self, *, layer: int, tokens: Mapping[int, int], dropped: Mapping[int, int] | None = None
    ) -> None:
        """Per-expert token and drop counters for one layer of one step (bounded labels)."""
        drops = dropped or {}
        experts = [*tokens, *(e for e in drops if e not in tokens)]
        self.record_expert_matrix(
            layers=[layer],
            tokens=np.array([[tokens.get(e, 0) for e in experts]], dtype=np.int64).reshape(1, len(experts)),
            dropped=np.array([[drops.get(e, 0) for e in experts]], dtype=np.int64).reshape(1, len(experts)),
            experts=experts,
        )

    def record_expert_matrix(
        self, *, layers: Sequence[int] | CountVector, tokens: npt.ArrayLike, dropped: npt.ArrayLike | None = None,
        experts: Sequence[int] | None = None,
    ) -> None:
        """Per-expert token and drop counters for rows of layers: row ``r`` is layer ``layers[r]``,
        column ``c`` expert ``experts[c]`` (default ``c``); the same as ``record_expert_counts`` per
        row in order, with one numpy pass instead of a Python walk over every expert. Counts <= 0
        are skipped. ``ValueError`` on mismatched shapes, repeated experts or non-numeric counts."""
        t = _expert_counts(tokens, "tokens")
        d = None if dropped is None else _expert_counts(dropped, "dropped")
        layer_list = [int(layer) for layer in (layers.tolist() if isinstance(layers, np.ndarray) else layers)]
        if len(layer_list) != t.shape[0] or (d is not None and d.shape != t.shape):
            raise ValueError(f"expert counts: {len(layer_list)} layers, tokens {t.shape}, "
                             f"dropped {None if d is None else d.shape}")
        ids: CountVector | None = None
        names: list[int] | None = None
        if experts is not None:
            ids = np.asarray(experts, dtype=np.int64).reshape(-1)
            if ids.size != t.shape[1] or np.unique(ids).size != ids.size:
                raise ValueError(f"expert counts: {t.shape[1]} columns need as many distinct experts, got {ids.size}")
            names = ids.tolist()
        layer_labels, own = self.expert_labels.admit_rows(layer_list, t, experts=ids)
        self._add_expert_sums("moescope_expert_tokens", layer_labels, own, t, names)
        if d is not None:
            self._add_expert_sums("moescope_expert_dropped_tokens", layer_labels, own, d, names)

    def _add_expert_sums(
        self, name: str, layer_labels: list[str], own: BoolMatrix, counts: ExpertCounts, names: list[int] | None
    ) -> None:
        """One update per label with counts > 0: each admitted expert's own, and the rest of its row
        summed into expert="other"."""
        positive = np.where(counts > 0, counts, 0)
        rows, cols = np.nonzero(own & (positive > 0))
        experts = cols.tolist() if names is None else [names[col] for col in cols.tolist()]
        updates: list[tuple[int, int | str, float]] = [
            *zip(rows.tolist(), experts, positive[rows, cols].tolist()),
            *((row, OTHER, n) for row, n in enumerate(np.where(own, 0, positive).sum(axis=1).tolist()) if n > 0),
        ]
        # (layer label, expert) -> the counter's child, kept per family: ~1000 updates a flush at DeepSeek-V3 shape
        children = self._expert_children.setdefault(name, {})
        for row, expert, n in updates:
            layer = layer_labels[row]
            child = children.get((layer, expert))
            if child is None:
                found = self._keyed_child(name, (layer, str(expert)))
                if found is None:  # past max_series: dropped and counted, per update
                    continue
                if isinstance(found, Histogram):
                    raise _wrong_kind(name, found, "inc")
                child = children[(layer, expert)] = found
            child.inc(n)

    def _set_layer_gauges(self, layer: str, values: Sequence[float]) -> None:
        """The layer's LAYER_HEALTH_GAUGES, in that order, to ``values``."""
        gauges = self._layer_gauges.get(layer)
        if gauges is not None:
            for gauge, value in zip(gauges, values):
                gauge.set(value)
            return
        found: list[Gauge] = []
        for (name, _), value in zip(LAYER_HEALTH_GAUGES, values):
            child = self._keyed_child(name, (layer,))
            if child is None:  # past max_series: dropped and counted, per update (never kept)
                continue
            if not isinstance(child, Gauge):
                raise _wrong_kind(name, child, "set")
            child.set(value)
            found.append(child)
        if len(found) == len(LAYER_HEALTH_GAUGES):
            self._layer_gauges[layer] = found

    def set_layer_health(self, health: LayerHealth) -> None:
        """Routing-health gauges for one layer of the latest step."""
        load = health.load
        self._set_layer_gauges(self.expert_labels.layer_label(health.layer), (
            health.router_entropy_bits, health.router_entropy_normalised, load.gini, load.entropy_bits,
            load.entropy_normalised, load.max_share, load.cv,
        ))

    def set_layer_health_rows(self, table: LayerTable, rows: Sequence[int]) -> None:
        """``set_layer_health(table.health(i))`` for each ``i`` of ``rows`` in order, read from the
        table's columns (no per-layer objects)."""
        index = list(rows)
        columns = [getattr(table, column)[index].tolist() for _, column in LAYER_HEALTH_GAUGES]
        for layer, *values in zip(table.layers[index].tolist(), *columns):
            self._set_layer_gauges(self.expert_labels.layer_label(layer), values)

    def set_step_health(self, step: StepHealth) -> None:
        """Step aggregates (token-weighted over layers; worst-layer Gini)."""
        self.set("moescope_step_router_entropy_normalized", step.router_entropy_normalised)
        self.set("moescope_step_expert_load_gini", step.gini)
        self.set("moescope_step_expert_load_gini_max", step.gini_max)

    def set_policy_state(self, *, rule: str, state: str) -> None:
        if state not in POLICY_STATES:
            raise ValueError(f"unknown policy state {state!r}; expected one of {POLICY_STATES}")
        for candidate in POLICY_STATES:
            self.set("moescope_policy_rule_state", 1.0 if candidate == state else 0.0, rule=rule, state=candidate)

    def refresh_self(self) -> None:
        """Agent CPU seconds and RSS from the kernel (getrusage, /proc/self/statm)."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.set_counter_total("moescope_agent_cpu_seconds", usage.ru_utime + usage.ru_stime)
        self.set("moescope_agent_resident_memory_bytes", float(_rss_bytes()))
        self._refresh_threads()

    def _refresh_threads(self) -> None:
        """moescope_agent_thread_cpu_seconds: each thread's CPU since the last scrape, added under
        its name (threads of one name summed; the main thread as ``main``). Kept per thread id, so a
        thread that exits takes nothing back and one that starts adds all of its time. Its
        schedstat's ns where the kernel has them, else its ticks; ~2 small reads a thread, at a
        scrape only."""
        pid = os.getpid()
        with self._threads_lock:  # (two scrapes at once: each thread's time is added once)
            last = self._thread_cpu_s
            now = procfs.task_cpu(pid, precise=True)
            added: dict[str, float] = {}
            for tid, (comm, cpu_s) in now.items():
                name = "main" if tid == pid else comm
                added[name] = added.get(name, 0.0) + max(cpu_s - last.get(tid, 0.0), 0.0)
            self._thread_cpu_s = {tid: cpu_s for tid, (_, cpu_s) in now.items()}
        for name, seconds in added.items():
            self.inc("moescope_agent_thread_cpu_seconds", seconds, thread=name)  # inc(0): the series shows

    def set_work_cpu(self, thread: str, cpu_ns: Mapping[str, int]) -> None:
        """A thread's CPU by part of its work (cumulative ns: Daemon.cpu_ns, PolicyLoop.cpu_ns) as
        moescope_agent_work_cpu_seconds{thread, part}."""
        for part, ns in list(cpu_ns.items()):  # (a copy: the owning thread may add a part meanwhile)
            self.set_counter_total("moescope_agent_work_cpu_seconds", ns / 1e9, thread=thread, part=part)

    def add_refresh_hook(self, hook: Callable[[], None]) -> None:
        """`hook` writes updates it holds back (moescope.agent.pipeline.Pipeline.flush_metrics); it runs
        before every scrape and every get(), and whenever the owner calls refresh()."""
        self._refresh_hooks.append(hook)

    def refresh(self) -> None:
        for hook in self._refresh_hooks:
            hook()

    def get(self, name: str, **labels: str) -> float:
        """Current value of one series (counters: the total; histograms: the count) — for tests and the TUI."""
        self.refresh()
        spec = self._specs[name]
        wanted = {"_total": "counter", "_count": "histogram", "": "gauge"}
        for metric in self._families[name].collect():
            for sample in metric.samples:
                suffix = sample.name[len(spec.name):]
                if wanted.get(suffix) == spec.kind and sample.labels == labels:
                    return float(sample.value)
        return math.nan


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _RefreshOnScrape(Collector):
    """Registered first in the registry: refreshes self-metrics just before each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        # the hooks first: a thread's CPU by part (a hook) is then read before the thread's own total
        try:
            self._metrics.refresh()
        except Exception:  # a scrape must still answer; the next one retries
            log.exception("metrics refresh hook failed")
        try:
            self._metrics.refresh_self()
        except OSError as exc:
            log.warning("self-metrics refresh failed: %s", exc)
        return []

    def describe(self) -> Iterable[Metric]:
        return []


# ---------------------------------------------------------------- the text exposition

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Samples only OpenMetrics has a place for: the text format writes each as a gauge family of its
# own after the family that made it (``_created`` is off in this process: Metrics.__init__).
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")
# A family's type in the text format (what OpenMetrics calls it otherwise): name suffix, type
_TEXT_TYPES = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
               "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}
_LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LEGACY_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def text_float(value: float) -> str:
    """A sample's value as the Prometheus text format has it (Go's float formatting, as the reference
    client writes it): ``+Inf``, ``-Inf``, ``NaN``, and an exponent from 1e7 up."""
    if value != value:
        return "NaN"
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # (Python writes up to 1e16 in full)
        digits = (text[0] + "." + text[1:dot] + text[dot + 1:]).rstrip("0.")
        return f"{digits}e+{dot - 1:02d}"
    return text


def _text_name(name: str, *, label: bool = False) -> str:
    """A metric (or label) name as the text format takes it: each character outside the legacy
    alphabet (``[a-zA-Z_:][a-zA-Z0-9_:]*``; no ``:`` in a label name) written as ``_``, as
    prometheus_client's default escaping does."""
    if (_LEGACY_LABEL if label else _LEGACY_NAME).fullmatch(name) or not name:
        return name
    extra = "_" if label else "_:"
    return "".join(c if c.isascii() and (c.isalpha() or c in extra or (i and c.isdigit())) else "_"
                   for i, c in enumerate(name))


def _text_help(text: str) -> str:
    """A HELP text as the text format takes it: backslashes and newlines escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _text_label_value(value: str) -> str:
    """A label value: as a HELP text, and its double quotes escaped too."""
    return _text_help(value).replace('"', '\\"')


class TextExposition:
    """``/metrics`` in the Prometheus text format (0.0.4), written from a registry's families.

    The same bytes as prometheus_client's ``generate_latest`` (tests/export/test_metrics_text.py
    holds them equal), without its per-sample work: each series' line head (its name and label set,
    sorted and escaped) is made once and kept between scrapes, each family's HELP and TYPE lines too.
    With the ``_created`` series gone, a scrape of the live agent went 5.5 -> 3.3 ms of its CPU at
    the reference load and 15.8 -> 7.0 ms at DeepSeek-V3 shape with eight producers
    (benchmarks/metrics_scrape.py; docs/benchmarks.md "/metrics: no `_created` series"). Heads of
    series that stopped showing are let go once they are more than twice a scrape's lines (a rank's
    pid gone, a layer's expert moved)."""

    def __init__(self, registry: Collector) -> None:
        self._registry = registry
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._family_heads: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()  # (two scrapes at once: the maps are written by one at a time)

    def render(self, names: frozenset[str] | None = None) -> bytes:
        """The text of every family, or only of those with a sample named in ``names`` (a scrape's
        ``name[]=`` filters: ``moescope_requests_total``, ``moescope_step_duration_seconds_bucket``)."""
        with self._lock:
            return self._render(names).encode("utf-8")

    def _render(self, names: frozenset[str] | None) -> str:
        out: list[str] = []
        heads = self._heads
        lines = 0
        for family in self._registry.collect():
            name, doc = family.name, family.documentation
            if names is not None and not any(sample.name in names for sample in family.samples):
                continue
            out.append(self._family_head(name, family.type, doc))
            held: dict[str, list[str]] | None = None  # the OpenMetrics-only samples, by suffix
            for sample in family.samples:
                sample_name, labels = sample.name, sample.labels
                key = (sample_name, tuple(labels.items()))
                head = heads.get(key)
                if head is None:
                    head = heads[key] = self._line_head(sample_name, labels)
                stamp = sample.timestamp
                line = (head + text_float(float(sample.value)) + "\n" if stamp is None
                        else f"{head}{text_float(float(sample.value))} {int(float(stamp) * 1000):d}\n")
                lines += 1
                suffix = sample_name[len(name):] if sample_name.startswith(name) else ""
                if suffix in _OPENMETRICS_ONLY:
                    if held is None:
                        held = {}
                    held.setdefault(suffix, []).append(line)
                else:
                    out.append(line)
            if held is not None:
                for suffix in sorted(held):
                    out.append(self._family_head(name + suffix, "gauge", doc))
                    out.extend(held[suffix])
        if len(heads) > 2 * lines + 1024:
            heads.clear()
        if len(self._family_heads) > 4096:
            self._family_heads.clear()
        return "".join(out)

    def _family_head(self, name: str, kind: str, doc: str) -> str:
        key = (name, kind, doc)
        text = self._family_heads.get(key)
        if text is None:
            suffix, text_kind = _TEXT_TYPES.get(kind, ("", kind))
            shown = _text_name(name + suffix)
            text = self._family_heads[key] = f"# HELP {shown} {_text_help(doc)}\n# TYPE {shown} {text_kind}\n"
        return text

    @staticmethod
    def _line_head(name: str, labels: Mapping[str, str]) -> str:
        if not labels:
            return _text_name(name) + " "
        pairs = ",".join(f'{_text_name(k, label=True)}="{_text_label_value(v)}"' for k, v in sorted(labels.items()))
        return f"{_text_name(name)}{{{pairs}}} "


WsgiApp = Callable[..., Iterable[bytes]]


def _metrics_app(exposition: TextExposition, fallback: WsgiApp) -> WsgiApp:
    """The WSGI app behind ``/metrics``: a GET (or HEAD) of any path gets the text format from
    ``exposition``, whatever it accepts (a Prometheus that asks for OpenMetrics first takes the text
    format: the server chooses), uncompressed (the default bind is loopback), only the families
    named by ``name[]=`` parameters where there are any; another method, or ``/favicon.ico``, goes
    to prometheus_client's own app."""

    def app(environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD") or environ.get("PATH_INFO") == "/favicon.ico":
            return fallback(environ, start_response)
        query = str(environ.get("QUERY_STRING") or "")
        wanted = parse_qs(query).get("name[]") if query else None
        body = exposition.render(frozenset(wanted) if wanted else None)
        start_response("200 OK", [("Content-Type", TEXT_CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [b"" if method == "HEAD" else body]

    return app


class _MetricsHttpServer(ThreadingWSGIServer):
    """prometheus_client's threaded WSGI server, served by a loop that sleeps until a scrape or
    stop(): socketserver's serve_forever wakes every 0.5 s to look for a shutdown request (two
    wake-ups a second, each ~0.3 ms of CPU on the VMs here, for a port scraped every 15 s)."""

    def serve_until(self, wake_fd: int) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(wake_fd, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == wake_fd:
                        return
                    self.handle_request()  # (a connection is ready: accepted without waiting)


class _MetricsHttpServer6(_MetricsHttpServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's signature
        """No access log on stderr."""


class MetricsServer:
    """Serves ``metrics.registry`` at ``http://ADDR:PORT/metrics`` from a daemon thread."""

    def __init__(self, metrics: Metrics, *, port: int = DEFAULT_METRICS_PORT, addr: str = DEFAULT_METRICS_ADDR) -> None:
        self.metrics = metrics
        self.addr = addr
        self.requested_port = port
        self._server: _MetricsHttpServer | None = None
        self._server_thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # the pipe stop() wakes the serving loop with

    def start(self) -> int:
        """Start serving; returns the bound port (useful with port 0). ``UsageError`` if it cannot bind."""
        refresher = _RefreshOnScrape(self.metrics)
        # A fresh registry that consults the refresher before the families, in that order.
        registry = CollectorRegistry(auto_describe=False)
        registry.register(refresher)
        registry.register(_Delegate(self.metrics.registry))
        where = f"{self.addr}:{self.requested_port}"
        try:
            family = socket.getaddrinfo(self.addr or None, self.requested_port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
            server_class = _MetricsHttpServer6 if family == socket.AF_INET6 else _MetricsHttpServer
            app = _metrics_app(TextExposition(registry), make_wsgi_app(registry))
            server = make_server(self.addr, self.requested_port, app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise errors.UsageError(f"cannot serve /metrics on {where}: {exc.strerror or exc}") from exc
        wake = os.pipe()
        thread = threading.Thread(target=server.serve_until, args=(wake[0],), name="moescope-metrics-http",
                                  daemon=True)
        self._server, self._server_thread, self._wake = server, thread, wake
        thread.start()
        if thread.native_id is not None:
            name_thread("ms-metrics-http", tid=thread.native_id)
        return self.port

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("MetricsServer not started")
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)
        if self._server is not None:
            self._server.server_close()
            self._server = None
        if self._wake is not None and (self._server_thread is None or not self._server_thread.is_alive()):
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        self._server_thread = None


class _Delegate(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` / ``--metrics-addr`` / ``--metrics-experts`` for subcommands that serve /metrics."""
    parser.add_argument("--metrics-port", type=errors.tcp_port, default=DEFAULT_METRICS_PORT, metavar="PORT",
                        help=f"serve Prometheus /metrics on this port (default {DEFAULT_METRICS_PORT}; 0 = off)")
    parser.add_argument("--metrics-addr", default=DEFAULT_METRICS_ADDR, metavar="ADDR",
                        help=f"address to bind /metrics to (default {DEFAULT_METRICS_ADDR})")
    parser.add_argument("--metrics-experts", type=_experts_bound, default=DEFAULT_MAX_EXPERTS_PER_LAYER, metavar="N",
                        help=f"per-expert token/drop series per layer: the N hottest (default "
                             f"{DEFAULT_MAX_EXPERTS_PER_LAYER}; the rest sum into expert=\"other\"; the per-layer "
                             "Gini/entropy gauges cover every expert); N = E for full per-expert series, 0 for "
                             "per-layer totals only")


def _experts_bound(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= MAX_EXPERTS_PER_LAYER:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_EXPERTS_PER_LAYER}, got {value}")
    return value
