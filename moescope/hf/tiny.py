"""Tiny random-weight MoE causal LMs built from transformers' own config classes (no download):
for tests, demos and the cost benchmark. Each builds and runs a forward pass in milliseconds on a CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TINY_HEADS = 4  # attention heads of every tiny model (hidden must split into them, each of an even width)

# arch name -> (config class name in transformers, its expert-count field)
TINY_ARCHS: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "num_experts"),
    "mixtral": ("MixtralConfig", "num_local_experts"),
    "qwen2_moe": ("Qwen2MoeConfig", "num_experts"),
    "deepseek_v3": ("DeepseekV3Config", "n_routed_experts"),
}


def tiny_config(arch: str, *, vocab: int = 128, hidden: int = 64, layers: int = 4, experts: int = 8,
                top_k: int = 2, max_positions: int = 512, **overrides: Any) -> Any:
    """The config of a tiny `arch` model; `overrides` go to the config class as they are."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}")
    class_name, experts_field = TINY_ARCHS[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": TINY_HEADS,
        "num_key_value_heads": 2, "intermediate_size": 2 * hidden, "max_position_embeddings": max_positions,
        "num_experts_per_tok": top_k, experts_field: experts,
    }
    if arch in ("qwen3_moe", "qwen2_moe", "deepseek_v3"):
        fields["moe_intermediate_size"] = hidden
    if arch == "qwen3_moe":
        fields["head_dim"] = hidden // TINY_HEADS
    if arch == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = hidden
    if arch == "deepseek_v3":
        # MLA expands its latent KV to every head: no grouped KV heads. With 2 the attention repeated
        # the 4 expanded heads to 8 wherever a mask was given, so every padded batch failed (a user
        # trial: HTTP 500 for every batched request; single requests, unmasked, worked)
        fields.update(first_k_dense_replace=0, n_group=2, topk_group=1, n_shared_experts=1, kv_lora_rank=16,
                      q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                      num_key_value_heads=TINY_HEADS)
    fields.update(overrides)
    return getattr(transformers, class_name)(**fields)


def tiny_model(arch: str, *, seed: int = 0, **config: Any) -> nn.Module:
    """A tiny random-weight causal LM of `arch`, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model: nn.Module = AutoModelForCausalLM.from_config(tiny_config(arch, **config))
    return model.eval()
