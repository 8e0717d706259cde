"""Grouped-query attention of the Qwen2-MoE, Qwen3-MoE and OLMoE families, its K/V cache,
and the builder of a decoder made of it.

Shapes: ``T`` packed tokens, ``D`` hidden size, ``H``/``KvH`` query/KV heads, ``hd`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moeguard_runtime.model.families.decoder import (
    DecoderArgs,
    DecoderLayer,
    HFDecoder,
    check_activation,
)
from moeguard_runtime.model.families.weights import load_by_name, moe_tensor, to_interleaved
from moeguard_runtime.model.hf_config import HFConfig, TensorSource
from moeguard_runtime.model.model import KVCache, RMSNorm, Segment, apply_rope, attend_segments


class GQACache(KVCache):
    """K/V of one sequence with an explicit head size (``head_dim`` need not be ``D / H``).

    ``k``, ``v``: ``[n_layer, n_kv_head, capacity, head_dim]``.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (n_layer, n_kv_head, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity


@dataclass(frozen=True)
class AttentionSpec:
    """What differs between the families' GQA attention.

    Attributes:
        qkv_bias: biases on q/k/v (Qwen2-MoE ``qkv_bias``, OLMoE ``attention_bias``).
        o_bias: a bias on the output projection (OLMoE ``attention_bias``).
        qk_norm: RMSNorm of q and k before the rotation: ``"head"`` over each head
            (Qwen3), ``"full"`` over the whole projection (OLMoE), ``"none"``.
        clip_qkv: clamp q, k and v to ``[-clip, clip]`` after the norm (OLMoE ``clip_qkv``).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"
    clip_qkv: float | None = None


class GQAAttention(nn.Module):
    """Causal attention with rotary positions and grouped KV heads, HF ``Qwen2MoeAttention``,
    ``Qwen3MoeAttention``, ``OlmoeAttention`` (the differences in :class:`AttentionSpec`).
    Softmax scale ``hd^-0.5``."""

    def __init__(self, args: DecoderArgs, layer: int, spec: AttentionSpec) -> None:
        super().__init__()
        hd, h, kvh = args.head_dim, args.n_head, args.n_kv_head
        self.layer, self.n_head, self.n_kv_head, self.head_dim = layer, h, kvh, hd
        self.q_proj = nn.Linear(args.dim, h * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kvh * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kvh * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * hd, args.dim, bias=spec.o_bias)
        per_head = spec.qk_norm == "head"
        self.q_norm = k_norm = None
        if spec.qk_norm != "none":
            self.q_norm = RMSNorm(hd if per_head else h * hd, args.norm_eps)
            k_norm = RMSNorm(hd if per_head else kvh * hd, args.norm_eps)
        self.k_norm = k_norm
        self.norm_per_head = per_head
        self.clip = spec.clip_qkv
        self.rope_factor = args.rope.attention_factor

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]) -> torch.Tensor:
        """``x`` [T, D], ``angles`` [T, hd/2] → [T, D]; writes K/V into each segment's cache."""
        hd, h, kvh = self.head_dim, self.n_head, self.n_kv_head
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, H*hd], [T, KvH*hd] x2
        if self.q_norm is not None and self.k_norm is not None and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(-1, h, hd), k.view(-1, kvh, hd), v.view(-1, kvh, hd)  # [T, heads, hd]
        if self.q_norm is not None and self.k_norm is not None and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        if self.rope_factor != 1.0:  # YaRN's attention factor (HF scales cos and sin)
            q, k = q * self.rope_factor, k * self.rope_factor
        out: torch.Tensor = self.o_proj(attend_segments(q, k, v, segments, self.layer))  # [T, D]
        return out


def gqa_tensor(source: TensorSource, name: str, shape: tuple[int, ...],
               args: DecoderArgs) -> torch.Tensor | None:
    """q/k projection weights and biases and the q/k norms of :class:`GQAAttention`, permuted
    from HF's half-split rotary layout (:func:`to_interleaved`); None for any other ``name``."""
    prefix, _, leaf = name.rpartition(".self_attn.")
    module = leaf.split(".")[0]
    if not prefix or module not in ("q_proj", "k_proj", "q_norm", "k_norm"):
        return None
    heads = shape[0] // args.head_dim  # per-head norms: 1 head; OLMoE's full norms: all heads
    return to_interleaved(source.take(f"model.{name}", shape), heads)


def build_gqa_decoder(cfg: HFConfig, source: TensorSource, args: DecoderArgs,
                      mlp: Callable[[int], nn.Module], spec: AttentionSpec,
                      shared_name: str = "shared_experts") -> HFDecoder:
    """A decoder of :class:`GQAAttention` layers whose MLP is ``mlp(layer)``, built on the
    meta device and filled from ``source`` (Qwen2-MoE, Qwen3-MoE, OLMoE)."""
    check_activation(cfg)
    with torch.device("meta"):
        layers = [DecoderLayer(args, GQAAttention(args, i, spec), mlp(i))
                  for i in range(args.n_layer)]
        model = HFDecoder(args, layers, args.head_dim, lambda capacity, dtype, device: GQACache(
            args.n_layer, args.n_kv_head, args.head_dim, capacity, dtype, device))

    def special(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        t = gqa_tensor(source, name, shape, args)
        return t if t is not None else moe_tensor(source, name, shape, shared_name)

    load_by_name(model, source, special, cfg.get_bool("tie_word_embeddings", False))
    return model
