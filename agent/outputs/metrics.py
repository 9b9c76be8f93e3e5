"""Prometheus families from joined events (the families themselves are declared in agent/metrics.py).

Every per-step metric is held here and written by ``force_flush`` (a refresh hook: the daemon's
publish tick and every scrape), so a scrape or ``Metrics.get`` always sees every step: step counts,
tokens and durations per pid (the unlabelled totals are their sums), expert loads, per-expert token
counters summed as one [layers, 2E] matrix (``Metrics.record_expert_matrix``), routing-health
gauges at their latest value. Writing ~80 labelled series per step was a fifth of the agent's CPU
under load. Joined requests' breakdown values (phases, TTFT, TPOT, tokens) are held the same way
and added per flush as one bucketed update per series.

Request counts, bytes and the latency histogram come from one of two places. By default from each
joined request record (a pipeline fed records: tests, benchmarks). Under `agent start`,
``use_kernel_totals`` switches them to the ingress probe's in-kernel aggregate, read at every
refresh (delta since the last read), so they are exact whatever happens to per-request records
(ring full, sampled out); queue wait stays per record (it needs the join). The kernel's log-linear
buckets map onto ``moescope_request_duration_seconds``'s bounds by each kernel bucket's midpoint
(probes/ingress/aggregate.py: a request within 3.1 % of a bound may land on its other side);
``_sum`` is the kernel's exact latency sum.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from moescope.agent.join import BufferedStep, JoinEvent, NetSignalSeen, RequestJoined, StepSeen, TelemetrySeen
from moescope.agent.metrics import SPECS, Metrics
from moescope.agent.outputs.traces import GEN_AI_OPERATION
from moescope.agent.outputs.values import finite
from moescope.agent.outputs.windows import WindowsOutput
from moescope.agent.request_phases import RequestBreakdown
from moescope.agent.routing_health import CountMatrix, CountVector, LayerTable, add_rows
from moescope.collectors.host import HostSample
from moescope.collectors.netsig import publish_net_signals
from moescope.collectors.nvml import NvmlSample
from moescope.probes.ingress.aggregate import RequestTotals

WINDOW_GAUGE_PERIOD_NS = 1_000_000_000  # the windowed Gini sums the whole window per layer
MAX_PENDING_OBSERVATIONS = 100_000  # ~10k requests without a flush (a pipeline with no refresh tick)
UNKNOWN_MODEL = "unknown"  # gen_ai_request_model when the runtime's stats name no model
MAX_MODEL_LABEL_CHARS = 128  # a label value is the runtime's own model name, cut to this


def model_label(model: str | None) -> str:
    """The bounded gen_ai_request_model label value."""
    return model[:MAX_MODEL_LABEL_CHARS] if model else UNKNOWN_MODEL


MAX_LATEST_TABLES = 64  # distinct layer sets whose latest health waits for the next flush
STEP_DURATION = "moescope_step_duration_seconds"
RANK_STEP_DURATION = "moescope_rank_step_duration_seconds"  # per pid; STEP_DURATION is all pids' together
INT32_MAX = 2**31 - 1  # the most an entry of PendingCounts' int32 sums may reach


class PendingCounts:
    """Tokens and drops per (layer, expert) summed between flushes, as one [layers, 2E] matrix
    (tokens | dropped): one array add per step (per-expert dicts cost ~2 ms a step at E = 256,
    L = 58). Steps of int32 counts (the join's compact blocks) are summed in an int32 matrix, folded
    into the int64 one before any entry could pass 2^31 - 1: an int32 add costs a third of one that
    widens each entry to int64 (~7 vs ~26 us a step at 58 x 512)."""

    def __init__(self) -> None:
        self._counts = np.zeros((0, 0), dtype=np.int64)
        self._narrow = np.zeros((0, 0), dtype=np.int32)  # int32 steps since the last fold, same shape
        self._narrow_bound = 0  # no entry of _narrow holds more than this
        self._layers_seen = np.zeros(0, dtype=bool)
        self._batches: list[tuple[CountVector, CountMatrix, CountMatrix]] = []  # E changed: kept apart

    def add(self, table: LayerTable) -> None:
        # (ufunc reductions, not the ndarray methods: those run numpy's Python wrappers, once a step)
        rows, experts = int(np.maximum.reduce(table.layers)) + 1, table.num_experts
        if self._counts.shape[1] not in (0, 2 * experts):
            self._batches.extend(self._drain())  # another E: the sums so far are flushed as they are
        if rows > self._counts.shape[0] or self._counts.shape[1] != 2 * experts:
            self._fold()
            grown = np.zeros((max(rows, self._counts.shape[0]), 2 * experts), dtype=np.int64)
            seen = np.zeros(grown.shape[0], dtype=bool)
            have = self._counts.shape[0]
            if self._counts.shape[1] == 2 * experts:
                grown[:have], seen[:have] = self._counts, self._layers_seen
            self._counts, self._layers_seen = grown, seen
            self._narrow = np.zeros(grown.shape, dtype=np.int32)
        into: CountMatrix = self._counts
        if table.tokens.dtype == np.int32:
            # counts are >= 0 (layer_table checks), so no entry grows by more than a whole column's sum
            step_bound = max(int(np.add.reduce(table.tokens_total)), int(np.add.reduce(table.dropped_total)))
            if self._narrow_bound + step_bound > INT32_MAX:
                self._fold()
            if step_bound <= INT32_MAX:
                into = self._narrow
                self._narrow_bound += step_bound
        if table.block is not None:
            add_rows(into, table.layers, table.block)
        else:
            add_rows(into[:, :experts], table.layers, table.tokens)
            add_rows(into[:, experts:], table.layers, table.dropped)
        self._layers_seen[table.layers] = True

    def _fold(self) -> None:
        if self._narrow_bound:
            self._counts += self._narrow
            self._narrow[...] = 0
            self._narrow_bound = 0

    def _drain(self) -> list[tuple[CountVector, CountMatrix, CountMatrix]]:
        self._fold()
        rows: CountVector = np.flatnonzero(self._layers_seen).astype(np.int64, copy=False)
        e = self._counts.shape[1] // 2
        counts = self._counts
        out: list[tuple[CountVector, CountMatrix, CountMatrix]]
        if rows.size == counts.shape[0]:  # every row seen (the usual case): views, no gather
            out = [(rows, counts[:, :e], counts[:, e:])] if rows.size else []
        else:
            out = [(rows, counts[rows, :e], counts[rows, e:])] if rows.size else []
        self._counts = np.zeros((0, 0), dtype=np.int64)
        self._narrow = np.zeros((0, 0), dtype=np.int32)
        self._layers_seen = np.zeros(0, dtype=bool)
        return out

    def take(self) -> list[tuple[CountVector, CountMatrix, CountMatrix]]:
        """(layers [L'], tokens [L', E], dropped [L', E]) per expert count E seen since the last take,
        oldest first, with a row for every layer that had a step (all-zero rows included)."""
        out = [*self._batches, *self._drain()]
        self._batches = []
        return out


Labels = tuple[tuple[str, str], ...]


class PendingObservations:
    """Histogram observations held between flushes, per (family, labels), then added as one bucketed
    update each (``Metrics.observe_buckets``): a joined request's ten phase / TTFT / TPOT values
    observed one by one cost ~60 us (prometheus_client locks and scans its bounds per call)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, Labels], list[float]] = {}
        self.held = 0  # values waiting (the owner flushes early past MAX_PENDING_OBSERVATIONS)

    def add(self, name: str, value: float, labels: Labels = ()) -> None:
        values = self._values.get((name, labels))
        if values is None:
            values = self._values[(name, labels)] = []
        values.append(value)
        self.held += 1

    def take(self) -> dict[tuple[str, Labels], list[float]]:
        out, self._values, self.held = self._values, {}, 0
        return out


def bucket_counts(bounds: tuple[float, ...], values: list[float]) -> list[int]:
    """Per-bucket (not cumulative) counts of ``values`` on a histogram's bounds plus +Inf, each value
    in the first bucket whose bound is >= it (prometheus_client's rule)."""
    index = np.searchsorted(np.asarray(bounds, dtype=np.float64), np.asarray(values, dtype=np.float64), side="left")
    return [int(c) for c in np.bincount(index, minlength=len(bounds) + 1).tolist()]


class MetricsOutput:
    name = "metrics"

    def __init__(self, metrics: Metrics, *, windows: WindowsOutput | None = None) -> None:
        self.metrics = metrics
        self.windows = windows  # for the windowed gauges (moescope_expert_load_gini_window)
        self._lock = threading.Lock()  # export on the daemon thread, force_flush on a scrape's
        self._pending_counts = PendingCounts()
        self._pending_observations = PendingObservations()  # joined requests' breakdowns
        self._pending_tokens = {"input": 0, "output": 0}
        self._pending_rank_steps: dict[int, list[int]] = {}  # pid -> [steps, tokens] since the last flush
        self._pending_load_bytes = 0  # moe.expert.load bytes since the last flush
        self._pending_experts = 0  # the latest step's E (moescope_experts), 0: none since the last flush
        # layer set (its index bytes) -> the latest step table with that set, oldest set first
        self._latest_tables: dict[bytes, LayerTable] = {}
        self._latest_step_health: LayerTable | None = None
        self._window_gauges_ns = 0
        self._kernel_totals: Callable[[], RequestTotals] | None = None
        self._kernel_published = RequestTotals()
        self._kernel_lock = threading.Lock()  # a scrape's refresh and the daemon's publish may overlap
        metrics.add_refresh_hook(self.force_flush)

    def use_kernel_totals(self, read: Callable[[], RequestTotals]) -> None:
        """Count requests, bytes and latency from `read()` (cumulative in-kernel totals, e.g.
        IngressProbe.totals) at every refresh, instead of from request records."""
        self._kernel_totals = read
        self.metrics.add_refresh_hook(self.publish_kernel_totals)

    def publish_kernel_totals(self) -> None:
        """Add what the kernel counted since the last call (any thread)."""
        read = self._kernel_totals
        if read is None:
            return
        with self._kernel_lock:
            current = read()
            delta = current - self._kernel_published
            self._kernel_published = current
        if delta.requests <= 0 and delta.bytes_in <= 0 and delta.bytes_out <= 0:
            return
        m = self.metrics
        m.inc("moescope_requests", delta.requests)
        m.inc("moescope_request_received_bytes", delta.bytes_in)
        m.inc("moescope_response_sent_bytes", delta.bytes_out)
        if delta.answered > 0:
            name = "moescope_request_duration_seconds"
            m.observe_buckets(name, delta.prometheus_buckets(SPECS[name].buckets), delta.latency_sum_ns / 1e9)

    # ------------------------------------------------------------------ Output
    def export(self, batch: Sequence[JoinEvent]) -> None:
        for event in batch:
            match event:
                case RequestJoined():
                    self._request(event)
                case StepSeen(step=b):
                    self._step(b)
                case TelemetrySeen(sample=sample):
                    self._telemetry(sample)
                case NetSignalSeen(record=record):
                    publish_net_signals(self.metrics, record)
                case _:
                    pass

    def force_flush(self) -> None:
        """Write the per-step metrics kept since the last flush into the registry (any thread)."""
        m = self.metrics
        with self._lock:
            pending = self._pending_counts.take()
            tables = list(self._latest_tables.values())
            step_table = self._latest_step_health
            self._latest_tables, self._latest_step_health = {}, None
            observations = self._pending_observations.take()
            held_tokens, self._pending_tokens = self._pending_tokens, {"input": 0, "output": 0}
            rank_steps, self._pending_rank_steps = self._pending_rank_steps, {}
            load_bytes, self._pending_load_bytes = self._pending_load_bytes, 0
            experts, self._pending_experts = self._pending_experts, 0
        if rank_steps:  # every step is counted per pid first: the totals are their sums
            m.inc("moescope_steps", sum(held[0] for held in rank_steps.values()))
            step_tokens = sum(held[1] for held in rank_steps.values())
            if step_tokens > 0:
                m.inc("moescope_step_tokens", step_tokens)
        for pid, (rank_step_count, rank_tokens) in sorted(rank_steps.items()):
            m.inc("moescope_rank_steps", rank_step_count, pid=str(pid))
            if rank_tokens > 0:
                m.inc("moescope_rank_step_tokens", rank_tokens, pid=str(pid))
        step_durations: list[float] = []  # the unlabelled step histogram: every pid's durations
        for (name, labels), values in observations.items():
            m.observe_buckets(name, bucket_counts(SPECS[name].buckets, values), float(sum(values)), **dict(labels))
            if name == RANK_STEP_DURATION:
                step_durations.extend(values)
        if step_durations:
            m.observe_buckets(STEP_DURATION, bucket_counts(SPECS[STEP_DURATION].buckets, step_durations),
                              float(sum(step_durations)))
        if load_bytes > 0:
            m.inc("moescope_expert_load_bytes", load_bytes)
        if experts:
            m.set("moescope_experts", experts)
        for direction, n in held_tokens.items():
            if n > 0:
                m.inc("moescope_request_tokens", n, direction=direction)
        for layers, tokens, dropped in pending:
            m.record_expert_matrix(layers=layers, tokens=tokens, dropped=dropped)
        latest: dict[int, tuple[LayerTable, int]] = {}  # each layer's row in the latest table holding it
        for table in tables:
            for row, layer in enumerate(table.layers.tolist()):
                latest[layer] = (table, row)
        run_table: LayerTable | None = None  # consecutive layers of one table: one call, in this order
        run_rows: list[int] = []
        for table, row in latest.values():
            if table is not run_table:
                if run_table is not None:
                    m.set_layer_health_rows(run_table, run_rows)
                run_table, run_rows = table, []
            run_rows.append(row)
        if run_table is not None:
            m.set_layer_health_rows(run_table, run_rows)
        if step_table is not None:
            m.set_step_health(step_table.step_health())

    def shutdown(self, deadline_ns: int) -> None:
        self.force_flush()

    def stats(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ events
    def _request(self, event: RequestJoined) -> None:
        m = self.metrics
        record = event.record
        if self._kernel_totals is None:  # else counted in the kernel (use_kernel_totals)
            m.observe("moescope_request_duration_seconds", (record.end_ns - record.start_ns) / 1e9)
            m.inc("moescope_requests", 1.0)
            m.inc("moescope_request_received_bytes", record.bytes_in)
            m.inc("moescope_response_sent_bytes", record.bytes_out)
        if event.steps:
            wait_s = max(0, event.steps[0].step.start_ns - record.start_ns) / 1e9
            with self._lock:  # held with the breakdown's values until the next flush (one bucketed update)
                self._pending_observations.add("moescope_request_queue_wait_seconds", wait_s)
        phases = event.breakdown
        if phases is not None:
            self._breakdown(phases, answered=record.answered)

    def _breakdown(self, b: RequestBreakdown, *, answered: bool) -> None:
        """The request's phases and tokens; the gen_ai.server.* histograms for answered ones (the
        conventions define them for successful responses). Held until the next flush."""
        with self._lock:
            add = self._pending_observations.add
            for phase, ns in (*b.phase_ns().items(), *b.subphase_ns().items()):
                add("moescope_request_phase_seconds", ns / 1e9, (("phase", phase),))
            tokens = self._pending_tokens
            if b.input_tokens is not None and b.input_tokens > 0:  # counters never go down
                tokens["input"] += b.input_tokens
            if b.output_tokens > 0:
                tokens["output"] += b.output_tokens
            if answered:
                labels = (("gen_ai_operation_name", GEN_AI_OPERATION), ("gen_ai_request_model", model_label(b.model)))
                add("gen_ai_server_request_duration_seconds", b.duration_ns / 1e9, labels)
                add("gen_ai_server_time_to_first_token_seconds", b.ttft_ns / 1e9, labels)
                if b.tpot_ns is not None:
                    add("gen_ai_server_time_per_output_token_seconds", b.tpot_ns / 1e9, labels)
        if self._pending_observations.held > MAX_PENDING_OBSERVATIONS:
            self.force_flush()  # bounded memory even where nothing refreshes the registry

    def _step(self, b: BufferedStep) -> None:
        """Every series of a step is held until the next flush: steps, tokens and durations per pid
        (the unlabelled totals are their sums), expert loads, per-expert counts and the latest
        health; only the windowed Gini (once a second) is written here."""
        step = b.step
        loads = step.expert_loads()
        table = b.table
        pending = self._pending_observations
        with self._lock:
            held = self._pending_rank_steps.get(step.pid)
            if held is None:
                held = self._pending_rank_steps[step.pid] = [0, 0]
            held[0] += 1
            if step.tokens is not None and step.tokens > 0:  # a counter cannot go down: bad payloads are skipped
                held[1] += step.tokens
            pending.add(RANK_STEP_DURATION, step.duration_ns / 1e9, (("pid", str(step.pid)),))
            for load in loads:
                pending.add("moescope_expert_load_duration_seconds", load.duration_ns / 1e9)
                if load.bytes_moved is not None and load.bytes_moved > 0:
                    self._pending_load_bytes += load.bytes_moved
            if len(table):
                self._pending_counts.add(table)
                # the latest table per set of layers (one set, normally): per-layer objects at flush
                key = table.layers.tobytes()
                self._latest_tables.pop(key, None)
                self._latest_tables[key] = table
                if len(self._latest_tables) > MAX_LATEST_TABLES:  # (steps of ever other layer sets)
                    del self._latest_tables[next(iter(self._latest_tables))]
                self._latest_step_health = table
            if b.num_experts:
                self._pending_experts = b.num_experts
        windows = self.windows
        if windows is not None and step.end_ns - self._window_gauges_ns >= WINDOW_GAUGE_PERIOD_NS:
            self._window_gauges_ns = now = step.end_ns
            for layer_index, gini in windows.layer_gini(now).items():
                self.metrics.set("moescope_expert_load_gini_window", gini, layer=str(layer_index))
        if pending.held > MAX_PENDING_OBSERVATIONS:
            self.force_flush()  # bounded memory even where nothing refreshes the registry

    def _telemetry(self, sample: object) -> None:
        m = self.metrics
        if isinstance(sample, NvmlSample):
            for gpu in sample.gpus:
                dev = str(gpu.index)
                for name, value in (
                    ("moescope_device_memory_used_bytes", gpu.memory_used_bytes),
                    ("moescope_device_memory_total_bytes", gpu.memory_total_bytes),
                    ("moescope_pcie_transmit_bytes_per_second", gpu.pcie_tx_bytes_per_s),
                    ("moescope_pcie_receive_bytes_per_second", gpu.pcie_rx_bytes_per_s),
                    ("moescope_target_memory_bytes", gpu.target_memory_used_bytes),
                ):
                    if finite(value):
                        m.set(name, float(value), device=dev)
                for link in gpu.nvlinks:
                    if finite(link.tx_total_bytes):
                        m.set_counter_total(
                            "moescope_nvlink_transmit_bytes",
                            float(link.tx_total_bytes),
                            device=dev,
                            link=str(link.link),
                        )
                    if finite(link.rx_total_bytes):
                        m.set_counter_total(
                            "moescope_nvlink_receive_bytes", float(link.rx_total_bytes), device=dev, link=str(link.link)
                        )
        elif isinstance(sample, HostSample):
            signal = sample.memory_signal()
            if signal is not None:
                m.set("moescope_device_memory_used_bytes", float(signal.used_bytes), device="host")
                m.set("moescope_device_memory_total_bytes", float(signal.total_bytes), device="host")
            if sample.rss_bytes is not None and finite(sample.rss_bytes):
                m.set("moescope_target_memory_bytes", float(sample.rss_bytes), device="host")
