"""Writes the recorded snapshots under tests/tui/fixtures/ (deterministic: seeded).

These stand in for snapshots recorded from a live pipeline until one exists; replace or add real
ones by copying a running agent's state file: `cp /run/moescope/agent-*.state.json fixtures/x.json`.
Run: .venv/bin/python -m tests.tui.make_fixtures
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Literal

from moescope.agent.state import (
    ActionRecord,
    Devices,
    Gpu,
    Header,
    HostBudget,
    Moe,
    MoeLayer,
    NvLink,
    Policy,
    Requests,
    RuleState,
    RuleStatus,
    SelfCost,
    Snapshot,
    SourceStats,
    Target,
    bin_expert_shares,
    hottest_experts,
    to_dict,
)

FIXTURES = Path(__file__).parent / "fixtures"
T0 = 1_790_000_000.0  # fixed "now" of every fixture


def gini(values: list[float]) -> float:
    xs = sorted(values)
    n = len(xs)
    total = sum(xs)
    if n == 0 or total == 0:
        return 0.0
    cum = sum((i + 1) * x for i, x in enumerate(xs))
    return (2 * cum) / (n * total) - (n + 1) / n


def layer(
    rng: random.Random,
    *,
    index: int,
    experts: int,
    tokens: int,
    hot: dict[int, float],
    entropy_norm: float,
    spread: float = 0.19,
    precision: str = "bf16",
    overrides: dict[str, str] | None = None,
    resident_device: int | None = None,
    drops: int = 0,
) -> MoeLayer:
    weights = [max(0.0, rng.gauss(1.0, spread)) for _ in range(experts)]
    for expert, factor in hot.items():
        weights[expert] *= factor
    total_w = sum(weights)
    counts = [round(w / total_w * tokens) for w in weights]
    shares, per_bin = bin_expert_shares(counts)
    return MoeLayer(
        layer=index,
        num_experts=experts,
        experts_per_bin=per_bin,
        expert_token_share=[round(s, 6) for s in shares],
        hot_experts=hottest_experts(counts),
        tokens_total=sum(counts),
        entropy_bits=round(entropy_norm * math.log2(experts), 3),
        gini=round(gini([float(c) for c in counts]), 4),
        capacity_drops=drops,
        precision=precision,
        expert_precision=overrides or {},
        resident_device=experts if resident_device is None else resident_device,
        resident_host=0 if resident_device is None else experts - resident_device,
    )


DEFAULT_RULES: list[tuple[str, str, float, str, Literal[">", "<"]]] = [
    ("fp16_fallback", "step p99", 430.0, "ms", ">"),
    ("expert_offload", "device mem used", 95.0, "%", ">"),
    ("memory_alert", "device mem used", 92.0, "%", ">"),
    ("expert_queue_soft_limit", "max tokens waiting", 50.0, "tok", ">"),
    ("expert_monopoly", "max layer Gini", 0.15, "", ">"),
    ("router_collapse", "min H/log2E", 0.536, "", "<"),
    ("expert_load_slow", "expert.load p99", 200.0, "ms", ">"),
    ("slo_latency", "request p99", 870.0, "ms", ">"),
]


def rules(states: dict[str, tuple[RuleState, float, float | None]]) -> list[RuleStatus]:
    out = []
    for name, signal, threshold, unit, cmp in DEFAULT_RULES:
        state, progress, value = states[name]
        out.append(
            RuleStatus(
                name=name,
                state=state,
                progress=progress,
                signal=signal,
                value=value,
                threshold=threshold,
                unit=unit or None,
                comparison=cmp,
            )
        )
    return out


def gpu_busy() -> Snapshot:
    rng = random.Random(8)
    layers = []
    for i in range(8):
        hot = {17: 9.0} if i == 5 else ({3: 2.5, 40: 2.0} if i == 2 else {})
        layers.append(
            layer(
                rng,
                index=i,
                experts=64,
                tokens=240_000,
                hot=hot,
                entropy_norm=0.52 if i == 6 else 0.60 + 0.002 * i,
                overrides={"17": "fp16"} if i == 5 else None,
                resident_device=60 if i == 7 else None,
                drops=1_250 if i == 5 else 0,
            )
        )
    gpus = [
        Gpu(
            index=g,
            name="NVIDIA H200",
            memory_used_bytes=int((131.9 if g == 0 else 98.4) * 2**30),
            memory_total_bytes=int(139.8 * 2**30),
            utilization_pct=91.0 if g == 0 else 64.0,
            nvlinks=[
                NvLink(link=k, tx_bytes_per_s=(6.5 + 0.1 * k + g) * 1e9, rx_bytes_per_s=(6.1 + 0.05 * k) * 1e9)
                for k in range(18)
            ],
        )
        for g in range(2)
    ]
    return Snapshot(
        header=Header(
            agent_pid=4242,
            started_unix_s=T0 - 3723.0,
            targets=[Target(pid=5151, comm="moe_server")],
            probes_attached=["ingress", "nvtx", "nvml", "host"],
            sources=[
                SourceStats(name="ingress", events_per_s=1520.0, drops_total=0),
                SourceStats(name="nvtx", events_per_s=412_000.0, drops_total=37),
                SourceStats(name="nvml", events_per_s=5.0, drops_total=0),
            ],
        ),
        taken_unix_s=T0,
        seq=14_892,
        publish_interval_s=0.25,
        requests=Requests(
            window_s=10.0,
            rate_per_s=380.4,
            latency_p50_ms=212.5,
            latency_p95_ms=611.0,
            latency_p99_ms=905.3,
            errors_total=12,
            errors_per_s=0.4,
        ),
        moe=Moe(window_s=10.0, layers=layers),
        devices=Devices(gpus=gpus),
        policy=Policy(
            rules=rules(
                {
                    "fp16_fallback": ("pending", 2 / 3, 455.0),
                    "expert_offload": ("armed", 0.0, 94.4),
                    "memory_alert": ("firing", 1.0, 94.4),
                    "expert_queue_soft_limit": ("cooling", 0.4, 12.0),
                    "expert_monopoly": ("pending", 0.35, 0.171),
                    "router_collapse": ("pending", 0.8, 0.52),
                    "expert_load_slow": ("armed", 0.0, 41.0),
                    "slo_latency": ("firing", 1.0, 905.3),
                }
            ),
            recent_actions=[
                ActionRecord(
                    at_unix_s=T0 - 4.2,
                    rule="memory_alert",
                    action="alert",
                    outcome="ok",
                    latency_ms=1.0,
                    detail="mem 94.4 % > 92 % for 3 s",
                ),
                ActionRecord(
                    at_unix_s=T0 - 31.0,
                    rule="expert_queue_soft_limit",
                    action="router penalty -0.3 L5/E17",
                    outcome="ok",
                    latency_ms=38.0,
                    detail="62 tokens waiting",
                ),
                ActionRecord(
                    at_unix_s=T0 - 95.0,
                    rule="expert_offload",
                    action="offload L7 E12,E40,E51,E60",
                    outcome="failed",
                    latency_ms=2_000.0,
                    detail="control socket timeout",
                ),
                ActionRecord(
                    at_unix_s=T0 - 140.0, rule="slo_latency", action="alert", outcome="ok", latency_ms=0.8, detail=None
                ),
            ],
        ),
        self_cost=SelfCost(cpu_pct=3.1, rss_bytes=71 * 2**20),
    )


def host_large_model() -> Snapshot:
    rng = random.Random(16384)
    layers = []
    for i in range(48):
        hot = {1000 + 37 * i: 40.0} if i in (9, 30) else {}
        layers.append(
            layer(
                rng,
                index=i,
                experts=16384,
                tokens=2_000_000,
                hot=hot,
                spread=0.2,
                entropy_norm=0.50 if i == 30 else 0.595 + 0.0005 * (i % 10),
                precision="fp16" if i >= 40 else "bf16",
                resident_device=None,
            )
        )
    return Snapshot(
        header=Header(
            agent_pid=777,
            started_unix_s=T0 - 42.0,
            targets=[Target(pid=900, comm="python3"), Target(pid=901, comm="python3")],
            probes_attached=["ingress", "nvtx"],
            sources=[
                SourceStats(name="ingress", events_per_s=88.0, drops_total=0),
                SourceStats(name="nvtx", events_per_s=96_500.0, drops_total=1_204),
                SourceStats(name="host", events_per_s=5.0, drops_total=None),
            ],
            dry_run=True,
        ),
        taken_unix_s=T0,
        seq=168,
        publish_interval_s=0.25,
        requests=Requests(
            window_s=10.0,
            rate_per_s=21.0,
            latency_p50_ms=48.0,
            latency_p95_ms=90.5,
            latency_p99_ms=None,
            errors_total=0,
            errors_per_s=0.0,
        ),
        moe=Moe(window_s=10.0, layers=layers),
        devices=Devices(
            gpus=[], host_budget=HostBudget(source="cgroup memory.max", used_bytes=15 * 2**30, total_bytes=16 * 2**30)
        ),
        policy=Policy(
            rules=rules(
                {
                    "fp16_fallback": ("armed", 0.0, 52.0),
                    "expert_offload": ("pending", 0.6, 96.0),
                    "memory_alert": ("firing", 1.0, 93.75),
                    "expert_queue_soft_limit": ("armed", 0.0, 3.0),
                    "expert_monopoly": ("firing", 1.0, 0.31),
                    "router_collapse": ("firing", 1.0, 0.50),
                    "expert_load_slow": ("armed", 0.0, None),
                    "slo_latency": ("armed", 0.0, None),
                }
            ),
            recent_actions=[
                ActionRecord(
                    at_unix_s=T0 - 2.0,
                    rule="router_collapse",
                    action="alert",
                    outcome="dry-run",
                    latency_ms=None,
                    detail="H/log2E 0.50 < 0.536 for 10 s",
                ),
                ActionRecord(
                    at_unix_s=T0 - 9.5,
                    rule="expert_monopoly",
                    action="replicate L30 E2110",
                    outcome="dry-run",
                    latency_ms=None,
                    detail="Gini 0.31 > 0.15 for 10 s",
                ),
            ],
        ),
        self_cost=SelfCost(cpu_pct=7.5, rss_bytes=140 * 10**6),
    )


def just_started() -> Snapshot:
    return Snapshot(
        header=Header(agent_pid=31337, started_unix_s=T0 - 0.4, targets=[Target(pid=2024, comm="vllm")]),
        taken_unix_s=T0,
        seq=1,
        publish_interval_s=0.25,
    )


def main() -> int:
    FIXTURES.mkdir(exist_ok=True)
    for name, make in (("gpu_busy", gpu_busy), ("host_large_model", host_large_model), ("just_started", just_started)):
        path = FIXTURES / f"{name}.json"
        path.write_text(json.dumps(to_dict(make()), separators=(",", ":"), allow_nan=False) + "\n")
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
