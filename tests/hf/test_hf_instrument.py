"""moescope.instrument() on real transformers models and on a hand-made MoE of another shape:
blocks found by structure, E and k, the router's scoring decided from its outputs, close() leaves
the model exactly as it was, a dense model gets the one-line reason. The NVTX events go to a
recording domain here (the real injection path: test_hf_nvtx.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import moescope
from moescope.hf.discover import NO_BLOCKS_REASON
from moescope.hf.tiny import tiny_model


@dataclass
class Attributes:
    message: str
    category: Any = None
    payload: Any = None


@dataclass
class RecordingDomain:
    """The subset of nvtx.Domain the emitter uses; keeps (kind, message, category, payload, depth)."""

    events: list[tuple[str, str, Any, Any, int]] = field(default_factory=list)
    depth: int = 0

    def get_registered_string(self, string: str) -> str:
        return string

    def get_event_attributes(self, message: Any = None, color: Any = None, category: Any = None,
                             payload: Any = None) -> Attributes:
        return Attributes(message, category, payload)

    def push_range(self, attributes: Any = None) -> None:
        self.events.append(("push", attributes.message, attributes.category, _copy(attributes.payload), self.depth))
        self.depth += 1

    def pop_range(self) -> None:
        self.depth -= 1
        self.events.append(("pop", "", None, None, self.depth))

    def mark(self, attributes: Any = None) -> None:
        self.events.append(("mark", attributes.message, attributes.category, _copy(attributes.payload), self.depth))

    def named(self, message: str) -> list[tuple[str, str, Any, Any, int]]:
        return [e for e in self.events if e[1] == message]


def _copy(payload: Any) -> Any:
    return payload.copy() if isinstance(payload, np.ndarray) else payload


def hook_state(model: nn.Module) -> list[tuple[str, int, int, int, int, int, tuple[str, ...]]]:
    """Every module's hook tables and attribute names: what instrument() touches and close() restores."""
    return [(name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._forward_hooks_always_called),
             len(m._forward_hooks_with_kwargs), len(m._forward_pre_hooks_with_kwargs), tuple(sorted(vars(m))))
            for name, m in model.named_modules()]


def entropy_bits(p: torch.Tensor) -> float:
    p = p.double()
    return float((-(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1) / math.log(2.0)).mean())


@pytest.mark.parametrize("arch,shared", [("mixtral", ()), ("qwen2_moe", ("shared_expert", "shared_expert_gate")),
                                         ("qwen3_moe", ())])
def test_blocks_found_by_structure_and_close_restores_the_model(arch: str, shared: tuple[str, ...]) -> None:
    model = tiny_model(arch, layers=3)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    before_state = hook_state(model)
    with torch.no_grad():
        plain = model(ids).logits
    domain = RecordingDomain()
    ins = moescope.instrument(model, domain=domain)
    assert ins.active and ins.reason == ""
    assert [(b.layer, b.path, b.router_name, b.experts_name, b.num_experts, b.top_k, b.shared) for b in ins.blocks] == [
        (i, f"model.layers.{i}.mlp", "gate", "experts", 8, 2, shared) for i in range(3)]
    assert hook_state(model) != before_state
    with torch.no_grad():
        observed = model(ids).logits
    assert torch.equal(plain, observed)  # the hooks read, never change
    assert len(domain.named("moe.step")) == 1 and len(domain.named("moe.layer")) == 3
    assert {s.kind for s in ins.scoring().values()} == {"softmax"}
    ins.close()
    assert hook_state(model) == before_state
    events = len(domain.events)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(plain, after) and len(domain.events) == events  # nothing emitted once closed


@pytest.mark.parametrize("defer", [True, False])
def test_cpu_path_events_nest_as_the_convention_says(defer: bool) -> None:
    model = tiny_model("qwen3_moe", layers=2)
    domain = RecordingDomain()
    ins = moescope.instrument(model, domain=domain, routing="layer", defer=defer)
    seen: dict[int, torch.Tensor] = {}
    handles = [b.router.register_forward_hook(lambda m, a, o, i=b.layer: seen.__setitem__(i, o[0]))
               for b in ins.blocks]
    ins.set_request_keys([7, 9])
    with torch.no_grad():
        model(torch.arange(12).reshape(2, 6))
    for h in handles:
        h.remove()
    ins.close()
    kinds = [(k, m, c, d) for k, m, c, _, d in domain.events if m]
    assert kinds[:3] == [("push", "moe.step", None, 0), ("mark", "moe.request", None, 1),
                         ("mark", "moe.request", None, 1)]
    per_layer = [("push", "moe.layer", None, 1), ("push", "moe.router", None, 2), ("mark", "moe.routing", None, 3),
                 ("push", "moe.experts", None, 2)]
    layer_events = [(k, m, None, d) for k, m, c, d in kinds[3:]]
    assert layer_events == per_layer * 2
    assert [e[3] for e in domain.named("moe.request")] == [7, 9]
    assert domain.named("moe.step")[0][3] == 12
    for layer, (router, routing) in enumerate(zip(domain.named("moe.router"), domain.named("moe.routing"))):
        assert router[2] == routing[2] == layer + 1
        logits = seen[layer]
        assert math.isclose(router[3], entropy_bits(torch.softmax(logits.double(), -1)), abs_tol=1e-6)
        want = torch.bincount(logits.topk(2, dim=-1).indices.reshape(-1), minlength=8)
        assert routing[3].tolist() == [*want.tolist(), *[0] * 8] and int(routing[3].sum()) == 2 * 12
    assert [e[3] for e in domain.named("moe.experts")] == [24, 24]
    assert domain.depth == 0


