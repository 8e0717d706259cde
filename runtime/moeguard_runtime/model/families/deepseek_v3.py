"""``model_type: deepseek_v3`` (DeepSeek-V3/R1, Kimi-K2-style), after HF ``modeling_deepseek_v3.py``.

* Multi-head latent attention (MLA, DeepSeek-V2 report §2.1, V3 report §2.1.1):
  ``c_kv = RMSNorm(W_dkv x)`` (``kv_lora_rank`` wide) and one rotary key
  ``k_rope = RoPE(W_kr x)`` (``qk_rope_head_dim``) shared by all heads are what
  a token leaves in the cache (:class:`MLACache`), not per-head K/V. Keys and
  values are expanded from the cache, ``[k_nope, v] = W_ukv c_kv`` (``kv_b_proj``),
  ``k = [k_nope, k_rope]``; queries come through an optional low-rank
  ``q_a_proj``/``q_a_layernorm``/``q_b_proj``; softmax scale
  ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5``.
* MoE (V3 report §2.1.2): sigmoid affinities; experts chosen on
  ``sigmoid + e_score_correction_bias`` within the ``topk_group`` best of
  ``n_group`` expert groups (a group's score: the sum of its two best); weights
  are the unbiased sigmoid scores of the chosen experts, renormalized when
  ``norm_topk_prob``, times ``routed_scaling_factor``; ``n_shared_experts``
  shared experts (one SwiGLU of ``n_shared_experts * moe_intermediate_size``)
  added unconditionally; the first ``first_k_dense_replace`` layers are dense.
* The multi-token-prediction layers (``num_nextn_predict_layers``, stored as
  layers ``num_hidden_layers`` and up) are not used for decoding and are skipped.

RoPE: default or YaRN (:mod:`moeguard_runtime.model.families.rope`), the latter with
DeepSeek's softmax-scale correction ``mscale(factor, mscale_all_dim)^2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeguard_runtime.model.checkpoint import hf_to_interleaved
from moeguard_runtime.model.families.decoder import (
    DecoderArgs,
    DecoderLayer,
    DenseMLP,
    HFDecoder,
    SparseMoE,
    causal_mask,
    check_activation,
    decoder_args,
)
from moeguard_runtime.model.families.routers import GroupLimitedSigmoid
from moeguard_runtime.model.families.weights import load_by_name, moe_tensor
from moeguard_runtime.model.hf_config import BuildOptions, HFConfig, TensorSource
from moeguard_runtime.model.model import KVCache, RMSNorm, Segment, apply_rope

MLA_NORM_EPS = 1e-6
"""HF builds ``q_a_layernorm`` and ``kv_a_layernorm`` with the RMSNorm default, not ``rms_norm_eps``."""


class MLACache(KVCache):
    """MLA's compressed cache of one sequence, all layers.

    ``k``: ``[n_layer, capacity, kv_lora_rank]`` normalized latents ``c_kv``;
    ``v``: ``[n_layer, capacity, qk_rope_head_dim]`` rotated shared keys. Memory is
    ``n_layer * capacity * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``
    (576 values per token and layer for DeepSeek-V3, against 2 * 128 * 192 for full K/V).
    """

    def __init__(self, n_layer: int, kv_lora_rank: int, rope_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros((n_layer, capacity, kv_lora_rank), dtype=dtype, device=device)
        self.v = torch.zeros((n_layer, capacity, rope_dim), dtype=dtype, device=device)
        self.capacity = capacity


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring); HF ``DeepseekV3Attention``."""

    def __init__(self, cfg: HFConfig, args: DecoderArgs, layer: int) -> None:
        super().__init__()
        d, h = args.dim, args.n_head
        bias = cfg.get_bool("attention_bias", False)
        self.layer, self.n_head = layer, h
        self.q_lora_rank = cfg.data.get("q_lora_rank")
        self.kv_lora_rank = cfg.get_int("kv_lora_rank")
        self.nope, self.rope = cfg.get_int("qk_nope_head_dim"), cfg.get_int("qk_rope_head_dim")
        self.v_dim = cfg.get_int("v_head_dim")
        qk = self.nope + self.rope
        self.scale = args.rope.softmax_scale(qk ** -0.5)
        self.rope_factor = args.rope.attention_factor
        if self.q_lora_rank:
            r = cfg.get_int("q_lora_rank")
            self.q_a_proj = nn.Linear(d, r, bias=bias)
            self.q_a_layernorm = RMSNorm(r, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(r, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]) -> torch.Tensor:
        """``x`` [T, D], ``angles`` [T, rope/2] → [T, D]; writes ``c_kv`` and ``k_rope`` into
        each segment's :class:`MLACache`."""
        h, nope, rope = self.n_head, self.nope, self.rope
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [T, H*(nope+rope)]
        else:
            q = self.q_proj(x)
        q = q.view(-1, h, nope + rope)  # [T, H, nope+rope]
        q_rot = apply_rope(q[..., nope:], angles) * self.rope_factor  # [T, H, rope]
        q = torch.cat([q[..., :nope], q_rot], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, r]
        k_rot = apply_rope(k_rot[:, None, :], angles)[:, 0] * self.rope_factor  # [T, rope]
        outs = []
        offset = 0
        for seg in segments:
            n, s0, s1 = seg.length, seg.start, seg.start + seg.length
            cache_c, cache_r = seg.cache.k[self.layer], seg.cache.v[self.layer]  # [cap, r], [cap, rope]
            cache_c[s0:s1] = latent[offset:offset + n]
            cache_r[s0:s1] = k_rot[offset:offset + n]
            qs = q[offset:offset + n]  # [n, H, nope+rope]
            attend = self._absorbed if n == 1 else self._expanded
            outs.append(attend(qs, cache_c[:s1], cache_r[:s1], causal_mask(n, s0, x.device)))
            offset += n
        out: torch.Tensor = self.o_proj(torch.cat(outs, dim=0))  # [T, D]
        return out

    def _expanded(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Prefill: keys and values expanded from the cache, as HF computes them.
        ``q`` [n, H, nope+rope], ``latent`` [s, r], ``k_rot`` [s, rope] → [n, H*v]."""
        h, nope, s = self.n_head, self.nope, latent.shape[0]
        kv = self.kv_b_proj(latent).view(s, h, nope + self.v_dim)  # [s, H, nope+v]
        k_nope, vals = kv.split([nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rot[:, None, :].expand(s, h, self.rope)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),  # [H, n|s, ...]
            attn_mask=mask, scale=self.scale)  # [H, n, v]
        return o.transpose(0, 1).reshape(q.shape[0], h * self.v_dim)

    def _absorbed(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Decode: attention in the latent space (DeepSeek-V2 report §2.1.3, "absorb" ``W_uk``
        into the query and ``W_uv`` into the output), so the cache is read as is instead of
        being expanded to ``H * (nope + v)`` per position. Same result up to summation order.
        ``q`` [n, H, nope+rope], ``latent`` [s, r], ``k_rot`` [s, rope] → [n, H*v]."""
        h, nope, s, r = self.n_head, self.nope, latent.shape[0], self.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, nope + self.v_dim, r)  # [H, nope+v, r]
        q_lat = torch.einsum("nhd,hdr->hnr", q[..., :nope], w[:, :nope])  # [H, n, r]
        query = torch.cat([q_lat, q[..., nope:].transpose(0, 1)], dim=-1)  # [H, n, r+rope]
        keys = torch.cat([latent, k_rot], dim=-1)[None].expand(h, s, r + self.rope)  # [H, s, r+rope]
        o_lat = F.scaled_dot_product_attention(query, keys, latent[None].expand(h, s, r),
                                               attn_mask=mask, scale=self.scale)  # [H, n, r]
        o = torch.einsum("hnr,hvr->nhv", o_lat, w[:, nope:])  # [n, H, v]
        return o.reshape(q.shape[0], h * self.v_dim)


