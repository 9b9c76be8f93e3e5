"""Forward hooks that turn a model's MoE blocks into moe/v2 NVTX events (docs/nvtx-convention.md).

Per forward call of the instrumented module: one `moe.step` range (payload: tokens in the batch)
with one `moe.request` mark per request key given with `set_request_keys`. Per MoE block and call:
`moe.layer` (payload E), inside it `moe.router` (payload: mean token entropy in bits of what the
router selects from, moescope/hf/scoring.py) and `moe.experts` (payload: assignments = k × tokens,
no capacity in these models); the routing vectors go once per step as `moe.step.routing` (the
default; `routing="layer"` sends one `moe.routing` per layer instead).

CPU: the ranges are live; `moe.layer` spans the block, `moe.experts` the experts call, and the
router range is opened after the router ran (its payload is its result), so router time is part
of the layer's remainder. CUDA: nothing is read back per layer; counts (bincount of the top-k
indices) and entropies stay on the device and CUDA events time each experts call; after the step
one copy brings them to the host and the layer ranges are emitted then, with `moe.step.device`
carrying each layer's expert device time (the layer ranges' own host durations mean nothing there).

The hooks run on the model thread only (NVTX ranges are per thread). A failure inside a hook is
counted and logged once; it never reaches the model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moescope import moe_nvtx
from moescope.hf.discover import Discovery, MoeBlock, discover
from moescope.hf.scoring import Scoring, classify, entropy_bits_numpy, entropy_bits_torch

log = logging.getLogger("moescope.hf")

# (layer, tokens routed per expert [E] int64, mean token router entropy in bits), per layer and step
RoutingObserver = Callable[[int, np.ndarray, float], None]
_STAT_NAMES = ("steps", "layers", "calls_outside_step", "layers_without_scores", "layers_without_indices",
               "indices_out_of_range", "hook_errors", "steps_without_tokens")


@dataclass(slots=True)
class _DeviceLayer:
    """A CUDA layer's numbers, still on the device until the step ends."""

    layer: int
    num_experts: int
    assignments: int
    counts: torch.Tensor  # [E] int64
    entropy_bits: torch.Tensor  # 0-d float32
    start: Any  # torch.cuda.Event, None off CUDA
    end: Any = None


@dataclass(slots=True)
class _StepState:
    depth: int = 0
    open: bool = False
    device_layers: list[_DeviceLayer] = field(default_factory=list)


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


