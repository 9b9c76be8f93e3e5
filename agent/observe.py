"""Everything `agent start` runs beside the ingress probe, assembled in one place.

    NVTX rings (collectors/nvtx → moe_convention) ─┐ typed records
    NVML / host memory (collectors/registry)  ─────┤ (daemon.emit)
    ingress probe (probes/ingress)            ─────┼─▶ join ─▶ outputs: traces (OTLP / file), /metrics,
    runtime stats (control socket)            ─────┘           windows ─▶ policy engine ─▶ control socket
                                                                       └─▶ state file ─▶ `agent top` / --tui

Each part is optional and fails soft: a target started without the NVTX variable, a host without
NVIDIA's driver, or a runtime without a control socket costs that part (said once at start), never
the others. Only a bad flag or config stops the start (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moescope import errors
from moescope.agent import state as st
from moescope.agent.daemon import Daemon, live_idle_period_ns
from moescope.agent.export.config import ExportConfig
from moescope.agent.export.setup import Tracing, build_tracing, stats_to_metrics
from moescope.agent.metrics import Metrics, MetricsServer
from moescope.agent.outputs import DEFAULT_LAYER_SPANS_PER_S
from moescope.agent.pipeline import Pipeline, PolicySignals, resource_attributes
from moescope.agent.policy.rules import RuleSpec, Signals
from moescope.agent.policy.stats_source import RuntimeStatsSource
from moescope.agent.source_metrics import publish_source_health
from moescope.collectors.moe_convention import MoeConventionParser, StepBatch
from moescope.collectors.registry import (
    DEFAULT_PERIOD_S,
    CollectorConfig,
    SampledSources,
    build_sampled_sources,
    enabled_collectors,
    sampled_names,
)
from moescope.probes.ingress.loader import DROP_NAMES
from moescope.procfs import name_thread, read_comm

if TYPE_CHECKING:  # imported where an NVTX ring is attached: a start without NVTX never loads it
    from moescope.collectors.nvtx import NvtxCollector

log = logging.getLogger(__name__)

POLICY_RETRY_S = 1.0
# The host-memory sampler runs at the policy's period (200 ms) only while it is the policy's memory
# signal; where NVML or the runtime's own device-pool accounting is, or no policy runs, it feeds the
# live view and /metrics alone and samples once a second (it was 0.25 % of a core at 5 Hz: a sixth
# of an idle agent). The policy loop switches it back at its next evaluation when that changes.
HOST_VIEW_PERIOD_S = 1.0
# ... and while nobody watches live either (no `agent top` on the state file, no --tui), every 5 s:
# /metrics is scraped every 15-30 s, and each sample was a wake-up of its own thread (~0.3-0.5 ms/s
# on this VM, two thirds of it the wake-up: docs/benchmarks.md "The export worker woken once a
# round; a request's spans in one call"). A live view brings it back to once a second at the next
# pacing (the policy's next evaluation; without a policy, the main loop's next round).
HOST_IDLE_PERIOD_S = 5.0
EXPORT_STATS_PERIOD_NS = 250_000_000
# The pipeline's held-back per-step metrics are written into the registry by every scrape (a
# refresh hook) and by the daemon this often, which only bounds what they hold between scrapes:
# written every second for nobody they were ~5 % of the main loop at the reference load.
HELD_METRICS_PERIOD_NS = 10_000_000_000


class Observers:
    def __init__(self, *, args: argparse.Namespace, daemon: Daemon, pipeline: Pipeline, tracing: Tracing,
                 metrics: Metrics, metrics_server: MetricsServer | None) -> None:
        self.args = args
        self.daemon = daemon
        self.pipeline = pipeline
        self.tracing = tracing
        self.metrics = metrics
        self.metrics_server = metrics_server
        self.notes: list[str] = []  # one line each, said at start
        self.targets: list[st.Target] = []
        self.probes: list[str] = []
        self.nvtx: list[NvtxCollector] = []
        self.parsers: list[MoeConventionParser] = []
        self.telemetry: SampledSources | None = None
        self.policy: Any = None
        self.policy_loop: Any = None
        self._policy_failures = 0  # evaluations and peeks that raised, of the policy loops stopped so far
        self._policy_cpu_ns: Counter[str] = Counter()  # the policy loops stopped so far: their CPU by part
        self._policy_cpu_lock = threading.Lock()  # _policy_cpu_ns and policy_loop's stop, against a scrape
        self.stats_signals: Any = None
        self.runtime_stats: RuntimeStatsSource | None = None
        self.nvtx_records: Any = None
        self._nvtx_announced: set[int] = set()
        self._nvtx_announce_hooked = False
        self._policy_pid: int | None = None  # the target the policy follows (built, or waiting for its socket)
        self._policy_retry_ns = 0
        self._policy_retry_hooked = False
        # the audit outcomes of policies closed before this one (a --port target's earlier servers)
        self._closed_audit_outcomes: Counter[str] = Counter()
        self._telemetry_pid: int | None = None
        self._export_to_metrics: Any = None
        self._export_published_ns = 0
        self._held_metrics_ns = 0
        self._policy_signals: PolicySignals | None = None  # the policy's source (_policy_source)
        self._host_paced: tuple[object, int, float] | None = None  # (telemetry, its sources, period) last set
        self._retire_hooked = False
        self.publisher: st.PeriodicPublisher | None = None
        self.live_view = False  # the live view runs in this process (--tui): always watched
        self.started_unix_s = time.time()
        self._meter = st.SelfCostMeter()
        self._event_totals: dict[str, tuple[float, int]] = {}
        self._sources_view: list[st.SourceStats] = []
        self._exited_comms: dict[int, str] = {}  # targets that exited while observed: pid -> comm
        self._rank_drops: dict[int, int] = {}  # pid -> NVTX records its ring lost (read on the daemon thread)
        self._seq = 0
        self._lock = threading.Lock()
        self._round_caps: list[Callable[[], int | None]] = []  # add_round_cap

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, args: argparse.Namespace, *, daemon: Daemon, config: ExportConfig) -> Observers:
        """Exporters and the pipeline, for the export config `agent start` resolved from its flags."""
        metrics = Metrics(max_experts_per_layer=args.metrics_experts)
        server = MetricsServer(metrics, port=args.metrics_port, addr=args.metrics_addr) if args.metrics_port else None
        # No metrics hook in the export worker: it publishes only between drain rounds, and a round
        # never ends while a stalled collector blocks each export; the daemon thread publishes instead.
        tracing = build_tracing(config, resource_attributes=resource_attributes(args.pid or []), metrics=None)
        layer_rate = getattr(args, "trace_layer_spans_per_s", None)
        pipeline = Pipeline(spans=tracing.factory, metrics=metrics, num_experts=args.num_experts, defer_requests=True,
                            span_detail=args.span_detail,
                            layer_spans_per_s=DEFAULT_LAYER_SPANS_PER_S if layer_rate is None else layer_rate)
        daemon.add_sink(pipeline.sink)

        def drain_requests(now_ns: int) -> None:
            # Join only requests that ended before every attached NVTX ring's last full drain
            # (rings are drained every 500 ms at most, or sooner when filling): their steps are in.
            watermark = min([now_ns] + [c.drained_through_ns for c in obs.nvtx if c.attached and not c.finished])
            pipeline.drain_requests(watermark)

        daemon.add_tick_hook(drain_requests, name="requests")

        def expire_steps(_now_ns: int) -> None:
            # Unclaimed steps become their own traces after retention, even when traffic stops.
            pipeline.expire()

        daemon.add_tick_hook(expire_steps, name="expire-steps")

        def encode_spans(_now_ns: int) -> None:
            # The round's spans encoded here, while in cache, for the export worker to write
            # (agent/export/processor.py "Encoding where the spans were made"); never raises.
            tracing.processor.encode_queued()

        daemon.add_tick_hook(encode_spans, name="encode-spans")
        obs = cls(args=args, daemon=daemon, pipeline=pipeline, tracing=tracing, metrics=metrics, metrics_server=server)
        obs.notes.append(tracing.describe())
        obs._export_to_metrics = stats_to_metrics(metrics, tracing.exporter)
        daemon.add_tick_hook(obs._publish_metrics, name="self-metrics")
        metrics.add_refresh_hook(obs._publish_work_cpu)  # (at each scrape: nothing between them)
        daemon.add_tick_hook(obs._pace_rounds, name="pacing")
        return obs

    def policy_cpu_ns(self) -> dict[str, int]:
        """The policy thread's CPU by part of its wake-ups (ns), every policy loop so far together."""
        with self._policy_cpu_lock:
            total = Counter(self._policy_cpu_ns)
            if self.policy_loop is not None:
                total.update(dict(self.policy_loop.cpu_ns))
        return dict(total)

    def _publish_work_cpu(self) -> None:
        """moescope_agent_work_cpu_seconds: the main loop's CPU by source and hook, the policy
        thread's by part of its wake-ups (a refresh hook: run at each scrape, on its thread)."""
        self.metrics.set_work_cpu("main", self.daemon.cpu_ns)
        policy = self.policy_cpu_ns()
        if policy:
            self.metrics.set_work_cpu("policy", policy)

    def add_round_cap(self, cap: Callable[[], int | None]) -> None:
        """``cap()`` bounds the quiet loop's period while it returns a period in ns (None: no bound),
        from the next pacing on (``pace_rounds`` at once makes it the next round's)."""
        self._round_caps.append(cap)

    def pace_rounds(self) -> None:
        """The quiet loop's longest period from the next round on: the live interval while a live
        view reads (this process's --tui, or `agent top` on the state file:
        PeriodicPublisher.watched), else --quiet-drain-s (default 4 s, agent/daemon.py: a round with
        data has a set-up cost of its own); never past a round cap (add_round_cap: a `--port` target
        waiting for its successor)."""
        idle = self.daemon.quiet_period_ns
        if self._watched():
            idle = min(idle, live_idle_period_ns(self.args.interval))  # (a shorter --quiet-drain-s stands)
        for cap in self._round_caps:
            bound = cap()
            if bound is not None:
                idle = min(idle, bound)
        self.daemon.set_idle_period(idle)

    def _pace_rounds(self, _now_ns: int) -> None:
        """Every round (a tick hook): ``pace_rounds``, and the host sampler's period where no
        policy paces it."""
        self.pace_rounds()
        if self.policy is None:  # (with a policy, its evaluations pace the host sampler)
            self._pace_host(policy_signal=False)
        return None

    def _watched(self) -> bool:
        """Whether a live view reads now: this process's --tui, or `agent top` on the state file."""
        publisher = self.publisher
        return self.live_view or (publisher is not None and publisher.watched())

    def _publish_metrics(self, now_ns: int) -> None:
        """Self-metrics and the live view's source rows, on the daemon thread (sources are polled
        there, so their counters are read there too) and whether or not a state file is written."""
        # as often as the live state is published (1 s; 250 ms with --tui), at most every 250 ms:
        # a scrape refreshes /metrics by itself, so nothing needs it more often (3.7 ms a round)
        if now_ns - self._export_published_ns < max(EXPORT_STATS_PERIOD_NS, int(self.args.interval * 1e9)):
            return None
        self._export_published_ns = now_ns
        if now_ns - self._held_metrics_ns >= HELD_METRICS_PERIOD_NS:
            self._held_metrics_ns = now_ns
            self.metrics.refresh()  # the pipeline's held-back per-step metrics (also done at every scrape)
        self._export_to_metrics(self.tracing.stats())
        self._sources_view = self._source_stats()
        self._rank_drops = self._nvtx_drops_per_pid()
        self._publish_parser_anomalies()
        publish_source_health(self.metrics, self.daemon.sources)
        engine = self.policy
        if engine is not None:
            from moescope.agent.policy import publish

            publish.publish_rule_metrics(engine, self.metrics)
        return None

    def attach(self, pids: list[int], *, probe_names: list[str]) -> None:
        """NVTX per target, telemetry and policy for the first target. Soft failures become notes."""
        self.probes = list(probe_names)
        for pid in pids:
            self.targets.append(st.Target(pid=pid, comm=read_comm(pid) or "?"))
        enabled = enabled_collectors(self.args)
        if "nvtx" in enabled:
            self._attach_nvtx(pids)
        if enabled & set(sampled_names()):
            self._attach_telemetry(pids[0] if pids else None)
        self._attach_policy(pids[0] if pids else None)
        try:
            state = st.StatePublisher(state_dir=Path(self.args.state_dir) if self.args.state_dir else None)
        except errors.SourceUnavailable as exc:
            # A side channel: without it `agent top` cannot see this agent; everything else goes on.
            self.notes.append(f"live state off (`agent top` will not see this agent): {exc}")
            return
        self.publisher = st.PeriodicPublisher(state, self.snapshot, interval_s=self.args.interval)
        if self.publisher.watch_error is not None:
            self.notes.append(f"live state written every {self.args.interval:g} s, read or not: "
                              f"{self.publisher.watch_error}")

    # ------------------------------------------------------------------ targets coming and going
    def detach(self, pid: int) -> None:
        """The target `pid` exited: stop the telemetry and the policy that followed it. Its NVTX
        collector drains what is left and finishes by itself (it sees the exit), then leaves the
        daemon's sources. Counters stay for the summary."""
        for target in self.targets:
            if target.pid == pid:
                self._exited_comms[pid] = target.comm  # the ranks panel keeps naming it, marked
        self.targets = [t for t in self.targets if t.pid != pid]
        if not self._retire_hooked:
            self._retire_hooked = True
            self.daemon.add_tick_hook(self._retire_finished_nvtx, name="nvtx-retire")
        if self.telemetry is not None and self._telemetry_pid == pid:
            self.telemetry.close()  # one shared deadline for all of them
            for source in self.telemetry.sources:
                self.daemon.sources.remove(source)
            self.telemetry = None
        if self._policy_pid == pid:
            self._stop_policy()

    def _retire_finished_nvtx(self, _now_ns: int) -> None:
        for collector in [c for c in self.nvtx if c.finished and c in self.daemon.sources]:
            collector.close()
            self.daemon.sources.remove(collector)
        return None

    def reattach(self, pid: int) -> list[str]:
        """A new target (a restarted server): NVTX, telemetry and policy follow it. Returns the
        lines to say (one per part that could not follow, and what did)."""
        first_note = len(self.notes)
        self.targets.append(st.Target(pid=pid, comm=read_comm(pid) or "?"))
        parts = ["ingress"] if "ingress" in self.probes else []  # (the probe follows it in agent/start.py)
        enabled = enabled_collectors(self.args)
        if "nvtx" in enabled:
            before = len(self.nvtx)
            self._attach_nvtx([pid])
            if len(self.nvtx) > before:
                parts.append("nvtx")
        if enabled & set(sampled_names()) and self.telemetry is None:
            self._attach_telemetry(pid)
            parts.append("telemetry")
        if not self.args.no_policy and self.policy is None and self._policy_pid is None:
            self._attach_policy_soft(pid)
            parts.append("policy" if self.policy is not None else "policy (waiting for its control socket)")
        lines = self.notes[first_note:]
        lines.append(f"following pid {pid}: {', '.join(parts) or 'nothing (no source could follow it)'}")
        return lines

    def _attach_policy_soft(self, pid: int) -> None:
        """Policy for a re-attached target: never an error; a missing socket is looked for again."""
        try:
            self._build_policy(pid)
        except errors.ControlError as exc:
            self.notes.append(f"policy waiting: {exc} (looking again every {POLICY_RETRY_S:.0f} s)")
            self._policy_pid = pid
            self._ensure_policy_retry()
            return
        except errors.MoescopeError as exc:
            self.notes.append(f"policy off: {exc}")
            return
        if self.policy is not None:
            self._start_policy()

    def _ensure_policy_retry(self) -> None:
        if not self._policy_retry_hooked:
            self._policy_retry_hooked = True
            self.daemon.add_tick_hook(self._retry_policy, name="policy-retry")

    def _stop_policy(self) -> None:
        self._stop_policy_loop()
        if self.policy is not None:
            self._closed_audit_outcomes.update(_outcomes(self.policy.audit.counts()))
            self.policy.close()
            self.policy = None
        if self.runtime_stats is not None:
            self.daemon.sources.remove(self.runtime_stats)
            self.runtime_stats = None
        if self.stats_signals is not None:
            self.stats_signals.close()
            self.stats_signals = None
        self._policy_pid = None

    def _attach_nvtx(self, pids: list[int]) -> None:
        from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
        from moescope.collectors.nvtx import NvtxCollector

        if self.args.nvtx_records and self.nvtx_records is None:
            from moescope.agent.nvtx_records import NvtxRecordsSink

            self.nvtx_records = NvtxRecordsSink(self.args.nvtx_records)
        def emit_steps(steps: list[StepEvent]) -> None:
            self.daemon.emit(StepBatch(tuple(steps)))

        for pid in pids:
            parser = MoeConventionParser(sink=emit_steps)
            sink: Any = parser
            if self.nvtx_records is not None:
                sink = self.nvtx_records.chain(parser)
            try:
                collector = NvtxCollector(pid, sink=sink)
            except (errors.SourceUnavailable, errors.NoSuchProcess) as exc:
                # A target that already exited is reported by the daemon's exit check (exit 8).
                self.notes.append(f"NVTX off for pid {pid}: {exc}")
                continue
            self.nvtx.append(collector)
            self.parsers.append(parser)
            self.daemon.add_source(collector)
            if not self._nvtx_announce_hooked:
                self._nvtx_announce_hooked = True
                self.daemon.add_tick_hook(self._announce_nvtx, name="nvtx-announce")
        if self.nvtx and "nvtx" not in self.probes:
            self.probes.append("nvtx")

    def _announce_nvtx(self, _now_ns: int) -> None:
        # The injection library idles (records nothing) until an agent attaches to its ring: say when.
        for collector in self.nvtx:
            if collector.attached and id(collector) not in self._nvtx_announced:
                self._nvtx_announced.add(id(collector))
                print(f"agent: nvtx: attached to the ring of pid {collector.pid}", file=sys.stderr, flush=True)
        return None

    def _attach_telemetry(self, pid: int | None) -> None:
        """One sampled source per enabled registry collector (NVML, host memory) for `pid`."""
        built = build_sampled_sources(
            CollectorConfig(
                target_pid=pid, budget_bytes=self.args.memory_budget_bytes, nvml_library=self.args.nvml_library
            ),
            emit=self.daemon.emit,
            enabled=enabled_collectors(self.args),
        )
        for name, why in built.unavailable.items():
            if name != "nvml":  # the NVML gateway already said its one line ("no NVIDIA driver ...")
                self.notes.append(f"telemetry: {name} off: {why}")
        self.telemetry = built
        self._telemetry_pid = pid
        if self.args.no_policy:
            self._pace_host(policy_signal=False)
        for source in built.sources:
            self.daemon.add_source(source)  # daemon.close() closes them under their one deadline
        if "telemetry" not in self.probes:
            self.probes.append("telemetry")

    def _attach_policy(self, pid: int | None) -> None:
        if self.args.no_policy:
            self.notes.append("policy off (--no-policy)")
            return
        try:
            self._build_policy(pid)
        except errors.ControlError as exc:
            if self.args.control_socket and not self.args.command:
                raise  # asked for explicitly beside a running server: not finding it is an error
            # A runtime the agent launched (or one still starting) creates its socket later.
            self.notes.append(f"policy waiting: {exc} (looking again every {POLICY_RETRY_S:.0f} s)")
            self._policy_pid = pid
            self._ensure_policy_retry()

    def _retry_policy(self, now_ns: int) -> None:
        if self.policy is not None or self._policy_pid is None or now_ns - self._policy_retry_ns < POLICY_RETRY_S * 1e9:
            return None
        self._policy_retry_ns = now_ns
        try:
            self._build_policy(self._policy_pid)
        except errors.ControlError:
            return None
        except errors.MoescopeError as exc:  # e.g. a policy file error found late: say it, go on
            log.warning("policy off: %s", exc)
            self._policy_pid = None
            return None
        # news, not a warning: the policy waited for a runtime still starting, as its start line said
        print(f"agent: {self.notes[-1]} (its control socket found)", file=sys.stderr, flush=True)
        self._start_policy()
        return None

    def _build_policy(self, pid: int | None) -> None:
        from moescope.agent.policy import publish
        from moescope.agent.policy.actuator import find_control_socket
        from moescope.agent.policy.stats_source import RuntimeStatsSignals, queue_floor_for
        from moescope.agent.policy.wiring import build_policy

        if self.args.control_socket:
            # (a runtime launched after `--` makes it seconds later: the policy waits for it, where
            # it once started at once and warned that it could not read the runtime's state)
            if not Path(self.args.control_socket).is_socket():
                raise errors.ControlError(f"no control socket at {self.args.control_socket}")
        elif pid is not None:
            find_control_socket(pid)  # ControlError until the runtime has made it (also in --dry-run)
        engine = build_policy(self.args, runtime_pid=pid)
        if engine is None:
            return
        self._policy_pid = pid
        engine.audit.add_hook(publish.metrics_hook(self.metrics))
        engine.audit.add_hook(publish.tracer_hook(self.tracing.provider.get_tracer("moescope.policy")))
        actuator = getattr(engine, "actuator", None)
        socket_path = getattr(actuator, "socket_path", None) or self.args.control_socket
        if socket_path:
            # Queue depth per expert is the runtime's own number (control-socket stats).
            self.stats_signals = RuntimeStatsSignals(socket_path, timeout_s=engine.config.command_timeout_ms / 1000.0,
                                                     runtime_pid=pid, queue_floor=queue_floor_for(engine.rules))
            # ... and what it reads (precision, residency) reaches spans and the live view as records
            self.runtime_stats = RuntimeStatsSource(self.stats_signals, emit=self.daemon.emit)
            self.daemon.add_source(self.runtime_stats)
        mode = "dry-run" if self.args.dry_run else "acting"
        self.notes.append(
            f"policy: {len(engine.rules)} rules, {mode}, control socket {socket_path}, audit {self.args.policy_audit}"
        )
        self.policy = engine

    def _start_policy(self) -> None:
        from moescope.agent.policy.engine import PolicyLoop

        assert self.policy is not None
        self.policy.start()
        period_s = self.policy.config.sample_period_s
        # The policy thread wakes every period anyway: it peeks at the rings for the main loop,
        # which then sleeps until its round (or until a peek finds a ring filling).
        peeks = self.daemon.lend_peeks(int(period_s * 1e9))
        self.policy_loop = PolicyLoop(self.policy, self._policy_source(), period_s=period_s,
                                      after_period=self.daemon.outside_peek if peeks else None)
        self.policy_loop.start()

    def _stop_policy_loop(self) -> None:
        if self.policy_loop is not None:
            self.policy_loop.stop()
            # (a failing evaluation is logged once; the summary says how many there were)
            self._policy_failures += self.policy_loop.source_errors + self.policy_loop.after_errors
            if self.policy_loop.after_period is not None:
                self.daemon.take_back_peeks()
            with self._policy_cpu_lock:  # (a scrape sees this loop's CPU once, never twice or not at all)
                self._policy_cpu_ns.update(self.policy_loop.cpu_ns)
                self.policy_loop = None

    def policy_signals(self) -> Signals:
        """The pipeline's windows, plus the runtime's queue depths (and its view where NVTX is off):
        the signals the policy's rules read (the others are left NaN / empty). The windows' fields
        are reused while no data came in for up to windows.SIGNALS_REUSE_NS (agent/outputs/windows.py).
        Made by the compiled ``PolicySignals`` (agent/pipeline.py), which the policy loop calls."""
        return self._policy_source()()

    def _policy_source(self) -> PolicySignals:
        """The policy's signal source for the runtime stats it reads now (made again when they change)."""
        held = self._policy_signals
        if held is None or held.stats is not self.stats_signals:
            held = self._policy_signals = PolicySignals(
                self.pipeline, self.stats_signals, rules=self._policy_rules, own=self._own_signals,
                pace=self._pace_host, nvtx=self.nvtx)
        return held

    def _policy_rules(self) -> tuple[RuleSpec, ...] | None:
        engine = self.policy
        return None if engine is None else engine.rules

    def _own_signals(self, wanted: frozenset[str] | None) -> dict[str, Any]:
        """Signals a subclass computes itself, as Signals fields (none here)."""
        return {}

    def _pace_host(self, *, policy_signal: bool) -> None:
        """The host sampler at the policy's period (its configured sample_period_ms) while it
        carries the policy's memory signal, else once a second while a live view reads
        (HOST_VIEW_PERIOD_S) and every HOST_IDLE_PERIOD_S while nobody does."""
        telemetry = self.telemetry  # read once: the daemon thread may detach it meanwhile
        if telemetry is None:
            return
        engine = self.policy
        policy_period_s = engine.config.sample_period_s if engine is not None else DEFAULT_PERIOD_S
        if policy_signal:
            period_s = policy_period_s
        else:
            period_s = HOST_VIEW_PERIOD_S if self._watched() else HOST_IDLE_PERIOD_S
        sources = telemetry.sources
        paced = (telemetry, len(sources), period_s)
        if self._host_paced == paced:
            return  # (the policy's wake asks every period; the sources are set when that changes)
        self._host_paced = paced
        for source in sources:
            if source.name == "host":
                source.set_period(period_s)

    # ------------------------------------------------------------------ run
    def serve_metrics(self) -> None:
        """Bind and serve /metrics (UsageError if the address cannot be bound): `agent start` does it
        before it lets a launched command run, so a port in use never leaves that command running."""
        if self.metrics_server is not None and not self.metrics_server.serving:
            port = self.metrics_server.start()
            print(f"agent: metrics: http://{self.args.metrics_addr}:{port}/metrics", file=sys.stderr, flush=True)

    def start(self) -> None:
        self.serve_metrics()
        if self.policy is not None:
            self._start_policy()
        if self.publisher is not None:
            self.publisher.start()

    def run_with_tui(self, daemon: Daemon, *, duration_ns: int | None, interval_s: float) -> str:
        """The daemon on a thread, the live view in the foreground; either ending stops both."""
        from moescope.agent.tui import run_live

        result: dict[str, str] = {}
        done = threading.Event()

        def loop() -> None:
            name_thread("ms-daemon")
            try:
                result["reason"] = daemon.run(duration_ns=duration_ns)
            finally:
                done.set()

        thread = threading.Thread(target=loop, name="moescope-daemon", daemon=True)
        self.live_view = True  # (its rounds at the view's interval: _pace_rounds)
        # Log lines would tear the full-screen view: hold them, and say them once it closes.
        held = HeldLogs()
        held.capture()
        thread.start()
        try:
            run_live(self.snapshot, interval_s, should_stop=done.is_set)
        finally:
            daemon.stop()
            thread.join()
            held.replay()
        return result.get("reason", "signal")

    def close(self) -> None:
        """Stop in dependency order; one deadline for the trace export."""
        self._stop_policy_loop()
        if self.policy is not None:
            self.policy.close()
        if self.stats_signals is not None:
            self.stats_signals.close()
        if self.publisher is not None:
            self.publisher.stop()
        if self.nvtx_records is not None:
            self.nvtx_records.close()
        # buffered steps out (unjoined ones as traces), outputs flushed; the export drained between
        # chunks while it keeps up, within a budget (a stalled backend then drops, counted)
        self.pipeline.shutdown(between=ExportDrain(self.tracing.force_flush))
        final = self.tracing.shutdown()
        if self._export_to_metrics is not None:
            self._export_to_metrics(final)
        if self.metrics_server is not None:
            self.metrics_server.stop()

    # ------------------------------------------------------------------ report
    def describe(self) -> list[str]:
        return list(self.notes)

    def summary_lines(self) -> list[str]:
        lines = []
        p = self.pipeline.stats()
        lines.append(
            f"pipeline: {p['requests']} requests ({p['requests_joined']} joined to steps), {p['steps']} steps "
            f"({p['steps_unjoined']} unjoined), {p['spans']} spans, layer subtrees "
            f"{p.get('layer_subtrees_kept_slow', 0)} slow + {p.get('layer_subtrees_kept_budget', 0)} kept, "
            f"{p.get('layer_subtrees_sampled_out', 0)} sampled out, "
            f"{p.get('step_trees_dropped_overflow', 0)} let go over the memory bound"
        )
        for collector, parser in zip(self.nvtx, self.parsers, strict=True):
            s = collector.stats()
            drops = {k: v for k, v in s.items() if _is_drop(k) and v}
            anomalies = {k: v for k, v in parser.stats().items() if k in _PARSER_ANOMALIES and v}
            lines.append(
                f"nvtx pid {collector.pid}: {s.get('records_received', 0)} records, drops {_counts_text(drops)}, "
                f"anomalies {_counts_text(anomalies)}"
            )
        export = self.tracing.stats()
        lines.append(f"export: {_fmt_export(export)}")
        if self.policy is not None or self._closed_audit_outcomes:
            outcomes = self._closed_audit_outcomes.copy()
            if self.policy is not None:
                outcomes.update(_outcomes(self.policy.audit.counts()))
            loop = self.policy_loop
            failed = self._policy_failures + (loop.source_errors + loop.after_errors if loop is not None else 0)
            # by outcome: an action the runtime refused or never answered is as visible as one it took
            lines.append(f"policy: {outcomes.total()} audit records{_by_outcome(outcomes)}, "
                         f"{failed} evaluations failed")
        signals = self.stats_signals
        if signals is not None and signals.polls:
            page = f", {signals.page_errors} stats page errors" if signals.page_errors else ""
            lines.append(f"runtime reads: {signals.polls}, {signals.page_periods} of them from its stats page, "
                         f"{signals.poll_errors} failed{page}")
        return lines

    def snapshot(self) -> st.Snapshot:
        with self._lock:
            self._seq += 1
            seq = self._seq
        requests, moe, devices = self.pipeline.panels()  # the runtime's precision/residency included
        policy = st.Policy()
        engine = self.policy  # read once: a re-attach may replace it meanwhile (daemon thread)
        if engine is not None:
            from moescope.agent.policy import publish

            policy = publish.policy_snapshot(engine)
        header = st.Header(
            agent_pid=os.getpid(),
            started_unix_s=self.started_unix_s,
            targets=list(self.targets),
            probes_attached=list(self.probes),
            sources=list(self._sources_view),
            dry_run=bool(getattr(self.args, "dry_run", False)),
        )
        return st.Snapshot(
            header=header,
            taken_unix_s=time.time(),
            seq=seq,
            publish_interval_s=self.args.interval,
            requests=requests,
            phases=self.pipeline.windows.phases_panel(),
            network=self.pipeline.windows.network_panel(),
            moe=moe,
            ranks=self.pipeline.windows.ranks_panel(
                nvtx_drops=dict(self._rank_drops),
                comms={**self._exited_comms, **{t.pid: t.comm for t in self.targets}},
                exited=self._exited_comms.keys() - {t.pid for t in self.targets}),
            devices=devices,
            policy=policy,
            self_cost=self._meter.sample(),
        )

    def _nvtx_drops_per_pid(self) -> dict[int, int]:
        """Records each attached ring lost (every drop counter summed), also as a per-pid counter."""
        out: dict[int, int] = {}
        for collector in list(self.nvtx):  # retired rings too: their counts stay in the panel
            try:
                stats = collector.stats()
            except Exception:  # a source's stats must not break the live view
                continue
            drops = sum(v for k, v in stats.items() if _is_drop(k) and isinstance(v, int))
            out[collector.pid] = out.get(collector.pid, 0) + drops
        for pid, drops in out.items():
            self.metrics.set_counter_total("moescope_rank_nvtx_records_dropped", float(drops), pid=str(pid))
        return out

    def _publish_parser_anomalies(self) -> None:
        """The moe parsers' counts of events they could not place, summed over rings, every reason
        (0 included) once a ring is watched: moescope_nvtx_anomalies_total{reason}."""
        if not self.parsers:
            return
        totals = dict.fromkeys(_PARSER_ANOMALIES, 0)
        for parser in self.parsers:  # (retired rings' parsers stay in the list: the sums never go down)
            stats = parser.stats()
            for reason in _PARSER_ANOMALIES:
                totals[reason] += int(stats.get(reason, 0))
        for reason, count in totals.items():
            self.metrics.set_counter_total("moescope_nvtx_anomalies", float(count), reason=reason)

    def _source_stats(self) -> list[st.SourceStats]:
        out = []
        now = time.monotonic()
        # Sources of one name (an NVTX ring per producer pid) are summed into one row and one series:
        # their totals set one counter, and per-pid detail is the ranks panel's.
        by_name: dict[str, tuple[int, dict[str, int]]] = {}
        sources: list[Any] = list(self.daemon.sources)
        # retired rings too, so the sums (cumulative counters) never go down when a producer exits
        sources += [collector for collector in self.nvtx if collector not in sources]
        for source in sources:
            try:
                stats = source.stats()
            except Exception:  # a source's stats must not break the live view
                continue
            events = int(stats.get("records", stats.get("records_received", stats.get("samples_emitted", 0))) or 0)
            seen_events, seen_lost = by_name.get(source.name, (0, {}))
            for k, v in stats.items():
                if _is_drop(k) and isinstance(v, int):
                    seen_lost[k] = seen_lost.get(k, 0) + v
            by_name[source.name] = (seen_events + events, seen_lost)
        for name, (events, lost) in by_name.items():
            drops = sum(lost.values())
            last = self._event_totals.get(name)
            rate = None
            if last is not None and now > last[0]:
                rate = max(0.0, (events - last[1]) / (now - last[0]))
            self._event_totals[name] = (now, events)
            self.metrics.set_counter_total("moescope_agent_events", float(events), source=name)
            for reason, count in lost.items():
                self.metrics.set_counter_total(
                    "moescope_agent_events_dropped", float(count), source=name, reason=reason
                )
            out.append(st.SourceStats(name=name, events_per_s=rate, drops_total=drops))
        # Trace export as a row of its own: spans exported per second; lost = failed + dropped.
        export = self.tracing.stats()
        last = self._event_totals.get("export")
        rate = None
        if last is not None and now > last[0]:
            rate = max(0.0, (export.exported - last[1]) / (now - last[0]))
        self._event_totals["export"] = (now, export.exported)
        out.append(st.SourceStats(name="export", events_per_s=rate, drops_total=export.failed + export.dropped))
        return out


