"""MoE routers of the HF families: router logits → each token's experts and weights.

A router takes ``[T, E]`` float32 logits (``x @ gate.T``, computed in float32 as
HF does) and the optional ``[E]`` score-correction bias, and returns
``(weights [T, k] float32, experts [T, k] int64)``, what
:func:`moeguard_runtime.model.moe.dispatch_experts` consumes. Mixtral's own router
is :func:`moeguard_runtime.model.moe.route` (softmax top-k, always renormalized).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class Router(Protocol):
    @property
    def top_k(self) -> int: ...

    def __call__(self, logits: torch.Tensor,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SoftmaxTopK:
    """Softmax over the experts, top-k, renormalized to sum 1 when ``normalize``
    (HF ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter`` with ``norm_topk_prob``)."""

    top_k: int
    normalize: bool

    def __call__(self, logits: torch.Tensor,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k], [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


@dataclass(frozen=True)
class GroupLimitedSigmoid:
    """DeepSeek-V3's router (V3 tech report §2.1.2, eqs. 13-16 and "node-limited routing";
    HF ``DeepseekV3TopkRouter``).

    Affinities ``s = sigmoid(logits)``. Experts are *chosen* on ``s + bias`` (the
    auxiliary-loss-free balancing bias ``e_score_correction_bias``), only within the
    ``topk_group`` best of ``n_group`` equal groups (a group scores the sum of its two
    best); the *weights* are the unbiased ``s`` of the chosen experts, divided by their
    sum (plus 1e-20) when ``normalize``, times ``routed_scaling_factor``.
    """

    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    normalize: bool

    def __call__(self, logits: torch.Tensor,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, e = logits.shape
        g = self.n_group
        scores = logits.sigmoid()  # [T, E]
        choice = scores if bias is None else scores + bias.float()  # [T, E]
        group_scores = choice.view(num_tokens, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
        expert_mask = group_mask[:, :, None].expand(num_tokens, g, e // g).reshape(num_tokens, e)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, experts)  # [T, k]
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts
