"""The reference model's device routing path (what CUDA runs: no host sync per layer, one copy per
step), run here on the CPU: route_device() equals route() for the "drop" policy, and a model step
on the device path gives the host path's logits, stats and NVTX events (layers emitted after the
last layer). On a GPU, tests/gpu/check_device_routing.py checks the same on CUDA with a sync count."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moescope.examples.moe_runtime.config import ModelConfig
from moescope.examples.moe_runtime.model import SequenceState, route, route_device
from moescope.examples.moe_runtime.runtime import Runtime, RuntimeOptions
from moescope.examples.moe_runtime.stats import StatsSnapshot
from moescope.moe_nvtx import NvtxInstrumentation
from tests.runtime.test_nvtx import RecordingDomain

torch.set_grad_enabled(False)

CFG = ModelConfig(d_model=64, d_ff=128, layers=3, experts=8, n_heads=2, capacity_factor=0.75)


@pytest.mark.parametrize("top_k,capacity_factor,tokens", [(2, 0.75, 37), (1, 1.25, 16), (3, 0.5, 50), (2, 4.0, 9)])
def test_device_route_equals_the_host_route(top_k: int, capacity_factor: float, tokens: int) -> None:
    cfg = dataclasses.replace(CFG, top_k=top_k, capacity_factor=capacity_factor)
    generator = torch.Generator().manual_seed(top_k * 100 + tokens)
    logits = torch.randn(tokens, cfg.experts, generator=generator) * 2
    logits[:, 3] += 1.5  # a hot expert, so capacity drops assignments
    host = route(cfg, logits, noise=None)
    device = route_device(cfg, logits, noise=None)
    row = device.row.numpy()
    assert row[:cfg.experts].astype(np.int64).tolist() == host.demand.tolist()
    assert row[cfg.experts:2 * cfg.experts].astype(np.int64).tolist() == host.dropped.tolist()
    assert int(row[-2]) == host.expert_index.numel() and device.capacity == host.capacity
    assert abs(row[-1] - host.entropy_bits) < 1e-6
    assert host.dropped.sum() > 0 or capacity_factor >= 4.0
    kept = device.slot_token < tokens
    slots = {(int(t), e, round(float(w), 6)) for e in range(cfg.experts)
             for t, w in zip(device.slot_token[e][kept[e]].tolist(), device.slot_weight[e][kept[e]].tolist())}
    want = {(int(t), int(e), round(float(w), 6))
            for t, e, w in zip(host.token_index.tolist(), host.expert_index.tolist(), host.weight.tolist())}
    assert slots == want
    assert float(device.slot_weight[~kept].abs().sum()) == 0.0  # padding carries no weight


def _run(device_routing: bool, steps: int = 3) -> tuple[list[torch.Tensor], RecordingDomain, StatsSnapshot]:
    domain = RecordingDomain()
    ins = NvtxInstrumentation(domain=domain, convention="v2")
    rt = Runtime(RuntimeOptions(model=CFG), instrumentation=ins)
    rt.model.device_routing = device_routing
    seqs = [SequenceState() for _ in range(3)]
    inputs = [rt.tokenizer.encode(p) for p in ("one prompt", "another, longer prompt", "x")]
    logits_per_step = []
    for _ in range(steps):
        ins.step_push(sum(len(t) for t in inputs))
        logits = rt.model.forward(seqs, inputs)
        ins.step_pop()
        logits_per_step.append(logits.clone())
        inputs = [[int(t)] for t in logits.argmax(-1).tolist()]
    return logits_per_step, domain, rt.stats.snapshot()


def test_a_device_path_step_gives_the_host_paths_logits_stats_and_events() -> None:
    host_logits, host_domain, host_stats = _run(False)
    device_logits, device_domain, device_stats = _run(True)
    for a, b in zip(host_logits, device_logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for key in ("tokens", "dropped", "rerouted_in", "capacity"):
        assert np.array_equal(np.asarray(device_stats[key]), np.asarray(host_stats[key])), key
    assert np.allclose(device_stats["entropy_bits"], host_stats["entropy_bits"], atol=1e-6)
    assert int(np.asarray(host_stats["dropped"]).sum()) > 0  # capacity 0.75 drops: the dump path ran

    def shape(domain: RecordingDomain) -> list[tuple[str, str, int | None, tuple[str, ...]]]:
        # the host path's per-expert host times have no device-path counterpart (moe.step.device on CUDA)
        return [(e.kind, e.message, e.category, e.parents) for e in domain.events if e.message != "moe.experts.time"]

    assert shape(device_domain) == shape(host_domain)
    for name in ("moe.routing", "moe.experts", "moe.layer"):
        host_payloads = [e.payload for e in host_domain.events if e.message == name and e.kind != "pop"]
        device_payloads = [e.payload for e in device_domain.events if e.message == name and e.kind != "pop"]
        assert [np.asarray(p).tolist() for p in device_payloads] == [np.asarray(p).tolist() for p in host_payloads]
    host_entropy = [e.payload for e in host_domain.events if e.message == "moe.router" and e.kind == "push"]
    device_entropy = [e.payload for e in device_domain.events if e.message == "moe.router" and e.kind == "push"]
    assert len(device_entropy) == 3 * CFG.layers and np.allclose(device_entropy, host_entropy, atol=1e-6)


def test_a_step_that_needs_a_host_decision_takes_the_host_path() -> None:
    rt = Runtime(RuntimeOptions(model=dataclasses.replace(CFG, overflow="reroute")),
                 instrumentation=NvtxInstrumentation(domain=RecordingDomain(), convention="v2"))
    rt.model.device_routing = True
    assert not rt.model._device_step(rt.store.snapshot())  # reroute decides per token on the host
    rt = Runtime(RuntimeOptions(model=CFG, capacity_experts=CFG.layers * CFG.experts - 1),
                 instrumentation=NvtxInstrumentation(domain=RecordingDomain(), convention="v2"))
    rt.model.device_routing = True
    assert not rt.model._device_step(rt.store.snapshot())  # an expert to load from the host
    rt = Runtime(RuntimeOptions(model=CFG), instrumentation=NvtxInstrumentation(domain=RecordingDomain(),
                                                                               convention="v1"))
    rt.model.device_routing = True
    assert not rt.model._device_step(rt.store.snapshot())  # v1's per-expert ranges need host counts
