"""Mixtral-style MoE decoder, in the style of pytorch-labs/gpt-fast ``mixtral-moe/model.py``.

The forward pass works on a *packed* batch (as vLLM): the tokens of all
sequences in a step are concatenated into one ``[T]`` tensor, so the
projections and the MoE layers see the whole batch at once, while attention
runs per sequence segment against that sequence's own :class:`KVCache`. A
segment is a prefill chunk (``n`` prompt tokens) or a decode token (``n = 1``).

Weights are random and seeded, or loaded from a safetensors checkpoint
(:func:`build_model`); the module layout (``tok_embeddings``,
``layers.N.attention.wqkv``, ``feed_forward.w13`` …) follows gpt-fast (the experts'
gate and up projections fused, as vLLM), and HF
Mixtral names are mapped onto it (:mod:`moeguard_runtime.model.checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeguard_core.presets import ModelArgs
from moeguard_runtime.model.checkpoint import load_state_dict
from moeguard_runtime.model.moe import (
    DEFAULT_EXPERT_CHUNK_TOKENS,
    MatmulChoice,
    MoeDispatch,
    MOEFeedForward,
    RoutingStats,
)
from moeguard_runtime.model.moe_device import PendingRouting


class KVCache:
    """Keys and values of one sequence, all layers.

    ``k``, ``v``: ``[n_layer, n_kv_head, capacity, head_dim]``; ``capacity`` is
    the prompt length plus ``max_new_tokens`` (known at admission), so memory is
    ``2 * n_layer * n_kv_head * capacity * head_dim * dtype_bytes``.
    """

    def __init__(self, args: ModelArgs, capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (args.n_layer, args.n_kv_head, capacity, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive tokens of one sequence, at positions ``start..start+length-1``."""

    cache: KVCache
    start: int
    length: int


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = normed.type_as(x) * self.weight
        return out


def rope_angles(max_seq_len: int, head_dim: int, base: float) -> torch.Tensor:
    """``[max_seq_len, head_dim // 2]`` rotary angles ``pos * base^(-2i/head_dim)`` (RoFormer)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    return torch.outer(pos, inv_freq).float()


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` (gpt-fast/Meta layout).

    ``x`` [n, heads, head_dim], ``angles`` [n, head_dim // 2] → [n, heads, head_dim].
    """
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # [n, h, hd/2, 2]
    cos = angles.cos()[:, None, :]  # [n, 1, hd/2]
    sin = angles.sin()[:, None, :]
    x0, x1 = xs[..., 0], xs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def attend_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               scale: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention of one sequence segment against its cached keys and values.

    ``q`` [H, n, hd] at positions ``start..start+n-1``, ``k``/``v`` [KvH, start+n, hd] (the cache,
    read in place) → [H, n, hd]. Query ``i`` sees keys ``0..start+i``. Query head ``j`` reads KV
    head ``j // (H // KvH)`` (HF's ``repeat_kv``) through ``scaled_dot_product_attention(
    enable_gqa=True)`` (torch ≥ 2.5), so K/V are never repeated per layer per step. A whole prompt
    (``start == 0``) uses ``is_causal`` rather than a mask (the fused kernels' fast path); a decode
    token needs no mask. The tensors get a batch dimension of 1: CUDA's fused kernels (flash,
    memory-efficient) take 4-D inputs only and fall back to the math kernel, which copies K/V for
    GQA, on 3-D ones.
    """
    n, s = q.shape[1], k.shape[1]
    mask, causal = None, False
    if n > 1 and start == 0 and n == s:
        causal = True
    elif n > 1:  # a later prefill chunk: query i (position start+i) sees keys 0..start+i
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(diagonal=start)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                       scale=scale, enable_gqa=q.shape[0] != k.shape[0])  # [1, H, n, hd]
    return o[0]


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
                    layer: int) -> torch.Tensor:
    """Attention of a packed batch: ``q`` [T, H, hd], ``k``/``v`` [T, KvH, hd] (rotated), the tokens of
    ``segments`` in order → [T, H*hd]. Each segment's keys and values are written into its sequence's
    cache (``layer``) at its positions, then its queries attend the cache through :func:`attend_gqa`."""
    h, hd = q.shape[1], q.shape[2]
    outs = []
    offset = 0
    for seg in segments:
        n, s0, s1 = seg.length, seg.start, seg.start + seg.length
        cache_k, cache_v = seg.cache.k[layer], seg.cache.v[layer]  # [KvH, cap, hd]
        cache_k[:, s0:s1] = k[offset:offset + n].transpose(0, 1)
        cache_v[:, s0:s1] = v[offset:offset + n].transpose(0, 1)
        qs = q[offset:offset + n].transpose(0, 1)  # [H, n, hd]
        o = attend_gqa(qs, cache_k[:, :s1], cache_v[:, :s1], s0)  # [H, n, hd], the cache read in place
        outs.append(o.transpose(0, 1).reshape(n, h * hd))
        offset += n
    return torch.cat(outs, dim=0)  # [T, H*hd]


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped KV heads (GQA, Ainslie
    et al. 2023): query head ``j`` attends with KV head ``j // (n_head // n_kv_head)``,
    as HF's ``repeat_kv``; ``scaled_dot_product_attention(enable_gqa=True)`` reads the
    cached K/V in place instead of repeating them per layer per step."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        hd = args.head_dim
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, hd
        self.wqkv = nn.Linear(args.dim, (args.n_head + 2 * args.n_kv_head) * hd, bias=False)
        self.wo = nn.Linear(args.n_head * hd, args.dim, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]) -> torch.Tensor:
        """``x`` [T, D], ``angles`` [T, hd/2] → [T, D]; writes K/V into each segment's cache."""
        hd, h, kvh = self.head_dim, self.n_head, self.n_kv_head
        q, k, v = self.wqkv(x).split([h * hd, kvh * hd, kvh * hd], dim=-1)
        q = apply_rope(q.view(-1, h, hd), angles)  # [T, H, hd]
        k = apply_rope(k.view(-1, kvh, hd), angles)  # [T, KvH, hd]
        v = v.view(-1, kvh, hd)  # [T, KvH, hd]
        out: torch.Tensor = self.wo(attend_segments(q, k, v, segments, self.layer))  # [T, D]
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, expert_chunk_tokens: int,
                 capacity_factor: float = 0.0, matmul_backend: MatmulChoice = "onednn",
                 dispatch: MoeDispatch = "auto") -> None:
        super().__init__()
        self.attention = Attention(args, layer)
        self.feed_forward = MOEFeedForward(args.dim, args.intermediate_size, args.num_experts,
                                           args.top_k, expert_chunk_tokens, capacity_factor,
                                           matmul_backend, dispatch)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]) -> tuple[torch.Tensor, RoutingStats | PendingRouting]:
        h = x + self.attention(self.attention_norm(x), angles, segments)  # [T, D]
        ff, stats = self.feed_forward(self.ffn_norm(h))
        return h + ff, stats


