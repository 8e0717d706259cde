"""Mixture-of-Experts feed-forward: router, grouped dispatch, routing statistics.

Shapes: ``T`` tokens in the batch (packed, all sequences together), ``D`` the
hidden size, ``I`` the expert SwiGLU width, ``E`` experts, ``k`` experts per
token. A *token-slot* is one (token, chosen expert) pair; a batch routes
``T * k`` of them.

Router (Mixtral, HF ``MixtralSparseMoeBlock``): softmax over the expert logits
in float32, top-k, then the k weights are renormalized to sum to 1.

Dispatch is *grouped*: the token-slots are sorted by expert so each expert runs
once on a contiguous slice (a dense ``[n, D] @ [D, I]`` matmul). gpt-fast's
per-token weight gather (``w1[expert_indices]``, ``[T, k, I, D]``) is fast for
decode but materialises ``T*k`` weight copies and runs out of memory at prefill,
so it is not used. A slice longer than ``expert_chunk_tokens`` is processed in
chunks, so the temporaries (``[chunk, D]`` gather, ``[chunk, I]`` activations)
are bounded by the chunk, not by the top expert's token count (the vLLM fused-MoE
fix chunks at about 2048 tokens). By default no token is dropped (dropless, as
MegaBlocks). With a ``capacity_factor`` (DeepSpeed ``sharded_moe.py``, GShard,
Switch), each expert takes at most :func:`expert_capacity` token-slots; first
choices are served before second choices, then in token order (DeepSpeed's
``top2gating`` priority); the slots over capacity are dropped and counted as
``overflow_tokens``, and each token's kept weights are renormalized.

Weight layout follows gpt-fast ``ConditionalFeedForward`` (and HF's nn.Linear
orientation, so Mixtral checkpoints load without transposes):
``w1``, ``w3``: ``[E, I, D]``; ``w2``: ``[E, D, I]``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_EXPERT_CHUNK_TOKENS = 2048
DEFAULT_MIN_CAPACITY = 4
"""DeepSpeed's ``min_capacity`` default."""


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float,
                    min_capacity: int = DEFAULT_MIN_CAPACITY) -> int:
    """DeepSpeed's formula: ``ceil(tokens * k / experts * capacity_factor)``, at least
    ``min_capacity`` token-slots per expert."""
    return max(min_capacity, math.ceil(num_tokens * top_k / num_experts * capacity_factor))


@dataclass(frozen=True)
class RoutingStats:
    """Routing of one batch through one MoE layer.

    Attributes:
        tokens_per_expert: ``[E]`` int64, token-slots routed to each expert.
        routed_slots: ``T * k``, the sum of ``tokens_per_expert``.
        top_expert_tokens: the largest entry of ``tokens_per_expert``.
        median_expert_tokens: the median entry (mean of the two middle entries
            when ``E`` is even).
        expert_skew_ratio: ``top / max(median, 1)``. The median is floored at one
            token so that a batch where most experts get nothing (e.g. a single
            decode token) gives a finite ratio equal to the top count, instead
            of infinity. 1.0 is perfect balance; an empty batch gives 0.0.
        balancedness: ``mean / max`` of ``tokens_per_expert`` (vLLM EPLB's
            measure): 1.0 is perfect balance, ``1/E`` is everything on one
            expert; an empty batch gives 1.0.
        overflow_tokens: token-slots dropped over capacity (0 when dropless).
        routing_seconds, expert_seconds: wall time of the router and of the
            expert matmuls in this layer (``time.perf_counter``).
    """

    tokens_per_expert: torch.Tensor
    routed_slots: int
    top_expert_tokens: int
    median_expert_tokens: float
    expert_skew_ratio: float
    balancedness: float
    overflow_tokens: int = 0
    routing_seconds: float = 0.0
    expert_seconds: float = 0.0


def routing_stats(tokens_per_expert: torch.Tensor, overflow_tokens: int = 0,
                  routing_seconds: float = 0.0, expert_seconds: float = 0.0) -> RoutingStats:
    """Statistics of a ``[E]`` tensor of token-slot counts (see :class:`RoutingStats`)."""
    counts = tokens_per_expert.detach().to(torch.int64).cpu()
    as_float = counts.to(torch.float64)
    total = int(counts.sum())
    top = int(counts.max()) if counts.numel() else 0
    median = float(torch.quantile(as_float, 0.5)) if counts.numel() else 0.0
    mean = float(as_float.mean()) if counts.numel() else 0.0
    skew = top / max(median, 1.0)
    balancedness = mean / top if top > 0 else 1.0
    return RoutingStats(counts, total, top, median, skew, balancedness, overflow_tokens,
                        routing_seconds, expert_seconds)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral router.

    Args:
        router_logits: ``[T, E]`` gate outputs (any float dtype).
        top_k: experts per token.

    Returns:
        ``(weights, experts)``: ``[T, k]`` float32 weights summing to 1 per token,
        and ``[T, k]`` int64 expert indices (highest weight first).
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k], [T, k]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """One expert: ``w2(silu(w1 x) * w3 x)``. ``x`` [n, D], ``w1``/``w3`` [I, D],
    ``w2`` [D, I] → [n, D]."""
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T  # [n, I] → [n, D]


def grouped_expert_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Run the experts on their token-slots, grouped by expert.

    Args:
        x: ``[T, D]`` hidden states.
        weights: ``[T, k]`` router weights (float32).
        experts: ``[T, k]`` int64 expert indices.
        w1, w3: ``[E, I, D]``; w2: ``[E, D, I]``.
        expert_chunk_tokens: most token-slots one expert processes at once.
        capacity: most token-slots per expert (None: dropless).

    Returns:
        ``(out, tokens_per_expert, overflow)``: ``[T, D]`` in ``x.dtype`` (the
        weighted sum over each token's kept experts), ``[E]`` int64 token-slot
        counts routed (before capacity), and the number of slots dropped.
    """
    if expert_chunk_tokens < 1:
        raise ValueError("expert_chunk_tokens must be >= 1")
    num_tokens, _k = experts.shape
    num_experts = w1.shape[0]
    flat_experts = experts.T.reshape(-1)  # [k*T] rank-major: first choices first
    counts = torch.bincount(flat_experts, minlength=num_experts)  # [E]
    order = torch.argsort(flat_experts, stable=True)  # [k*T] slots sorted by expert
    slot_token = order % num_tokens  # [k*T] token index of each sorted slot
    slot_weight = weights.T.reshape(-1)[order]  # [k*T] float32
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    overflow = 0
    if capacity is not None:
        kept_counts = counts.clamp(max=capacity)
        overflow = int((counts - kept_counts).sum())
        if overflow:
            pos = torch.arange(order.numel()) - torch.repeat_interleave(
                torch.tensor(bounds[:-1]), counts)  # [k*T] position within its expert
            keep = (pos < capacity).to(slot_weight.dtype)
            kept = slot_weight * keep
            denom = torch.zeros(num_tokens, dtype=kept.dtype).index_add_(0, slot_token, kept)
            slot_weight = kept / denom.clamp(min=1e-9)[slot_token]  # renormalize what is kept
    out = torch.zeros_like(x)  # [T, D]
    for e in range(num_experts):
        start, end = bounds[e], bounds[e + 1]
        if capacity is not None:
            end = min(end, start + capacity)
        for c0 in range(start, end, expert_chunk_tokens):
            c1 = min(c0 + expert_chunk_tokens, end)
            tok = slot_token[c0:c1]  # [n]
            y = swiglu_expert(x[tok], w1[e], w2[e], w3[e])  # [n, D]
            y = y * slot_weight[c0:c1, None].to(y.dtype)
            out.index_add_(0, tok, y)
            del y, tok
    return out, counts, overflow


class MOEFeedForward(nn.Module):
    """Router plus stacked SwiGLU experts (gpt-fast ``MOEFeedForward``).

    ``capacity_factor`` 0 (default) is dropless; above 0, DeepSpeed capacity.
    """

    def __init__(self, dim: int, intermediate_size: int, num_experts: int, top_k: int,
                 expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
                 capacity_factor: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)  # weight [E, D]
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))  # [E, I, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))  # [E, D, I]
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))  # [E, I, D]
        self.top_k = top_k
        self.num_experts = num_experts
        self.expert_chunk_tokens = expert_chunk_tokens
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        """``x`` [T, D] → ``([T, D], RoutingStats)``."""
        t0 = time.perf_counter()
        weights, experts = route(self.gate(x), self.top_k)  # [T, k] each
        t1 = time.perf_counter()
        capacity = None
        if self.capacity_factor > 0:
            capacity = expert_capacity(x.shape[0], self.top_k, self.num_experts,
                                       self.capacity_factor)
        out, counts, overflow = grouped_expert_forward(
            x, weights, experts, self.w1, self.w2, self.w3, self.expert_chunk_tokens, capacity)
        t2 = time.perf_counter()
        return out, routing_stats(counts, overflow, t1 - t0, t2 - t1)