def test_a_dense_model_gets_the_one_line_reason() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    model = AutoModelForCausalLM.from_config(config).eval()
    before = hook_state(model)
    ins = moescope.instrument(model, domain=RecordingDomain())
    assert ins.blocks == () and not ins.active
    assert ins.reason == NO_BLOCKS_REASON and "\n" not in ins.reason and "dense model" in ins.reason
    assert hook_state(model) == before


class Chooser(nn.Module):
    """A router of another shape and name: returns probabilities, then indices, then weights."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.proj(x), dim=-1)
        weights, index = probs.topk(self.k, dim=-1)
        return probs, index, weights


class Bank(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1)

    def forward(self, x: torch.Tensor, *, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for slot in range(index.shape[-1]):
            out += weights[:, slot, None] * torch.einsum("th,thd->td", x, self.w[index[:, slot]])
        return out


class OddMoe(nn.Module):
    def __init__(self, hidden: int = 16, experts: int = 6, k: int = 3) -> None:
        super().__init__()
        self.chooser = Chooser(hidden, experts, k)
        self.bank = Bank(hidden, experts)
        self.always = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _probs, index, weights = self.chooser(x)
        return self.bank(x, index=index, weights=weights) + self.always(x)


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(OddMoe(), nn.ReLU(), OddMoe())

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.stack(inputs_embeds)


def test_a_family_never_seen_is_found_by_its_shape() -> None:
    torch.manual_seed(0)
    model = OddModel().eval()
    domain = RecordingDomain()
    ins = moescope.instrument(model, domain=domain, routing="layer")
    assert [(b.path, b.router_name, b.experts_name, b.num_experts, b.top_k, b.shared) for b in ins.blocks] == [
        ("stack.0", "chooser", "bank", 6, 3, ("always",)), ("stack.2", "chooser", "bank", 6, 3, ("always",))]
    probs: list[torch.Tensor] = []
    handles = [b.router.register_forward_hook(lambda m, a, o: probs.append(o[0])) for b in ins.blocks]
    x = torch.randn(10, 16)
    with torch.no_grad():
        model(inputs_embeds=x)
    for h in handles:
        h.remove()
    assert {s.kind for s in ins.scoring().values()} == {"probabilities"}
    assert domain.named("moe.step")[0][3] == 10
    for p, router, routing in zip(probs, domain.named("moe.router"), domain.named("moe.routing"), strict=True):
        assert math.isclose(router[3], entropy_bits(p), abs_tol=1e-6)
        want = torch.bincount(p.topk(3, dim=-1).indices.reshape(-1), minlength=6).tolist()
        assert routing[3].tolist() == want + [0] * 6
    ins.close()


def test_sigmoid_router_with_correction_bias_is_measured_as_it_selects() -> None:
    model: Any = tiny_model("deepseek_v3", layers=2)  # a transformers model: its attributes are not typed
    generator = torch.Generator().manual_seed(4)
    for layer in model.model.layers:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=generator) * 0.5)
    domain = RecordingDomain()
    ins = moescope.instrument(model, domain=domain, routing="layer")
    logits: list[torch.Tensor] = []
    handles = [b.router.register_forward_hook(lambda m, a, o: logits.append(o[0])) for b in ins.blocks]
    with torch.no_grad():
        model(torch.arange(16).reshape(2, 8))
    for h in handles:
        h.remove()
    scoring = ins.scoring()
    assert [(s.kind, s.bias_name) for s in scoring.values()] == [("sigmoid", "e_score_correction_bias")] * 2
    for block, s, router, routing in zip(ins.blocks, logits, domain.named("moe.router"), domain.named("moe.routing"),
                                         strict=True):
        bias: Any = block.router.e_score_correction_bias
        q = torch.sigmoid(s.double()) + bias.double()
        assert math.isclose(router[3], entropy_bits(q / q.sum(-1, keepdim=True)), abs_tol=1e-6)
        assert int(routing[3][:8].sum()) == 2 * 16
    ins.close()


def test_importing_moescope_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, moescope; print('torch' in sys.modules, 'transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["False", "False"]


def test_deferred_path_sends_the_live_paths_numbers_after_the_step() -> None:
    """The path CUDA takes (device-side counts and entropies, one copy per step, layers emitted after
    the step), run on the CPU: same routing and entropy as the live path, layers in order, no device
    time vector (there are no CUDA events on a CPU)."""
    model: Any = tiny_model("qwen2_moe", layers=3)
    ids = torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(8))

    def run(defer: bool) -> tuple[RecordingDomain, int]:
        domain = RecordingDomain()
        ins = moescope.instrument(model, domain=domain, routing="layer", defer=defer)
        seen: list[int] = []  # events emitted when the final norm runs: after the last MoE block
        handle = model.model.norm.register_forward_hook(lambda m, a, o: seen.append(len(domain.events)))
        with torch.no_grad():
            model(ids)
        handle.remove()
        ins.close()
        return domain, seen[0]

    (live, live_before_end), (deferred, deferred_before_end) = run(False), run(True)
    assert live_before_end == 1 + 3 * 7 and deferred_before_end == 1  # deferred: only the step's push
    assert [(k, m, d) for k, m, _, _, d in deferred.events] == [(k, m, d) for k, m, _, _, d in live.events]
    for name in ("moe.layer", "moe.experts", "moe.step"):
        assert [e[2:4] for e in deferred.named(name)] == [e[2:4] for e in live.named(name)]
    assert [e[3].tolist() for e in deferred.named("moe.routing")] == [e[3].tolist() for e in live.named("moe.routing")]
    for a, b in zip(deferred.named("moe.router"), live.named("moe.router"), strict=True):
        assert a[2] == b[2] and math.isclose(a[3], b[3], abs_tol=1e-6)
    assert deferred.named("moe.step.device") == [] and deferred.depth == 0


class Picker(nn.Module):
    """A router whose output layout can change between calls: "logits" (top-k is the block's),
    "tuple" (logits, weights, indices) or "swapped" (weights, indices, logits)."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.5)
        self.k = k
        self.layout = "logits"

    def forward(self, x: torch.Tensor) -> Any:
        logits = x @ self.weight.T
        if self.layout == "logits":
            return logits
        weights, index = torch.softmax(logits, -1).topk(self.k, dim=-1)
        return (logits, weights, index) if self.layout == "tuple" else (weights, index, logits)


class PickMoe(nn.Module):
    def __init__(self, hidden: int = 16, experts: int = 6, k: int = 2) -> None:
        super().__init__()
        self.router = Picker(hidden, experts, k)
        self.experts = Bank(hidden, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.router(x)
        if self.router.layout == "tuple":
            _, weights, index = out
        elif self.router.layout == "swapped":
            weights, index, _ = out
        else:
            weights, index = torch.softmax(out, -1).topk(self.router.k, dim=-1)
        return self.experts(x, index=index, weights=weights)


class PickModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(PickMoe(), nn.ReLU(), PickMoe())

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.stack(inputs_embeds)


def _forwards(model: nn.Module, inputs: list[dict[str, torch.Tensor]], *, defer: bool,
              between: Any = None) -> tuple[RecordingDomain, Any]:
    domain = RecordingDomain()
    ins = moescope.instrument(model, domain=domain, routing="layer", defer=defer)
    with torch.no_grad():
        for i, kwargs in enumerate(inputs):
            if between is not None:
                between(i)
            model(**kwargs)
    return domain, ins


def _same_events(a: RecordingDomain, b: RecordingDomain) -> None:
    assert [(k, m, c, d) for k, m, c, _, d in a.events] == [(k, m, c, d) for k, m, c, _, d in b.events]
    assert [e[3].tolist() for e in a.named("moe.routing")] == [e[3].tolist() for e in b.named("moe.routing")]
    for name in ("moe.layer", "moe.experts", "moe.step"):
        assert [e[3] for e in a.named(name)] == [e[3] for e in b.named(name)]
    for x, y in zip(a.named("moe.router"), b.named("moe.router"), strict=True):
        assert math.isclose(x[3], y[3], abs_tol=1e-6)


def test_after_the_first_call_the_router_alone_keeps_the_layer() -> None:
    """A transformers router returns the very index tensor its experts get: from the second step on
    only the router is wrapped (the experts' own forward is back), with the live path's numbers
    step after step; close() still leaves the model exactly as it was."""
    model: Any = tiny_model("qwen3_moe", layers=2)
    before = hook_state(model)
    generator = torch.Generator().manual_seed(12)
    inputs = [{"input_ids": torch.randint(0, 128, shape, generator=generator)} for shape in ((2, 7), (2, 1), (3, 1))]
    live, live_ins = _forwards(model, inputs, defer=False)
    live_ins.close()
    deferred, ins = _forwards(model, inputs, defer=True)
    assert all("forward" not in vars(b.experts) and "forward" in vars(b.router) for b in ins.blocks)
    ins.close()
    assert hook_state(model) == before
    _same_events(deferred, live)
    assert len(deferred.named("moe.step")) == 3 and len(deferred.named("moe.layer")) == 6
    assert ins.stats()["layers"] == 6 and ins.stats()["hook_errors"] == 0


class FakeCudaEvent:
    """torch.cuda.Event at the hardware boundary this machine lacks: each record() says on which
    stream; elapsed_time() is a fixed 0.25 ms (tests/gpu/check_device_routing.py checks real ones)."""

    records: list[object] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing

    def record(self, stream: object = None) -> None:
        FakeCudaEvent.records.append(stream)

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        return 0.25


@pytest.mark.parametrize("reduce_early", [False, True])
def test_cuda_layers_take_their_fast_path_after_the_first_call(reduce_early: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA layers (the device faked at torch.cuda's Event and stream; the reductions run where the
    tensors are): from the second step on every experts call takes _CUDA_FAST — the tensors kept,
    the event pair recorded on the stream looked up once a step — with the host path's numbers step
    after step (also when every layer is reduced early) and one device time per layer in
    moe.step.device."""
    from moescope.hf import emit

    if reduce_early:
        monkeypatch.setattr(emit, "_PENDING_ELEMENTS_CUDA", 1)
    early: list[int] = []
    reduce_pending = emit.Instrumentation._reduce_pending

    def counted(self: Any) -> None:
        early.append(len(self._step.pending))
        reduce_pending(self)

    monkeypatch.setattr(emit.Instrumentation, "_reduce_pending", counted)

    model: Any = tiny_model("qwen3_moe", layers=3)
    generator = torch.Generator().manual_seed(21)
    inputs = [{"input_ids": torch.randint(0, 128, shape, generator=generator)} for shape in ((2, 7), (2, 1), (3, 1))]
    host, host_ins = _forwards(model, inputs, defer=True)
    host_ins.close()
    lookups: list[object] = []

    def current_stream(device: object = None) -> object:
        lookups.append(device)
        return f"stream-{len(lookups)}"

    FakeCudaEvent.records = []
    monkeypatch.setattr(emit, "_cuda_index", lambda block: 0)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    cuda, ins = _forwards(model, inputs, defer=True)
    assert ins._mode == [emit._CUDA_FAST] * 3 and ins.stats()["hook_errors"] == 0
    ins.close()
    assert [e[3].tolist() for e in cuda.named("moe.routing")] == [e[3].tolist() for e in host.named("moe.routing")]
    for x, y in zip(cuda.named("moe.router"), host.named("moe.router"), strict=True):
        assert math.isclose(x[3], y[3], abs_tol=1e-6)
    assert [d[3].tolist() for d in cuda.named("moe.step.device")] == [[250.0] * 3] * 3
    # step 1 learns (Event.record() with no stream); steps 2 and 3: one lookup each, both events on it
    assert early == ([1] * 9 if reduce_early else [])  # then every layer as it comes; else all at the end
    assert lookups == [0, 0]
    assert FakeCudaEvent.records == [None] * 6 + ["stream-1"] * 6 + ["stream-2"] * 6


# per step: the router's layout, and whether the experts are still wrapped before that step
@pytest.mark.parametrize("layouts,wrapped", [
    (("logits", "logits", "tuple", "tuple", "swapped"), (True, True, True, True, True, True)),
    (("tuple", "tuple", "swapped", "swapped", "logits"), (True, False, False, False, False, True))])
def test_a_router_of_any_layout_and_one_that_changes_are_followed(layouts: tuple[str, ...],
                                                                  wrapped: tuple[bool, ...]) -> None:
    """A router that returns logits only (the block picks top-k: the experts wrapper takes the
    indices) or a tuple with the indices (the router wrapper alone), and one whose layout changes
    between steps (the layer is learned again): the live path's numbers throughout."""
    torch.manual_seed(1)
    model = PickModel().eval()
    generator = torch.Generator().manual_seed(13)
    inputs = [{"inputs_embeds": torch.randn(n, 16, generator=generator)} for n in (5, 3, 4, 6, 2)]
    routers = [m.router for m in model.stack if isinstance(m, PickMoe)]
    experts = [m.experts for m in model.stack if isinstance(m, PickMoe)]
    before = hook_state(model)
    seen: list[bool] = []

    def set_layout(i: int) -> None:
        seen.append(all("forward" in vars(e) for e in experts))
        for router in routers:
            router.layout = layouts[i]

    live, live_ins = _forwards(model, inputs, defer=False, between=set_layout)
    live_ins.close()
    seen.clear()
    deferred, ins = _forwards(model, inputs, defer=True, between=set_layout)
    seen.append(all("forward" in vars(e) for e in experts))
    assert tuple(seen) == wrapped
    ins.close()
    assert hook_state(model) == before
    _same_events(deferred, live)
    assert ins.stats()["layers"] == 10 and ins.stats()["hook_errors"] == ins.stats()["layers_without_scores"] == 0


def _truth(kind: str, scores: torch.Tensor, indices: torch.Tensor, bias: torch.Tensor | None,
           num_experts: int) -> tuple[list[int], float, int]:
    """One layer by the definitions, float64, one token at a time: counts, entropy bits, out of range."""
    flat = indices.reshape(-1).tolist()
    counts = [sum(1 for i in flat if i == e) for e in range(num_experts)]
    total = 0.0
    for row in scores.double().reshape(-1, num_experts):
        if kind == "softmax":
            p = torch.softmax(row, -1)
        elif kind == "sigmoid":
            q = torch.sigmoid(row) + (0.0 if bias is None else bias.double())
            q = q.clamp_min(0.0)
            p = q / q.sum()
        else:
            p = row
        total += entropy_bits(p)
    return counts, total / scores.shape[0], sum(1 for i in flat if not 0 <= i < num_experts)


@pytest.mark.parametrize("kind", ["softmax", "probabilities", "sigmoid"])
@pytest.mark.parametrize("host_counting", ["list", "numpy"])
def test_deferred_reductions_on_device_and_host_equal_the_definitions(kind: str, host_counting: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The step-end reduction: the device one (torch ops, what CUDA runs; run here on the CPU) and
    the host one (list.count for a small step, numpy for a large one) both equal a token-by-token
    count and entropy, with indices outside 0..E-1."""
    from moescope.hf import emit

    if host_counting == "numpy":
        monkeypatch.setattr(emit, "_LIST_COUNT_WORK", 0)
    generator = torch.Generator().manual_seed(11)
    num_experts, tokens, k = 6, 9, 2
    scores, indices, biases, expected = [], [], [], []
    for layer in range(3):
        raw = torch.randn(tokens, num_experts, generator=generator)
        scores.append(torch.softmax(raw, -1) if kind == "probabilities" else raw)
        biases.append(torch.rand(num_experts, generator=generator) * 0.3 if kind == "sigmoid" and layer != 1 else None)
        indices.append(torch.randint(0, num_experts, (tokens, k), generator=generator))
        indices[-1][0, 0], indices[-1][1, 1] = -1, num_experts  # not routed here: counted apart
        expected.append(_truth(kind, scores[-1], indices[-1], biases[-1], num_experts))
    for reduce in (emit._reduce_torch, emit._reduce_host):
        counts, entropy = reduce(scores, indices, num_experts, kind, biases)
        reduced = emit._Reduced(entries=[(layer, layer, scores[layer], indices[layer]) for layer in range(3)],
                                counts=counts, entropy=entropy)
        ((host_counts, entropy_bits),) = emit._to_host([reduced])
        assert host_counts.shape == (3, num_experts + 1)
        for layer, (want_counts, want_entropy, out_of_range) in enumerate(expected):
            assert host_counts[layer, :num_experts].tolist() == want_counts
            assert host_counts[layer, -1] == out_of_range == 2
            assert math.isclose(float(entropy_bits[layer]), want_entropy, abs_tol=1e-6), reduce.__name__


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0, 79.0, 200.0])
def test_host_softmax_entropy_holds_at_every_logit_scale(scale: float) -> None:
    """The host reduction's entropy at logit scales from flat to saturated, at E = 8 and 256: within
    1e-7 bits of the float64 definition, with no overflow and no warning."""
    import warnings

    from moescope.hf import emit

    generator = torch.Generator().manual_seed(int(scale * 10))
    for num_experts in (8, 256):
        scores = [torch.randn(33, num_experts, generator=generator) * scale for _ in range(2)]
        indices = [torch.zeros(33, 2, dtype=torch.int64) for _ in range(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, entropy = emit._reduce_host(scores, indices, num_experts, "softmax", None)
        for layer, s in enumerate(scores):
            want = float(torch.special.entr(torch.softmax(s.double(), -1)).sum(-1).mean()) / math.log(2.0)
            assert math.isclose(float(entropy[layer]), want, abs_tol=1e-7), (scale, num_experts)


def test_a_long_step_is_reduced_early_with_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pending scores past the bound are reduced at once (bounded memory on a long prefill): the
    events are those of a step reduced at its end."""
    from moescope.hf import emit

    model = tiny_model("mixtral", layers=3)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))

    def run() -> RecordingDomain:
        domain = RecordingDomain()
        ins = moescope.instrument(model, domain=domain, routing="layer")
        with torch.no_grad():
            model(ids)
        ins.close()
        return domain

    at_end = run()
    monkeypatch.setattr(emit, "_PENDING_ELEMENTS", 1)
    early = run()
    assert [(k, m, c, d) for k, m, c, _, d in early.events] == [(k, m, c, d) for k, m, c, _, d in at_end.events]
    assert [e[3].tolist() for e in early.named("moe.routing")] == [e[3].tolist() for e in at_end.named("moe.routing")]
    for a, b in zip(early.named("moe.router"), at_end.named("moe.router"), strict=True):
        assert math.isclose(a[3], b[3], abs_tol=1e-12)
    assert len(at_end.named("moe.layer")) == 3


def _values(payload: Any) -> np.ndarray:
    """A vector payload as sent: a held vector (0-d structured array) or a plain array."""
    return payload["values"] if payload.dtype.names else payload


def _steps(domain: RecordingDomain) -> list[list[tuple[str, str, Any, Any, int]]]:
    """The events of each moe.step range, in order."""
    steps: list[list[tuple[str, str, Any, Any, int]]] = []
    for event in domain.events:
        if event[0] == "push" and event[1] == "moe.step":
            steps.append([])
        steps[-1].append(event)
    return steps


def _run_steps(model: Any, *, compact: bool, steps: int = 3) -> tuple[RecordingDomain, list[Any], Any]:
    """A prefill of 2 x 7 tokens and greedy decode steps, with the model's own router logits."""
    domain = RecordingDomain()
    seen: list[tuple[int, list[int], float]] = []
    ins = moescope.instrument(model, domain=domain, compact=compact,
                              on_routing=lambda layer, counts, bits: seen.append((layer, counts.tolist(), bits)))
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(21))
    router_logits: list[Any] = []
    past = None
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=past, use_cache=True, output_router_logits=True)
            router_logits.append(out.router_logits)
            past = out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
    ins.close()
    return domain, router_logits, (ins, seen)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_compact_steps_carry_the_full_forms_numbers(arch: str) -> None:
    """The default (moe/v2.2 compact: per layer only moe.layer, the step's routing and entropies as
    two held vectors) sends, step after step, the numbers of the full form (moe.router and
    moe.experts per layer) and of the model's own router outputs: counts, k x tokens, entropy."""
    model: Any = tiny_model(arch, layers=3)
    compact, truth, (ins, compact_seen) = _run_steps(model, compact=True)
    full, _, (full_ins, full_seen) = _run_steps(model, compact=False)
    assert ins.compact and not full_ins.compact and ins.stats()["layers"] == 9
    top_k = int(model.config.num_experts_per_tok)
    assert not compact.named("moe.router") and not compact.named("moe.experts") and compact.depth == 0
    for step, full_step, logits in zip(_steps(compact), _steps(full), truth, strict=True):
        layers = [(e[0], e[1], e[2], e[3], e[4]) for e in step if e[1] == "moe.layer"]
        assert layers == [("push", "moe.layer", i + 1, 8, 1) for i in range(3)]
        (routing,) = [e for e in step if e[1] == "moe.step.routing"]
        (entropy,) = [e for e in step if e[1] == "moe.step.entropy"]
        (full_routing,) = [e for e in full_step if e[1] == "moe.step.routing"]
        full_entropy = [e[3] for e in full_step if e[1] == "moe.router"]
        assert routing[4] == entropy[4] == 1  # marks inside moe.step
        assert step[0][3] == full_step[0][3]  # tokens
        assert _values(routing[3]).tolist() == full_routing[3].tolist()
        assert np.allclose(_values(entropy[3]), full_entropy, rtol=0, atol=1e-9)
        rows = _values(routing[3]).reshape(3, 16)
        for layer, x in enumerate(logits):
            p = torch.softmax(x.double(), -1)
            want = torch.bincount(x.topk(top_k, dim=-1).indices.reshape(-1), minlength=8).tolist()
            assert rows[layer].tolist() == want + [0] * 8 and sum(want) == top_k * x.shape[0] == top_k * step[0][3]
            assert math.isclose(float(_values(entropy[3])[layer]), entropy_bits(p), abs_tol=1e-6)
    assert [(layer, counts) for layer, counts, _ in compact_seen] == [(layer, counts) for layer, counts, _ in full_seen]
    assert np.allclose([b for _, _, b in compact_seen], [b for _, _, b in full_seen], rtol=0, atol=1e-9)