class Transformer(nn.Module):
    """The decoder. :meth:`forward` returns logits of each segment's last token.
    ``matmul_backend``: kernel of the expert matmuls (:data:`moe.MatmulChoice`);
    ``dispatch``: how the MoE layers group their slots (:data:`moe.MoeDispatch`)."""

    def __init__(self, args: ModelArgs,
                 expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
                 capacity_factor: float = 0.0, matmul_backend: MatmulChoice = "onednn",
                 dispatch: MoeDispatch = "auto") -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i, expert_chunk_tokens, capacity_factor,
                                                     matmul_backend, dispatch)
                                    for i in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.angles = torch.empty(0)  # [max_seq_len, hd/2], set by setup_rope()

    def setup_rope(self, device: torch.device | str | None = None) -> None:
        """Rotary angles, float32 on ``device`` (default: the weights' device). Kept
        out of the parameters and buffers so that ``model.to(dtype)`` never rounds them."""
        if device is None:
            device = self.output.weight.device
        angles = rope_angles(self.args.max_seq_len, self.args.head_dim, self.args.rope_base)
        self.angles = angles.to(device)

    def new_cache(self, capacity: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> KVCache:
        """One sequence's K/V cache of ``capacity`` positions (the engine's hook, see
        :class:`moeguard_runtime.model.serving.ServingModel`)."""
        return KVCache(self.args, capacity, dtype, device)

    def set_expert_chunk_tokens(self, n: int) -> None:
        """Bound on token-slots one expert processes at once (applies to the next step)."""
        for layer in self.layers:
            assert isinstance(layer, TransformerBlock)
            layer.feed_forward.expert_chunk_tokens = n

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[Segment]
                ) -> tuple[torch.Tensor, list[RoutingStats | PendingRouting]]:
        """``tokens``, ``positions``: [T] int64, packed in segment order.

        Returns ``([S, V] float32 logits of each segment's last token, per-layer routing)``;
        :func:`moe.read_back` turns pending routing into :class:`moe.RoutingStats`.
        """
        x = self.tok_embeddings(tokens)  # [T, D]
        angles = self.angles[positions]  # [T, hd/2]
        stats = []
        for layer in self.layers:
            x, s = layer(x, angles, segments)
            stats.append(s)
        last = torch.tensor([0, *(s.length for s in segments)],
                            device=x.device).cumsum(0)[1:] - 1  # [S]
        logits = self.output(self.norm(x[last]))  # [S, V]
        return logits.float(), stats


