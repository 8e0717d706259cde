"""Grouped expert dispatch with no host synchronisation, for CUDA (``F.grouped_mm``).

:func:`moe.dispatch_experts` reads each layer's ``[E]`` counts on the host to
slice the sorted token-slots per expert: one device synchronisation per MoE
layer. Here the slices stay on the device: the slots are sorted by expert, the
groups' end offsets are ``cumsum(counts)`` (``int32``, on the device), and each
projection of all experts (the fused gate/up ``w13``, then ``w2``) is one
``torch.nn.functional.grouped_mm`` (torch >=
2.9; bfloat16 on CUDA SM >= 80, as its documentation states). Chunks of
``expert_chunk_tokens`` slots keep the temporaries bounded (``[chunk, I]``), with
the offsets clipped to each chunk. Every shape is static (``T * k`` slots), so
the only transfer of a step is the engine's: the sampled tokens together with
every layer's counts (:func:`read_back`).

Capacity (DeepSpeed): slots over capacity keep their place with weight 0 (the
kept weights renormalized per token), so shapes stay static; the dropped slots
are computed and discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeguard_runtime.model.timing import Mark


@dataclass(frozen=True)
class PendingRouting:
    """A layer's routing whose numbers are still on the device.

    Attributes:
        counts: ``[E]`` int64, token-slots routed to each expert.
        overflow: 0-d int64, slots dropped over capacity.
        marks: as :attr:`moe.RoutingStats.marks`.
        chunks: grouped matmuls the slots were split into (:attr:`moe.RoutingStats.expert_chunks`).
    """

    counts: torch.Tensor
    overflow: torch.Tensor
    marks: tuple[Mark, Mark, Mark]
    chunks: int = 1


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether :func:`device_dispatch` runs on ``x``: CUDA bfloat16 with ``F.grouped_mm``."""
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def device_dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor,
                    expert_chunk_tokens: int, capacity: int | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts on their token-slots, grouped by expert, without a host read.

    Args:
        x: ``[T, D]``; weights: ``[T, k]`` float32; experts: ``[T, k]`` int64.
        w13: ``[E, 2I, D]`` fused gate (rows ``0..I-1``) and up projections; w2: ``[E, D, I]``
            (``nn.Linear`` layout).
        expert_chunk_tokens: most token-slots per grouped matmul.
        capacity: most token-slots per expert (None: dropless).

    Returns:
        ``(out [T, D] in x.dtype, counts [E] int64, overflow 0-d int64)``, all on ``x``'s device.

    Raises:
        ValueError: ``expert_chunk_tokens < 1``.
    """
    if expert_chunk_tokens < 1:
        raise ValueError("expert_chunk_tokens must be >= 1")
    num_tokens, k = experts.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    flat = experts.reshape(-1)  # [S] token-major, S = T*k
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    order = torch.argsort(flat, stable=True)  # [S] grouped by expert, tokens ascending
    slot_weight = weights.reshape(-1)  # [S] token-major
    overflow = torch.zeros((), dtype=torch.int64, device=x.device)
    if capacity is not None:
        kept = weights * capacity_keep(experts, counts, capacity).view(num_tokens, k)  # [T, k]
        denom = kept.sum(-1, keepdim=True)  # [T, 1]
        slot_weight = torch.where(denom > 0, kept / denom.clamp_min(1e-30), kept).reshape(-1)
        overflow = (counts - counts.clamp(max=capacity)).sum()
    slot_weight = slot_weight[order]  # [S] sorted
    slot_token = order // k  # [S]
    offs = torch.cumsum(counts, 0)  # [E] end of each expert's group
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # views: [E, D, 2I], [E, I, D]
    out = torch.zeros_like(x)  # [T, D]
    slots = num_tokens * k
    for c0 in range(0, slots, expert_chunk_tokens):
        c1 = min(c0 + expert_chunk_tokens, slots)
        tok = slot_token[c0:c1]  # [n]
        xs = x.index_select(0, tok)  # [n, D]
        offs_c = (offs - c0).clamp(0, c1 - c0).to(torch.int32)  # [E] this chunk's groups
        h = F.grouped_mm(xs, w13t, offs=offs_c)  # [n, 2I]
        act = F.silu(h[:, :inter]).mul_(h[:, inter:])  # [n, I], contiguous
        del h
        y = F.grouped_mm(act, w2t, offs=offs_c)  # [n, D]
        y.mul_(slot_weight[c0:c1, None].to(y.dtype))
        out.index_add_(0, tok, y)
    return out, counts, overflow


def capacity_keep(experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[T*k]`` bool (token-major slots): kept under ``capacity`` with DeepSpeed's
    priority, all first choices before second choices, each rank in token order."""
    num_tokens, k = experts.shape
    rank_major = experts.T.reshape(-1)  # [k*T], index r*T + t
    order = torch.argsort(rank_major, stable=True)
    starts = torch.cumsum(counts, 0) - counts  # [E]
    device = experts.device
    pos = (torch.arange(order.numel(), device=device)  # position within its expert
           - torch.repeat_interleave(starts, counts, output_size=order.numel()))  # no host sync
    keep_rm = torch.zeros(order.numel(), dtype=torch.bool, device=device)
    keep_rm[order] = pos < capacity
    return keep_rm.view(k, num_tokens).T.reshape(-1)  # back to token-major t*k + r
