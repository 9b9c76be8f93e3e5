"""The reference MoE transformer: L blocks of causal self-attention + MoE FFN (E SwiGLU experts,
top-k softmax gate, optional Gumbel noise, capacity factor with drop|reroute, router penalties).

Weights are random, made locally from a seed. Attention runs per sequence (ragged batches, each
with its own KV cache); the MoE FFN runs over all tokens of the step together, which is what makes
routing, capacity and expert load batch-level phenomena.

Two routing paths, the same numbers (with Gumbel noise the device path draws a step's noise at
once, so its draws differ). Host (CPU, and any step CUDA cannot run without a sync): the router's
logits are routed on the host and each layer's events are emitted as it runs. Device (CUDA
by default, when the step's experts are all resident, overflow is "drop", moe/v2 without per-expert
ranges and no sync_ranges): top-k, capacity and the per-expert counts stay on the device, each
expert runs on a fixed-size buffer of its capacity (padding rows carry weight 0), the layer's
vectors go into one per-step device buffer [L, 2E + 2] and CUDA events time its experts; at the
end of the forward one copy brings the buffer to the host, and the layers' events and stats are
emitted then (`moe.step.device` carries the experts' device time). No host sync per layer.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moescope.examples.moe_runtime.config import ModelConfig
from moescope.examples.moe_runtime.residency import TIER_HOST, TORCH_DTYPES, ExpertHandle, ExpertStore, torch_device
from moescope.examples.moe_runtime.stats import RuntimeStats
from moescope.moe_nvtx import Instrumentation


@dataclasses.dataclass
class SequenceState:
    """One request's KV cache and length. Owned by the model thread."""

    length: int = 0
    keys: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    values: list[torch.Tensor | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Routing:
    """One layer's routing decision for a step (after capacity)."""

    token_index: torch.Tensor  # [A] int64, token row of each assignment
    expert_index: torch.Tensor  # [A] int64
    weight: torch.Tensor  # [A] float32 gate weight
    demand: np.ndarray  # [E] tokens routed per expert before capacity
    dropped: np.ndarray  # [E] tokens over capacity per expert (dropped or rerouted away)
    rerouted_in: np.ndarray  # [E] tokens received as next-best
    entropy_bits: float  # mean token entropy of the router distribution
    capacity: int


def _rand(gen: torch.Generator, *shape: int, scale: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def make_expert_masters(cfg: ModelConfig) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """fp32 master weights of every expert, on host, from the seed (independent of other weights)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    d, f = cfg.d_model, cfg.d_ff
    return [
        [(_rand(gen, d, f, scale=1 / math.sqrt(d)), _rand(gen, d, f, scale=1 / math.sqrt(d)),
          _rand(gen, f, d, scale=1 / math.sqrt(f))) for _ in range(cfg.experts)]
        for _ in range(cfg.layers)
    ]


def route(cfg: ModelConfig, logits: torch.Tensor, *, noise: torch.Tensor | None) -> Routing:
    """Top-k gate with capacity. logits [N, E] already include router penalties.

    Selection uses logits + noise (Gumbel, scaled by tau) when noise is given (ties: lower expert
    index first under reroute; torch.topk's order under drop); gate weights are the
    softmax of the clean logits over the k selected experts. Capacity is filled slot-major in token
    order (all first choices, then second choices, ...). Overflow: "drop" loses that assignment
    (the residual carries the token); "reroute" gives it, with the same weight, to the token's
    best-ranked remaining expert with room (rank k, k+1, ...), else drops it.
    """
    n_tokens, n_experts = logits.shape
    k = cfg.top_k
    probs = torch.softmax(logits, dim=-1)
    entropy = -(probs * torch.log2(probs.clamp_min(1e-30))).sum(-1)
    entropy_bits = float(entropy.mean()) if n_tokens else 0.0
    selection = logits if noise is None else logits + noise
    if cfg.overflow == "reroute":
        # Reroute needs every token's full ranking; ties break towards the lower expert index.
        full_order = torch.argsort(selection, dim=-1, descending=True, stable=True)
        order: torch.Tensor | None = full_order
        topk = full_order[:, :k]
    else:
        order = None
        topk = torch.topk(selection, k, dim=-1, sorted=True).indices
    weights = torch.softmax(logits.gather(1, topk), dim=-1)
    capacity = cfg.capacity_tokens(n_tokens)
    demand = np.bincount(topk.reshape(-1).numpy(), minlength=n_experts).astype(np.int64)
    fill = torch.zeros(n_experts, dtype=torch.int64)
    kept_tok: list[torch.Tensor] = []
    kept_exp: list[torch.Tensor] = []
    kept_w: list[torch.Tensor] = []
    overflow: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    rows = torch.arange(n_tokens)
    for slot in range(k):
        experts = topk[:, slot]
        # Position of each token in its expert's queue, in token order (sort-based: no N x E tensor).
        by_expert = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=n_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(experts)
        position[by_expert] = torch.arange(n_tokens) - starts[experts[by_expert]]
        keep = position + fill[experts] < capacity
        fill = torch.clamp(fill + counts, max=capacity)
        kept_tok.append(rows[keep])
        kept_exp.append(experts[keep])
        kept_w.append(weights[keep, slot])
        if not bool(keep.all()):
            over = ~keep
            overflow.append((rows[over], experts[over], weights[over, slot]))
    dropped = np.zeros(n_experts, dtype=np.int64)
    rerouted_in = np.zeros(n_experts, dtype=np.int64)
    for _tok, exp, _ in overflow:
        dropped += np.bincount(exp.numpy(), minlength=n_experts)
    if order is not None and overflow:
        fill_list = fill.tolist()
        used: dict[int, set[int]] = {}
        extra_tok: list[int] = []
        extra_exp: list[int] = []
        extra_w: list[float] = []
        for tok, _, w in overflow:
            for t, weight in zip(tok.tolist(), w.tolist()):
                ranking = order[t].tolist()
                taken = used.setdefault(t, set(ranking[:k]))
                for candidate in ranking[k:]:
                    if candidate not in taken and fill_list[candidate] < capacity:
                        fill_list[candidate] += 1
                        taken.add(candidate)
                        rerouted_in[candidate] += 1
                        extra_tok.append(t)
                        extra_exp.append(candidate)
                        extra_w.append(weight)
                        break
        if extra_tok:
            kept_tok.append(torch.tensor(extra_tok, dtype=torch.int64))
            kept_exp.append(torch.tensor(extra_exp, dtype=torch.int64))
            kept_w.append(torch.tensor(extra_w, dtype=torch.float32))
    return Routing(
        token_index=torch.cat(kept_tok) if kept_tok else torch.zeros(0, dtype=torch.int64),
        expert_index=torch.cat(kept_exp) if kept_exp else torch.zeros(0, dtype=torch.int64),
        weight=torch.cat(kept_w) if kept_w else torch.zeros(0),
        demand=demand, dropped=dropped, rerouted_in=rerouted_in,
        entropy_bits=entropy_bits, capacity=capacity,
    )


@dataclasses.dataclass(frozen=True)
class DeviceRouting:
    """One layer's routing on the device, for a fixed-size dispatch: no value is read back."""

    slot_token: torch.Tensor  # [E, capacity] int64: token row per expert slot; n_tokens = padding
    slot_weight: torch.Tensor  # [E, capacity] float32 gate weight; 0 for padding
    row: torch.Tensor  # [2E + 2] float64: demand[E], dropped[E], kept assignments, entropy bits
    capacity: int


def route_device(cfg: ModelConfig, logits: torch.Tensor, *, noise: torch.Tensor | None) -> DeviceRouting:
    """route() for the "drop" policy with every value kept on the logits' device (no host sync):
    the same selection, weights, capacity fill (slot-major, token order) and counts."""
    n_tokens, n_experts = logits.shape
    k, device = cfg.top_k, logits.device
    probs = torch.softmax(logits, dim=-1)
    entropy = -(probs * torch.log2(probs.clamp_min(1e-30))).sum(-1)
    selection = logits if noise is None else logits + noise
    topk = torch.topk(selection, k, dim=-1, sorted=True).indices
    weights = torch.softmax(logits.gather(1, topk), dim=-1)
    capacity = cfg.capacity_tokens(n_tokens)
    ones = torch.ones(n_tokens, dtype=torch.int64, device=device)
    demand = torch.zeros(n_experts, dtype=torch.int64, device=device)
    dropped = torch.zeros(n_experts, dtype=torch.int64, device=device)
    fill = torch.zeros(n_experts, dtype=torch.int64, device=device)
    dump = n_experts * capacity  # where assignments over capacity are written, then discarded
    slot_token = torch.full((dump + 1,), n_tokens, dtype=torch.int64, device=device)
    slot_weight = torch.zeros(dump + 1, dtype=torch.float32, device=device)
    rows = torch.arange(n_tokens, device=device)
    for slot in range(k):
        experts = topk[:, slot]
        # scatter_add_, not bincount: CUDA bincount reads its maximum back to the host
        counts = torch.zeros(n_experts, dtype=torch.int64, device=device).scatter_add_(0, experts, ones)
        by_expert = torch.argsort(experts, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(experts)
        position[by_expert] = rows - starts[experts[by_expert]]
        place = position + fill[experts]
        keep = place < capacity
        target = torch.where(keep, experts * capacity + place, dump)
        slot_token.scatter_(0, target, rows)
        slot_weight.scatter_(0, target, weights[:, slot].float())
        demand += counts
        dropped.scatter_add_(0, experts, (~keep).long())
        fill = torch.clamp(fill + counts, max=capacity)
    entropy_bits = entropy.mean() if n_tokens else torch.zeros((), device=device)
    row = torch.cat([demand.double(), dropped.double(), fill.sum().double().reshape(1),
                     entropy_bits.double().reshape(1)])
    return DeviceRouting(slot_token=slot_token[:dump].view(n_experts, capacity),
                         slot_weight=slot_weight[:dump].view(n_experts, capacity), row=row, capacity=capacity)


def expert_ffn(x: torch.Tensor, handle: ExpertHandle, *, device: torch.device) -> torch.Tensor:
    """SwiGLU in the handle's dtype on the handle's device (true fp16/bf16 matmuls when reduced);
    the result comes back as fp32 on `device`."""
    h = x.to(device=handle.w1.device, dtype=TORCH_DTYPES[handle.dtype])
    y = (F.silu(h @ handle.w1) * (h @ handle.w3)) @ handle.w2
    return y.to(device=device, dtype=torch.float32)


class MoEModel:
    def __init__(self, cfg: ModelConfig, *, store: ExpertStore, stats: RuntimeStats,
                 instrumentation: Instrumentation, sync_ranges: bool = False,
                 device_routing: bool | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.store = store
        self.stats = stats
        self.ins = instrumentation
        self.device = torch_device(store.primary)
        # CUDA work is asynchronous: with sync_ranges, FFN and step ranges end when the GPU is done.
        self.sync_ranges = sync_ranges and instrumentation.active and self.device.type == "cuda"
        # the device routing path (module docstring): CUDA by default; True also on a CPU (tests)
        self.device_routing = self.device.type == "cuda" if device_routing is None else device_routing
        self._events: list[tuple[Any, Any]] = []  # CUDA event pair per layer, reused every step
        gen = torch.Generator().manual_seed(cfg.seed)
        d, v = cfg.d_model, cfg.vocab
        dev = self.device

        def param(*shape: int, scale: float) -> torch.Tensor:
            return _rand(gen, *shape, scale=scale).to(dev)

        self.embed = param(v, d, scale=1.0)
        self.pos = param(cfg.max_seq, d, scale=0.1)
        self.blocks = []
        for _ in range(cfg.layers):
            self.blocks.append({
                "ln1": torch.ones(d, device=dev), "ln2": torch.ones(d, device=dev),
                "wqkv": param(d, 3 * d, scale=1 / math.sqrt(d)),
                "wo": param(d, d, scale=1 / math.sqrt(d)),
                "router": param(d, cfg.experts, scale=1 / math.sqrt(d)),
            })
        self.ln_f = torch.ones(d, device=dev)
        self.lm_head = param(d, v, scale=1 / math.sqrt(d))
        self._penalty_lock = threading.Lock()
        self._penalties = torch.zeros(cfg.layers, cfg.experts, device=dev)
        self._penalty_values = [[0.0] * cfg.experts for _ in range(cfg.layers)]  # as set (reporting)
        self._noise_gen = torch.Generator().manual_seed(cfg.seed + 2)

    def new_sequence(self) -> SequenceState:
        """A new request's state (its KV cache), made when the engine admits it."""
        return SequenceState()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def non_expert_bytes(cfg: ModelConfig) -> int:
        d = cfg.d_model
        per_layer = 2 * d + 3 * d * d + d * d + d * cfg.experts
        return 4 * (cfg.vocab * d + cfg.max_seq * d + cfg.layers * per_layer + d + d * cfg.vocab)

    # ----- router penalties (immutable tensor swapped under a lock) -----

    def set_penalty(self, *, layers: list[int], expert: int, penalty: float) -> None:
        with self._penalty_lock:
            new = self._penalties.clone()
            for layer in layers:
                new[layer, expert] = penalty
                self._penalty_values[layer][expert] = penalty
            self._penalties = new

    def penalties(self) -> list[list[float]]:
        with self._penalty_lock:
            return [list(row) for row in self._penalty_values]

    # ----- forward -----

    def forward(self, seqs: list[SequenceState], new_tokens: list[list[int]]) -> torch.Tensor:
        """One step: append new_tokens[i] to seqs[i]; returns next-token logits [B, vocab]."""
        cfg, ins = self.cfg, self.ins
        experts_table = self.store.snapshot()  # one consistent expert table for the whole step
        with self._penalty_lock:
            penalties = self._penalties
        lengths = [len(t) for t in new_tokens]
        for seq, n in zip(seqs, lengths):
            if seq.length + n > cfg.max_seq:
                raise ValueError(f"sequence of {seq.length + n} tokens exceeds max_seq {cfg.max_seq}")
        token_ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64, device=self.device)
        positions = torch.tensor(
            [seq.length + i for seq, n in zip(seqs, lengths) for i in range(n)], dtype=torch.int64, device=self.device)
        x = self.embed[token_ids] + self.pos[positions]
        if self._device_step(experts_table):
            rows = torch.empty(cfg.layers, 2 * cfg.experts + 2, dtype=torch.float64, device=self.device)
            # the step's noise in one draw and one copy (a copy per layer would wait per layer)
            noise = self._noise(torch.Size((cfg.layers, x.shape[0], cfg.experts)), self.device)
            for layer, block in enumerate(self.blocks):
                x = x + self._attention(layer, block, _rms_norm(x, block["ln1"]), seqs, lengths)
                x = x + self._moe_device(layer, block, _rms_norm(x, block["ln2"]), experts_table[layer],
                                         penalties[layer], rows, None if noise is None else noise[layer])
            self._emit_device_step(rows, n_tokens=int(token_ids.shape[0]))
        else:
            for layer, block in enumerate(self.blocks):
                ins.layer_push(layer, cfg.experts)
                x = x + self._attention(layer, block, _rms_norm(x, block["ln1"]), seqs, lengths)
                x = x + self._moe(layer, block, _rms_norm(x, block["ln2"]), experts_table[layer], penalties[layer])
                ins.pop()
        for seq, n in zip(seqs, lengths):
            seq.length += n
        ends = torch.tensor(np.cumsum(lengths) - 1, dtype=torch.int64, device=self.device)
        return _rms_norm(x[ends], self.ln_f) @ self.lm_head

    def _device_step(self, table: list[list[ExpertHandle]]) -> bool:
        """Whether this step takes the device path: it needs no per-layer host decision (no expert
        to load from the host, no reroute, no per-expert ranges or per-expert syncs)."""
        return (self.device_routing and self.cfg.overflow == "drop" and not self.ins.expert_ranges
                and not self.sync_ranges and all(h.tier != TIER_HOST for row in table for h in row))

    def _noise(self, shape: torch.Size, device: torch.device) -> torch.Tensor | None:
        if self.cfg.gumbel_tau <= 0:
            return None
        uniform = torch.rand(shape, generator=self._noise_gen).clamp(1e-9, 1 - 1e-9)
        return (-torch.log(-torch.log(uniform)) * self.cfg.gumbel_tau).to(device)

    def _moe_device(self, layer: int, block: dict[str, torch.Tensor], h: torch.Tensor,
                    table: list[ExpertHandle], penalty: torch.Tensor, rows: torch.Tensor,
                    noise: torch.Tensor | None) -> torch.Tensor:
        """The device path's MoE FFN: every expert on its fixed-size capacity buffer; the layer's
        vectors into `rows[layer]`. Nothing here waits for the device."""
        logits = (h @ block["router"]) - penalty
        routing = route_device(self.cfg, logits, noise=noise)
        rows[layer].copy_(routing.row)
        timed = self.ins.active and h.is_cuda
        if timed:
            while len(self._events) <= layer:
                self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[layer][0].record()
        padded = torch.cat([h, h.new_zeros(1, h.shape[1])])  # row n_tokens: what padding slots read
        out = torch.zeros_like(padded)
        for expert, handle in enumerate(table):
            slots = routing.slot_token[expert]
            y = expert_ffn(padded[slots], handle, device=h.device)
            out.index_add_(0, slots, y * routing.slot_weight[expert][:, None])
        if timed:
            self._events[layer][1].record()
        return out[:-1]

    def _emit_device_step(self, rows: torch.Tensor, *, n_tokens: int) -> None:
        """After the device path's last layer: one copy of the step's vectors, then each layer's
        events (back to back: on a device their host durations mean nothing) and stats."""
        cfg, ins = self.cfg, self.ins
        host = rows.cpu().numpy()  # the step's one device-to-host copy
        experts = cfg.experts
        demand_all = host[:, :experts].astype(np.int64)
        dropped_all = host[:, experts:2 * experts].astype(np.int64)
        capacity = cfg.capacity_tokens(n_tokens)
        no_reroute = np.zeros(experts, dtype=np.int64)
        time_us = np.zeros(cfg.layers, dtype=np.float32)
        for layer in range(cfg.layers):
            entropy_bits = float(host[layer, -1])
            ins.layer_push(layer, experts)
            ins.router_push(layer, entropy_bits)
            ins.routing(layer, demand_all[layer], dropped_all[layer])
            ins.pop()
            ins.experts_push(layer, int(host[layer, -2]))
            ins.experts_pop()
            ins.pop()
            self.stats.record_routing(layer=layer, demand=demand_all[layer], dropped=dropped_all[layer],
                                      rerouted_in=no_reroute, entropy_bits=entropy_bits, capacity=capacity)
            if layer < len(self._events) and ins.active and self.device.type == "cuda":
                start, end = self._events[layer]
                time_us[layer] = start.elapsed_time(end) * 1000.0  # ms -> µs; complete after the copy
        if ins.active and self.device.type == "cuda":
            ins.step_device_mark(time_us)

    def _attention(self, layer: int, block: dict[str, torch.Tensor], h: torch.Tensor,
                   seqs: list[SequenceState], lengths: list[int]) -> torch.Tensor:
        cfg = self.cfg
        heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        qkv = h @ block["wqkv"]
        outputs = []
        start = 0
        for seq, n in zip(seqs, lengths):
            q, k, v = qkv[start:start + n].split(cfg.d_model, dim=-1)
            start += n
            q, k, v = (t.reshape(n, heads, head_dim).transpose(0, 1) for t in (q, k, v))
            while len(seq.keys) <= layer:
                seq.keys.append(None)
                seq.values.append(None)
            past_k, past_v = seq.keys[layer], seq.values[layer]
            if past_k is not None and past_v is not None:
                k = torch.cat([past_k, k], dim=1)
                v = torch.cat([past_v, v], dim=1)
            seq.keys[layer], seq.values[layer] = k, v
            total = k.shape[1]
            # Query i (absolute position total - n + i) sees keys at positions <= its own.
            mask = torch.arange(total, device=h.device)[None, :] <= (
                torch.arange(n, device=h.device)[:, None] + total - n
            )
            scores = (q @ k.transpose(1, 2)) / math.sqrt(head_dim)
            scores = scores.masked_fill(~mask, float("-inf"))
            outputs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, cfg.d_model))
        return torch.cat(outputs) @ block["wo"]

    def _moe(self, layer: int, block: dict[str, torch.Tensor], h: torch.Tensor,
             table: list[ExpertHandle], penalty: torch.Tensor) -> torch.Tensor:
        cfg, ins = self.cfg, self.ins
        logits = (h @ block["router"]) - penalty
        noise = self._noise(logits.shape, logits.device)
        routing = route(cfg, logits.cpu() if logits.device.type != "cpu" else logits,
                        noise=noise.cpu() if noise is not None else None)
        # The payload (entropy) must be known at push: NVTX pops carry no attributes.
        ins.router_push(layer, routing.entropy_bits)
        ins.routing(layer, routing.demand, routing.dropped)  # v2: one vector; v1: a mark per expert
        ins.pop()
        self.stats.record_routing(layer=layer, demand=routing.demand, dropped=routing.dropped,
                                  rerouted_in=routing.rerouted_in, entropy_bits=routing.entropy_bits,
                                  capacity=routing.capacity)
        out = torch.zeros_like(h)
        if routing.expert_index.numel() == 0:
            return out
        order = torch.argsort(routing.expert_index, stable=True)
        token_index = routing.token_index[order].to(h.device)
        expert_index = routing.expert_index[order]
        weight = routing.weight[order].to(h.device)
        counts = torch.bincount(expert_index, minlength=cfg.experts).tolist()
        ins.experts_push(layer, int(expert_index.numel()))
        expert_ranges, expert_times = ins.expert_ranges, ins.expert_times
        time_us = np.zeros(cfg.experts, dtype=np.float32) if expert_times else None
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_index[start:start + n]
            w = weight[start:start + n]
            start += n
            handle = table[expert]
            if handle.tier == TIER_HOST:
                ins.load_push(expert, handle.nbytes)
                handle, bytes_moved = self.store.load_for_step(handle)
                ins.pop()
                self.stats.record_load(layer=layer, expert=expert, bytes_moved=bytes_moved)
            if expert_ranges:
                ins.ffn_push(expert, n)
            t0 = time.perf_counter_ns() if time_us is not None else 0
            y = expert_ffn(h[rows], handle, device=h.device)
            if self.sync_ranges:
                self.synchronize()
            if time_us is not None:
                time_us[expert] = (time.perf_counter_ns() - t0) / 1e3
            if expert_ranges:
                ins.pop()
            out.index_add_(0, rows, y * w[:, None])
        if time_us is not None:
            ins.experts_time_mark(layer, time_us)
        ins.experts_pop()
        return out
