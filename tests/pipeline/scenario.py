"""Hand-built join scenarios for agent/pipeline.py and an independent numpy model of what it must report.

Everything here is constructed from the real input types (``moescope.probes.ingress.loader.IngressRecord``,
``moescope.collectors.moe_convention.StepEvent`` and friends, ``moescope.collectors.host.MemorySignal`` inside a
``moescope.collectors.registry.TelemetryRecord``). Which request each step served is *declared* in the
scenario (not derived with the pipeline's join rule), and every statistic is recomputed here with
numpy formulas written independently of agent/routing_health.py (pairwise Gini, ``np.std`` CV,
``np.percentile`` quantiles).

Times are CLOCK_MONOTONIC-like ns (``T0_NS`` + milliseconds); spans are expected at ``+ EPOCH_OFFSET_NS``.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np

from moescope.agent.policy.actuator import RuntimeState
from moescope.collectors.host import HostSample, MemorySignal
from moescope.collectors.moe_convention import (
    ExpertFfnEvent,
    ExpertLoadEvent,
    LayerEvent,
    RouterEvent,
    StepEvent,
)
from moescope.collectors.registry import TelemetryRecord
from moescope.probes.ingress.loader import F_NO_RESPONSE, IngressRecord

MS = 1_000_000
T0_NS = 5_000_000_000_000  # an uptime-like monotonic origin
EPOCH_OFFSET_NS = 1_750_000_000_000_000_000  # fixed CLOCK_MONOTONIC -> Unix epoch shift for the test
NUM_LAYERS = 3
NUM_EXPERTS = 16  # the moe.layer payload; the scenario only routes to experts 0..11 (E must come from the payload)
ROUTED_EXPERTS = 12
TOP_K = 2
RETENTION_NS = 2_000 * MS
STEP_FEED_DELAY_NS = 500_000  # the NVTX collector hands a step over a little after it ends
RECORD_FEED_DELAY_NS = 300_000  # the ingress ring likewise
PID_A, PID_B = 4100, 5200
MEMORY = MemorySignal(used_bytes=3 << 30, total_bytes=8 << 30, source="cgroup", scope="cgroup v2 /moe.slice")
PRECISION = {0: "bf16", 1: "bf16", 2: "fp16"}
TARGET_RSS_BYTES = 1_234 << 20


def host_sample(signal: MemorySignal = MEMORY) -> HostSample:
    """What collectors/host.py hands the sinks: the target's RSS and the memory signal (no GPU)."""
    return HostSample(
        at_ns=1_750_000_000_000_000_000, pid=PID_A, alive=True, rss_bytes=TARGET_RSS_BYTES, cgroup=None,
        cgroup_error="not read in this test", host_total_bytes=16 << 30, signal=signal,
    )


class FakeClock:
    """Time injection: the pipeline's ``clock=`` reads ``now_ns``, which the feeder advances."""

    def __init__(self, now_ns: int = T0_NS) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def ms(t: float) -> int:
    return T0_NS + int(round(t * MS))


