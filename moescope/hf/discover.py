"""Find the Mixture-of-Experts blocks of a PyTorch model by their structure, not by class names.

A block is a module with two children: an *experts* module holding per-expert weights (parameters
whose first dimension is the number of experts E, the fused layout of transformers 5.x) and a
*router* module with a 2-D weight of E rows (its per-token scores over the E experts). At run time
(moescope/hf/emit.py) the block is confirmed: the router's output carries a [tokens, E] score
tensor and the experts module is called with integer top-k indices. Any other child with parameters
(Qwen2-MoE's `shared_expert` and `shared_expert_gate`, DeepSeek's `shared_experts`) is reported as a
shared (dense) part. A family never tested here, built the same way, is found the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# Attribute names under which routers, blocks and configs store k (read, never required).
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "k")
NO_BLOCKS_REASON = (
    "no MoE blocks: no submodule has an experts child with per-expert weights (parameters of E rows "
    "per expert) beside a router child with an E-row weight — a dense model has none"
)


@dataclass(frozen=True, slots=True)
class MoeBlock:
    """One MoE block: `layer` is its index in model order (the NVTX layer id)."""

    layer: int
    path: str  # module path in the model, e.g. "model.layers.3.mlp"
    block: nn.Module
    router_name: str  # the router's attribute name on the block, e.g. "gate"
    router: nn.Module
    experts_name: str
    experts: nn.Module
    num_experts: int
    top_k: int | None  # None: learned from the index tensor at the first call
    shared: tuple[str, ...]  # names of the block's other (dense, every-token) children

    def describe(self) -> str:
        k = "?" if self.top_k is None else str(self.top_k)
        shared = f", shared: {', '.join(self.shared)}" if self.shared else ""
        return (f"layer {self.layer}: {self.path} (router .{self.router_name} "
                f"{type(self.router).__name__}, experts .{self.experts_name} {type(self.experts).__name__}, "
                f"E={self.num_experts}, k={k}{shared})")


@dataclass(frozen=True, slots=True)
class Discovery:
    blocks: tuple[MoeBlock, ...]
    reason: str  # why no block was found; "" when some were
    skipped: tuple[str, ...]  # candidates seen but not usable, each with why

    def describe(self) -> str:
        lines = [b.describe() for b in self.blocks] or [self.reason]
        return "\n".join([*lines, *(f"skipped: {s}" for s in self.skipped)])


def _int_attr(obj: object) -> int | None:
    for name in _TOP_K_ATTRS:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def fused_expert_count(module: nn.Module) -> int | None:
    """E when every own parameter of 3 or more dimensions shares its first dimension E >= 2 (one slice
    per expert). Own parameters only: a decoder layer that contains an experts module is not one."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return None  # a convolution's 3-D kernel is not one slice per expert
    firsts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() >= 3}
    if len(firsts) == 1:
        (count,) = firsts
        return count if count >= 2 else None
    return None


def _router_rows(module: nn.Module, num_experts: int) -> bool:
    """The module holds a 2-D weight with one row per expert (the score projection)."""
    return any(p.dim() == 2 and p.shape[0] == num_experts for p in module.parameters())


def _looped_experts(module: nn.Module, siblings: list[tuple[str, nn.Module]]) -> bool:
    """transformers 4.x layout: a ModuleList of N identical expert modules, each called by the block,
    beside a router with an N-row weight (a list of decoder layers has no such sibling)."""
    if not (isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1):
        return False
    return any(c is not module and _router_rows(c, len(module)) for _, c in siblings)


def discover(model: nn.Module) -> Discovery:
    blocks: list[MoeBlock] = []
    skipped: list[str] = []
    found_prefixes: list[str] = []
    config_k = _int_attr(getattr(model, "config", None))
    for path, module in model.named_modules():
        if any(path.startswith(p) for p in found_prefixes):
            continue  # inside a block already found: its experts are not blocks of their own
        children = [(n, c) for n, c in module.named_children()]
        for experts_name, experts in children:
            if _looped_experts(experts, children):
                skipped.append(f"{path or '<model>'}.{experts_name}: a list of {len(experts)} expert modules "
                               "called one by one (transformers 4.x layout), not called with top-k indices")
                continue
            count = fused_expert_count(experts)
            if count is None:
                continue
            routers = [(n, c) for n, c in children if c is not experts and _router_rows(c, count)]
            if len(routers) != 1:
                if len(routers) > 1:
                    skipped.append(f"{path}: {len(routers)} children score {count} experts "
                                   f"({', '.join(n for n, _ in routers)}); which one routes is ambiguous")
                continue
            router_name, router = routers[0]
            shared = tuple(n for n, c in children if c is not experts and c is not router
                           and any(True for _ in c.parameters()))
            top_k = _int_attr(router) or _int_attr(module) or _int_attr(experts) or config_k
            blocks.append(MoeBlock(layer=len(blocks), path=path, block=module, router_name=router_name,
                                   router=router, experts_name=experts_name, experts=experts,
                                   num_experts=count, top_k=top_k, shared=shared))
            found_prefixes.append(path + ".")
            break
    reason = "" if blocks else NO_BLOCKS_REASON
    return Discovery(blocks=tuple(blocks), reason=reason, skipped=tuple(skipped))
