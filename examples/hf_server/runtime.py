"""A transformers MoE causal LM served with the reference runtime's parts: the batching engine,
the HTTP front end and the control socket (docs/control-protocol.md), so ingress joins, traces,
metrics, the live view and the policy work as they do on the reference runtime.

Routing statistics come from `moescope.instrument()` itself (its `on_routing` observer), the same
numbers it sends over NVTX. Control: `set_router_penalty` and `set_precision` (every expert) are
honoured; the residency commands answer "unsupported: ..." (fused experts are one tensor per
layer: there is no single expert to move) and `ping`/`stats` list the capabilities.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from torch import nn

import moescope
from moescope.errors import ConfigError
from moescope.examples.hf_server.backend import PRECISIONS, HfBackend
from moescope.examples.moe_runtime.batcher import BatchEngine
from moescope.examples.moe_runtime.residency import CommandError
from moescope.examples.moe_runtime.server import Tokenizer
from moescope.examples.moe_runtime.stats import (
    LAYER_FIELDS,
    SPARSE_FIELDS,
    RuntimeStats,
    selected_layer_fields,
    sparse_pairs,
)
from moescope.moe_nvtx import Instrumentation as NoOpInstrumentation

PROTOCOL = "moescope-control/1"
DEFAULT_BUDGET_USED_SHARE = 0.8  # as the reference runtime: everything resident uses this share
# Commands honoured; the others of the protocol answer "unsupported: ...".
CAPABILITIES = ("ping", "stats", "set_router_penalty", "set_precision")
UNSUPPORTED_WHY = "the model's experts are fused (one weight tensor per layer), so no single expert can be moved"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfOptions:
    max_batch_size: int = 16
    max_wait_ms: float = 5.0
    max_waiting: int = 1024
    max_tokens_limit: int = 256
    max_seq: int = 512


class RequestKeyRelay(NoOpInstrumentation):
    """The engine's instrumentation for a model that `moescope.instrument()` observes: the step
    range comes from the model's forward hook, so this only hands the step's request keys over."""

    def __init__(self, target: moescope.Instrumentation) -> None:
        self._target = target
        self._keys: list[int] = []
        self.active = target.active

    def step_push(self, tokens: int) -> None:
        self._keys = []

    def request_mark(self, request_key: int) -> None:
        self._keys.append(request_key)
        self._target.set_request_keys(self._keys)

    def step_requests(self, keys: Sequence[int], input_tokens: Sequence[int], output_tokens: Sequence[int]) -> None:
        self._target.set_request_tokens(keys, input_tokens, output_tokens)


def short_model_name(description: str) -> str:
    """The stats "model" label: a Hugging Face id as given, a local directory's last component,
    "tiny ARCH" as "tiny-ARCH"."""
    text = description.strip()
    if os.path.isdir(text):
        text = os.path.basename(os.path.normpath(text)) or text
    return "-".join(text.split()) or "unknown"


class HfRuntime:
    def __init__(self, *, model: nn.Module, tokenizer: Tokenizer, options: HfOptions, description: str,
                 pad_id: int = 0, model_name: str | None = None) -> None:
        if options.max_batch_size < 1 or options.max_wait_ms < 0 or options.max_waiting < 1:
            raise ConfigError("max_batch_size and max_waiting must be >= 1 and max_wait_ms >= 0")
        self.options = options
        self.description = description
        self._model_name = model_name or short_model_name(description)
        self.model_config = getattr(model, "config", None)
        self._tokenizer = tokenizer
        self._precision_changes = 0
        self.ins = moescope.instrument(model, on_routing=self._record_routing)
        if not self.ins.blocks:
            raise ConfigError(f"{description}: {self.ins.reason}")
        self.layers = len(self.ins.blocks)
        self.experts = max(b.num_experts for b in self.ins.blocks)
        self._zeros = np.zeros(self.experts, dtype=np.int64)
        self.stats = RuntimeStats(layers=self.layers, experts=self.experts)
        self.backend = HfBackend(model=model, instrumentation=self.ins, pad_id=pad_id)
        self._engine = BatchEngine(model=self.backend, stats=self.stats, instrumentation=RequestKeyRelay(self.ins),
                                   max_batch_size=options.max_batch_size, max_wait_ms=options.max_wait_ms,
                                   max_waiting=options.max_waiting)

    def _record_routing(self, layer: int, counts: np.ndarray, entropy_bits: float) -> None:
        demand = counts if counts.shape[0] == self.experts else np.pad(counts, (0, self.experts - counts.shape[0]))
        self.stats.record_routing(layer=layer, demand=demand, dropped=self._zeros, rerouted_in=self._zeros,
                                  entropy_bits=entropy_bits, capacity=0)

    # ----- server.ServedRuntime

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def engine(self) -> BatchEngine:
        return self._engine

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_seq(self) -> int:
        return self.options.max_seq

    @property
    def max_tokens_limit(self) -> int:
        return self.options.max_tokens_limit

    # ----- stats

    def _memory(self) -> dict[str, Any]:
        backend = self.backend
        device = str(backend.device)
        expert_bytes = sum(backend.expert_bytes(i) * b.num_experts for i, b in enumerate(self.ins.blocks))
        all_bytes = sum(p.numel() * p.element_size() for p in backend.model.parameters())
        native_expert_bytes = sum(backend.expert_bytes_native(i) * b.num_experts for i, b in enumerate(self.ins.blocks))
        non_expert = max(0, all_bytes - expert_bytes)
        budget = int((native_expert_bytes + non_expert) / DEFAULT_BUDGET_USED_SHARE)
        used = expert_bytes + non_expert
        master_bytes = sum(t.numel() * t.element_size() for m in backend._masters.values() for t in m.values())
        first = self.ins.blocks[0]
        elements = sum(p.numel() for p in first.experts.parameters(recurse=False)) // first.num_experts
        experts_total = sum(b.num_experts for b in self.ins.blocks)
        return {
            "devices": {device: {"expert_bytes": expert_bytes, "non_expert_bytes": non_expert, "used_bytes": used,
                                 "budget_bytes": budget, "used_ratio": round(used / budget, 6),
                                 "resident_experts": experts_total, "capacity_experts": experts_total}},
            "host": {"master_bytes": master_bytes, "offload_bytes": 0, "total_bytes": master_bytes},
            "expert_bytes_fp32": elements * 4,
        }

    def close(self) -> None:
        """Nothing to remove: no stats page here (device memory moves with every step on a GPU, so a
        poller reads `stats` over the socket each period)."""

    def stats_dict(self, *, fields: list[object] | None = None, placement_since: int | None = None) -> dict[str, Any]:
        # placement here is each layer's precision (the experts never move): it changes with set_precision
        version = self._precision_changes
        wanted = selected_layer_fields(fields, placement_since, version)
        snap = self.stats.snapshot()
        penalties = self.backend.penalties()
        precisions = self.backend.precisions()
        device = str(self.backend.device)
        top_k = self.ins.top_k()
        layers = []
        for i, block in enumerate(self.ins.blocks):
            e = self.experts
            layers.append({
                "layer": i, "module": block.path, "experts": block.num_experts, "top_k": top_k.get(i),
                "shared": list(block.shared),
                "tokens": snap["tokens"][i], "dropped": snap["dropped"][i], "rerouted_in": snap["rerouted_in"][i],
                "queue_depth": snap["queue_depth"][i], "queue_peak": snap["queue_peak"][i],
                "last_step_tokens": snap["last_step_tokens"][i],
                "penalty": penalties[i] + [0.0] * (e - block.num_experts),
                "device": [device] * e, "tier": ["device"] * e, "dtype": [precisions[i]] * e,
                "precision": [precisions[i]] * e, "offloaded": [False] * e, "loads": snap["loads"][i],
                "entropy_bits": snap["entropy_bits"][i], "capacity": snap["capacity"][i],
            })
        if wanted != frozenset(LAYER_FIELDS):  # a poller's narrowed reply: the descriptive keys always stay
            left_out = set(LAYER_FIELDS) - wanted
            sparse = [(name, dense) for name, dense in SPARSE_FIELDS.items() if name in wanted]
            layers = [{**{k: v for k, v in row.items() if k not in left_out},
                       **{name: sparse_pairs(cast(list[float], row[dense])) for name, dense in sparse}}
                      for row in layers]
        counts = {name: 0 for name in PRECISIONS}
        for i, block in enumerate(self.ins.blocks):
            counts[precisions[i]] += block.num_experts
        cfg = self.model_config
        known_k = [k for k in top_k.values() if k]
        return {
            "protocol": PROTOCOL,
            "pid": os.getpid(),
            "model": self._model_name,
            "config": {
                "model": self.description, "arch": getattr(cfg, "model_type", None), "layers": self.layers,
                "experts": self.experts, "top_k": known_k[0] if known_k else None,
                "d_model": getattr(cfg, "hidden_size", None), "vocab": getattr(cfg, "vocab_size", None),
                "max_seq": self.max_seq, "capacity_factor": None, "overflow": "none", "gumbel_tau": 0.0,
                "devices": [device], "primary_device": device, "max_batch_size": self.options.max_batch_size,
                "max_wait_ms": self.options.max_wait_ms, "nvtx_active": self.ins.active,
                "nvtx_convention": "v2", "capabilities": list(CAPABILITIES),
            },
            "layers": layers,
            "placement_version": version,
            "precision": {"default": precisions[0], "counts": counts},
            "memory": self._memory(),
            "counters": {**snap["counters"], "migrations": 0, "precision_changes": self._precision_changes},
            "queue": self.engine.queue_sizes(),
        }

    # ----- commands (args already type-checked by the control layer)

    def cmd_ping(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL, "pid": os.getpid(), "uid": os.getuid(), "capabilities": list(CAPABILITIES)}

    def cmd_stats(self, *, fields: list[object] | None = None, placement_since: int | None = None) -> dict[str, Any]:
        return self.stats_dict(fields=fields, placement_since=placement_since)

    def cmd_set_router_penalty(self, *, expert: int, penalty: float, layer: int | None = None) -> dict[str, Any]:
        if not 0 <= expert < self.experts:
            raise CommandError(f"expert {expert} out of range 0..{self.experts - 1}")
        if not (penalty >= 0 and math.isfinite(penalty)):
            raise CommandError(f"penalty must be a finite number >= 0 (it is subtracted from the logit), got {penalty}")
        if layer is not None and not 0 <= layer < self.layers:
            raise CommandError(f"layer {layer} out of range 0..{self.layers - 1}")
        layers = [i for i in (range(self.layers) if layer is None else [layer])
                  if expert < self.ins.blocks[i].num_experts]
        self.backend.set_penalty(layers=layers, expert=expert, penalty=float(penalty))
        return {"layers": layers, "expert": expert, "penalty": float(penalty)}

    def cmd_set_precision(self, *, precision: str, experts: list[list[int]] | None = None) -> dict[str, Any]:
        if precision not in PRECISIONS:
            raise CommandError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        if experts is not None:
            raise CommandError(f"unsupported: set_precision of single experts ({UNSUPPORTED_WHY}); "
                               "omit 'experts' to change every expert")
        changed_layers = self.backend.set_precision(precision)
        self._precision_changes += changed_layers
        changed = sum(self.ins.blocks[i].num_experts for i in range(changed_layers))
        counts = self.stats_dict()["precision"]["counts"]
        return {"changed": changed, "precision": precision, "counts": counts}

    def _unsupported(self, cmd: str) -> dict[str, Any]:
        raise CommandError(f"unsupported: {cmd} ({UNSUPPORTED_WHY}); this runtime supports {', '.join(CAPABILITIES)}")

    def cmd_migrate_expert(self, **_args: object) -> dict[str, Any]:
        return self._unsupported("migrate_expert")

    def cmd_offload_expert(self, **_args: object) -> dict[str, Any]:
        return self._unsupported("offload_expert")

    def cmd_restore_expert(self, **_args: object) -> dict[str, Any]:
        return self._unsupported("restore_expert")

    def cmd_prefetch(self, **_args: object) -> dict[str, Any]:
        return self._unsupported("prefetch")

    def cmd_set_resident_capacity(self, **_args: object) -> dict[str, Any]:
        return self._unsupported("set_resident_capacity")
