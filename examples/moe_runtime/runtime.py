"""The assembled runtime: model, expert store, stats, batching engine, and the control commands
(docs/control-protocol.md) as plain methods that both the control socket and tests call."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from moescope.errors import ConfigError
from moescope.examples.moe_runtime.batcher import BatchEngine
from moescope.examples.moe_runtime.config import PRECISIONS, ModelConfig
from moescope.examples.moe_runtime.model import MoEModel, make_expert_masters
from moescope.examples.moe_runtime.residency import CommandError, ExpertStore, MoveResult, validate_device_name
from moescope.examples.moe_runtime.stats import (
    LAYER_FIELDS,
    PLACEMENT_FIELDS,
    SPARSE_FIELDS,
    RuntimeStats,
    selected_layer_fields,
    sparse_pairs,
)
from moescope.examples.moe_runtime.tokenizer import ByteTokenizer
from moescope.moe_nvtx import DEFAULT_CONVENTION, Instrumentation, make_instrumentation
from moescope.stats_page import LAYOUT_NAME, StatsPageWriter

PROTOCOL = "moescope-control/1"
MODEL_NAME = "moescope-reference-moe"  # stats "model": what the agent labels gen_ai.request.model with
# Default budget: everything resident uses this share of it.
DEFAULT_BUDGET_USED_SHARE = 0.8


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _moves_stats(command: Callable[Concatenate[Runtime, _P], _R]) -> Callable[Concatenate[Runtime, _P], _R]:
    """A command that may change what `stats` says outside the stats page (placement, precision, a
    pool): the page's version moves after it, failed too (it may have done part), so a poller reads
    `stats` again."""

    @functools.wraps(command)
    def run(self: Runtime, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return command(self, *args, **kwargs)
        finally:
            if self.page is not None:
                self.page.touch(self._version_key())

    return run


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    devices: tuple[str, ...] = ("cpu",)
    precision: str = "fp32"
    capacity_experts: int | None = None  # per device; None = every expert fits
    initial_resident_experts: int | None = None  # per device; None = capacity
    device_memory_budget_bytes: int | None = None
    cache_on_load: bool = False
    max_batch_size: int = 16
    max_wait_ms: float = 5.0
    max_waiting: int = 1024
    max_tokens_limit: int = 256
    nvtx: bool = True
    nvtx_convention: str = DEFAULT_CONVENTION  # moe/v2 (vectors per layer) or v1 (marks per expert)
    nvtx_expert_ranges: bool | None = None  # per-expert moe.expert.ffn ranges (None: v1 yes, v2 no)
    nvtx_routing: str = "layer"  # v2: a moe.routing vector per layer, or one moe.step.routing per step
    sync_ranges: bool = False  # CUDA: synchronise before closing ffn/step ranges (true GPU time)
    torch_threads: int | None = None
    # the per-period part of `stats` in a shared-memory file (moescope/stats_page.py); the CLI's default
    stats_page: bool = False


class Runtime:
    def __init__(self, options: RuntimeOptions, *, instrumentation: Instrumentation | None = None) -> None:
        cfg = options.model
        cfg.validate()
        if not options.devices:
            raise ConfigError("at least one device is needed")
        for device in options.devices:
            validate_device_name(device)
        if len(set(options.devices)) != len(options.devices):
            raise ConfigError(f"devices repeat: {list(options.devices)}")
        if options.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {options.precision!r}")
        if options.max_batch_size < 1 or options.max_wait_ms < 0 or options.max_waiting < 1:
            raise ConfigError("max_batch_size and max_waiting must be >= 1 and max_wait_ms >= 0")
        if options.torch_threads:
            torch.set_num_threads(options.torch_threads)
        self.options = options
        self.cfg = cfg
        total_experts = cfg.layers * cfg.experts
        capacity = total_experts if options.capacity_experts is None else options.capacity_experts
        if capacity < 0:
            raise ConfigError(f"capacity_experts must be >= 0, got {capacity}")
        initial = capacity if options.initial_resident_experts is None else options.initial_resident_experts
        if not 0 <= initial <= capacity:
            raise ConfigError(f"initial resident experts ({initial}) must be in 0..capacity ({capacity})")
        non_expert = MoEModel.non_expert_bytes(cfg)
        expert_bytes_all = total_experts * cfg.expert_params() * 4
        budget = options.device_memory_budget_bytes
        if budget is None:
            budget = int((expert_bytes_all + non_expert) / DEFAULT_BUDGET_USED_SHARE)
        if budget <= 0:
            raise ConfigError(f"device memory budget must be > 0 bytes, got {budget}")
        self.stats = RuntimeStats(layers=cfg.layers, experts=cfg.experts)
        self.store = ExpertStore(
            masters=make_expert_masters(cfg), devices=list(options.devices), capacity_experts=capacity,
            initial_resident=initial, precision=options.precision, budget_bytes=budget,
            non_expert_bytes=non_expert, cache_on_load=options.cache_on_load,
        )
        self.ins = instrumentation if instrumentation is not None else make_instrumentation(
            enabled=options.nvtx, convention=options.nvtx_convention, expert_ranges=options.nvtx_expert_ranges,
            routing_place=options.nvtx_routing)
        self.model = MoEModel(cfg, store=self.store, stats=self.stats, instrumentation=self.ins,
                              sync_ranges=options.sync_ranges)
        self.tokenizer = ByteTokenizer(vocab=cfg.vocab)
        self.page = StatsPageWriter(layers=cfg.layers, experts=cfg.experts) if options.stats_page else None
        if self.page is not None:
            self.stats.attach_page(self.page, version_key=self._version_key)
        self.engine = BatchEngine(model=self.model, stats=self.stats, instrumentation=self.ins,
                                  max_batch_size=options.max_batch_size, max_wait_ms=options.max_wait_ms,
                                  max_waiting=options.max_waiting)

    # ----- what the HTTP front end reads (server.ServedRuntime) -----

    @property
    def model_name(self) -> str:
        return MODEL_NAME

    @property
    def max_seq(self) -> int:
        return self.cfg.max_seq

    @property
    def max_tokens_limit(self) -> int:
        return self.options.max_tokens_limit

    def close(self) -> None:
        """Remove the stats page (the server's last step on the way out)."""
        if self.page is not None:
            self.page.close()

    # ----- stats -----

    def _version_key(self) -> object:
        # what `stats` outside the page depends on: the placement (precision too) and the pools' sizes
        return self.store.placement_version, tuple(self.store.capacity.items())

    def stats_dict(self, *, fields: list[object] | None = None, placement_since: int | None = None) -> dict[str, Any]:
        """The `stats` result (docs/control-protocol.md); `fields` / `placement_since` narrow its
        per-layer part to what a poller needs (at 48 layers x 128 experts the whole reply is ~400 KB)."""
        cfg = self.cfg
        version = self.store.placement_version
        wanted = selected_layer_fields(fields, placement_since, version)
        snap = self.stats.snapshot()
        table = self.store.table() if not wanted.isdisjoint(PLACEMENT_FIELDS) else None
        penalties = self.model.penalties() if not wanted.isdisjoint(("penalty", "penalty_sparse")) else None
        columns: dict[str, Any] = dict(snap)  # field -> one value (or list) per layer
        if penalties is not None:
            columns["penalty"] = penalties
        if table is not None:
            columns.update(table)
        for name, dense in SPARSE_FIELDS.items():
            if name in wanted:
                columns[name] = [sparse_pairs(row) for row in columns[dense]]
        order = [name for name in (*LAYER_FIELDS, *SPARSE_FIELDS) if name in wanted]
        layers = []
        for layer in range(cfg.layers):
            row: dict[str, Any] = {"layer": layer}
            for name in order:
                row[name] = columns[name][layer]
            layers.append(row)
        counters = dict(snap["counters"])
        counters["migrations"] = self.store.migrations
        counters["precision_changes"] = self.store.precision_changes
        reply: dict[str, Any] = {
            "protocol": PROTOCOL,
            "pid": os.getpid(),
            "model": MODEL_NAME,
            "config": {
                "layers": cfg.layers, "experts": cfg.experts, "top_k": cfg.top_k, "d_model": cfg.d_model,
                "d_ff": cfg.d_ff, "vocab": cfg.vocab, "max_seq": cfg.max_seq, "capacity_factor": cfg.capacity_factor,
                "overflow": cfg.overflow, "gumbel_tau": cfg.gumbel_tau, "devices": list(self.store.devices),
                "primary_device": self.store.primary, "max_batch_size": self.options.max_batch_size,
                "max_wait_ms": self.options.max_wait_ms, "nvtx_active": self.ins.active,
                "nvtx_convention": self.ins.convention,
            },
            "layers": layers,
            "placement_version": version,
            "precision": {"default": self.store.default_precision, "counts": self.store.precision_counts()},
            "memory": self.store.memory(),
            "counters": counters,
            "queue": self.engine.queue_sizes(),
        }
        if self.page is not None:
            reply["stats_page"] = {"path": str(self.page.path), "layout": LAYOUT_NAME, "bytes": self.page.size}
        return reply

    # ----- commands (args already type-checked by the control layer) -----

    def cmd_ping(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL, "pid": os.getpid(), "uid": os.getuid()}

    @_moves_stats
    def cmd_migrate_expert(self, *, layer: int, expert: int, device: str, dtype: str | None = None) -> MoveResult:
        return self.store.migrate(layer, expert, device=device, dtype=dtype)

    @_moves_stats
    def cmd_offload_expert(self, *, layer: int, expert: int, dtype: str = "fp16") -> MoveResult:
        return self.store.offload(layer, expert, dtype=dtype)

    @_moves_stats
    def cmd_restore_expert(self, *, layer: int, expert: int, device: str | None = None) -> MoveResult:
        return self.store.restore(layer, expert, device=device)

    @_moves_stats
    def cmd_set_precision(self, *, precision: str, experts: list[list[int]] | None = None) -> dict[str, Any]:
        pairs = None
        if experts is not None:
            pairs = []
            for item in experts:
                if not (isinstance(item, list) and len(item) == 2 and all(_is_int(v) for v in item)):
                    raise CommandError(f"experts must be a list of [layer, expert] int pairs, got {item!r}")
                pairs.append((item[0], item[1]))
        return self.store.set_precision(precision, pairs)

    def cmd_set_router_penalty(self, *, expert: int, penalty: float, layer: int | None = None) -> dict[str, Any]:
        if not 0 <= expert < self.cfg.experts:
            raise CommandError(f"expert {expert} out of range 0..{self.cfg.experts - 1}")
        if not (penalty >= 0 and penalty < float("inf")):
            raise CommandError(
                f"penalty must be a finite number >= 0 (it is subtracted from the logit), got {penalty}")
        if layer is not None and not 0 <= layer < self.cfg.layers:
            raise CommandError(f"layer {layer} out of range 0..{self.cfg.layers - 1}")
        layers = list(range(self.cfg.layers)) if layer is None else [layer]
        self.model.set_penalty(layers=layers, expert=expert, penalty=float(penalty))
        if self.page is not None:
            self.page.publish_penalty(np.asarray(self.model.penalties(), dtype=np.float64))
        return {"layers": layers, "expert": expert, "penalty": float(penalty)}

    @_moves_stats
    def cmd_prefetch(self, *, count: int = 1, layer: int | None = None, device: str | None = None) -> dict[str, Any]:
        hotness, cumulative = self.stats.hotness_lists()
        return self.store.prefetch(count=count, layer=layer, device=device, hotness=hotness, cumulative=cumulative)

    @_moves_stats
    def cmd_set_resident_capacity(self, *, device: str, experts: int) -> dict[str, Any]:
        return self.store.set_capacity(device, experts)

    def cmd_stats(self, *, fields: list[object] | None = None, placement_since: int | None = None) -> dict[str, Any]:
        return self.stats_dict(fields=fields, placement_since=placement_since)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
