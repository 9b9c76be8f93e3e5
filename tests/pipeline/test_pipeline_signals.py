"""What the pipeline hands the policy (Signals), the TUI (panels -> Snapshot) and Prometheus (Metrics),
each number recomputed independently with numpy from the inputs that were fed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pytest

from moescope.agent import state as st
from moescope.agent.metrics import Metrics
from moescope.agent.outputs.windows import ROUTING_BUCKETS
from moescope.agent.pipeline import Pipeline
from moescope.agent.policy.rules import Signals
from moescope.collectors.moe_convention import StepEvent
from moescope.collectors.nvml import NA, GpuSample, NvLinkSample, NvmlSample, ProcessGpuMemory
from moescope.collectors.registry import TelemetryRecord
from moescope.probes.ingress.loader import IngressRecord

from .scenario import (
    MEMORY,
    MS,
    NUM_EXPERTS,
    NUM_LAYERS,
    PID_A,
    PRECISION,
    RETENTION_NS,
    STEP_FEED_DELAY_NS,
    TARGET_RSS_BYTES,
    FakeClock,
    build_step,
    counts_vector,
    feed,
    host_sample,
    main_scenario,
    percentile,
    record,
    ref_entropy_bits,
    ref_gini,
    ref_layer,
    ref_step,
    runtime_state,
)

WINDOW_NS = 10_000 * MS
RATE_WINDOW_NS = 5_000 * MS  # the TUI's events/s window in agent/pipeline.py
GAP_MS = (12_000.0, 23_500.0)  # a lull in the stream: the windows drain while the policy keeps sampling


@dataclass
class Run:
    """A 30 s stream with an 11.5 s lull: steps with varied durations, loads and skew; requests with varied latency."""

    steps: list[StepEvent]
    records: list[IngressRecord]

    def events(self) -> list[tuple[int, int, str, object]]:
        out: list[tuple[int, int, str, object]] = [
            (s.end_ns + STEP_FEED_DELAY_NS, i, "step", s) for i, s in enumerate(self.steps)
        ]
        out += [(r.end_ns + 300_000, i, "request", r) for i, r in enumerate(self.records)]
        return sorted(out, key=lambda e: (e[0], e[1], e[2]))


def make_run(seed: int) -> Run:
    rng = np.random.default_rng(seed)
    steps = []
    t = 100.0
    while t < 30_000:
        dur = float(np.clip(rng.lognormal(np.log(4.0), 0.7), 0.5, 80.0))
        load = [None, None, 0, 1, 2][int(rng.integers(0, 5))]
        steps.append(
            build_step(rng, pid=PID_A, tid=4102, start_ms=t, end_ms=t + dur, keys=[], tokens=int(rng.integers(1, 48)),
                       load_layer=load, skew=0.2 + 4.0 * t / 30_000)
        )
        t += dur + float(rng.uniform(1.0, 120.0))
        if GAP_MS[0] <= t < GAP_MS[1]:
            t = GAP_MS[1]
    records = []
    t = 50.0
    i = 0
    while t < 30_000:
        latency = float(np.clip(rng.lognormal(np.log(60.0), 0.9), 1.0, 2_000.0))
        records.append(
            record(pid=PID_A, tid=4101, fd=900 + i % 4, generation=1, seq=i, peer=("127.0.0.1", 41000 + i % 4),
                   start_ms=t, end_ms=t + latency, bytes_in=int(rng.integers(200, 600)),
                   bytes_out=int(rng.integers(100, 9000)), answered=bool(rng.random() > 0.05))
        )
        t += float(rng.uniform(10.0, 150.0))
        if GAP_MS[0] <= t < GAP_MS[1]:
            t = GAP_MS[1]
        i += 1
    return Run(steps=steps, records=records)


def in_window(t_ns: int, now_ns: int) -> bool:
    return t_ns > now_ns - WINDOW_NS  # a window covers (now - W, now]


def routing_window_steps(steps: list[StepEvent], now_ns: int) -> list[StepEvent]:
    """The steps the routing window still holds: it sums steps (by end time, in arrival order) into
    buckets of WINDOW_NS / ROUTING_BUCKETS, a bucket starting at its first step, and holds a bucket
    while its last step is inside the window (agent/outputs/windows.py)."""
    bucket_ns = WINDOW_NS // ROUTING_BUCKETS
    buckets: list[list[StepEvent]] = []
    start = last = 0
    for step in steps:
        t = max(step.end_ns, last)
        if not buckets or t >= start + bucket_ns:
            buckets.append([])
            start = t
        buckets[-1].append(step)
        last = t
    held: list[StepEvent] = []
    for bucket in buckets:
        if in_window(max(s.end_ns for s in bucket), now_ns):
            held.extend(bucket)
    return held


def expected_signals(steps: Iterable[StepEvent], records: Iterable[IngressRecord], now_ns: int) -> Signals:
    steps = list(steps)
    # loads are windowed by their own end time, steps by theirs
    load_ms = [
        (ld.end_ns - ld.start_ns) / 1e6
        for s in steps for layer in s.layers for ld in layer.loads if in_window(ld.end_ns, now_ns)
    ]
    routed = routing_window_steps(steps, now_ns)
    steps = [s for s in steps if in_window(s.end_ns, now_ns)]
    step_ms = [(s.end_ns - s.start_ns) / 1e6 for s in steps]
    request_ms = [(r.end_ns - r.start_ns) / 1e6 for r in records if in_window(r.end_ns, now_ns)]
    gini: dict[int, float] = {}
    ratio: dict[int, float] = {}
    for layer in range(NUM_LAYERS):
        routers = [s.layers[layer].router for s in routed]
        if not routers:
            continue
        counts = np.sum([counts_vector(r.tokens, NUM_EXPERTS) for r in routers if r is not None], axis=0)
        weights = np.array([sum(r.tokens.values()) for r in routers if r is not None], dtype=np.float64)
        bits = np.array([r.entropy_bits for r in routers if r is not None])
        gini[layer] = ref_gini(counts)
        ratio[layer] = float(np.average(bits, weights=weights) / np.log2(NUM_EXPERTS))
    return Signals(
        t_s=now_ns / 1e9,
        step_p99_ms=percentile(step_ms, 99) if step_ms else math.nan,
        expert_load_p99_ms=percentile(load_ms, 99) if load_ms else math.nan,
        request_p99_ms=percentile(request_ms, 99) if request_ms else math.nan,
        expert_load_gini=gini,
        router_entropy_ratio=ratio,
    )


def same(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-9, abs=1e-12)


# what the policy's rules may ask for: the default rules' signals, a phase rule's, a network one's
WANTED: tuple[frozenset[str], ...] = (
    frozenset(("step_p99_ms", "device_memory_used_ratio", "expert_queue_tokens", "expert_load_gini",
               "router_entropy_ratio", "expert_load_p99_ms", "request_p99_ms")),
    frozenset(("request_phase_decode_p99_ms", "request_ttft_p99_ms")),
    frozenset(("tcp_retransmits_per_s",)),
    frozenset(),
)


def check_wanted(pipeline: Pipeline, full: Signals) -> None:
    """signals(wanted=...) computes the wanted fields as signals() does, and leaves the rest unset."""
    unset = Signals(t_s=full.t_s)
    for wanted in WANTED:
        part = pipeline.signals(full.t_s, wanted=wanted)
        for f in dataclasses.fields(Signals):
            want = getattr(full if f.name in wanted or f.name == "t_s" else unset, f.name)
            got = getattr(part, f.name)
            assert same(got, want) if isinstance(want, float) else got == want, (sorted(wanted), f.name)


def test_wanted_signals_cover_every_field() -> None:
    from moescope.agent.outputs.windows import _ALL_SIGNALS

    runtime_only = {"t_s", "expert_queue_tokens"}  # (the snapshot's time; the runtime's stats give the queues)
    assert _ALL_SIGNALS | runtime_only == {f.name for f in dataclasses.fields(Signals)}


def test_signals_over_sliding_windows() -> None:
    run = make_run(seed=11)
    clock = FakeClock()
    pipeline = Pipeline(spans=None, clock=clock, window_ns=WINDOW_NS)
    assert math.isnan(pipeline.signals().step_p99_ms) and pipeline.signals().expert_load_gini == {}
    pipeline.on_telemetry(TelemetryRecord(collector="host", sample=host_sample()))
    fed_steps: list[StepEvent] = []
    fed_records: list[IngressRecord] = []
    checks = 0

    def check(now_ns: int) -> bool:
        clock.now_ns = now_ns  # the clock only moves forward: a query evicts for good
        sig = pipeline.signals()
        want = expected_signals(fed_steps, fed_records, now_ns)
        assert sig.t_s == now_ns / 1e9
        for name in ("step_p99_ms", "expert_load_p99_ms", "request_p99_ms"):
            assert same(getattr(sig, name), getattr(want, name)), (name, now_ns)
        for name in ("expert_load_gini", "router_entropy_ratio"):
            got, exp = dict(getattr(sig, name)), getattr(want, name)
            assert isinstance(exp, dict) and sorted(got) == sorted(exp), (name, now_ns)
            for layer, value in exp.items():
                assert got[layer] == pytest.approx(value, rel=1e-9), (name, layer, now_ns)
        assert sig.device_memory_used_ratio == pytest.approx(MEMORY.used_bytes / MEMORY.total_bytes)
        check_wanted(pipeline, sig)
        # asked again with nothing changed (the policy asks ten times between two main-loop rounds):
        # the routing signals made once, the same objects
        again = pipeline.signals()
        assert again.expert_load_gini is sig.expert_load_gini and again.router_entropy_ratio is sig.router_entropy_ratio
        return not want.expert_load_gini

    empty = 0
    last_ns = clock.now_ns
    for i, (t_ns, _, kind, obj) in enumerate(run.events()):
        # the policy samples between events too (every 200 ms in production; every 1.5 s here)
        for sample_ns in range(last_ns + 1_500 * MS, t_ns, 1_500 * MS):
            empty += check(sample_ns)
            checks += 1
        clock.now_ns = last_ns = t_ns
        if kind == "step":
            assert isinstance(obj, StepEvent)
            pipeline.on_steps([obj])
            fed_steps.append(obj)
        else:
            assert isinstance(obj, IngressRecord)
            pipeline.on_request(obj)
            fed_records.append(obj)
        if i % 37 == 5:
            check(t_ns)
            checks += 1
    assert checks > 10 and len(run.steps) > 200 and len(run.records) > 200
    assert empty > 0  # the lull drained every window mid-stream, and the answers said so
    # window edges: a step ending at t is in the window at t + W - 1 ns and out of it at t + W
    for step in fed_steps[-6:]:
        check(step.end_ns + WINDOW_NS - 1)
        check(step.end_ns + WINDOW_NS)
    # the stream's end: 10 s later every window is empty again
    clock.now_ns = max(r.end_ns for r in run.records) + WINDOW_NS + 1
    sig = pipeline.signals()
    assert math.isnan(sig.step_p99_ms) and math.isnan(sig.request_p99_ms) and math.isnan(sig.expert_load_p99_ms)
    assert sig.expert_load_gini == {} and sig.router_entropy_ratio == {}


def test_panels_make_a_snapshot_that_round_trips() -> None:
    run = make_run(seed=12)
    clock = FakeClock()
    pipeline = Pipeline(spans=None, clock=clock, window_ns=WINDOW_NS)
    pipeline.sink(runtime_state(PRECISION))
    pipeline.on_telemetry(TelemetryRecord(collector="host", sample=host_sample()))
    arrivals: list[tuple[int, IngressRecord]] = []
    for t_ns, _, kind, obj in run.events():
        clock.now_ns = t_ns
        if kind == "step":
            assert isinstance(obj, StepEvent)
            pipeline.on_steps([obj])
        else:
            assert isinstance(obj, IngressRecord)
            pipeline.on_request(obj)
            arrivals.append((t_ns, obj))
    now = clock.now_ns
    requests, moe, devices = pipeline.panels()

    window = [r for _, r in arrivals if in_window(r.end_ns, now)]
    lat = [(r.end_ns - r.start_ns) / 1e6 for r in window]
    recent = [r for t, r in arrivals if t >= now - RATE_WINDOW_NS]
    assert requests.window_s == WINDOW_NS / 1e9
    assert requests.latency_p50_ms == pytest.approx(percentile(lat, 50), rel=1e-9)
    assert requests.latency_p95_ms == pytest.approx(percentile(lat, 95), rel=1e-9)
    assert requests.latency_p99_ms == pytest.approx(percentile(lat, 99), rel=1e-9)
    assert requests.errors_total == sum(not r.answered for _, r in arrivals) > 0
    assert requests.rate_per_s == pytest.approx(len(recent) / (RATE_WINDOW_NS / 1e9))
    assert requests.errors_per_s == pytest.approx(sum(not r.answered for r in recent) / (RATE_WINDOW_NS / 1e9))

    steps = [s for s in run.steps if in_window(s.end_ns, now)]
    assert moe.window_s == WINDOW_NS / 1e9
    assert [m.layer for m in moe.layers] == list(range(NUM_LAYERS))
    for panel in moe.layers:
        routers = [s.layers[panel.layer].router for s in steps]
        counts = np.sum([counts_vector(r.tokens, NUM_EXPERTS) for r in routers if r is not None], axis=0)
        drops = np.sum([counts_vector(r.dropped, NUM_EXPERTS) for r in routers if r is not None], axis=0)
        w = np.array([sum(r.tokens.values()) for r in routers if r is not None], dtype=np.float64)
        assert panel.num_experts == NUM_EXPERTS and panel.experts_per_bin == 1
        assert panel.tokens_total == int(counts.sum())
        assert panel.capacity_drops == int(drops.sum())
        assert panel.gini == pytest.approx(ref_gini(counts), rel=1e-9)
        assert panel.entropy_bits == pytest.approx(np.average([r.entropy_bits for r in routers if r], weights=w))
        assert panel.expert_token_share == pytest.approx(list(counts / counts.sum()), abs=1e-6)  # rounded to 1e-6
        hottest = sorted(range(NUM_EXPERTS), key=lambda e: (-counts[e], e))[:3]
        assert [(h.expert, h.share) for h in panel.hot_experts] == [
            (e, pytest.approx(counts[e] / counts.sum())) for e in hottest
        ]
        assert panel.precision == PRECISION[panel.layer]
    assert devices.gpus == []
    assert devices.host_budget == st.HostBudget(
        source=f"{MEMORY.source}: {MEMORY.scope}", used_bytes=MEMORY.used_bytes, total_bytes=MEMORY.total_bytes
    )

    snap = st.Snapshot(header=st.Header(agent_pid=1, started_unix_s=1.0), taken_unix_s=2.0, requests=requests,
                       moe=moe, devices=devices)
    assert st.from_json(st.to_json(snap)) == snap


def gpu(index: int, *, free_bytes: int, tx_total: list[int], pids: tuple[int, ...]) -> GpuSample:
    total = 80 << 30
    return GpuSample(
        index=index, name="NVIDIA H200", uuid=f"GPU-{index:04d}", memory_api="v2", memory_total_bytes=total,
        memory_used_bytes=total - free_bytes - (1 << 28), memory_free_bytes=free_bytes, memory_reserved_bytes=1 << 28,
        utilization_gpu_percent=NA if index else 87, utilization_memory_percent=40, nvlink_link_count=len(tx_total),
        nvlinks=tuple(
            NvLinkSample(link=i, supported=True, tx_bytes_per_s=float(t) / 10, rx_bytes_per_s=NA, tx_total_bytes=t,
                         rx_total_bytes=NA)
            for i, t in enumerate(tx_total)
        ),
        pcie_tx_bytes_per_s=1.5e9, pcie_rx_bytes_per_s=NA,
        processes=tuple(ProcessGpuMemory(pid=p, used_bytes=10 << 30, kind="compute") for p in pids),
        target_memory_used_bytes=(10 << 30) * len(pids),
    )


def nvml(*gpus: GpuSample) -> TelemetryRecord:
    return TelemetryRecord(
        collector="nvml", sample=NvmlSample(at_ns=0, gpus=gpus, lost_gpus=(), target_pids=frozenset({PID_A}))
    )


def test_device_telemetry_metrics_panels_and_memory_signal() -> None:
    """NVML samples (built at the hardware boundary) beside the host sample: gauges, NVLink counter
    totals, the devices panel, and which memory signal the policy sees."""
    metrics = Metrics()
    pipeline = Pipeline(spans=None, metrics=metrics, clock=FakeClock())
    pipeline.on_telemetry(TelemetryRecord(collector="host", sample=host_sample()))
    assert pipeline.signals().device_memory_used_ratio == pytest.approx(3 / 8)
    first = nvml(
        gpu(0, free_bytes=20 << 30, tx_total=[100, 200], pids=(PID_A,)),
        gpu(1, free_bytes=5 << 30, tx_total=[7], pids=()),
    )
    pipeline.on_telemetry(first)
    second = nvml(
        gpu(0, free_bytes=10 << 30, tx_total=[150, 260], pids=(PID_A,)),
        gpu(1, free_bytes=4 << 30, tx_total=[9], pids=()),
    )
    pipeline.on_telemetry(second)
    # a later host sample does not replace the GPU signal
    pipeline.on_telemetry(TelemetryRecord(collector="host", sample=host_sample()))
    # the target uses GPU 0 only: its signal is GPU 0's total - free
    assert pipeline.signals().device_memory_used_ratio == pytest.approx((80 - 10) / 80)
    assert pipeline.memory_source() == "nvml"
    assert pipeline.stats()["telemetry_samples"] == 4

    sample = second.sample
    assert isinstance(sample, NvmlSample)
    for g in sample.gpus:
        dev = str(g.index)
        assert metrics.get("moescope_device_memory_used_bytes", device=dev) == g.memory_used_bytes
        assert metrics.get("moescope_device_memory_total_bytes", device=dev) == g.memory_total_bytes
        assert metrics.get("moescope_pcie_transmit_bytes_per_second", device=dev) == 1.5e9
        assert math.isnan(metrics.get("moescope_pcie_receive_bytes_per_second", device=dev))  # N/A: no series
        # the GPU memory the target's processes hold on this device (GPU 1: none of them)
        assert metrics.get("moescope_target_memory_bytes", device=dev) == (10 << 30 if g.index == 0 else 0)
        for link in g.nvlinks:
            assert metrics.get("moescope_nvlink_transmit_bytes", device=dev, link=str(link.link)) == link.tx_total_bytes
            assert math.isnan(metrics.get("moescope_nvlink_receive_bytes", device=dev, link=str(link.link)))
    assert metrics.get("moescope_device_memory_used_bytes", device="host") == MEMORY.used_bytes
    assert metrics.get("moescope_device_memory_total_bytes", device="host") == MEMORY.total_bytes
    assert metrics.get("moescope_target_memory_bytes", device="host") == TARGET_RSS_BYTES

    _, _, devices = pipeline.panels()
    assert [(g.index, g.name, g.memory_used_bytes, g.memory_total_bytes, g.utilization_pct) for g in devices.gpus] == [
        (0, "NVIDIA H200", (80 << 30) - (10 << 30) - (1 << 28), 80 << 30, 87.0),
        (1, "NVIDIA H200", (80 << 30) - (4 << 30) - (1 << 28), 80 << 30, None),
    ]
    assert [(lk.link, lk.tx_bytes_per_s, lk.rx_bytes_per_s) for lk in devices.gpus[0].nvlinks] == [
        (0, 15.0, None),
        (1, 26.0, None),
    ]
    assert devices.host_budget is not None and devices.host_budget.source == "nvml: GPU 0 GPU-0000"
    snap = st.Snapshot(header=st.Header(agent_pid=1, started_unix_s=1.0), taken_unix_s=2.0, devices=devices)
    assert st.from_json(st.to_json(snap)) == snap


def sample_value(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_metrics_equal_what_was_fed() -> None:
    scenario = main_scenario(seed=13)
    metrics = Metrics(max_experts_per_layer=NUM_EXPERTS)  # full per-expert series (opt-in): each checked
    clock = FakeClock()
    pipeline = Pipeline(spans=None, metrics=metrics, clock=clock, step_retention_ns=RETENTION_NS)
    feed(scenario, pipeline, clock)
    records = list(scenario.records.values())
    steps = list(scenario.steps.values())
    loads = [ld for s in steps for layer in s.layers for ld in layer.loads]

    assert metrics.get("moescope_requests") == len(records)
    assert metrics.get("moescope_request_duration_seconds") == len(records)
    assert sample_value(metrics, "moescope_request_duration_seconds_sum") == pytest.approx(
        sum((r.end_ns - r.start_ns) / 1e9 for r in records)
    )
    assert metrics.get("moescope_request_received_bytes") == sum(r.bytes_in for r in records)
    assert metrics.get("moescope_response_sent_bytes") == sum(r.bytes_out for r in records)
    waits = [
        (min(scenario.steps[s].start_ns for s in served) - scenario.records[name].start_ns) / 1e9
        for name, served in scenario.served_by.items() if served
    ]
    assert metrics.get("moescope_request_queue_wait_seconds") == len(waits)
    assert sample_value(metrics, "moescope_request_queue_wait_seconds_sum") == pytest.approx(sum(waits))
    # one latency-bucket check, counted independently
    le = 0.05
    assert sample_value(metrics, "moescope_request_duration_seconds_bucket", le=str(le)) == sum(
        (r.end_ns - r.start_ns) / 1e9 <= le for r in records
    )

    assert metrics.get("moescope_steps") == len(steps)
    assert metrics.get("moescope_step_tokens") == sum(s.tokens or 0 for s in steps)
    assert metrics.get("moescope_step_duration_seconds") == len(steps)
    assert sample_value(metrics, "moescope_step_duration_seconds_sum") == pytest.approx(
        sum((s.end_ns - s.start_ns) / 1e9 for s in steps)
    )
    assert metrics.get("moescope_expert_load_duration_seconds") == len(loads) > 0
    assert sample_value(metrics, "moescope_expert_load_duration_seconds_sum") == pytest.approx(
        sum((ld.end_ns - ld.start_ns) / 1e9 for ld in loads)
    )
    assert metrics.get("moescope_expert_load_bytes") == sum(ld.bytes_moved or 0 for ld in loads)
    assert metrics.get("moescope_experts") == NUM_EXPERTS

    # per-expert counters: every (layer, expert) series equals the sum of its marks; no "other"
    want_tokens: dict[tuple[str, str], int] = {}
    want_dropped: dict[tuple[str, str], int] = {}
    for s in steps:
        for layer in s.layers:
            assert layer.router is not None
            for e, n in layer.router.tokens.items():
                key = (str(layer.layer), str(e))
                want_tokens[key] = want_tokens.get(key, 0) + n
            for e, n in layer.router.dropped.items():
                key = (str(layer.layer), str(e))
                want_dropped[key] = want_dropped.get(key, 0) + n
    for family, want in (("moescope_expert_tokens", want_tokens), ("moescope_expert_dropped_tokens", want_dropped)):
        got = {
            (smp.labels["layer"], smp.labels["expert"]): smp.value
            for m in metrics.registry.collect() if m.name == family
            for smp in m.samples if smp.name == f"{family}_total"
        }
        assert got == want and len(want) > NUM_LAYERS, family

    # latest-step gauges equal the last fed step's recomputation; the window Gini all steps' sum
    last = max(steps, key=lambda s: s.end_ns)
    for layer in last.layers:
        assert layer.router is not None
        ref = ref_layer(layer.router, NUM_EXPERTS)
        lbl = str(layer.layer)
        for metric, attribute in (
            ("moescope_router_entropy_bits", "moe.router.entropy_bits"),
            ("moescope_router_entropy_normalized", "moe.router.entropy_normalized"),
            ("moescope_expert_load_gini", "moe.expert_load.gini"),
            ("moescope_expert_load_entropy_bits", "moe.expert_load.entropy_bits"),
            ("moescope_expert_load_entropy_normalized", "moe.expert_load.entropy_normalized"),
            ("moescope_expert_load_max_share", "moe.expert_load.max_share"),
            ("moescope_expert_load_cv", "moe.expert_load.cv"),
        ):
            assert metrics.get(metric, layer=lbl) == pytest.approx(ref[attribute], rel=1e-9), metric
        in_window_counts = []
        for s in steps:
            if last.end_ns - WINDOW_NS < s.end_ns <= last.end_ns:
                router = s.layers[layer.layer].router
                assert router is not None
                in_window_counts.append(counts_vector(router.tokens, NUM_EXPERTS))
        window_counts = np.sum(in_window_counts, axis=0)
        assert metrics.get("moescope_expert_load_gini_window", layer=lbl) == pytest.approx(
            ref_gini(window_counts), rel=1e-9
        )
        assert ref["moe.expert_load.entropy_bits"] == pytest.approx(
            ref_entropy_bits(counts_vector(layer.router.tokens, NUM_EXPERTS))
        )
    step_ref = ref_step(last, NUM_EXPERTS)
    assert metrics.get("moescope_step_router_entropy_normalized") == pytest.approx(
        step_ref["moe.router.entropy_normalized"]
    )
    assert metrics.get("moescope_step_expert_load_gini") == pytest.approx(step_ref["moe.expert_load.gini"])
    assert metrics.get("moescope_step_expert_load_gini_max") == pytest.approx(step_ref["moe.expert_load.gini_max"])
    assert metrics.get("moescope_device_memory_used_bytes", device="host") == MEMORY.used_bytes
    assert metrics.get("moescope_target_memory_bytes", device="host") == TARGET_RSS_BYTES
    assert (
        metrics.get("moescope_agent_metric_series_dropped", metric="moescope_expert_tokens") == 0
    )  # none dropped, shown


def test_per_expert_series_are_bounded_by_default_at_deepseek_shape() -> None:
    """DeepSeek-V3 shape (58 MoE layers, 256 experts): by default each layer keeps series for its 8
    hottest experts and sums the rest into expert="other" — bounded, and no token lost."""
    layers, experts = 58, 256
    rng = np.random.default_rng(3)
    metrics = Metrics()
    sent = 0
    for _ in range(5):
        for layer in range(layers):
            counts = rng.poisson(rng.uniform(0.1, 40.0, size=experts))
            sent += int(counts.sum())
            metrics.record_expert_counts(layer=layer, tokens={e: int(n) for e, n in enumerate(counts) if n})
    samples = [s for f in metrics.registry.collect() if f.name == "moescope_expert_tokens"
               for s in f.samples if s.name == "moescope_expert_tokens_total"]
    assert len(samples) <= layers * (8 + 1)
    assert {s.labels["expert"] for s in samples if s.labels["layer"] == "0"} - {"other"}
    assert sum(s.value for s in samples) == sent
    assert metrics.get("moescope_agent_metric_series_dropped", metric="moescope_expert_tokens") == 0
    full = Metrics(max_experts_per_layer=experts)  # opt-in: every expert its own series
    full.record_expert_counts(layer=0, tokens={e: 1 for e in range(experts)})
    assert len([s for f in full.registry.collect() if f.name == "moescope_expert_tokens" for s in f.samples
                if s.name == "moescope_expert_tokens_total"]) == experts


def test_rates_stay_bounded_without_a_live_view() -> None:
    # Nobody reads the request/step rates when no state file is written: adding must prune too.
    from moescope.agent.outputs.windows import EventRate

    rate = EventRate(window_ns=1_000)
    for t in range(100_000):
        rate.add(t)
    assert len(rate.times) == 1_001  # the last window_ns (inclusive), not all 100 000
    assert rate.rate(99_999) == pytest.approx(1_001 / 1e-6)


def test_overrides_are_set_and_not_computed_by_the_windows() -> None:
    """A field handed in (the kernel's request p99, the runtime's queues and memory) is the one in the
    Signals, and the windows do not compute their own value of it only to have it replaced. Seen
    through eviction: a window's p99 drops what has left it first (SlidingQuantile.quantile), so a
    sample past the window is still held by a window nobody asked (SlidingQuantile is compiled in
    `make test`: its methods cannot be patched to count calls)."""
    clock = FakeClock()
    pipeline = Pipeline(spans=None, clock=clock, window_ns=WINDOW_NS)
    windows = pipeline.windows
    request_window, step_window = windows._request_latency_ms, windows._step_ms
    request_window.add(clock.now_ns, 5.0)
    step_window.add(clock.now_ns, 5.0)
    clock.now_ns += 2 * WINDOW_NS  # both samples are out of their windows from now on
    overrides = {"request_p99_ms": 12.5, "expert_queue_tokens": {(0, 3): 60.0}, "device_memory_used_ratio": 0.25}
    sig = pipeline.signals(wanted=None, overrides=overrides)
    assert (sig.request_p99_ms, dict(sig.expert_queue_tokens), sig.device_memory_used_ratio) == (
        12.5, {(0, 3): 60.0}, 0.25)
    assert len(request_window) == 1  # not asked: its sample is still held
    assert len(step_window) == 0 and math.isnan(sig.step_p99_ms)  # the step p99 still computed
    sig = pipeline.signals(wanted=None)
    assert len(request_window) == 0 and math.isnan(sig.request_p99_ms)
