"""What a router selects from, decided from what it returns, and the entropy of that distribution.

Routers of transformers 5.x return a [tokens, E] score tensor, the top-k weights and the top-k
indices. The score tensor is raw logits for most families, probabilities for some (Gemma-4), and
for DeepSeek-V3-style routers the logits of a sigmoid whose output, plus a per-expert correction
bias, is what top-k (group-limited) selects on. Which one a router is follows from its own first
call, without class names: probabilities sum to 1 per token; otherwise the top-k weights it hands
the experts keep the ratio of the selected experts' scores, exp(s_a - s_b) for a softmax router and
σ(s_a)/σ(s_b) for a sigmoid one. A sigmoid router's bias is the E-element tensor on the router with
which top-k of σ(s) + bias reproduces the indices best (none if no such tensor helps).

Entropy (bits, mean over the step's tokens) of the distribution over all E experts:
softmax → softmax(logits); probabilities → as returned; sigmoid → max(σ(s) + bias, 0) normalised
to sum 1 (selection scores before the group limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

KINDS = ("softmax", "probabilities", "sigmoid")
_LN2 = math.log(2.0)
_SIMPLEX_TOLERANCE = 1e-3
_max, _add = np.maximum.reduce, np.add.reduce  # the ufuncs themselves: no Python wrapper per call


@dataclass(frozen=True, slots=True)
class Scoring:
    kind: str  # one of KINDS
    evidence: str  # how it was decided, for the report
    bias: torch.Tensor | None = None  # sigmoid: the selection bias [E] (the router's own tensor)
    bias_name: str = ""

    def describe(self) -> str:
        bias = f" + {self.bias_name}" if self.bias_name else ""
        what = {"softmax": "softmax(logits)", "probabilities": "probabilities as returned",
                "sigmoid": f"normalised sigmoid(logits){bias}"}[self.kind]
        return f"{what} ({self.evidence})"


def classify(router: nn.Module, scores: torch.Tensor, indices: torch.Tensor,
             weights: torch.Tensor | None) -> Scoring:
    """Decide from one call's tensors; costs one host sync (done once per router)."""
    s = scores.detach().reshape(-1, scores.shape[-1]).double()
    idx = indices.detach().reshape(s.shape[0], -1).long()
    if s.numel() and bool((s >= 0).all()) and float((s.sum(-1) - 1.0).abs().max()) < _SIMPLEX_TOLERANCE:
        return Scoring(kind="probabilities", evidence="scores sum to 1 per token")
    if weights is None or idx.shape[-1] < 2 or s.shape[0] == 0:
        return Scoring(kind="softmax", evidence="assumed: k = 1 or no top-k weights to compare")
    w = weights.detach().reshape(idx.shape).double()
    chosen = s.gather(1, idx[:, :2])
    keep = (w[:, 0] > 0) & (w[:, 1] > 0)
    if not bool(keep.any()):
        return Scoring(kind="softmax", evidence="assumed: top-k weights not positive")
    log_ratio = torch.log(w[keep, 0]) - torch.log(w[keep, 1])
    err_softmax = float((log_ratio - (chosen[keep, 0] - chosen[keep, 1])).abs().max())
    sig = torch.nn.functional.logsigmoid(chosen[keep])
    err_sigmoid = float((log_ratio - (sig[:, 0] - sig[:, 1])).abs().max())
    evidence = f"top-k weight ratios: softmax error {err_softmax:.1e}, sigmoid error {err_sigmoid:.1e}"
    if err_softmax <= err_sigmoid:
        return Scoring(kind="softmax", evidence=evidence)
    bias, bias_name, agreement = _selection_bias(router, s, idx)
    return Scoring(kind="sigmoid", evidence=f"{evidence}; top-k reproduced for {agreement:.0%} of tokens",
                   bias=bias, bias_name=bias_name)


def _selection_bias(router: nn.Module, s: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor | None, str, float]:
    num_experts, k = s.shape[-1], idx.shape[-1]
    probs = torch.sigmoid(s)
    want = idx.sort(-1).values
    candidates: list[tuple[str, torch.Tensor | None]] = [("", None)]
    for name, own in [*router.named_parameters(), *router.named_buffers()]:
        if own.dim() == 1 and own.shape[0] == num_experts:
            candidates.append((name, own))
    best: tuple[torch.Tensor | None, str, float] = (None, "", -1.0)
    for name, tensor in candidates:
        choice = probs if tensor is None else probs + tensor.detach().double().to(probs.device)
        got = choice.topk(k, dim=-1).indices.sort(-1).values
        agreement = float((got == want).all(-1).double().mean())
        if agreement > best[2] or (agreement == best[2] and tensor is not None):  # a tie: the router's own bias
            best = (tensor, name, agreement)
    return best


def entropy_bits_numpy(scoring: Scoring, scores: np.ndarray) -> float:
    """CPU path: the mean token entropy in bits of a [T, E] float array. Called once per layer and
    step, so it is written for few ufunc calls (each costs microseconds at these sizes)."""
    rows = scores.shape[0]
    if rows == 0:
        return 0.0
    if scoring.kind == "softmax":
        # H = log Z - Σ p z per token, z = s - max(s), p = e^z / Z (float64: within 1e-9 of the definition)
        z = scores - _max(scores, axis=1, keepdims=True)
        z = z.astype(np.float64, copy=False)
        e = np.exp(z)
        total = _add(e, axis=1)
        return float(_add(np.log(total)) - _add(np.einsum("ij,ij->i", e, z) / total)) / (rows * _LN2)
    s = scores.astype(np.float64, copy=False)
    if scoring.kind == "sigmoid":
        q = 1.0 / (1.0 + np.exp(-s))
        if scoring.bias is not None:
            q = q + scoring.bias.detach().double().cpu().numpy()
        q = np.maximum(q, 0.0)
        p = q / np.maximum(q.sum(axis=1, keepdims=True), np.finfo(np.float64).tiny)
    else:
        p = s
    logs = np.log(np.where(p > 0, p, 1.0))
    return float(-(p * logs).sum(axis=1).mean() / _LN2)


def sum_entropy_nats_layers(kind: str, scores: torch.Tensor, bias: torch.Tensor | None, *,
                            dtype: torch.dtype) -> torch.Tensor:
    """Deferred path: [n] sums over tokens of the token entropies (nats) of n layers' [n, T, E] scores
    at once, computed in `dtype` on the scores' device (no host sync); `bias` [n, E] for sigmoid
    routers. Three tensor ops for a softmax router, whatever n: inside a forward each op costs
    microseconds (caches cold after the model's own work), far more than its arithmetic at decode sizes."""
    if kind == "softmax":
        p = torch.softmax(scores, dim=-1, dtype=dtype)
    elif kind == "sigmoid":
        q = torch.sigmoid(scores.to(dtype))
        if bias is not None:
            q = (q + bias.to(dtype)[:, None, :]).clamp_min_(0.0)
        p = q / q.sum(-1, keepdim=True).clamp_min_(torch.finfo(dtype).tiny)
    else:
        p = scores.to(dtype).clamp_min(0.0)
    return torch.special.entr(p).sum(dim=(1, 2))