def build(cfg: HFConfig, source: TensorSource, options: BuildOptions) -> HFDecoder:
    """The DeepSeek-V3 decoder of ``cfg``, filled from ``source``.

    Raises:
        CheckpointError: a missing or bad ``config.json`` key (e.g. experts not divisible
            into ``n_group`` groups of at least two), or any tensor problem.
    """
    check_activation(cfg)
    num_experts = cfg.get_int("n_routed_experts", "num_local_experts")
    args = decoder_args(cfg, num_experts, head_dim=cfg.get_int("qk_rope_head_dim"))
    n_group, topk_group = cfg.get_int("n_group", default=1), cfg.get_int("topk_group", default=1)
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
        raise cfg.error("n_group", f"{n_group} must split n_routed_experts ({num_experts}) "
                                   f"into groups of at least 2")
    if not 1 <= topk_group <= n_group:
        raise cfg.error("topk_group", f"{topk_group} must be in 1..n_group ({n_group})")
    if args.top_k > topk_group * (num_experts // n_group):
        raise cfg.error("num_experts_per_tok", f"{args.top_k} exceeds the experts of "
                                               f"topk_group groups")
    dense_layers = cfg.get_int("first_k_dense_replace", default=0)
    moe_size = cfg.get_int("moe_intermediate_size")
    shared = cfg.get_int("n_shared_experts", default=0) * moe_size
    interleaved = cfg.get_bool("rope_interleave", True)
    router = GroupLimitedSigmoid(args.top_k, n_group, topk_group,
                                 cfg.get_float("routed_scaling_factor", 1.0),
                                 cfg.get_bool("norm_topk_prob", True))

    def mlp(layer: int) -> nn.Module:
        if layer < dense_layers:
            return DenseMLP(args.dim, cfg.get_int("intermediate_size"))
        return SparseMoE(args.dim, moe_size, num_experts, router, options, shared_size=shared,
                         score_bias=True, router_fp32=True)

    with torch.device("meta"):
        layers = [DecoderLayer(args, MLAttention(cfg, args, i), mlp(i)) for i in range(args.n_layer)]
        attn = layers[0].self_attn
        assert isinstance(attn, MLAttention)
        r, rope = attn.kv_lora_rank, attn.rope
        model = HFDecoder(args, layers, rope, lambda capacity, dtype, device: MLACache(
            args.n_layer, r, rope, capacity, dtype, device))

    def special(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        t = moe_tensor(source, name, shape, "shared_experts")
        if t is not None or interleaved:
            return t
        # rope_interleave false: the rotary rows are in HF's half-split layout
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            t = source.take(f"model.{name}", shape)
            w = t.view(args.n_head, -1, shape[-1])  # [H, nope+rope, in]
            nope = w.shape[1] - rope
            rot = hf_to_interleaved(w[:, nope:].reshape(-1, shape[-1]), args.n_head)
            return torch.cat([w[:, :nope], rot.view(args.n_head, rope, -1)], 1).reshape(shape)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight") or \
                name.endswith("self_attn.kv_a_proj_with_mqa.bias"):
            t = source.take(f"model.{name}", shape)
            rot = t[r:] if t.dim() == 2 else t[r:, None]
            rot = hf_to_interleaved(rot, 1)
            return torch.cat([t[:r], rot if t.dim() == 2 else rot[:, 0]])
        return None

    mtp = [f"model.layers.{args.n_layer + i}." for i in
           range(cfg.get_int("num_nextn_predict_layers", default=0))]
    load_by_name(model, source, special, cfg.get_bool("tie_word_embeddings", False), ignore=mtp)
    return model
