"""A transformers MoE causal LM as the batching engine's step model (batcher.StepModel), with the two
control actions such a model can honour without changing its code:

- router penalty: a logit bias on the router. While a layer has a penalty its router runs under a
  TorchFunctionMode that subtracts the penalty from the output of the router's own projection
  (the `F.linear` inside the router whose output has E columns), so selection, weights and the
  reported logits all see it; without one the router runs as loaded (its hooks do nothing);
- precision fallback of the experts: the fused expert weights are rebuilt from a kept copy of the
  weights as loaded, at fp16/bf16; the experts' inputs are cast to that dtype and the output back.
  The change waits for the running step to end (a step never sees half-converted experts).

Each step recomputes every running sequence in full (left-padded, no KV cache): simple and exact,
and every forward call is one `moe.step` of `moescope.instrument()`. A demo server, not a fast one.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch convention
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from moescope.hf import Instrumentation, MoeBlock

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in PRECISIONS.items()}


@dataclasses.dataclass(eq=False)
class HfSequence:
    """One request's tokens so far (prompt, then generated)."""

    length: int = 0
    ids: list[int] = dataclasses.field(default_factory=list)


class _RouterLogitBias(TorchFunctionMode):
    """Subtracts a per-expert penalty from the router projection's output (last dim E)."""

    def __init__(self, penalty: torch.Tensor) -> None:
        super().__init__()
        self.penalty = penalty

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.linear and isinstance(out, torch.Tensor) and out.shape[-1] == self.penalty.shape[0]:
            out = out - self.penalty.to(device=out.device, dtype=out.dtype)
        return out


class HfBackend:
    def __init__(self, *, model: nn.Module, instrumentation: Instrumentation, pad_id: int) -> None:
        self.model = model
        self.ins = instrumentation
        self.blocks: tuple[MoeBlock, ...] = instrumentation.blocks
        self.pad_id = pad_id
        self.sync_ranges = False
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()  # a precision change waits for the running step to end
        self._penalty_lock = threading.Lock()
        self._penalties = [[0.0] * b.num_experts for b in self.blocks]  # as set (reporting)
        self._modes: list[_RouterLogitBias | None] = [None] * len(self.blocks)
        self._entered: list[_RouterLogitBias | None] = [None] * len(self.blocks)
        self._penalty_hooks: list[RemovableHandle] = []
        self._install_penalty_hooks()
        self.native_dtype = next(model.parameters()).dtype
        self._precision = [DTYPE_NAMES.get(self.native_dtype, "fp32")] * len(self.blocks)
        self._masters: dict[int, dict[str, torch.Tensor]] = {}  # layer -> expert weights as loaded
        self._cast_hooks: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}

    # ----- batcher.StepModel

    def new_sequence(self) -> HfSequence:
        return HfSequence()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(self, seqs: list[HfSequence], new_tokens: list[list[int]]) -> torch.Tensor:
        for seq, tokens in zip(seqs, new_tokens):
            seq.ids.extend(tokens)
            seq.length = len(seq.ids)
        width = max(len(s.ids) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):  # left padding: every sequence's last token is in the last column
            ids[row, width - len(seq.ids):] = torch.tensor(seq.ids, dtype=torch.long)
            mask[row, width - len(seq.ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with self._lock, torch.no_grad():
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), use_cache=False)
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    # ----- router penalty

    def penalties(self) -> list[list[float]]:
        with self._penalty_lock:
            return [list(p) for p in self._penalties]

    def set_penalty(self, *, layers: list[int], expert: int, penalty: float) -> None:
        """Takes effect from the router's next call; never waits for a running step (the mode a router
        call runs under is one reference, swapped whole)."""
        with self._penalty_lock:
            for layer in layers:
                self._penalties[layer][expert] = penalty
                values = self._penalties[layer]
                bias = torch.tensor(values, dtype=torch.float32)
                self._modes[layer] = _RouterLogitBias(bias) if any(values) else None

    def _install_penalty_hooks(self) -> None:
        """Once: each router enters its layer's penalty mode, if any, for the length of its call."""
        for layer, block in enumerate(self.blocks):
            self._penalty_hooks.append(block.router.register_forward_pre_hook(
                lambda m, a, layer=layer: self._router_enter(layer)))
            self._penalty_hooks.append(block.router.register_forward_hook(
                lambda m, a, o, layer=layer: self._router_exit(layer), always_call=True))

    def _router_enter(self, layer: int) -> None:
        mode = self._modes[layer]
        self._entered[layer] = mode
        if mode is not None:
            mode.__enter__()

    def _router_exit(self, layer: int) -> None:
        mode, self._entered[layer] = self._entered[layer], None
        if mode is not None:
            mode.__exit__(None, None, None)

    # ----- precision of the experts

    def precisions(self) -> list[str]:
        with self._lock:
            return list(self._precision)

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert's weights of `layer` at its current dtype."""
        block = self.blocks[layer]
        total = sum(p.numel() * p.element_size() for p in block.experts.parameters(recurse=False))
        return total // block.num_experts

    def expert_bytes_native(self, layer: int) -> int:
        block = self.blocks[layer]
        masters = self._masters.get(layer)
        if masters is None:
            return self.expert_bytes(layer)
        return sum(t.numel() * t.element_size() for t in masters.values()) // block.num_experts

    def set_precision(self, precision: str) -> int:
        """Rebuilds every layer's experts at `precision` from the weights as loaded; returns layers changed."""
        dtype = PRECISIONS[precision]
        changed = 0
        with self._lock:
            for layer, block in enumerate(self.blocks):
                if self._precision[layer] == precision:
                    continue
                params = dict(block.experts.named_parameters(recurse=False))
                masters = self._masters.setdefault(layer, {n: p.detach().clone() for n, p in params.items()})
                for name, param in params.items():
                    param.data = masters[name].to(dtype)
                self._precision[layer] = precision
                changed += 1
                for handle in self._cast_hooks.pop(layer, ()):
                    handle.remove()
                if dtype != self.native_dtype:
                    self._cast_hooks[layer] = self._cast_experts(block.experts, dtype)
        return changed

    def _cast_experts(self, experts: nn.Module, dtype: torch.dtype) -> tuple[RemovableHandle, RemovableHandle]:
        native = self.native_dtype

        def cast_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            cast = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            cast_kw = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                       for k, v in kwargs.items()}
            return cast, cast_kw

        def cast_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return output.to(native) if isinstance(output, torch.Tensor) else output

        # prepend: the cast runs before moescope's experts hook, which only reads the indices
        return (experts.register_forward_pre_hook(cast_in, with_kwargs=True, prepend=True),
                experts.register_forward_hook(cast_out))