class Instrumentation:
    """What `moescope.instrument(model)` returns: the blocks found, the NVTX state, and `close()`."""

    def __init__(self, *, model: nn.Module, discovery: Discovery, emitter: moe_nvtx.Instrumentation,
                 nvtx_state: str, on_routing: RoutingObserver | None = None, defer: bool | None = None) -> None:
        self.model = model
        self.discovery = discovery
        self.blocks: tuple[MoeBlock, ...] = discovery.blocks
        self.nvtx_state = nvtx_state
        self._em = emitter
        self._handles: list[RemovableHandle] = []
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._step = _StepState()
        self._request_keys: list[int] = []
        self._scores: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._scoring: list[Scoring | None] = [None] * len(self.blocks)
        self._top_k: list[int | None] = [b.top_k for b in self.blocks]
        self._experts_open = [False] * len(self.blocks)
        # deferred (device) path per block: where its experts live, read once (instrument after moving
        # the model to its device), unless the caller chose
        self._cuda = [_cuda_flag(b) if defer is None else defer for b in self.blocks]
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

    def close(self) -> None:
        """Removes every hook; the model is as it was before `instrument()`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._scores = [None] * len(self.blocks)

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- hooks

    def _attach(self) -> None:
        add = self._handles.append
        add(self.model.register_forward_pre_hook(self._step_pre, with_kwargs=True))
        add(self.model.register_forward_hook(self._step_post, always_call=True))
        for block in self.blocks:
            layer = block.layer
            add(block.block.register_forward_pre_hook(lambda m, a, layer=layer: self._layer_pre(layer)))
            add(block.block.register_forward_hook(lambda m, a, o, layer=layer: self._layer_post(layer),
                                                  always_call=True))
            add(block.router.register_forward_hook(lambda m, a, o, layer=layer: self._router_post(layer, o)))
            add(block.experts.register_forward_pre_hook(
                lambda m, a, kw, layer=layer: self._experts_pre(layer, a, kw), with_kwargs=True))
            add(block.experts.register_forward_hook(lambda m, a, o, layer=layer: self._experts_post(layer),
                                                    always_call=True))

    def _failed(self, where: str, exc: BaseException) -> None:
        self._stats["hook_errors"] += 1
        if not self._warned:
            self._warned = True
            log.warning("moescope.instrument: %s hook failed (%s: %s); counted, the model is unaffected",
                        where, type(exc).__name__, exc)

    def _step_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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
            for key in self._request_keys:
                self._em.request_mark(key)
            self._request_keys = []
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("step", exc)

    def _step_post(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        step = self._step
        step.depth = max(0, step.depth - 1)
        if step.depth or not step.open:
            return
        step.open = False
        try:
            if step.device_layers:
                self._emit_device_layers(step.device_layers)
            self._stats["steps"] += 1
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("step end", exc)
        finally:
            step.device_layers = []
            self._em.step_pop()

    def _layer_pre(self, layer: int) -> None:
        if not self._step.open:
            self._stats["calls_outside_step"] += 1
            return
        if self._cuda[layer]:
            return  # emitted after the step (see the module docstring)
        self._em.layer_push(layer, self.blocks[layer].num_experts)

    def _layer_post(self, layer: int) -> None:
        self._scores[layer] = None
        if self._step.open and not self._cuda[layer]:
            self._em.pop()

    def _router_post(self, layer: int, output: object) -> None:
        if self._step.open:
            self._scores[layer] = _first_tensor(output, integer=False, last_dim=self.blocks[layer].num_experts)

    def _experts_pre(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._experts_open[layer] = False
        if not self._step.open:
            return
        try:
            self._route(layer, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - never into the model
            self._failed("experts", exc)

    def _route(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        block = self.blocks[layer]
        values = (*args, *kwargs.values())
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
        assignments = int(indices.numel())
        if self._cuda[layer]:
            flat = indices.reshape(-1)
            # indices outside 0..E-1 (an expert-parallel "not here" marker) land in bin E, then go
            flat = torch.where((flat < 0) | (flat >= num_experts), num_experts, flat)
            counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
            entropy_dev = (entropy_bits_torch(scoring, scores) if scores.numel()
                           else torch.zeros((), device=scores.device))
            start = None
            if indices.is_cuda:  # device time from CUDA events; a deferred CPU layer has none
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            self._step.device_layers.append(_DeviceLayer(
                layer=layer, num_experts=num_experts, assignments=assignments, counts=counts,
                entropy_bits=entropy_dev, start=start))
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
        device_layers = self._step.device_layers
        if (device_layers and device_layers[-1].layer == layer and device_layers[-1].start is not None
                and device_layers[-1].end is None):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            device_layers[-1].end = end
        if self._experts_open[layer]:
            self._experts_open[layer] = False
            self._em.experts_pop()

    def _emit_device_layers(self, layers: list[_DeviceLayer]) -> None:
        """CUDA: one device-to-host copy for the step, then the layers' events in order."""
        packed = torch.cat([*(d.counts.double() for d in layers),
                            torch.stack([d.entropy_bits.double() for d in layers])]).cpu().numpy()
        em = self._em
        offset = 0
        device_us = np.zeros(len(layers), dtype=np.float32)
        for i, d in enumerate(layers):
            counts = packed[offset:offset + d.num_experts].astype(np.int64)
            offset += d.num_experts
            entropy = float(packed[-len(layers) + i])
            em.layer_push(d.layer, d.num_experts)
            em.router_push(d.layer, entropy)
            em.routing(d.layer, counts, self._zeros[d.num_experts])
            em.pop()
            em.experts_push(d.layer, d.assignments)
            em.experts_pop()
            em.pop()
            if d.start is not None and d.end is not None:
                device_us[i] = d.start.elapsed_time(d.end) * 1000.0  # ms -> µs; complete after the copy
            if self._on_routing is not None:
                self._on_routing(d.layer, counts, entropy)
        if any(d.start is not None for d in layers):
            em.step_device_mark(device_us)


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
               on_routing: RoutingObserver | None = None, defer: bool | None = None) -> Instrumentation:
    """Finds the model's MoE blocks and emits moe/v2 for every forward call of `model`.

    routing: "step" (one `moe.step.routing` vector per step, cheapest) or "layer" (one per layer).
    inject: set NVTX_INJECTION64_PATH (when unset) before the first NVTX call, so the process can be
    observed by a later `agent start --pid PID`. on_routing: also called per layer and step with the
    routing (a serving process's own statistics). defer: compute on the device and emit the layers
    after the step (default: where the experts are on CUDA). With no NVTX tool and no observer
    nothing is hooked."""
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

