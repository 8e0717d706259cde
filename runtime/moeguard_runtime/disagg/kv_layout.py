"""Which bytes of a sequence's KV cache a prefill/decode handoff moves (pure: addresses and sizes only).

Every cache the worker allocates (:class:`moeguard_runtime.model.model.KVCache` and the families' subclasses)
holds two contiguous tensors, ``k`` and ``v``, whose second-to-last dimension is the token position:

* GQA (the embedded model, Mixtral, Qwen2/3-MoE, OLMoE): ``[n_layer, n_kv_head, capacity, head_dim]``;
* MLA (DeepSeek-V3): ``[n_layer, capacity, kv_lora_rank]`` and ``[n_layer, capacity, qk_rope_head_dim]``.

A prompt of ``n`` tokens fills positions ``0..n-1``: for each index of the leading dimensions one contiguous
run of ``n * width`` elements at ``lead * capacity * width``. The handoff moves exactly these runs (one NIXL
descriptor each, as vLLM's NIXL connector moves one descriptor per KV block), never the unfilled tail, so the
two sides' capacities may differ (the decode side's is its own prompt + ``max_new_tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeguard_runtime.model.model import KVCache


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes of host memory at address ``addr``."""

    addr: int
    nbytes: int


def cache_tensors(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of ``cache``.

    Raises:
        ValueError: a tensor that is not contiguous, has fewer than 2 dimensions, or whose capacities differ.
    """
    for name, t in (("k", cache.k), ("v", cache.v)):
        if t.dim() < 2 or not t.is_contiguous():
            raise ValueError(f"cache.{name} must be a contiguous tensor of >= 2 dimensions, got {tuple(t.shape)}")
        if t.shape[-2] != cache.capacity:
            raise ValueError(f"cache.{name} has {t.shape[-2]} positions, the cache's capacity is {cache.capacity}")
    return cache.k, cache.v


def prompt_regions(tensors: Sequence[torch.Tensor], tokens: int) -> list[Region]:
    """The runs holding positions ``0..tokens-1`` of each tensor ``[..., capacity, width]``, in order
    (tensor, then leading index).

    Raises:
        ValueError: ``tokens`` outside ``1..capacity`` of some tensor.
    """
    out: list[Region] = []
    for t in tensors:
        capacity, width = t.shape[-2], t.shape[-1]
        if not 1 <= tokens <= capacity:
            raise ValueError(f"cannot move {tokens} positions of a cache of {capacity}")
        lead = math.prod(t.shape[:-2])
        row = width * t.element_size()
        base = t.data_ptr()
        out += [Region(base + i * capacity * row, tokens * row) for i in range(lead)]
    return out


def transfer_bytes(cache: KVCache, tokens: int) -> int:
    """Bytes a handoff of ``tokens`` prompt positions of ``cache`` moves."""
    return sum(r.nbytes for r in prompt_regions(cache_tensors(cache), tokens))