def build_step(
    rng: np.random.Generator,
    *,
    pid: int,
    tid: int,
    start_ms: float,
    end_ms: float,
    keys: Sequence[int],
    tokens: int,
    load_layer: int | None = None,
    skew: float = 1.0,
) -> StepEvent:
    """One ``moe.step`` tree: NUM_LAYERS layers, router marks over ROUTED_EXPERTS of NUM_EXPERTS,
    drops over a capacity, an FFN per loaded expert, optionally an expert load in one layer."""
    start, end = ms(start_ms), ms(end_ms)
    step = StepEvent(pid=pid, tid=tid, start_ns=start, end_ns=end, tokens=tokens, requests=list(keys))
    span = (end - start) // NUM_LAYERS
    for layer_index in range(NUM_LAYERS):
        l0 = start + layer_index * span + 1_000
        l1 = l0 + span - 2_000
        weights = np.linspace(1.0, 1.0 + skew * (layer_index + 1), ROUTED_EXPERTS)
        rng.shuffle(weights)
        counts = rng.multinomial(tokens * TOP_K, weights / weights.sum())
        capacity = int(np.ceil(1.25 * tokens * TOP_K / ROUTED_EXPERTS))
        router = RouterEvent(
            layer=layer_index,
            start_ns=l0 + 1_000,
            end_ns=l0 + 20_000,
            entropy_bits=float(rng.uniform(1.5, 3.9)),
            tokens={int(e): int(c) for e, c in enumerate(counts) if c > 0},
            dropped={int(e): int(c) - capacity for e, c in enumerate(counts) if c > capacity},
        )
        layer = LayerEvent(layer=layer_index, start_ns=l0, end_ns=l1, router=router, num_experts=NUM_EXPERTS)
        t = l0 + 30_000
        if load_layer == layer_index:
            hot = int(np.argmax(counts))
            dur = int(rng.integers(50_000, 400_000))
            layer.loads.append(
                ExpertLoadEvent(expert=hot, start_ns=t, end_ns=t + dur, bytes_moved=int(rng.integers(1, 64)) << 20)
            )
            t += dur + 1_000
        for expert, count in router.tokens.items():
            served = count - router.dropped.get(expert, 0)
            layer.ffns.append(ExpertFfnEvent(expert=expert, start_ns=t, end_ns=t + 5_000, tokens=served))
            t += 6_000
        step.layers.append(layer)
    return step


class Thread(TypedDict):
    """The serving thread a record comes from, passed to record() as keyword arguments."""

    pid: int
    tid: int


