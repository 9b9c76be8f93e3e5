"""Forward hooks that turn a model's MoE blocks into moe/v2 NVTX events (docs/nvtx-convention.md).

Per forward call of the instrumented module: one `moe.step` range (payload: tokens in the batch)
with one `moe.request` mark per request key given with `set_request_keys` (or one
`moe.step.requests` vector, `set_request_tokens`). Per MoE block and call: `moe.layer` (payload E).
Compact (moe/v2.2, the default): nothing else per layer; after the last layer the step's routing
(`moe.step.routing`) and router entropies (`moe.step.entropy`: mean token entropy in bits of what
the router selects from, moescope/hf/scoring.py) as two held vectors (moescope/moe_nvtx.py
CompactStep). Full (`compact=False`, `routing="layer"` or live): inside each `moe.layer` a
`moe.router` (payload: the entropy) and `moe.experts` (payload: assignments = k × tokens, no
capacity in these models); the routing vectors once per step as `moe.step.routing`, or per layer
(`routing="layer"`: one `moe.routing` in each router).

Deferred (the default, and always on CUDA): the hooks only keep each layer's router scores and
top-k indices (references, no copy) and, on CUDA, time its experts call with CUDA events. On a CPU,
after a layer's first call, that is all they do: when the router returns the very index tensor the
experts get, the experts wrapper is taken off and the router's keeps both (one wrapped call per
layer). When the step ends, every layer's counts (the indices scattered into per-layer bins) and
entropy are computed in one batch of tensor ops on the model's device, one copy brings them to the
host, and the layer ranges are emitted then, back to back, with `moe.step.device` carrying each
layer's experts time on CUDA (the layer ranges' own durations mean nothing). Nothing is read back
per layer. A step whose pending scores pass
`_PENDING_ELEMENTS` (`_PENDING_ELEMENTS_CUDA` on CUDA) is reduced early (on the device, still without a
host sync) to bound what is held.

Live (`defer=False`, CPU layers only): `moe.layer` spans the block, `moe.experts` the experts call,
and the router range is opened after the router ran (its payload is its result, computed per layer
on the host), so router time is part of the layer's remainder. Costs more per layer.

The hooks run on the model thread only (NVTX ranges are per thread). A failure inside a hook is
counted and logged once; it never reaches the model.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope import moe_nvtx
from moescope.hf import native
from moescope.hf.discover import Discovery, MoeBlock, discover
from moescope.hf.scoring import Scoring, classify, entropy_bits_numpy, sum_entropy_nats_layers

log = logging.getLogger("moescope.hf")

# (layer, tokens routed per expert [E] int64, mean token router entropy in bits), per layer and step
RoutingObserver = Callable[[int, np.ndarray, float], None]
_STAT_NAMES = ("steps", "layers", "calls_outside_step", "layers_without_scores", "layers_without_indices",
               "indices_out_of_range", "hook_errors", "steps_without_tokens")
# Score elements a step may hold before its pending layers are reduced (4 MiB of float32 scores):
# small steps are reduced once at the step end, a long prefill every few layers.
_PENDING_ELEMENTS = 1 << 20
# ... and on CUDA, where each early reduction is ~15 kernel launches of host time in a host-bound
# step and 16 Mi elements are 32-64 MiB of device memory: a 2048-token prefill at E=128 is reduced
# once, at the step end, for up to 64 layers (each early reduction cost ~0.2 ms there: H200 run)
_PENDING_ELEMENTS_CUDA = 1 << 24
_LN2 = math.log(2.0)


# One experts call of the step, not yet reduced: (call, layer, router scores [T, E] as returned,
# the top-k index tensor the experts were called with) — references, no copy. `call` is its place
# among the step's experts calls (emission order, CUDA event pair).
_Entry = tuple[int, int, torch.Tensor, torch.Tensor]
_UNKNOWN, _ITSELF = -2, -1  # where a router's scores sit in its output: not learned yet, the output itself
# a layer's hook mode (Instrumentation._mode); _CUDA_FAST: a CUDA layer after its first call
_SLOW, _EXPERTS_FAST, _ROUTER_FAST, _CUDA_FAST = 0, 1, 2, 3
_add = np.add.reduce  # the ufunc method itself: no Python wrapper per call
# Host counts by list.count up to this much work (E x (assignments + 40) summed over the step's
# layers, about 30 µs); numpy above, whose few calls cost more than that in a forward
_LIST_COUNT_WORK = 20_000
# A compact host step with indices outside 0..E-1 (which scatter_add refuses) is counted by a
# Python loop up to this many assignments (all layers; ≈ 60 ns each here), by one bincount above
# (≈ 5 tensor calls, ≈ 100 µs whatever the size)
_LOOP_COUNT_ASSIGNMENTS = 1536
_COMPACT_LAYOUTS = 64  # held-vector layouts kept (steps that run other sets of layers)


@dataclass(slots=True)
class _Reduced:
    """A group of a step's calls reduced together: device tensors until the step's one copy, or
    numpy arrays when reduced on the host."""

    entries: list[_Entry]
    counts: torch.Tensor | np.ndarray  # [n, E + 1] int64: column E counts indices outside 0..E-1
    entropy: torch.Tensor | list[float]  # mean over tokens: nats [n] (device tensor) or bits (host)


@dataclass(slots=True)
class _StepState:
    depth: int = 0
    open: bool = False
    closed: bool = False  # close() ran: no step opens again, every wrapper passes straight through
    pending: list[_Entry] = field(default_factory=list)  # one list for the object's life (hooks hold it)
    pending_elements: int = 0
    reduced: list[_Reduced] = field(default_factory=list)
    calls: int = 0  # experts calls of the step: the index of its CUDA event pair


def _find_tensor(value: object, *, integer: bool, last_dim: int | None = None) -> tuple[torch.Tensor | None, int]:
    """The first tensor of `value` (itself, or an item of a tuple or list) of the wanted kind, and
    where it was: its index in the sequence, _ITSELF, or _UNKNOWN when none is."""
    if isinstance(value, (tuple, list)):
        items: Iterable[tuple[int, object]] = enumerate(value)
    else:
        items = ((_ITSELF, value),)
    for place, item in items:
        if isinstance(item, torch.Tensor) and item.dim() >= 1 and item.is_floating_point() != integer:
            if last_dim is None or item.shape[-1] == last_dim:
                return item, place
    return None, _UNKNOWN


def _find_indices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, int | str]:
    """The experts call's top-k index tensor (its first integer tensor argument) and where it was:
    its position, or its keyword."""
    found, place = _find_tensor(args, integer=True)
    if found is not None or not kwargs:
        return found, place
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and not value.is_floating_point():
            return value, name
    return None, _UNKNOWN


def _cuda_index(block: MoeBlock) -> int:
    """The device index of a CUDA layer's experts (-1 for a host layer)."""
    return next((p.get_device() for p in block.experts.parameters() if p.is_cuda), -1)