def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter from a generator seeded with ``seed`` (same seed, same
    weights). Matrices ~ N(0, 1/fan_in) so activations keep unit scale; the
    embedding ~ N(0, 1); norm weights are 1. The fused ``w13`` is drawn as the
    unfused ``w1`` and ``w3`` were, in the same order, so a seed gives the weights it gave
    before the fusion."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(_unfused_parameters(model)):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "tok_embeddings.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


def _unfused_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters()`` with each ``X.w13`` ``[E, 2I, D]`` given as its two halves ``X.w1``
    and ``X.w3`` (views)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        if name.endswith(".w13"):
            half = p.shape[1] // 2
            out += [(name.removesuffix("13") + "1", p[:, :half]), (name.removesuffix("13") + "3", p[:, half:])]
        else:
            out.append((name, p))
    return out


def embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` ``[vocab_size, dim]`` on the current default device: on the meta device its weight is
    left undrawn (:func:`init_weights` or a checkpoint fills it after materialising); elsewhere it is drawn from
    N(0, 1) as ``nn.Embedding`` draws it.

    ``nn.Embedding`` draws its weight with ``normal_`` unless given one. On the meta device, where
    :func:`build_model` and the families build, ``normal_`` runs its Python reference (``torch._refs``), whose
    first call imports ``torch._dynamo`` and ``torch._inductor``: 2-3 s of CPU in every worker start (on the
    AMD EPYC of the tests: 2.6 s of a 5.8-s start of the ``tiny`` preset, measured with cProfile, 2026-12-06).
    """
    weight = torch.empty(vocab_size, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)  # nn.Embedding's own initialisation
    return nn.Embedding(vocab_size, dim, _weight=weight)


def materialise(model: nn.Module) -> None:
    """Give every meta parameter and buffer of ``model`` uninitialised CPU storage of its shape and dtype, in
    place (what ``model.to_empty(device="cpu")`` does for contiguous tensors).

    ``to_empty`` allocates with ``torch.empty_like`` of the meta tensors, which runs its Python reference
    (``torch._refs.empty_like``) and so imports ``torch.fx.experimental.symbolic_shapes`` and sympy on its first
    call: 0.73 s of CPU in every worker start (cProfile, AMD EPYC, 2026-12-06). ``torch.empty`` of a shape on
    the CPU is the CPU's own kernel.

    Raises:
        ValueError: a meta tensor is not contiguous (``torch.empty`` would not keep its strides).
    """
    def fresh(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        if not t.is_contiguous():
            raise ValueError(f"cannot materialise a non-contiguous meta tensor of shape {tuple(t.shape)}")
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")
    model._apply(fresh)  # type: ignore[no-untyped-call]  # as to_empty itself does, with torch.empty


def build_model(args: ModelArgs, seed: int = 0, dtype: torch.dtype = torch.float32,
                expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
                capacity_factor: float = 0.0, checkpoint: str | None = None,
                device: torch.device | str = "cpu",
                matmul_backend: MatmulChoice = "onednn",
                dispatch: MoeDispatch = "auto") -> Transformer:
    """Build on the meta device (no allocation), then either load ``checkpoint``
    (a local safetensors file or folder, :mod:`moeguard_runtime.model.checkpoint`;
    tensors are assigned, not copied into fresh storage) or materialise and fill
    with seeded weights (drawn on the CPU, so a seed gives the same weights on
    every device), then cast to ``dtype`` and move to ``device``. The rotary
    angles stay float32 on ``device``. ``matmul_backend``, ``dispatch``: see :data:`moe.MatmulChoice`, :data:`moe.MoeDispatch`.

    Raises:
        checkpoint.CheckpointError: an unreadable checkpoint, or one of another shape.
    """
    with torch.device("meta"):
        model = Transformer(args, expert_chunk_tokens, capacity_factor, matmul_backend, dispatch)
    if checkpoint is not None:
        expected = {k: v.shape for k, v in model.state_dict().items()}
        model.load_state_dict(load_state_dict(checkpoint, args, expected), assign=True, strict=True)
    else:
        materialise(model)
        init_weights(model, seed)
    model = model.to(dtype).to(device)
    model.setup_rope(device)
    return model.eval()