class ExportDrain:
    """Called between the chunks of the closing flush: lets the trace export write what is queued
    (``Tracing.force_flush``), FLUSH_DRAIN_CALL_S a call, until FLUSH_DRAIN_BUDGET_S in all or a
    call that did not finish (the backend is slow or down: later chunks are queued as they come
    and what does not fit is dropped and counted, as before)."""

    def __init__(self, flush: Callable[[float], bool], *, budget_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._flush = flush
        self._clock = clock
        self._until = clock() + (FLUSH_DRAIN_BUDGET_S if budget_s is None else budget_s)
        self.calls = 0
        self.gave_up = False

    def __call__(self) -> None:
        if self.gave_up:
            return
        left = self._until - self._clock()
        if left <= 0:
            self.gave_up = True
            return
        self.calls += 1
        if not self._flush(min(FLUSH_DRAIN_CALL_S, left)):
            self.gave_up = True


FLUSH_DRAIN_CALL_S = 2.0
FLUSH_DRAIN_BUDGET_S = 10.0


class HeldLogs(logging.Handler):
    """Holds the root logger's records while a full-screen view owns the terminal, then hands them
    to the handlers it displaced, in order. Bounded: past ``max_records`` the oldest are dropped,
    and the replay says how many. (Not hold/release: logging.Handler's lock owns those names.)"""

    def __init__(self, *, max_records: int = 1000) -> None:
        super().__init__(level=logging.NOTSET)
        self.records: deque[logging.LogRecord] = deque(maxlen=max_records)
        self.dropped = 0
        self._displaced: list[logging.Handler] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
        self.records.append(record)

    def capture(self) -> None:
        root = logging.getLogger()
        self._displaced = list(root.handlers)
        for handler in self._displaced:
            root.removeHandler(handler)
        root.addHandler(self)

    def replay(self) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        for handler in self._displaced:
            root.addHandler(handler)
        if self.dropped:
            log.warning("%d log lines dropped while the live view was up (the oldest)", self.dropped)
        for record in self.records:
            root.handle(record)
        self.records.clear()


_INGRESS_DROPS = frozenset(DROP_NAMES.values())
# An NVTX ring's records the agent never received that no "*drop*" counter holds: slots claimed and
# never committed (a writer that died or stalled mid-record, a ring file cut short), and what a
# previous agent left in the ring at attach. (The producer's own drops are its *_dropped counters.)
_NVTX_LOSSES = frozenset(("lost_uncommitted", "skipped_at_attach"))


def _is_drop(counter: str) -> bool:
    """A source counter that counts lost events: named "*drop*", one of the ingress probe's
    in-kernel loss counters (ring full, connection evicted, in-flight table full), or an NVTX
    ring's records lost on the agent's side."""
    return "drop" in counter or counter in _INGRESS_DROPS or counter in _NVTX_LOSSES


def _counts_text(counts: dict[str, int]) -> str:
    """`0`, or `21 (orphans 21)`, or `5 (misplaced 3, unknown_names 2)`: a total and its parts."""
    if not counts:
        return "0"
    parts = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{sum(counts.values())} ({parts})"


def _outcomes(counts: Mapping[tuple[str, str, str], int]) -> Counter[str]:
    """An audit log's (rule, decision, outcome) counts by outcome."""
    out: Counter[str] = Counter()
    for (_rule, _decision, outcome), n in counts.items():
        out[outcome] += n
    return out


def _by_outcome(outcomes: Counter[str]) -> str:
    """` (40 ok, 6 timeout)`: the audit records by outcome, most first; nothing when there are none."""
    if not outcomes:
        return ""
    return " (" + ", ".join(f"{n} {outcome}" for outcome, n in outcomes.most_common()) + ")"


_PARSER_ANOMALIES = (
    "unknown_names", "malformed_payloads", "malformed_categories", "misplaced", "orphans", "pending_overflow"
)


def _fmt_export(stats: Any) -> str:
    fields = getattr(stats, "__dataclass_fields__", None)
    if fields:
        return ", ".join(f"{name} {getattr(stats, name)}" for name in fields)
    return str(stats)