def _batch_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if isinstance(ids, torch.Tensor):
        return int(ids.numel())
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return int(embeds.shape[:-1].numel())
    return None


def _stack_scores(scores: Sequence[torch.Tensor], num_experts: int) -> torch.Tensor:
    stacked = torch.stack(list(scores))
    if stacked.requires_grad:
        stacked = stacked.detach()
    return stacked.reshape(len(scores), -1, num_experts)


def _stack_biases(biases: Sequence[torch.Tensor | None] | None, num_experts: int, like: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor | None:
    if biases is None or all(b is None for b in biases):
        return None
    return torch.stack([torch.zeros(num_experts, dtype=dtype, device=like.device) if b is None
                        else b.detach().reshape(num_experts).to(device=like.device, dtype=dtype) for b in biases])


def _reduce_torch(scores: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], num_experts: int, kind: str,
                  biases: Sequence[torch.Tensor | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [n, E + 1] int64, mean token entropy nats [n]) of n calls that share E, scoring kind,
    shapes and device: stacked, a few tensor ops for all of them, no host sync (float32 on the device)."""
    n = len(scores)
    stacked = _stack_scores(scores, num_experts)
    bias = _stack_biases(biases, num_experts, stacked, torch.float32)
    entropy = sum_entropy_nats_layers(kind, stacked, bias, dtype=torch.float32) / max(stacked.shape[1], 1)
    bins = num_experts + 1
    flat = torch.stack([i.detach().reshape(-1) for i in indices]).long()
    # indices outside 0..E-1 (an expert-parallel "not here" marker) land in bin E: -1 -> E, >= E -> E
    flat = flat.clamp(-1, num_experts).remainder_(bins)
    flat += torch.arange(0, n * bins, bins, device=flat.device).unsqueeze(1)
    flat = flat.reshape(-1)
    # scatter_add_, not bincount: CUDA bincount reads the maximum back to the host
    counts = torch.zeros(n * bins, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones(1, dtype=torch.int64, device=flat.device).expand(flat.shape[0]))
    return counts.view(n, bins), entropy


@functools.lru_cache(maxsize=64)
def _bin_offsets(layers: int, bins: int) -> np.ndarray:
    """[layers, 1] uint64: where each layer's bins start in one bincount over all of them (read-only)."""
    offsets = np.arange(0, layers * bins, bins, dtype=np.uint64)[:, None]
    offsets.flags.writeable = False
    return offsets


def _count_host(indices: Sequence[torch.Tensor], num_experts: int) -> np.ndarray:
    """[n, E + 1] int64 counts of CPU index tensors, column E for indices outside 0..E-1. A small
    step is counted by Python's list.count (one tensor call, then C loops), a large one with numpy."""
    n = len(indices)
    flat = torch.stack(list(indices)).reshape(n, -1)
    assignments = flat.shape[1]
    if n * num_experts * (assignments + 40) <= _LIST_COUNT_WORK:
        experts = range(num_experts)
        rows = []
        for row in flat.tolist():
            counts = [row.count(e) for e in experts]
            counts.append(assignments - sum(counts))
            rows.append(counts)
        return np.array(rows, dtype=np.int64)
    if flat.dtype != torch.int64:
        flat = flat.long()
    # viewed unsigned, a negative index (an expert-parallel "not here" marker) is huge: one minimum
    # puts it and every index >= E in bin E
    bins = num_experts + 1
    binned = np.minimum(flat.numpy().view(np.uint64), num_experts)
    binned += _bin_offsets(n, bins)
    return np.bincount(binned.view(np.int64).reshape(-1), minlength=n * bins).reshape(n, bins)


def _reduce_host(scores: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], num_experts: int, kind: str,
                 biases: Sequence[torch.Tensor | None] | None) -> tuple[np.ndarray, list[float]]:
    """The same numbers for CPU tensors — (counts [n, E + 1] int64, mean token entropy bits per
    call) — in as few calls as it takes: inside a forward each tensor or numpy call costs tens of
    microseconds (caches cold after the model's own work), more than the arithmetic of a decode step.
    Entropy in float64."""
    stacked = _stack_scores(scores, num_experts)
    bias = _stack_biases(biases, num_experts, stacked, torch.float64)
    scale = 1.0 / (max(stacked.shape[1], 1) * _LN2)
    bits = [total * scale for total in sum_entropy_nats_layers(kind, stacked, bias, dtype=torch.float64).tolist()]
    return _count_host(indices, num_experts), bits


def _to_host(reduced: list[_Reduced]) -> list[tuple[np.ndarray, Sequence[float]]]:
    """(counts [n, E+1] int64, entropy bits per call) per group: one device-to-host copy for the step."""
    on_device = [(r.counts, r.entropy) for r in reduced if isinstance(r.counts, torch.Tensor)]
    packed = np.empty(0)
    if on_device:
        device = on_device[0][0].device
        packed = torch.cat([torch.as_tensor(t).reshape(-1).to(device=device, dtype=torch.float64)
                            for pair in on_device for t in pair]).cpu().numpy()
    out: list[tuple[np.ndarray, Sequence[float]]] = []
    offset = 0
    for r in reduced:
        if isinstance(r.counts, np.ndarray) and isinstance(r.entropy, list):  # reduced on the host
            out.append((r.counts, r.entropy))
            continue
        n, bins = r.counts.shape
        counts = packed[offset:offset + n * bins].astype(np.int64).reshape(n, bins)
        offset += n * bins
        out.append((counts, (packed[offset:offset + n] / _LN2).tolist()))
        offset += n
    return out


_ONES_SHAPES = 16  # index shapes whose scatter_add source is kept (a decode step per batch size, ...)
_ONES_KEEP_ELEMENTS = 1 << 16  # assignments (all layers) of the largest step whose source is kept


