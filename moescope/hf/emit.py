"""Forward hooks that turn a model's MoE blocks into moe/v2 NVTX events (docs/nvtx-convention.md).

Per forward call of the instrumented module: one `moe.step` range (payload: tokens in the batch)
with one `moe.request` mark per request key given with `set_request_keys`. Per MoE block and call:
`moe.layer` (payload E), inside it `moe.router` (payload: mean token entropy in bits of what the
router selects from, moescope/hf/scoring.py) and `moe.experts` (payload: assignments = k × tokens,
no capacity in these models); the routing vectors go once per step as `moe.step.routing` (the
default; `routing="layer"` sends one `moe.routing` per layer instead).

Deferred (the default, and always on CUDA): the hooks only keep each layer's router scores and
top-k indices (references, no copy) and time its experts call (CUDA events on a GPU, the host clock
on a CPU, where the experts run synchronously). When the step ends, every layer's counts (the
indices scattered into per-layer bins) and entropy are computed in one batch of tensor ops on the
model's device, one copy brings them to the host, and the layer ranges are emitted then, back to
back, with `moe.step.device` carrying each layer's experts time (the layer ranges' own durations
mean nothing). Nothing is read back per layer. A step whose pending scores pass
`_PENDING_ELEMENTS` is reduced early (on the device, still without a host sync) to bound what is held.

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
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope import moe_nvtx
from moescope.hf.discover import Discovery, MoeBlock, discover
from moescope.hf.scoring import (
    Scoring,
    classify,
    entropy_bits_numpy,
    mean_entropy_nats_layers,
    sum_entropy_nats_layers_numpy,
)

log = logging.getLogger("moescope.hf")

# (layer, tokens routed per expert [E] int64, mean token router entropy in bits), per layer and step
RoutingObserver = Callable[[int, np.ndarray, float], None]
_STAT_NAMES = ("steps", "layers", "calls_outside_step", "layers_without_scores", "layers_without_indices",
               "indices_out_of_range", "hook_errors", "steps_without_tokens")
# Score elements a step may hold before its pending layers are reduced (4 MiB of float32 scores):
# small steps are reduced once at the step end, a long prefill every few layers.
_PENDING_ELEMENTS = 1 << 20
_LN2 = math.log(2.0)


@dataclass(slots=True)
class _Pending:
    """One experts call of the step, not yet reduced: the router's scores and the top-k indices."""

    call: int  # its place among the step's experts calls (emission order, CUDA event pair)
    layer: int
    num_experts: int
    assignments: int
    scores: torch.Tensor  # [T, E] as the router returned it
    indices: torch.Tensor  # the index tensor the experts were called with
    scoring: Scoring


@dataclass(slots=True)
class _Reduced:
    """A group of pending calls reduced on the device: still tensors until the step's one copy."""

    entries: list[_Pending]
    counts: torch.Tensor | np.ndarray  # [n, E + 1] int64: column E counts indices outside 0..E-1
    entropy_nats: torch.Tensor | np.ndarray  # [n] mean over tokens


@dataclass(slots=True)
class _StepState:
    depth: int = 0
    open: bool = False
    pending: list[_Pending] = field(default_factory=list)
    pending_elements: int = 0
    reduced: list[_Reduced] = field(default_factory=list)
    calls: int = 0  # experts calls of the step: the index of its CUDA event pair


def _first_tensor(value: object, *, integer: bool, last_dim: int | None = None) -> torch.Tensor | None:
    items: Iterable[object] = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() >= 1 and item.is_floating_point() != integer:
            if last_dim is None or item.shape[-1] == last_dim:
                return item
    return None


def _cuda_flag(block: MoeBlock) -> bool:
    return any(p.is_cuda for p in block.experts.parameters())


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


def _reduce_group(entries: list[_Pending]) -> _Reduced:
    """Counts and mean entropies of calls that share E, scoring kind, token count and device:
    stacked, a few tensor ops for all of them, no host sync (float32 on the device)."""
    first = entries[0]
    num_experts, device = first.num_experts, first.scores.device
    scores = torch.stack([e.scores.detach().reshape(-1, num_experts) for e in entries]).float()
    bias = None
    if first.scoring.kind == "sigmoid" and any(e.scoring.bias is not None for e in entries):
        bias = torch.stack([torch.zeros(num_experts, device=device) if e.scoring.bias is None
                            else e.scoring.bias.detach().reshape(num_experts).to(device) for e in entries]).float()
    entropy = mean_entropy_nats_layers(first.scoring.kind, scores, bias)
    bins = num_experts + 1
    flat = torch.stack([e.indices.detach().reshape(-1) for e in entries]).long()
    # indices outside 0..E-1 (an expert-parallel "not here" marker) land in bin E: -1 -> E, >= E -> E
    flat = flat.clamp(-1, num_experts).remainder_(bins)
    flat += torch.arange(0, len(entries) * bins, bins, device=flat.device).unsqueeze(1)
    flat = flat.reshape(-1)
    # scatter_add_, not bincount: CUDA bincount reads the maximum back to the host
    counts = torch.zeros(len(entries) * bins, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones(1, dtype=torch.int64, device=flat.device).expand(flat.shape[0]))
    return _Reduced(entries=entries, counts=counts.view(len(entries), bins), entropy_nats=entropy)