class UnevenModel(nn.Module):
    """Two MoE blocks of different E (6 and 4): compact steps take the general path."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(OddMoe(experts=6), nn.ReLU(), OddMoe(experts=4, k=2))

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.stack(inputs_embeds)


@pytest.mark.parametrize("case", ["uneven", "reduced_early", "changing_layout"])
def test_compact_general_path_carries_the_full_forms_numbers(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compact steps off the batched fast path (layers of different E; a step reduced early, as a
    long prefill is) and on it with a router whose layout changes between steps (learned again)
    carry the full form's numbers."""
    from moescope.hf import emit

    torch.manual_seed(2)
    generator = torch.Generator().manual_seed(22)
    model: nn.Module
    if case == "reduced_early":
        monkeypatch.setattr(emit, "_PENDING_ELEMENTS", 1)
        model = tiny_model("qwen3_moe", layers=3)
        inputs: list[dict[str, torch.Tensor]] = [
            {"input_ids": torch.randint(0, 128, shape, generator=generator)} for shape in ((2, 5), (1, 3))]
    else:
        model = UnevenModel().eval() if case == "uneven" else PickModel().eval()
        inputs = [{"inputs_embeds": torch.randn(n, 16, generator=generator)} for n in (5, 3, 4)]
    routers = [m.router for m in model.modules() if isinstance(m, PickMoe)]

    def run(compact: bool) -> RecordingDomain:
        domain = RecordingDomain()
        ins = moescope.instrument(model, domain=domain, compact=compact)
        with torch.no_grad():
            for i, kwargs in enumerate(inputs):
                for router in routers:
                    router.layout = ("tuple", "logits", "swapped")[i]
                model(**kwargs)
        ins.close()
        assert ins.stats()["hook_errors"] == 0
        return domain

    compact, full = run(True), run(False)
    assert not compact.named("moe.router") and compact.depth == 0
    assert len(compact.named("moe.step.routing")) == len(compact.named("moe.step.entropy")) == len(inputs)
    for step, full_step in zip(_steps(compact), _steps(full), strict=True):
        assert [e[2:4] for e in step if e[1] == "moe.layer"] == [e[2:4] for e in full_step if e[1] == "moe.layer"]
        (routing,) = [_values(e[3]).tolist() for e in step if e[1] == "moe.step.routing"]
        (full_routing,) = [e[3].tolist() for e in full_step if e[1] == "moe.step.routing"]
        assert routing == full_routing
        (entropy,) = [_values(e[3]) for e in step if e[1] == "moe.step.entropy"]
        assert np.allclose(entropy, [e[3] for e in full_step if e[1] == "moe.router"], rtol=0, atol=1e-9)