class _CompactFast:
    """The compact step end of a host model whose layers share E: torch views of the held vectors
    (its counts and entropies are written straight there), scatter_add's sources and the per-layer
    bin offsets of the out-of-range fallback."""

    __slots__ = ("layers", "experts", "expert_ids", "step", "matrix", "tokens", "tokens_t", "entropy_t", "kind",
                 "scorings", "_weights", "_pack", "_ones", "_zeros", "_scatter", "_native", "_native_kind")

    def __init__(self, step: moe_nvtx.CompactStep, experts: int) -> None:
        layers = len(step.layer_experts)
        self.layers, self.experts, self.step = layers, experts, step
        matrix = step.matrix()
        assert matrix is not None  # one E for every layer: make() checked
        self.matrix = matrix  # [L, 2E] int32: per layer tokens[E] ++ over_capacity[E]
        self.expert_ids = range(experts)
        self.tokens = matrix[:, :experts]  # written each step; the over-capacity halves stay 0
        self.tokens_t = torch.from_numpy(matrix)[:, :experts]  # the same bytes as a tensor
        self.entropy_t = torch.from_numpy(step.entropy)
        self._weights: dict[int, torch.Tensor] = {}  # per T·E: [T·E] of 1 / (T ln 2)
        # the routing vector's bytes from a flat list of L·E counts: per layer E int32; the pad bytes
        # (its over-capacity half, 0 since nothing writes it) are skipped by pack_into
        self._pack = struct.Struct("=" + f"{experts}i{4 * experts}x" * layers).pack_into
        self.kind: str | None = None
        self.scorings: list[Scoring] = []
        self._ones: dict[torch.Size, torch.Tensor] = {}  # per [L, assignments]: int32 ones, scatter_add's source
        self._zeros = torch.zeros(layers, experts, dtype=torch.int32)  # scatter_add's base (never written)
        # counts by one scatter_add into the held vector until a step has indices outside 0..E-1
        # (scatter_add refuses them): from then on by the loop or bincount, which leave them out
        self._scatter = True
        # one native call for the whole step (moescope/hf/step_fill.c) when the library is built and
        # the kind is one it computes (learn_kind); the torch ops below otherwise
        self._native = native.StepFill(matrix, step.entropy) if native.available() else None
        self._native_kind = -1

    @classmethod
    def make(cls, ins: Instrumentation) -> _CompactFast | None:
        experts = set(ins._num_experts)
        if len(experts) != 1:
            return None
        (num_experts,) = experts
        layers = len(ins._num_experts)
        return cls(ins._compact_step(tuple((i, num_experts) for i in range(layers))), num_experts)

    def learn_kind(self, scorings: Sequence[Scoring | None]) -> bool | None:
        """True when every layer's scoring is known and of one kind (decided at the layers' first
        calls), None while some are not known yet, False when they differ (never this path)."""
        known = [s for s in scorings if s is not None]
        if len(known) != self.layers:
            return None
        if len({s.kind for s in known}) != 1:
            return False
        self.kind, self.scorings = known[0].kind, known
        self._native_kind = native.KIND_CODES.get(self.kind, -1)
        if self._native_kind < 0:
            self._native = None  # sigmoid routers (a bias per layer): the torch ops
        return True

    def fill(self, scores: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...], *,
             score_elements: int | None = None) -> int:
        """Each layer's scores [..., E] and indices [..., k] (layer order, one shape each) -> the
        held vectors; returns the indices outside 0..E-1 (left out of the counts). Inside a forward
        each tensor call costs 10-40 µs on a small CPU (caches cold after the model's own work) and
        a Python loop or struct call about as much, so this is six calls: a softmax router's
        entropies by cat, float64 softmax, entr and one matrix-vector product into the held vector;
        the counts by cat and one scatter_add into the held vector (`out=` buffers for the entropy
        ops measured slower than fresh tensors). `score_elements`: the scores' elements summed over
        the layers (the router wrapper's running count), else counted here. Raises RuntimeError
        when the layers' shapes differ (cat refuses other sizes but the first's; a sum of elements
        unlike L × the first layer's catches that, and the same for the indices; the caller takes
        the general path). The native pass (moescope/hf/step_fill.c) does all of it in one call
        when the library is built and the tensors are ones it reads."""
        if self._native is not None:  # one C pass over the tensors' memory (None: not tensors it takes)
            outside = self._native.fill(scores, indices, self._native_kind)
            if outside is not None:
                return outside
        layers, experts = self.layers, self.experts
        if score_elements is None:
            score_elements = sum(s.numel() for s in scores)
        if score_elements != layers * scores[0].numel():
            raise RuntimeError("the layers' scores differ in shape")
        stacked = torch.cat(scores)  # [L·T, E] (or [L·B, S, E])
        if stacked.requires_grad:
            stacked = stacked.detach()
        if self.kind == "softmax":
            # mean token entropy in bits: entr(softmax) summed per layer and scaled by one
            # matrix-vector product, written into the held vector (float64 throughout)
            entr = torch.special.entr(torch.softmax(stacked, dim=-1, dtype=torch.float64)).view(layers, -1)
            torch.mv(entr, self._scale(entr.shape[1]), out=self.entropy_t)
        else:
            per_layer = stacked.reshape(layers, -1, experts)
            biases = [s.bias for s in self.scorings] if self.kind == "sigmoid" else None
            bias = _stack_biases(biases, experts, per_layer, torch.float64)
            nats = sum_entropy_nats_layers(self.kind or "", per_layer, bias, dtype=torch.float64)
            torch.mul(nats, 1.0 / (max(per_layer.shape[1], 1) * _LN2), out=self.entropy_t)
        if sum(i.numel() for i in indices) != layers * indices[0].numel():
            raise RuntimeError("the layers' indices differ in shape")
        flat = torch.cat(indices).view(layers, -1)
        if flat.dtype != torch.int64:  # scatter_add's index type
            flat = flat.long()
        if self._scatter:
            ones = self._ones.get(flat.shape)
            if ones is None:
                ones = self._ones_like(flat)
            try:
                # tokens per expert per layer straight into the held vector's tokens halves
                torch.scatter_add(self._zeros, 1, flat, ones, out=self.tokens_t)
                return 0
            except RuntimeError:  # an index outside 0..E-1: counted below, from now on too
                self._scatter = False
        return self._count_out_of_range(flat)

    def _ones_like(self, flat: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(flat.shape, dtype=torch.int32)
        if ones.numel() <= _ONES_KEEP_ELEMENTS:
            if len(self._ones) >= _ONES_SHAPES:
                self._ones.clear()
            self._ones[flat.shape] = ones
        return ones

    def _count_out_of_range(self, flat: torch.Tensor) -> int:
        """The counts of [L, assignments] int64 indices some of which lie outside 0..E-1 (left out;
        returns how many): a Python loop for a small step, one bincount over all layers above."""
        layers, experts = self.layers, self.experts
        assignments = flat.shape[1]
        if layers * assignments <= _LOOP_COUNT_ASSIGNMENTS:
            counted = self._count_small(flat.tolist())
            if counted is not None:
                self._pack(self.step.routing_bytes, 0, *counted)  # tokens[E] per layer; over capacity untouched (0)
                return layers * assignments - sum(counted)
        # a large step: one bincount over all layers, out-of-range indices in each layer's bin E
        bins = experts + 1
        binned = flat.clamp(-1, experts).remainder_(bins)
        binned += self._offsets(bins)
        counts_t = torch.bincount(binned.reshape(-1), minlength=layers * bins).view(layers, bins)
        self.tokens_t.copy_(counts_t[:, :experts])
        return int(counts_t[:, experts].sum())

    def _count_small(self, rows: list[list[int]]) -> list[int] | None:
        """L·E counts of a small step's index lists by a plain loop (a loop warms up after its first
        pass; a tensor or numpy call pays its cold start every step). Bin E takes -1 and E (the
        "not routed here" markers; left out); None when an index lies further out (the caller
        counts another way)."""
        experts = self.experts
        counted: list[int] = []
        for row in rows:
            if row and min(row) < -1:
                return None
            bins = [0] * (experts + 1)
            try:
                for index in row:
                    bins[index] += 1  # -1 lands in bins[E]
            except IndexError:  # an index > E
                return None
            del bins[experts]
            counted += bins
        return counted

    def _scale(self, size: int) -> torch.Tensor:
        """[T·E] float64 of 1 / (T ln 2): the per-layer sum of token entropies (nats) to the mean in bits."""
        weights = self._weights.get(size)
        if weights is None:
            if len(self._weights) >= _COMPACT_LAYOUTS:
                self._weights.clear()
            tokens = size // self.experts
            weights = self._weights[size] = torch.full((size,), 1.0 / (max(tokens, 1) * _LN2), dtype=torch.float64)
        return weights

    def _offsets(self, bins: int) -> torch.Tensor:
        return torch.arange(0, self.layers * bins, bins, dtype=torch.int64).unsqueeze(1)


class _Wrapped:
    """One module whose `forward` is wrapped (an instance attribute over the class's method): the
    module's `__call__` then takes torch's no-hook fast path, which costs less per call than a
    forward hook (a hooked call runs torch's hook dispatch). `remove()` restores it exactly; if
    something wrapped it again after us, ours stays in that chain and passes straight through (the
    instrumentation's closed flag)."""

    __slots__ = ("module", "wrapper", "original", "had_own")

    def __init__(self, module: nn.Module, wrapper: Callable[..., Any], original: Callable[..., Any],
                 had_own: bool) -> None:
        self.module, self.wrapper, self.original, self.had_own = module, wrapper, original, had_own

    @classmethod
    def around(cls, module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> _Wrapped:
        """Sets module.forward to make(the current forward)."""
        original = module.forward
        had_own = "forward" in vars(module)
        wrapper = make(original)
        module.forward = wrapper
        return cls(module, wrapper, original, had_own)

    def remove(self) -> bool:
        """Restores the module's forward; False when something wrapped it after us (ours stays in its chain)."""
        own = vars(self.module)
        if own.get("forward") is not self.wrapper:
            return False
        if self.had_own:
            own["forward"] = self.original
        else:
            del own["forward"]
        return True


class Instrumentation:
    """What `moescope.instrument(model)` returns: the blocks found, the NVTX state, and `close()`."""

    def __init__(self, *, model: nn.Module, discovery: Discovery, emitter: moe_nvtx.Instrumentation,
                 nvtx_state: str, on_routing: RoutingObserver | None = None, defer: bool = True,
                 compact: bool = False) -> None:
        self.model = model
        self.discovery = discovery
        self.blocks: tuple[MoeBlock, ...] = discovery.blocks
        self.nvtx_state = nvtx_state
        self._em = emitter
        self._handles: list[_Wrapped] = []
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._step = _StepState()
        self._request_keys: list[int] = []
        self._request_tokens: tuple[list[int], list[int]] | None = None  # (input, output) per key
        layers = len(self.blocks)
        self._num_experts = [b.num_experts for b in self.blocks]
        self._scores: list[torch.Tensor | None] = [None] * layers
        self._scoring: list[Scoring | None] = [None] * layers
        self._top_k: list[int | None] = [b.top_k for b in self.blocks]
        self._experts_open = [False] * layers
        # learned at a layer's first call, so later calls take the scores and indices from there
        self._score_place = [_UNKNOWN] * layers
        self._index_place: list[int | str] = [_UNKNOWN] * layers
        # where the experts live, read once (instrument after moving the model to its device):
        # CUDA layers are always deferred, CPU layers unless defer=False
        self._device_index = [_cuda_index(b) for b in self.blocks]  # its CUDA device (-1: a host layer)
        self._cuda = [index >= 0 for index in self._device_index]
        self._any_cuda = any(self._cuda)
        self._deferred = [defer or cuda for cuda in self._cuda]
        # per layer, after its first call on a deferred host layer: a fast path keeps the scores and
        # indices and does nothing else (_ROUTER_FAST: both from the router's output; _EXPERTS_FAST:
        # the indices from the experts call); a CUDA layer's (_CUDA_FAST) also times the experts call
        # with its CUDA event pair. Live layers stay _SLOW.
        self._mode = [_SLOW] * layers
        self._router_index_place = [_UNKNOWN] * layers
        self._router_outputs: list[object] = [None] * layers  # a _SLOW layer's router output, until its experts call
        self._experts_handles: dict[int, _Wrapped] = {}
        self._events: list[tuple[Any, Any]] = []  # CUDA event pairs, one per experts call of a step, reused
        # each device's current stream, looked up once a step (the events are recorded on it:
        # Event.record() with no stream looks it up per call, ~20 Python calls, ~30 µs a layer on the
        # host of a host-bound decode step)
        self._streams: dict[int, Any] = {}
        self._zeros = {b.num_experts: np.zeros(b.num_experts, dtype=np.int64) for b in self.blocks}
        # moe/v2.2 compact steps (deferred layers only): per layout (layer, E) of a step, its held vectors
        self.compact = compact and all(self._deferred)
        self._compact_steps: dict[tuple[tuple[int, int], ...], moe_nvtx.CompactStep] = {}
        self._fast: _CompactFast | None = None  # the whole-model host step, built at its first use
        # no batched fast path: the full form, CUDA layers, or layers that differ in E
        self._fast_off = not self.compact or self._any_cuda
        self._warned = False
        self._on_routing = on_routing
        if (emitter.active or on_routing is not None) and self.blocks:
            self._attach()

    # ----- public

    @property
    def active(self) -> bool:
        """Hooks are installed and emit NVTX (a tool is attached and MoE blocks were found)."""
        return bool(self._handles) and self._em.active

    @property
    def hooked(self) -> bool:
        """Hooks are installed (to emit, or only to feed `on_routing`)."""
        return bool(self._handles)

    @property
    def reason(self) -> str:
        """Why nothing is emitted ("" when active)."""
        if not self.blocks:
            return self.discovery.reason
        return "" if self.active else f"NVTX {self.nvtx_state}"

    def scoring(self) -> dict[int, Scoring]:
        """Per layer, what its router was found to select from (after the layer's first call)."""
        return {i: s for i, s in enumerate(self._scoring) if s is not None}

    def top_k(self) -> dict[int, int | None]:
        return dict(enumerate(self._top_k))

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def describe(self) -> str:
        head = f"moescope.instrument: {len(self.blocks)} MoE block(s); NVTX {self.nvtx_state}"
        lines = [head, self.discovery.describe()]
        lines += [f"layer {i} router selects from {s.describe()}" for i, s in self.scoring().items()]
        return "\n".join(lines)

    def set_request_keys(self, keys: Sequence[int]) -> None:
        """Request keys of the next forward call (marked as `moe.request` inside its step)."""
        self._request_keys = [int(k) for k in keys]
        self._request_tokens = None

    def set_request_tokens(self, keys: Sequence[int], input_tokens: Sequence[int],
                           output_tokens: Sequence[int]) -> None:
        """Request keys of the next forward call with each one's input and output tokens in it:
        sent as one `moe.step.requests` vector inside its step (moe/v2.1)."""
        self._request_keys = [int(k) for k in keys]
        self._request_tokens = ([int(n) for n in input_tokens], [int(n) for n in output_tokens])

    def close(self) -> None:
        """Removes every hook; the model is as it was before `instrument()`. A step in progress
        still ends (its range is closed); none opens after."""
        self._step.closed = True
        for wrapped in reversed(self._handles):
            wrapped.remove()
        self._handles.clear()
        self._experts_handles.clear()
        self._router_outputs = [None] * len(self.blocks)
        self._scores = [None] * len(self.blocks)

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- hooks

    def _attach(self) -> None:
        add = self._handles.append
        add(_Wrapped.around(self.model, self._step_forward))
        for block in self.blocks:
            layer = block.layer
            add(_Wrapped.around(block.router, functools.partial(self._router_forward, layer)))
            experts = _Wrapped.around(block.experts, functools.partial(self._experts_forward, layer))
            self._experts_handles[layer] = experts
            add(experts)
            if not self._deferred[layer]:  # live: the block's own range
                add(_Wrapped.around(block.block, functools.partial(self._block_forward, layer)))

    def _step_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        step, step_pre, step_post = self._step, self._step_pre, self._step_post

        def forward(*args: Any, **kwargs: Any) -> Any:
            if step.depth:  # a nested call of the same module: part of the open step
                step.depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    step.depth -= 1
            if step.closed:
                return original(*args, **kwargs)
            step_pre(args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                step_post()

        return forward

    def _router_forward(self, layer: int, original: Callable[..., Any]) -> Callable[..., Any]:
        step, scores, outputs, failed = self._step, self._scores, self._router_outputs, self._failed
        mode, score_places, index_places = self._mode, self._score_place, self._router_index_place
        pending, num_experts = step.pending, self.blocks[layer].num_experts
        may_fast = self._deferred[layer] and not self._cuda[layer]

        def forward(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if not step.open:
                return output
            try:
                place = score_places[layer]
                if mode[layer] == _ROUTER_FAST:  # the router returns the experts' very index tensor: keep both
                    try:
                        found, indices = output[place], output[index_places[layer]]
                        # the layout as learned: E-column scores, integer indices (else learned again)
                        if found.shape[-1] == num_experts and not indices.dtype.is_floating_point:
                            pending.append((step.calls, layer, found, indices))
                            step.calls += 1
                            step.pending_elements += found.numel()
                            if step.pending_elements > _PENDING_ELEMENTS:  # a long prefill: reduce now, hold less
                                self._reduce_pending()
                            return output
                    except (TypeError, IndexError, AttributeError, KeyError):  # not a tuple of tensors any more
                        pass
                    self._leave_router_fast(layer)  # its output changed: through the experts wrapper again
                if place >= 0:
                    found = output[place] if type(output) is tuple and place < len(output) else None
                else:
                    found = output if place == _ITSELF else None
                if not (isinstance(found, torch.Tensor) and found.dim() >= 1 and found.shape[-1] == num_experts
                        and found.is_floating_point()):
                    found, score_places[layer] = _find_tensor(output, integer=False, last_dim=num_experts)
                scores[layer] = found
                if mode[layer] == _SLOW and may_fast:
                    outputs[layer] = output  # the experts call may find its index tensor in it
            except Exception as exc:  # noqa: BLE001 - never into the model
                failed("router", exc)
            return output

        return forward

    def _experts_forward(self, layer: int, original: Callable[..., Any]) -> Callable[..., Any]:
        step, scores, places, mode, failed = self._step, self._scores, self._index_place, self._mode, self._failed
        pending, slow, cuda_fast = step.pending, self._experts_call, self._experts_cuda_fast

        def forward(*args: Any, **kwargs: Any) -> Any:
            layer_mode = mode[layer]
            if layer_mode == _ROUTER_FAST:  # kept by the router wrapper (here only when ours could not be removed)
                return original(*args, **kwargs)
            if layer_mode == _CUDA_FAST and step.open:
                return cuda_fast(layer, original, args, kwargs)
            if step.open and layer_mode == _EXPERTS_FAST:  # keep the two tensors, nothing else
                taken = False
                try:
                    found = scores[layer]
                    place = places[layer]
                    if isinstance(place, int):
                        indices = args[place] if place < len(args) else None
                    else:
                        indices = kwargs.get(place)
                    if found is not None and isinstance(indices, torch.Tensor) and not indices.is_floating_point():
                        scores[layer] = None
                        pending.append((step.calls, layer, found, indices))
                        taken = True
                        step.calls += 1
                        step.pending_elements += found.numel()
                        if step.pending_elements > _PENDING_ELEMENTS:  # a long prefill: reduce now, hold less
                            self._reduce_pending()
                except Exception as exc:  # noqa: BLE001 - never into the model
                    taken = True
                    failed("experts", exc)
                if taken:
                    return original(*args, **kwargs)
            return slow(layer, original, args, kwargs)

        return forward

    def _experts_call(self, layer: int, original: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """An experts call off the fast paths: outside a step, a layer's first call, live or CUDA layers."""
        if not self._step.open:
            if not self._step.closed:
                self._stats["calls_outside_step"] += 1
            return original(*args, **kwargs)
        self._experts_pre(layer, args, kwargs)
        if not (self._cuda[layer] or not self._deferred[layer]):  # nothing to end: no CUDA event, no live range
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            self._experts_post(layer)

    def _experts_cuda_fast(self, layer: int, original: Callable[..., Any], args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> Any:
        """A CUDA layer's experts call after its first: the scores and indices kept for the step end,
        the call timed by the step's next CUDA event pair on its device's current stream. Anything
        unexpected (no scores from the router, no index tensor) goes the slow way, which learns again."""
        pair = stream = None
        try:
            found = self._scores[layer]
            place = self._index_place[layer]
            if isinstance(place, int):
                indices = args[place] if place < len(args) else None
            else:
                indices = kwargs.get(place)
            if found is not None and isinstance(indices, torch.Tensor) and not indices.is_floating_point():
                self._scores[layer] = None
                pair = self._event_pair(self._keep(layer, found, indices))
                device = self._device_index[layer]
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.current_stream(device)
                pair[0].record(stream)
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("experts", exc)
            return original(*args, **kwargs)
        if pair is None:
            self._mode[layer] = _SLOW
            return self._experts_call(layer, original, args, kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            pair[1].record(stream)

    def _keep(self, layer: int, scores: torch.Tensor, indices: torch.Tensor) -> int:
        """A deferred layer call's tensors kept for the step end (the step reduced early past its
        limit); the call's index in the step (its CUDA event pair's)."""
        step = self._step
        call = step.calls
        step.pending.append((call, layer, scores, indices))
        step.calls = call + 1
        step.pending_elements += scores.numel()
        if step.pending_elements > (_PENDING_ELEMENTS_CUDA if self._cuda[layer] else _PENDING_ELEMENTS):
            self._reduce_pending()  # a long prefill: reduce now, hold less
        return call

    def _event_pair(self, call: int) -> tuple[Any, Any]:
        """The step's `call`-th CUDA event pair (made at the first step that has that many calls)."""
        events = self._events
        if call == len(events):
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        return events[call]

    def _take_router_fast(self, layer: int, output: object, indices: torch.Tensor) -> None:
        """After a deferred host layer's first call: if its router returned the very index tensor the
        experts got, the router wrapper keeps both from then on and the experts wrapper goes (one
        Python call per layer instead of two); otherwise the experts wrapper keeps the indices."""
        place = next((i for i, item in enumerate(output) if item is indices), _UNKNOWN) \
            if type(output) is tuple else _UNKNOWN
        if place == _UNKNOWN or self._score_place[layer] < 0:
            self._mode[layer] = _EXPERTS_FAST
            return
        self._router_index_place[layer] = place
        self._mode[layer] = _ROUTER_FAST
        handle = self._experts_handles.get(layer)
        if handle is not None and handle.remove():
            self._handles.remove(handle)
            del self._experts_handles[layer]

    def _leave_router_fast(self, layer: int) -> None:
        self._mode[layer] = _SLOW  # the next call learns again
        if layer not in self._experts_handles and not self._step.closed:
            handle = _Wrapped.around(self.blocks[layer].experts, functools.partial(self._experts_forward, layer))
            self._experts_handles[layer] = handle
            self._handles.append(handle)

    def _block_forward(self, layer: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            self._layer_pre(layer)
            try:
                return original(*args, **kwargs)
            finally:
                self._layer_post(layer)

        return forward

    def _failed(self, where: str, exc: BaseException) -> None:
        self._stats["hook_errors"] += 1
        if not self._warned:
            self._warned = True
            log.warning("moescope.instrument: %s hook failed (%s: %s); counted, the model is unaffected",
                        where, type(exc).__name__, exc)

    def _step_pre(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The outermost call's start (its wrapper counts nested calls). Every line here runs once
        per forward with the caches cold, so the common case (input_ids by keyword) comes first."""
        step = self._step
        step.depth = 1
        if self._streams:
            self._streams.clear()  # looked up again this step (a server may change streams between steps)
        try:
            ids = kwargs.get("input_ids")
            tokens = ids.numel() if isinstance(ids, torch.Tensor) else _batch_tokens(args, kwargs)
            if tokens is None:
                self._stats["steps_without_tokens"] += 1
                tokens = 0
            self._em.step_push(tokens)
            step.open = True
            if self._request_tokens is not None:
                self._em.step_requests(self._request_keys, *self._request_tokens)
                self._request_keys, self._request_tokens = [], None
            elif self._request_keys:
                for key in self._request_keys:
                    self._em.request_mark(key)
                self._request_keys = []
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("step", exc)

    def _step_post(self) -> None:
        step = self._step
        step.depth = 0
        if not step.open:
            return
        step.open = False
        pending, reduced = step.pending, step.reduced
        try:
            if pending or reduced:
                # the common host step first: every layer once, batched into the held vectors
                if self._fast_off or reduced or not self._emit_compact_fast(pending):
                    self._emit_deferred(step)
            self._stats["steps"] += 1
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("step end", exc)
        finally:
            pending.clear()
            if reduced:
                reduced.clear()
            step.pending_elements = step.calls = 0
            self._em.step_pop()

    def _layer_pre(self, layer: int) -> None:
        if not self._step.open:
            return  # counted by the experts wrapper
        self._em.layer_push(layer, self.blocks[layer].num_experts)

    def _layer_post(self, layer: int) -> None:
        self._scores[layer] = None
        if self._step.open:
            self._em.pop()

    def _experts_pre(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._experts_open[layer] = False
        try:
            self._route(layer, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("experts", exc)

    def _route(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        block = self.blocks[layer]
        router_output, self._router_outputs[layer] = self._router_outputs[layer], None
        indices, place = _find_indices(args, kwargs)
        scores = self._scores[layer]
        self._scores[layer] = None
        if indices is None:
            self._stats["layers_without_indices"] += 1
            return
        if scores is None:
            self._stats["layers_without_scores"] += 1
            return
        num_experts = block.num_experts
        scoring = self._scoring[layer]
        if scoring is None:
            values = (*args, *kwargs.values()) if kwargs else args
            weights, _ = _find_tensor(values, integer=False, last_dim=indices.shape[-1])
            scoring = self._scoring[layer] = classify(block.router, scores, indices, weights)
            self._top_k[layer] = int(indices.shape[-1])
        self._index_place[layer] = place
        if self._deferred[layer]:
            call = self._keep(layer, scores, indices)
            if self._cuda[layer]:  # device time from a reused CUDA event pair
                self._event_pair(call)[0].record()
                self._experts_open[layer] = True
                self._mode[layer] = _CUDA_FAST  # its later calls: _experts_cuda_fast
            else:
                self._take_router_fast(layer, router_output, indices)  # later calls: a fast path
            return
        self._stats["layers"] += 1
        flat_np = indices.detach().numpy().ravel()
        try:
            counts_np = np.bincount(flat_np, minlength=num_experts)
        except ValueError:  # negative indices (an expert-parallel "not here" marker): not routed here
            flat_np = flat_np[flat_np >= 0]
            counts_np = np.bincount(flat_np, minlength=num_experts)
        if counts_np.shape[0] > num_experts:
            self._stats["indices_out_of_range"] += int(counts_np[num_experts:].sum())
            counts_np = counts_np[:num_experts]
        detached = scores.detach()
        if detached.dtype not in (torch.float32, torch.float64):
            detached = detached.float()
        entropy = entropy_bits_numpy(scoring, detached.reshape(-1, num_experts).numpy())
        em = self._em
        em.router_push(layer, entropy)
        em.routing(layer, counts_np, self._zeros[num_experts])
        em.pop()
        em.experts_push(layer, indices.numel())
        self._experts_open[layer] = True
        if self._on_routing is not None:
            self._on_routing(layer, counts_np, entropy)

    def _experts_post(self, layer: int) -> None:
        if not self._experts_open[layer]:
            return
        self._experts_open[layer] = False
        if self._cuda[layer]:
            self._events[self._step.calls - 1][1].record()
        else:
            self._em.experts_pop()

    def _reduce_pending(self) -> None:
        step = self._step
        step.reduced += self._reduce(step.pending)
        step.pending.clear()
        step.pending_elements = 0

    def _reduce(self, pending: list[_Entry]) -> list[_Reduced]:
        """The calls grouped by E, scoring kind, shapes and device, each group reduced at once."""
        groups: dict[tuple[int, str, torch.Size, torch.Size, int, int], list[_Entry]] = {}
        num_experts, scoring = self._num_experts, self._scoring
        for entry in pending:
            _, layer, scores, indices = entry
            layer_scoring = scoring[layer]
            kind = layer_scoring.kind if layer_scoring is not None else ""
            key = (num_experts[layer], kind, scores.shape, indices.shape, scores.get_device(), indices.get_device())
            group = groups.get(key)
            if group is None:
                groups[key] = [entry]
            else:
                group.append(entry)
        out: list[_Reduced] = []
        for (experts, kind, _, _, scores_device, indices_device), entries in groups.items():
            biases = [s.bias if s is not None else None for s in (scoring[e[1]] for e in entries)] \
                if kind == "sigmoid" else None
            reduce = _reduce_host if scores_device < 0 and indices_device < 0 else _reduce_torch
            counts, entropy = reduce([e[2] for e in entries], [e[3] for e in entries], experts, kind, biases)
            out.append(_Reduced(entries=entries, counts=counts, entropy=entropy))
        return out

    def _emit_deferred(self, step: _StepState) -> None:
        if self.compact:
            self._emit_compact(step)
        else:
            self._emit_full(step)

    def _compact_step(self, layout: tuple[tuple[int, int], ...]) -> moe_nvtx.CompactStep:
        made = self._compact_steps.get(layout)
        if made is None:
            if len(self._compact_steps) >= _COMPACT_LAYOUTS:  # a model whose steps vary without end
                self._compact_steps.clear()
            made = self._compact_steps[layout] = self._em.compact_step([e for _, e in layout], [i for i, _ in layout])
        return made

    def _emit_compact_fast(self, pending: list[_Entry]) -> bool:
        """A host step that ran every layer once, in order, with one E, scoring kind and shape: a
        few batched tensor ops write its counts and entropies straight into the held vectors. False
        (nothing done) for any other step."""
        fast = self._fast
        if fast is None:
            fast = self._fast = _CompactFast.make(self)
            if fast is None:
                self._fast_off = True  # layers of different E: always the general path
                return False
        _, layer_ids, scores, indices = zip(*pending)
        if layer_ids != fast.step.layer_ids:
            return False
        if fast.kind is None:
            learned = fast.learn_kind(self._scoring)
            if not learned:
                self._fast_off = learned is False  # routers of different kinds: always the general path
                return False
        try:
            out_of_range = fast.fill(scores, indices, score_elements=self._step.pending_elements)
        except RuntimeError:  # shapes differ between layers: the general path
            return False
        stats = self._stats
        stats["layers"] += fast.layers
        if out_of_range:
            stats["indices_out_of_range"] += out_of_range
        fast.step.emit()
        on_routing = self._on_routing
        if on_routing is not None:
            experts = fast.experts
            for layer, (row, bits) in enumerate(zip(fast.matrix, fast.step.entropy.tolist(), strict=True)):
                on_routing(layer, row[:experts].astype(np.int64), bits)
        return True

    def _emit_compact(self, step: _StepState) -> None:
        """Any compact step (CUDA layers, a step reduced early, some layers only): the full form's
        reductions and its one device-to-host copy, then the held vectors filled in layer order."""
        rows = self._reduced_rows(step)
        rows.sort(key=lambda row: (row[0][1], row[0][0]))  # layer index order (the vectors' row order)
        compact = self._compact_step(tuple((entry[1], self._num_experts[entry[1]]) for entry, _, _ in rows))
        on_routing = self._on_routing
        for i, ((_, layer, _, _), counts_row, entropy) in enumerate(rows):
            row = compact.rows[i]
            experts = counts_row.shape[0]
            row[:experts] = counts_row
            compact.entropy[i] = entropy
            if on_routing is not None:
                on_routing(layer, counts_row, entropy)
        compact.emit()
        if self._any_cuda:
            self._em.step_device_mark(self._device_time_us(sorted(rows, key=lambda row: row[0][0])))

    def _reduced_rows(self, step: _StepState) -> list[tuple[_Entry, np.ndarray, float]]:
        """(entry, counts [E] int64, entropy bits) of each of the step's calls, in call order: every
        group reduced, one device-to-host copy."""
        reduced = step.reduced + self._reduce(step.pending) if step.pending else step.reduced
        rows: list[tuple[_Entry, np.ndarray, float]] = []
        for r, (counts, entropy_bits) in zip(reduced, _to_host(reduced), strict=True):
            experts = counts.shape[1] - 1
            out_of_range = int(_add(counts[:, experts]))
            rows += zip(r.entries, counts[:, :experts], entropy_bits)
            if out_of_range:
                self._stats["indices_out_of_range"] += out_of_range
        if len(reduced) > 1:
            rows.sort(key=lambda row: row[0][0])
        self._stats["layers"] += len(rows)
        return rows

    def _device_time_us(self, rows: list[tuple[_Entry, np.ndarray, float]]) -> np.ndarray:
        """Each call's experts device time (µs; 0 for a host layer), rows in call order; the events
        are complete after the step's copy."""
        time_us = np.zeros(len(rows), dtype=np.float32)
        for i, ((call, layer, _, _), _, _) in enumerate(rows):  # i == call
            if self._cuda[layer]:
                start, end = self._events[call]
                time_us[i] = start.elapsed_time(end) * 1000.0  # ms -> µs
        return time_us

    def _emit_full(self, step: _StepState) -> None:
        """The step's deferred layers: reduced together, one device-to-host copy, then their events
        in call order and the experts times as `moe.step.device`."""
        rows = self._reduced_rows(step)
        em, zeros, num_experts, on_routing = self._em, self._zeros, self._num_experts, self._on_routing
        layer_push, router_push, routing, pop = em.layer_push, em.router_push, em.routing, em.pop
        experts_push, experts_pop = em.experts_push, em.experts_pop
        for (_, layer, _, indices), counts_row, entropy in rows:
            experts = num_experts[layer]
            layer_push(layer, experts)
            router_push(layer, entropy)
            routing(layer, counts_row, zeros[experts])
            pop()
            experts_push(layer, indices.numel())
            experts_pop()
            pop()
            if on_routing is not None:
                on_routing(layer, counts_row, entropy)
        if self._any_cuda:
            em.step_device_mark(self._device_time_us(rows))


def arrange_injection() -> str:
    """Sets NVTX_INJECTION64_PATH to moescope's library when unset, so the process's first NVTX call
    loads it and a later `agent start --pid PID` can attach. Returns what was done, in words."""
    from moescope.collectors.nvtx import INJECTION_ENV, injection_library_path
    from moescope.errors import NvtxUnavailable

    if os.environ.get(INJECTION_ENV):
        return f"{INJECTION_ENV} already set"
    try:
        os.environ[INJECTION_ENV] = str(injection_library_path())
    except NvtxUnavailable as exc:
        return f"not arranged: {exc}"
    return f"{INJECTION_ENV} set by moescope.instrument()"


def instrument(model: nn.Module, *, routing: str = "step", inject: bool = True,
               domain: moe_nvtx.NvtxDomainLike | None = None,
               on_routing: RoutingObserver | None = None, defer: bool = True,
               compact: bool = True) -> Instrumentation:
    """Finds the model's MoE blocks and emits moe/v2 for every forward call of `model`.

    routing: "step" (one `moe.step.routing` vector per step, cheapest) or "layer" (one per layer).
    compact (with routing="step" and deferred layers; the default): the v2.2 compact form — per
    layer only `moe.layer`, the step's routing and router entropies as two held vectors; False:
    also `moe.router` and `moe.experts` per layer (their payloads: entropy, k × tokens).
    inject: set NVTX_INJECTION64_PATH (when unset) before the first NVTX call, so the process can be
    observed by a later `agent start --pid PID`. on_routing: also called per layer and step with the
    routing (a serving process's own statistics; deferred layers: after the step). defer: keep each
    layer's tensors and reduce them all at the step end, then emit the layers (the default; always on
    CUDA); False: live per-layer ranges for CPU layers, at a per-layer cost. With no NVTX tool and
    no observer nothing is hooked."""
    if routing not in moe_nvtx.ROUTING_PLACES:
        raise ValueError(f"routing must be one of {moe_nvtx.ROUTING_PLACES}, got {routing!r}")
    started_ns = time.monotonic_ns()
    discovery = discover(model)
    injection = arrange_injection() if inject and domain is None else "not arranged"
    emitter = moe_nvtx.make_instrumentation(enabled=True, domain=domain, routing_place=routing)
    if emitter.active:
        state = f"active ({injection})"
    else:
        state = ("inactive: no NVTX tool attached (NVTX was initialised before moescope.instrument() "
                 f"without one; {injection})")
    ins = Instrumentation(model=model, discovery=discovery, emitter=emitter, nvtx_state=state, on_routing=on_routing,
                          defer=defer, compact=compact and routing == "step")
    log.debug("instrumented %d blocks in %.1f ms", len(discovery.blocks), (time.monotonic_ns() - started_ns) / 1e6)
    return ins

