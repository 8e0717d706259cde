"""The reference the MoE dispatch is measured and tested against: HF transformers'
``MixtralSparseMoeBlock.forward`` expert loop (v4.4x), re-typed without the transformers package."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hf_expert_loop(x: torch.Tensor, gate_w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers ``MixtralSparseMoeBlock.forward`` (v4.4x), re-typed: router softmax
    in float32, top-k, renormalize, then a loop over experts with ``index_add_``."""
    router_logits = x @ gate_w.T
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(x.dtype)
    final = torch.zeros_like(x)
    expert_mask = F.one_hot(selected_experts, num_classes=w1.shape[0]).permute(2, 1, 0)
    for e in range(w1.shape[0]):
        idx, top_x = torch.where(expert_mask[e])
        current = x[None, top_x].reshape(-1, x.shape[-1])
        h = (F.silu(current @ w1[e].T) * (current @ w3[e].T)) @ w2[e].T
        final.index_add_(0, top_x, h * routing_weights[top_x, idx, None])
    return final