@functools.lru_cache(maxsize=64)
def _bin_offsets(layers: int, bins: int) -> np.ndarray:
    """[layers, 1]: where each layer's bins start in one bincount over all of them (read-only)."""
    offsets = np.arange(0, layers * bins, bins)[:, None]
    offsets.flags.writeable = False
    return offsets


def _reduce_group_numpy(entries: list[_Pending]) -> _Reduced:
    """The same numbers for CPU tensors with numpy, in as few calls as it takes (a CPU torch op
    costs several numpy ufuncs, and each call costs microseconds inside a forward)."""
    first = entries[0]
    num_experts, n = first.num_experts, len(entries)
    stacked = torch.stack([e.scores for e in entries])
    if stacked.requires_grad:
        stacked = stacked.detach()
    if stacked.dtype not in (torch.float32, torch.float64):
        stacked = stacked.float()
    scores = stacked.numpy().reshape(n, -1, num_experts)
    bias = None
    if first.scoring.kind == "sigmoid" and any(e.scoring.bias is not None for e in entries):
        bias = np.stack([np.zeros(num_experts) if e.scoring.bias is None
                         else e.scoring.bias.detach().double().reshape(num_experts).numpy() for e in entries])
    tokens = scores.shape[1]
    sums = sum_entropy_nats_layers_numpy(first.scoring.kind, scores, bias) if tokens else np.zeros(n)
    bins = num_experts + 1
    flat = torch.stack([e.indices for e in entries]).numpy().reshape(n, -1)
    # indices outside 0..E-1 (an expert-parallel "not here" marker) land in bin E: -1 -> E, >= E -> E
    flat = np.maximum(np.minimum(flat, num_experts), -1)
    flat %= bins
    flat += _bin_offsets(n, bins)
    counts = np.bincount(flat.ravel(), minlength=n * bins).reshape(n, bins)
    return _Reduced(entries=entries, counts=counts, entropy_nats=sums / max(tokens, 1))


def _reduce(pending: list[_Pending]) -> list[_Reduced]:
    groups: dict[tuple[object, ...], list[_Pending]] = {}
    for entry in pending:
        key = (entry.num_experts, entry.scoring.kind, entry.scores.shape, entry.indices.shape,
               entry.scores.device, entry.indices.device)
        groups.setdefault(key, []).append(entry)
    return [_reduce_group_numpy(group) if group[0].scores.device.type == "cpu" and group[0].indices.device.type == "cpu"
            else _reduce_group(group) for group in groups.values()]


def _to_host(reduced: list[_Reduced]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(counts [n, E+1] int64, entropy bits [n] float64) per group: one device-to-host copy for the step."""
    on_device = [r for r in reduced if isinstance(r.counts, torch.Tensor)]
    if not on_device:
        return [(np.asarray(r.counts), np.asarray(r.entropy_nats) / _LN2) for r in reduced]
    device = on_device[0].counts.device
    packed = torch.cat([torch.as_tensor(t).reshape(-1).to(device=device, dtype=torch.float64)
                        for r in reduced for t in (r.counts, r.entropy_nats)]).cpu().numpy()
    out: list[tuple[np.ndarray, np.ndarray]] = []
    offset = 0
    for r in reduced:
        n, bins = r.counts.shape
        counts = packed[offset:offset + n * bins].astype(np.int64).reshape(n, bins)
        offset += n * bins
        out.append((counts, packed[offset:offset + n] / _LN2))
        offset += n
    return out


class _Wrapped:
    """One module whose `forward` is wrapped (an instance attribute over the class's method): the
    module's `__call__` then takes torch's no-hook fast path, which costs less per call than a
    forward hook (a hooked call runs torch's hook dispatch). `remove()` restores it exactly; if
    something wrapped it again after us, ours only stops acting (passes straight through)."""

    __slots__ = ("module", "wrapper", "original", "had_own", "active")

    def __init__(self, module: nn.Module, wrapper: Callable[..., Any], original: Callable[..., Any],
                 had_own: bool) -> None:
        self.module, self.wrapper, self.original, self.had_own = module, wrapper, original, had_own
        self.active = True

    @classmethod
    def around(cls, module: nn.Module, body: Callable[..., Any]) -> _Wrapped:
        """Wraps module.forward with body(original, *args, **kwargs)."""
        original = module.forward
        had_own = "forward" in vars(module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if wrapped.active:
                return body(original, *args, **kwargs)
            return original(*args, **kwargs)

        wrapped = cls(module, forward, original, had_own)
        module.forward = forward
        return wrapped

    def remove(self) -> None:
        self.active = False
        own = vars(self.module)
        if own.get("forward") is self.wrapper:
            if self.had_own:
                own["forward"] = self.original
            else:
                del own["forward"]


class Instrumentation:
    """What `moescope.instrument(model)` returns: the blocks found, the NVTX state, and `close()`."""

    def __init__(self, *, model: nn.Module, discovery: Discovery, emitter: moe_nvtx.Instrumentation,
                 nvtx_state: str, on_routing: RoutingObserver | None = None, defer: bool = True) -> None:
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
        self._scores: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._scoring: list[Scoring | None] = [None] * len(self.blocks)
        self._top_k: list[int | None] = [b.top_k for b in self.blocks]
        self._experts_open = [False] * len(self.blocks)
        # where the experts live, read once (instrument after moving the model to its device):
        # CUDA layers are always deferred, CPU layers unless defer=False
        self._cuda = [_cuda_flag(b) for b in self.blocks]
        self._deferred = [defer or cuda for cuda in self._cuda]
        self._events: list[tuple[Any, Any]] = []  # CUDA event pairs, one per experts call of a step, reused
        self._zeros = {b.num_experts: np.zeros(b.num_experts, dtype=np.int64) for b in self.blocks}
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
        """Removes every hook; the model is as it was before `instrument()`."""
        for wrapped in reversed(self._handles):
            wrapped.remove()
        self._handles.clear()
        self._scores = [None] * len(self.blocks)

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- hooks

    def _attach(self) -> None:
        add = self._handles.append
        step_pre, step_post = self._step_pre, self._step_post

        def step_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            step_pre(args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                step_post()

        add(_Wrapped.around(self.model, step_around))
        for block in self.blocks:
            add(_Wrapped.around(block.router, self._router_wrapper(block.layer)))
            add(_Wrapped.around(block.experts, self._experts_wrapper(block.layer)))
            if not self._deferred[block.layer]:  # live: the block's own range
                add(_Wrapped.around(block.block, self._block_wrapper(block.layer)))

    def _router_wrapper(self, layer: int) -> Callable[..., Any]:
        step, scores, num_experts = self._step, self._scores, self.blocks[layer].num_experts

        def router(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if step.open:
                scores[layer] = _first_tensor(output, integer=False, last_dim=num_experts)
            return output

        return router

    def _experts_wrapper(self, layer: int) -> Callable[..., Any]:
        step, experts_pre, experts_post, stats = self._step, self._experts_pre, self._experts_post, self._stats
        ends = self._cuda[layer] or not self._deferred[layer]  # a CUDA event or a live range to end

        def experts(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not step.open:
                stats["calls_outside_step"] += 1
                return original(*args, **kwargs)
            experts_pre(layer, args, kwargs)
            if not ends:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                experts_post(layer)

        return experts

    def _block_wrapper(self, layer: int) -> Callable[..., Any]:
        def block(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            self._layer_pre(layer)
            try:
                return original(*args, **kwargs)
            finally:
                self._layer_post(layer)

        return block

    def _failed(self, where: str, exc: BaseException) -> None:
        self._stats["hook_errors"] += 1
        if not self._warned:
            self._warned = True
            log.warning("moescope.instrument: %s hook failed (%s: %s); counted, the model is unaffected",
                        where, type(exc).__name__, exc)

    def _step_pre(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        step = self._step
        step.depth += 1
        if step.depth > 1:
            return  # a nested call of the same module: part of the open step
        try:
            tokens = _batch_tokens(args, kwargs)
            if tokens is None:
                self._stats["steps_without_tokens"] += 1
            self._em.step_push(tokens or 0)
            step.open = True
            if self._request_tokens is not None:
                self._em.step_requests(self._request_keys, *self._request_tokens)
            else:
                for key in self._request_keys:
                    self._em.request_mark(key)
            self._request_keys, self._request_tokens = [], None
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("step", exc)

    def _step_post(self) -> None:
        step = self._step
        step.depth = max(0, step.depth - 1)
        if step.depth or not step.open:
            return
        step.open = False
        try:
            if step.pending or step.reduced:
                self._emit_deferred(step)
            self._stats["steps"] += 1
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("step end", exc)
        finally:
            step.pending, step.reduced, step.pending_elements, step.calls = [], [], 0, 0
            self._em.step_pop()

    def _layer_pre(self, layer: int) -> None:
        if not self._step.open:
            return  # counted by the experts wrapper
        self._em.layer_push(layer, self.blocks[layer].num_experts)

    def _layer_post(self, layer: int) -> None:
        self._scores[layer] = None
        if self._step.open:
            self._em.pop()

    def _router_post(self, layer: int, output: object) -> None:
        if self._step.open:
            self._scores[layer] = _first_tensor(output, integer=False, last_dim=self.blocks[layer].num_experts)

    def _experts_pre(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._experts_open[layer] = False
        try:
            self._route(layer, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("experts", exc)

    def _route(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        block = self.blocks[layer]
        values = (*args, *kwargs.values()) if kwargs else args
        indices = _first_tensor(values, integer=True)
        scores = self._scores[layer]
        self._scores[layer] = None
        if indices is None:
            self._stats["layers_without_indices"] += 1
            return
        if scores is None:
            self._stats["layers_without_scores"] += 1
            return
        self._stats["layers"] += 1
        num_experts = block.num_experts
        scoring = self._scoring[layer]
        if scoring is None:
            weights = _first_tensor(values, integer=False, last_dim=indices.shape[-1])
            scoring = self._scoring[layer] = classify(block.router, scores, indices, weights)
            self._top_k[layer] = int(indices.shape[-1])
        assignments = indices.numel()
        if self._deferred[layer]:
            step = self._step
            entry = _Pending(call=step.calls, layer=layer, num_experts=num_experts, assignments=assignments,
                             scores=scores, indices=indices, scoring=scoring)
            step.pending.append(entry)
            step.pending_elements += scores.numel()
            if step.pending_elements > _PENDING_ELEMENTS:  # a long prefill: reduce now, hold less
                step.reduced += _reduce(step.pending)
                step.pending, step.pending_elements = [], 0
            if self._cuda[layer]:  # device time from a reused CUDA event pair
                if step.calls == len(self._events):
                    self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                self._events[step.calls][0].record()
                self._experts_open[layer] = True
            step.calls += 1
            return
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
        em.experts_push(layer, assignments)
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

    def _emit_deferred(self, step: _StepState) -> None:
        """The step's deferred layers: reduced together, one device-to-host copy, then their events
        in call order and the experts times as `moe.step.device`."""
        reduced = step.reduced + _reduce(step.pending)
        calls: list[tuple[_Pending, np.ndarray, float]] = []
        for r, (counts, entropy_bits) in zip(reduced, _to_host(reduced), strict=True):
            self._stats["indices_out_of_range"] += int(counts[:, -1].sum())
            calls += [(e, counts[i, :-1], float(entropy_bits[i])) for i, e in enumerate(r.entries)]
        if len(reduced) > 1:
            calls.sort(key=lambda row: row[0].call)
        em = self._em
        timed = any(self._cuda[e.layer] for e, _, _ in calls)
        time_us = np.zeros(len(calls), dtype=np.float32)
        for i, (entry, counts_row, entropy) in enumerate(calls):  # i == entry.call
            layer = entry.layer
            em.layer_push(layer, entry.num_experts)
            em.router_push(layer, entropy)
            em.routing(layer, counts_row, self._zeros[entry.num_experts])
            em.pop()
            em.experts_push(layer, entry.assignments)
            em.experts_pop()
            em.pop()
            if self._cuda[layer]:
                start, end = self._events[entry.call]
                time_us[i] = start.elapsed_time(end) * 1000.0  # ms -> µs; complete after the copy
            if self._on_routing is not None:
                self._on_routing(layer, counts_row, entropy)
        if timed:
            em.step_device_mark(time_us)


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
               on_routing: RoutingObserver | None = None, defer: bool = True) -> Instrumentation:
    """Finds the model's MoE blocks and emits moe/v2 for every forward call of `model`.

    routing: "step" (one `moe.step.routing` vector per step, cheapest) or "layer" (one per layer).
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
                          defer=defer)
    log.debug("instrumented %d blocks in %.1f ms", len(discovery.blocks), (time.monotonic_ns() - started_ns) / 1e6)
    return ins