def _compact_fast(kind: str, layers: int, num_experts: int, path: str,
                  biases: list[torch.Tensor | None] | None = None) -> Any:
    """A whole-model compact step end of `layers` x E, its kind learned as at a model's first
    step; path "torch" takes the native pass away (the torch ops, what runs without the library)."""
    from moescope import moe_nvtx
    from moescope.hf import emit
    from moescope.hf.scoring import Scoring

    fast = emit._CompactFast(moe_nvtx.CompactStep([num_experts] * layers, domain=None), num_experts)
    assert fast.learn_kind([Scoring(kind=kind, evidence="", bias=b) for b in (biases or [None] * layers)])
    if path == "torch":
        fast._native = None
    else:
        from moescope.hf import native

        assert native.available(), "libmoescope_hf.so not built (pip install -e .)"
    return fast


@pytest.mark.parametrize("kind", ["softmax", "probabilities", "sigmoid"])
@pytest.mark.parametrize("counting", ["loop", "bincount", "native"])
def test_compact_fast_fill_equals_the_definitions(kind: str, counting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact fast path's batched reduction into the held vectors (the native pass, or the
    torch ops counting by a loop or bincount) equals a token-by-token count and entropy, with
    indices outside 0..E-1 (near: -1 and E; far: -5 and E + 3) left out. Sigmoid routers (a bias
    per layer) always take the torch ops."""
    from moescope.hf import emit

    if counting == "bincount":
        monkeypatch.setattr(emit, "_LOOP_COUNT_ASSIGNMENTS", 0)
    generator = torch.Generator().manual_seed(23)
    num_experts, tokens, k, layers = 6, 9, 2, 3
    for far in (False, True):
        scores, indices, biases, expected = [], [], [], []
        for layer in range(layers):
            raw = torch.randn(tokens, num_experts, generator=generator)
            scores.append(torch.softmax(raw, -1) if kind == "probabilities" else raw)
            with_bias = kind == "sigmoid" and layer != 1
            biases.append(torch.rand(num_experts, generator=generator) * 0.3 if with_bias else None)
            indices.append(torch.randint(0, num_experts, (tokens, k), generator=generator))
            indices[-1][0, 0], indices[-1][1, 1] = (-5, num_experts + 3) if far else (-1, num_experts)
            expected.append(_truth(kind, scores[-1], indices[-1], biases[-1], num_experts))
        fast = _compact_fast(kind, layers, num_experts, "native" if counting == "native" else "torch", biases)
        assert (fast._native is not None) is (counting == "native" and kind != "sigmoid")
        for row in fast.step.rows:
            row[:num_experts] = 7  # a previous step's counts are overwritten (over capacity is never written)
        out_of_range = fast.fill(tuple(scores), tuple(indices))
        assert out_of_range == 2 * layers
        for layer, (want_counts, want_entropy, _) in enumerate(expected):
            assert fast.step.rows[layer].tolist() == want_counts + [0] * num_experts
            assert math.isclose(float(fast.step.entropy[layer]), want_entropy, abs_tol=1e-6)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_compact_fast_fill_scatters_in_range_counts_then_falls_back_for_good(index_dtype: torch.dtype) -> None:
    """Without the native pass, in-range indices are counted by one scatter_add into the held
    vector (int32 indices too); a step with an index outside 0..E-1 (which scatter_add refuses) is
    counted by the fallback, and so is every later step, each equal to a token-by-token count."""
    generator = torch.Generator().manual_seed(29)
    num_experts, tokens, k, layers = 5, 7, 2, 4
    fast = _compact_fast("softmax", layers, num_experts, "torch")
    for step, planted in enumerate((False, False, True, False)):
        scores = [torch.randn(tokens, num_experts, generator=generator) for _ in range(layers)]
        indices = [torch.randint(0, num_experts, (tokens, k), generator=generator).to(index_dtype)
                   for _ in range(layers)]
        if planted:
            indices[2][3, 1] = num_experts
        for row in fast.step.rows:
            row[:num_experts] = 9  # the last step's counts are overwritten
        assert fast.fill(tuple(scores), tuple(indices)) == int(planted), step
        assert fast._scatter is (step < 2), step  # off from the first out-of-range step on
        for layer in range(layers):
            want_counts, want_entropy, _ = _truth("softmax", scores[layer], indices[layer].long(), None, num_experts)
            assert fast.step.rows[layer].tolist() == want_counts + [0] * num_experts, (step, layer)
            assert math.isclose(float(fast.step.entropy[layer]), want_entropy, abs_tol=1e-6)


@pytest.mark.parametrize("score_dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_compact_fast_native_pass_takes_what_it_can_and_hands_the_rest_to_torch(
        score_dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    """The native pass reads float32, float64 and bfloat16 scores and int64 or int32 indices where
    torch keeps them; float16 scores, a non-contiguous layer, a lazily negated view or a layer of
    another shape go to the torch ops (it writes nothing then). Either way the held vectors equal
    the definitions computed in float64 from the same scores; extreme logits (-inf, +-1e4) stay
    finite."""
    from moescope.hf import native

    generator = torch.Generator().manual_seed(31)
    num_experts, tokens, k, layers = 7, 5, 3, 3
    fast = _compact_fast("softmax", layers, num_experts, "native")
    for case in ("plain", "extreme", "strided", "negated", "ragged"):
        scores = [torch.randn(tokens, num_experts, generator=generator).to(score_dtype) for _ in range(layers)]
        indices = [torch.randint(0, num_experts, (tokens, k), generator=generator).to(index_dtype)
                   for _ in range(layers)]
        if case == "extreme":
            scores[0][0, :3] = torch.tensor([float("-inf"), 1e4, -1e4]).to(score_dtype)
        elif case == "strided":
            scores[1] = torch.randn(num_experts, tokens, generator=generator).to(score_dtype).t()
        elif case == "negated":  # a lazily negated view: its memory holds the values un-negated
            scores[2] = torch._neg_view(scores[2])
        elif case == "ragged":
            indices[2] = indices[2][:-1]
        native_takes = score_dtype != torch.float16 and case in ("plain", "extreme")
        if case == "negated":
            assert scores[2].is_neg()
        assert (fast._native.fill(scores, indices, native.KIND_CODES["softmax"]) is not None) is native_takes, case
        if case == "ragged":  # not one shape per layer: the general path takes such a step
            with pytest.raises(RuntimeError):
                fast.fill(tuple(scores), tuple(indices))
            continue
        for row in fast.step.rows:
            row[:num_experts] = 3
        assert fast.fill(tuple(scores), tuple(indices)) == 0
        for layer in range(layers):
            want_counts, want_entropy, _ = _truth("softmax", scores[layer].double(), indices[layer].long(), None,
                                                  num_experts)
            assert fast.step.rows[layer].tolist() == want_counts + [0] * num_experts, (case, layer)
            assert math.isfinite(float(fast.step.entropy[layer]))
            assert math.isclose(float(fast.step.entropy[layer]), want_entropy, abs_tol=1e-9), (case, layer)


def test_native_step_fill_refuses_arguments_it_does_not_take() -> None:
    """The C entry point answers -1 (nothing written) for arguments out of its contract, never
    reading through a null address."""
    from moescope.hf import native

    fill = native._FILL
    assert fill is not None, "libmoescope_hf.so not built (pip install -e .)"
    routing = np.full((2, 8), 5, dtype=np.int32)
    entropy = np.zeros(2)
    ptrs = np.zeros(4, dtype=np.uint64)
    addr = native._address
    good = (addr(ptrs), 2, 3, 4, 6, 0, 0, 8, addr(routing), 8, addr(entropy))
    for at, bad in ((5, 2), (6, 3), (7, 2), (9, 3), (3, 0), (1, -1)):
        args = list(good)
        args[at] = bad
        assert fill(*args) == -1, (at, bad)
    assert fill(*good) == -1  # null tensor addresses with tokens to read
    assert fill(addr(ptrs), 2, 0, 4, 0, 0, 0, 8, addr(routing), 8, addr(entropy)) == 0  # an empty step
    assert routing[:, :4].tolist() == [[0] * 4] * 2 and routing[:, 4:].tolist() == [[5] * 4] * 2
    assert entropy.tolist() == [0.0, 0.0]
