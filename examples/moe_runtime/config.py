"""Runtime configuration: model sizes, routing, residency, batching. One frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
import math

from moescope.errors import ConfigError

OVERFLOW_POLICIES = ("drop", "reroute")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and routing of the MoE transformer. Defaults fit 2 CPU cores."""

    vocab: int = 512
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 512
    layers: int = 4
    experts: int = 16
    top_k: int = 2
    max_seq: int = 512
    capacity_factor: float = 1.25
    overflow: str = "drop"
    gumbel_tau: float = 0.0
    seed: int = 1234

    def validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.vocab >= 258, f"vocab must be >= 258 (256 bytes + BOS/EOS), got {self.vocab}"),
            (self.d_model >= 8, f"d_model must be >= 8, got {self.d_model}"),
            (
                self.n_heads >= 1 and self.d_model % self.n_heads == 0,
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})",
            ),
            (self.d_ff >= 1, f"d_ff must be >= 1, got {self.d_ff}"),
            (self.layers >= 1, f"layers must be >= 1, got {self.layers}"),
            (self.experts >= 2, f"experts must be >= 2, got {self.experts}"),
            (1 <= self.top_k <= self.experts, f"top_k must be in 1..experts, got {self.top_k}"),
            (self.max_seq >= 2, f"max_seq must be >= 2, got {self.max_seq}"),
            (
                self.capacity_factor > 0 and math.isfinite(self.capacity_factor),
                f"capacity_factor must be > 0, got {self.capacity_factor}",
            ),
            (self.overflow in OVERFLOW_POLICIES, f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}"),
            (
                self.gumbel_tau >= 0 and math.isfinite(self.gumbel_tau),
                f"gumbel_tau must be >= 0, got {self.gumbel_tau}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def expert_params(self) -> int:
        """Parameters of one SwiGLU expert: w1, w3 (d_model x d_ff) and w2 (d_ff x d_model)."""
        return 3 * self.d_model * self.d_ff

    def capacity_tokens(self, n_tokens: int) -> int:
        """Per-expert capacity for a step of n_tokens (GShard: cf * tokens * k / E, at least 1)."""
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.experts))