def record(
    *,
    pid: int,
    tid: int,
    fd: int,
    generation: int,
    seq: int,
    peer: tuple[str, int],
    start_ms: float,
    end_ms: float,
    bytes_in: int,
    bytes_out: int,
    answered: bool = True,
) -> IngressRecord:
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    start, end = ms(start_ms), ms(end_ms)
    return IngressRecord(
        tgid=pid, tid=tid, fd=fd, generation=generation, seq=seq, family=int(family), peer_addr=peer[0],
        peer_port=peer[1], start_ns=start, first_response_ns=(start + (end - start) // 2) if answered else 0,
        end_ns=end, bytes_in=bytes_in, bytes_out=bytes_out if answered else 0, flags=0 if answered else F_NO_RESPONSE,
    )


@dataclass
class Scenario:
    records: dict[str, IngressRecord]
    steps: dict[str, StepEvent]
    served_by: dict[str, list[str]]  # request name -> the step names that served it (declared)
    unjoined: list[str]  # steps no request claims (declared)
    telemetry: list[TelemetryRecord] = field(default_factory=list)
    # records the ingress ring hands over late (a drain period), by request name
    record_delay_ns: dict[str, int] = field(default_factory=dict)

    def record_name(self, rec: IngressRecord) -> str:
        return next(name for name, r in self.records.items() if r is rec)

    def events(self) -> list[tuple[int, str, str]]:
        """(arrival ns, kind, name) in arrival order: a step when the collector hands it over, a
        request when the kernel record arrives (after the response was written)."""
        out = [(s.end_ns + STEP_FEED_DELAY_NS, "step", n) for n, s in self.steps.items()]
        out += [
            (r.end_ns + self.record_delay_ns.get(n, RECORD_FEED_DELAY_NS), "request", n)
            for n, r in self.records.items()
        ]
        return sorted(out)

    def arrival_order(self) -> list[str]:
        return [name for _, kind, name in self.events() if kind == "request"]

    def owner_of(self, step_name: str) -> str:
        """The request whose trace holds the step's full subtree: the first, in record arrival
        order, of the requests the step served."""
        claimants = [r for r, steps in self.served_by.items() if step_name in steps]
        return min(claimants, key=self.arrival_order().index)

    def joined_steps(self) -> list[str]:
        return sorted({s for steps in self.served_by.values() for s in steps})


def main_scenario(seed: int = 6) -> Scenario:
    """Keep-alive requests on one fd, fd reuse, a batch of 3 over several decode steps, a request
    whose step expired before its record arrived, unclaimed steps, and two pids with the same fd."""
    rng = np.random.default_rng(seed)
    a: Thread = {"pid": PID_A, "tid": 4101}
    b: Thread = {"pid": PID_B, "tid": 5201}
    p7, p8, p9 = ("127.0.0.1", 50001), ("127.0.0.1", 50002), ("::1", 50003)
    records = {
        # batch of three on fds 7, 8, 9 (pid A), finishing in the order R9a, R7a, R8a
        "R7a": record(**a, fd=7, generation=1, seq=1, peer=p7, start_ms=0, end_ms=60, bytes_in=310, bytes_out=900),
        "R8a": record(**a, fd=8, generation=1, seq=1, peer=p8, start_ms=2, end_ms=75, bytes_in=295, bytes_out=1400),
        "R9a": record(**a, fd=9, generation=1, seq=1, peer=p9, start_ms=4, end_ms=40, bytes_in=280, bytes_out=400),
        # keep-alive: second and third requests on fd 7 (and a second on fd 8)
        "R7b": record(**a, fd=7, generation=1, seq=2, peer=p7, start_ms=80, end_ms=110, bytes_in=305, bytes_out=700),
        "R8b": record(**a, fd=8, generation=1, seq=2, peer=p8, start_ms=82, end_ms=120, bytes_in=301, bytes_out=800),
        "R7c": record(**a, fd=7, generation=1, seq=3, peer=p7, start_ms=130, end_ms=150, bytes_in=299, bytes_out=300),
        # fd 7 closed and reused by a new connection (generation 2, another peer port)
        "R7d": record(**a, fd=7, generation=2, seq=1, peer=("127.0.0.1", 50005), start_ms=200, end_ms=230,
                      bytes_in=320, bytes_out=650),
        # a long request whose only step expires (retention 2 s) before its record arrives
        "R10": record(**a, fd=10, generation=1, seq=1, peer=("127.0.0.1", 50006), start_ms=240, end_ms=5240,
                      bytes_in=333, bytes_out=123456),
        "R7e": record(**a, fd=7, generation=2, seq=2, peer=("127.0.0.1", 50005), start_ms=3000, end_ms=3030,
                      bytes_in=321, bytes_out=640),
        # pid B uses fd 7 too, at the same time as pid A's fd 7
        "RB1": record(**b, fd=7, generation=1, seq=1, peer=("10.0.0.9", 40000), start_ms=5, end_ms=55,
                      bytes_in=400, bytes_out=2000),
        # pid B: the client gave up before any response
        "RB2": record(**b, fd=7, generation=1, seq=2, peer=("10.0.0.9", 40000), start_ms=60, end_ms=90,
                      bytes_in=410, bytes_out=0, answered=False),
    }
    sa = {"pid": PID_A, "tid": 4102}
    sb = {"pid": PID_B, "tid": 5202}
    spec: list[tuple[str, dict[str, int], float, float, list[int], int, int | None]] = [
        ("S1", sa, 10, 18, [7, 8, 9], 60, 1),  # prefill of the batch of three, with an expert load
        ("S2", sa, 20, 24, [7, 8, 9], 3, None),
        ("S3", sa, 26, 30, [7, 8, 9], 3, None),
        ("S4", sa, 42, 46, [7, 8], 2, 0),
        ("S5", sa, 48, 52, [7, 8], 2, None),
        ("S6", sa, 62, 66, [8], 1, None),
        ("S7", sa, 68, 72, [8], 1, 2),
        ("S8", sa, 85, 95, [7, 8], 40, None),
        ("S9", sa, 97, 101, [7, 8], 2, None),
        ("S10", sa, 112, 116, [8], 1, None),
        ("S11", sa, 135, 145, [7], 20, 1),
        ("SU", sa, 160, 170, [], 16, None),  # no request marks (warm-up)
        ("SU2", sa, 172, 180, [42], 8, None),  # a key no request record ever carries
        ("S12", sa, 205, 225, [7], 30, None),
        ("S13", sa, 245, 250, [10], 12, None),
        ("S14", sa, 3005, 3020, [7], 25, 0),
        ("SB1", sb, 12, 30, [7], 50, None),
        ("SB2", sb, 31, 50, [7], 2, 2),
        # a second model thread of pid B: starts first, completes (and arrives) last
        ("SB3", {"pid": PID_B, "tid": 5203}, 8, 53, [7], 30, 0),
    ]
    steps = {
        name: build_step(rng, **who, start_ms=s, end_ms=e, keys=keys, tokens=tok, load_layer=load)
        for name, who, s, e, keys, tok, load in spec
    }
    served_by = {
        "R9a": ["S1", "S2", "S3"],
        "R7a": ["S1", "S2", "S3", "S4", "S5"],
        "R8a": ["S1", "S2", "S3", "S4", "S5", "S6", "S7"],
        "R7b": ["S8", "S9"],
        "R8b": ["S8", "S9", "S10"],
        "R7c": ["S11"],
        "R7d": ["S12"],
        "R10": [],  # S13 expired before this record arrived
        "R7e": ["S14"],
        "RB1": ["SB1", "SB2", "SB3"],
        "RB2": [],
    }
    return Scenario(
        records=records,
        steps=steps,
        served_by=served_by,
        unjoined=["SU", "SU2", "S13"],
        telemetry=[TelemetryRecord(collector="host", sample=host_sample())],
        # R7c's record arrives after the step of the next connection on the same (reused) fd
        record_delay_ns={"R7c": 76 * MS},
    )


def runtime_state(precision: dict[int, str]) -> RuntimeState:
    """The runtime's own view (control-socket `stats`) with one precision for every expert of a layer."""
    return RuntimeState(
        precision_default="fp32", devices=["cpu"], primary_device="cpu", layers=NUM_LAYERS, experts=NUM_EXPERTS,
        tokens={}, last_step_tokens={}, queue_depth={}, entropy_bits={}, penalty={}, device={}, tier={}, dtype={},
        precision={(layer, e): p for layer, p in precision.items() for e in range(NUM_EXPERTS)},
        memory={}, expert_bytes_fp32=0,
    )


def feed_linked_steps(pipeline: Any, clock: FakeClock, n: int, *, seed: int = 5) -> list[StepEvent]:
    """Two requests (fds 3 and 4) over ``n`` steps of a batch of both: the first to arrive owns
    every step, the second's prefill and decode link to them. Step 0 is the prefill; the decode
    steps' durations are distinct (1 + (7 i mod n-1) ms). Returns the steps."""
    rng = np.random.default_rng(seed)
    steps = [build_step(rng, pid=1, tid=1, start_ms=10 + 25 * i, end_ms=10 + 25 * i + 1 + (7 * i) % (n - 1),
                        keys=[3, 4], tokens=4) for i in range(n)]
    for s in steps:
        clock.now_ns = s.end_ns
        pipeline.on_steps([s])
    end_ms = 25 * n + 100
    first = record(pid=1, tid=1, fd=3, generation=1, seq=1, peer=("127.0.0.1", 1), start_ms=0, end_ms=end_ms,
                   bytes_in=1, bytes_out=1)
    later = record(pid=1, tid=1, fd=4, generation=1, seq=2, peer=("127.0.0.1", 2), start_ms=0, end_ms=end_ms + 5,
                   bytes_in=1, bytes_out=1)
    for rec in (first, later):
        clock.now_ns = rec.end_ns
        pipeline.on_request(rec)
    pipeline.expire(flush=True)
    return steps


def feed(scenario: Scenario, pipeline: Any, clock: FakeClock) -> None:
    """Telemetry first, then steps and records in arrival order with the clock at each arrival;
    finally retire every buffered step (``expire(flush=True)``, as on shutdown)."""
    for sample in scenario.telemetry:
        pipeline.sink(sample)  # the daemon's dispatch
    pipeline.sink(runtime_state(PRECISION))  # the runtime's control-socket stats, as a record
    for t_ns, kind, name in scenario.events():
        clock.now_ns = t_ns
        if kind == "step":
            pipeline.on_steps([scenario.steps[name]])
        else:
            pipeline.sink(scenario.records[name])  # the daemon's dispatch, as in production
    clock.now_ns += RETENTION_NS * 2
    pipeline.expire(flush=True)


# ---------------------------------------------------------------------------------------------
# independent reference math


def counts_vector(marks: dict[int, int], num_experts: int) -> np.ndarray:
    c = np.zeros(num_experts, dtype=np.float64)
    for e, n in marks.items():
        c[e] += n
    return c


def ref_gini(c: np.ndarray) -> float:
    """Mean absolute difference over all ordered pairs / (2 * mean): the pairwise definition."""
    c = np.asarray(c, dtype=np.float64)
    return float(np.abs(c[:, None] - c[None, :]).sum() / (2.0 * c.size * c.sum()))


def ref_entropy_bits(c: np.ndarray) -> float:
    p = np.asarray(c, dtype=np.float64) / np.sum(c)
    p = p[p > 0]
    return float(-np.sum(p * np.log2(p)))


def ref_layer(router: RouterEvent, num_experts: int) -> dict[str, Any]:
    """The layer span's routing-health attributes, recomputed."""
    c = counts_vector(router.tokens, num_experts)
    d = counts_vector(router.dropped, num_experts)
    n = c.sum()
    h = ref_entropy_bits(c)
    return {
        "moe.layer.experts": num_experts,
        "moe.router.entropy_bits": router.entropy_bits,
        "moe.router.entropy_normalized": router.entropy_bits / np.log2(num_experts),
        "moe.expert_load.gini": ref_gini(c),
        "moe.expert_load.entropy_bits": h,
        "moe.expert_load.entropy_normalized": h / np.log2(num_experts),
        "moe.expert_load.max_share": c.max() / n,
        "moe.expert_load.cv": float(np.std(c) / np.mean(c)),
        "moe.tokens.routed": int(n),
        "moe.tokens.dropped": int(d.sum()),
        "moe.tokens.drop_fraction": d.sum() / n,
        "moe.expert.tokens": [int(x) for x in c],
        "moe.expert.dropped": [int(x) for x in d],
    }


def ref_step(step: StepEvent, num_experts: int) -> dict[str, Any]:
    """The step span's aggregates: token-weighted means over layers, worst-layer Gini/max share."""
    layers = [ref_layer(layer.router, num_experts) for layer in step.layers if layer.router is not None]
    w = np.array([x["moe.tokens.routed"] for x in layers], dtype=np.float64)
    dropped = sum(x["moe.tokens.dropped"] for x in layers)

    def avg(key: str) -> float:
        return float(np.average([x[key] for x in layers], weights=w))

    return {
        "moe.router.entropy_bits": avg("moe.router.entropy_bits"),
        "moe.router.entropy_normalized": avg("moe.router.entropy_normalized"),
        "moe.expert_load.gini": avg("moe.expert_load.gini"),
        "moe.expert_load.gini_max": max(x["moe.expert_load.gini"] for x in layers),
        "moe.expert_load.max_share": max(x["moe.expert_load.max_share"] for x in layers),
        "moe.tokens.dropped": dropped,
        "moe.tokens.drop_fraction": dropped / w.sum(),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank (moescope.latency's definition), computed independently: numpy's inverted CDF."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="inverted_cdf"))
