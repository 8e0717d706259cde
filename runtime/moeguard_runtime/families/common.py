"""Building blocks shared by the HF families (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3).

Module names follow HF's (``embed_tokens``, ``layers.N.self_attn.q_proj``,
``layers.N.mlp.gate`` …) so a checkpoint maps onto them by dropping the
``model.`` prefix; only the experts are restacked (``experts.E.gate_proj`` →
``w1[E]``) to feed :func:`moeguard_runtime.moe.grouped_expert_forward`, and the
q/k rows are permuted to the interleaved rotary layout of
:func:`moeguard_runtime.model.apply_rope` (:func:`to_interleaved`).

Shapes: ``T`` packed tokens, ``D`` hidden size, ``H``/``KvH`` query/KV heads,
``hd`` head dim, ``E`` routed experts, ``k`` experts per token, ``I`` expert width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeguard_runtime.checkpoint import hf_to_interleaved
from moeguard_runtime.families.routers import Router
from moeguard_runtime.hf_checkpoint import BuildOptions, HFConfig, TensorSource
from moeguard_runtime.model import KVCache, RMSNorm, Segment, apply_rope, rope_angles
from moeguard_runtime.moe import (
    RoutingStats,
    expert_capacity,
    grouped_expert_forward,
    routing_stats,
    swiglu_expert,
)


@dataclass(frozen=True)
class DecoderArgs:
    """Shape of an HF MoE decoder (the fields the engine and telemetry read, plus attention).

    ``head_dim`` is the rotary (and, for GQA, the K/V) head size; ``num_experts``
    and ``top_k`` describe the routed experts.
    """

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    rope_base: float
    norm_eps: float
    num_experts: int
    top_k: int


def decoder_args(cfg: HFConfig, num_experts: int, head_dim: int | None = None) -> DecoderArgs:
    """The common fields of ``config.json`` (HF names), with the family's expert count."""
    dim, n_head = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    return DecoderArgs(
        n_layer=cfg.get_int("num_hidden_layers"), dim=dim, n_head=n_head,
        n_kv_head=cfg.get_int("num_key_value_heads", default=n_head),
        head_dim=head_dim or cfg.get_int("head_dim", default=dim // max(n_head, 1)),
        vocab_size=cfg.get_int("vocab_size"), max_seq_len=cfg.max_seq_len(),
        rope_base=cfg.rope_theta(), norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        num_experts=num_experts, top_k=cfg.get_int("num_experts_per_tok"))


def check_activation(cfg: HFConfig) -> None:
    act = cfg.data.get("hidden_act", "silu")
    if act != "silu":
        raise cfg.error("hidden_act", f"{act!r} is not supported (only silu, SwiGLU experts)")


def to_interleaved(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a ``[n_heads * hd, ...]`` q/k weight, bias or per-head norm weight from HF's
    half-split rotary layout (``rotate_half``) to the interleaved pairs of ``apply_rope``
    (as gpt-fast's ``convert_hf_checkpoint.py``). A 1-D tensor is treated as one column."""
    if t.dim() == 1:
        return hf_to_interleaved(t[:, None], n_heads)[:, 0]
    return hf_to_interleaved(t, n_heads)


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


def causal_mask(n: int, s0: int, device: torch.device) -> torch.Tensor | None:
    """``[n, s0 + n]`` bool: query ``i`` (position ``s0 + i``) sees keys ``0..s0 + i``; None for one query."""
    if n == 1:
        return None
    return torch.ones(n, s0 + n, dtype=torch.bool, device=device).tril(diagonal=s0)


class GQAAttention(nn.Module):
    """Causal attention with rotary positions and grouped KV heads, HF ``Qwen2MoeAttention`` /
    ``Qwen3MoeAttention``: optional q/k/v bias (Qwen2), optional per-head RMSNorm of q and k
    before the rotation (Qwen3, ``q_norm``/``k_norm``). Softmax scale ``hd^-0.5``."""

    def __init__(self, args: DecoderArgs, layer: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hd, h, kvh = args.head_dim, args.n_head, args.n_kv_head
        self.layer, self.n_head, self.n_kv_head, self.head_dim = layer, h, kvh, hd
        self.q_proj = nn.Linear(args.dim, h * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(args.dim, kvh * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(args.dim, kvh * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(h * hd, args.dim, bias=False)
        self.q_norm = RMSNorm(hd, args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, args.norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]) -> torch.Tensor:
        """``x`` [T, D], ``angles`` [T, hd/2] → [T, D]; writes K/V into each segment's cache."""
        hd, h, kvh = self.head_dim, self.n_head, self.n_kv_head
        q = self.q_proj(x).view(-1, h, hd)  # [T, H, hd]
        k = self.k_proj(x).view(-1, kvh, hd)  # [T, KvH, hd]
        v = self.v_proj(x).view(-1, kvh, hd)  # [T, KvH, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        outs = []
        offset = 0
        for seg in segments:
            n, s0, s1 = seg.length, seg.start, seg.start + seg.length
            cache_k, cache_v = seg.cache.k[self.layer], seg.cache.v[self.layer]  # [KvH, cap, hd]
            cache_k[:, s0:s1] = k[offset:offset + n].transpose(0, 1)
            cache_v[:, s0:s1] = v[offset:offset + n].transpose(0, 1)
            keys = cache_k[:, :s1].repeat_interleave(h // kvh, dim=0)  # [H, s1, hd]
            vals = cache_v[:, :s1].repeat_interleave(h // kvh, dim=0)  # [H, s1, hd]
            qs = q[offset:offset + n].transpose(0, 1)  # [H, n, hd]
            o = F.scaled_dot_product_attention(qs, keys, vals,
                                               attn_mask=causal_mask(n, s0, x.device))  # [H, n, hd]
            outs.append(o.transpose(0, 1).reshape(n, h * hd))
            offset += n
        out: torch.Tensor = self.o_proj(torch.cat(outs, dim=0))  # [T, D]
        return out


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate x) * up x)`` (HF ``Qwen2MoeMLP``, ``DeepseekV3MLP``)."""

    def __init__(self, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, D] → [T, D]."""
        return swiglu_expert(x, self.gate_proj.weight, self.down_proj.weight, self.up_proj.weight)


class SparseMoE(nn.Module):
    """Routed SwiGLU experts (grouped dispatch, :mod:`moeguard_runtime.moe`), plus optional
    shared experts: ungated (DeepSeek-V3 ``shared_experts``) or scaled by
    ``sigmoid(shared_expert_gate x)`` (Qwen2-MoE ``shared_expert``).

    The expert chunking and the capacity guardrail are those of
    :class:`moeguard_runtime.moe.MOEFeedForward` (``expert_chunk_tokens``,
    ``capacity_factor``); the routing statistics count routed token-slots only.
    """

    def __init__(self, dim: int, intermediate_size: int, num_experts: int, router: Router,
                 options: BuildOptions, *, shared_size: int = 0, shared_gate: bool = False,
                 score_bias: bool = False, router_fp32: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)  # weight [E, D]
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))  # [E, I, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))  # [E, D, I]
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))  # [E, I, D]
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if score_bias else None
        self.shared = DenseMLP(dim, shared_size) if shared_size else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.router = router
        self.num_experts, self.top_k = num_experts, router.top_k
        self.expert_chunk_tokens = options.expert_chunk_tokens
        self.capacity_factor = options.capacity_factor
        self.router_fp32 = router_fp32
        """Keep ``gate.weight`` and the bias float32 whatever the model's dtype (HF DeepSeek-V3's
        ``_keep_in_fp32_modules_strict``): a bfloat16 bias would reorder close experts."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        """``x`` [T, D] → ``([T, D], RoutingStats)``."""
        t0 = time.perf_counter()
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E] float32
        weights, experts = self.router(logits, self.e_score_correction_bias)  # [T, k] each
        t1 = time.perf_counter()
        capacity = None
        if self.capacity_factor > 0:
            capacity = expert_capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        out, counts, overflow = grouped_expert_forward(
            x, weights, experts, self.w1, self.w2, self.w3, self.expert_chunk_tokens, capacity)
        t2 = time.perf_counter()
        if self.shared is not None:
            shared = self.shared(x)  # [T, D]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared  # [T, 1] * [T, D]
            out = out + shared
        return out, routing_stats(counts, overflow, t1 - t0, t2 - t1)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, args: DecoderArgs, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]) -> tuple[torch.Tensor, RoutingStats | None]:
        h = x + self.self_attn(self.input_layernorm(x), angles, segments)  # [T, D]
        y = self.mlp(self.post_attention_layernorm(h))
        if isinstance(y, tuple):
            return h + y[0], y[1]
        return h + y, None


class HFDecoder(nn.Module):
    """An HF MoE decoder (embeddings, layers, final norm, LM head) on the engine's packed batch.

    ``forward(tokens, positions, segments)`` returns ``([S, V] float32 logits of each
    segment's last token, routing statistics of each MoE layer, dense layers skipped)``.
    ``rope_dim`` is the rotated width (``head_dim``; MLA's ``qk_rope_head_dim``).
    """

    def __init__(self, args: DecoderArgs, layers: list[DecoderLayer], rope_dim: int,
                 cache_factory: Callable[[int, torch.dtype, torch.device | str], KVCache]) -> None:
        super().__init__()
        self._args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_dim = rope_dim
        self.angles = torch.empty(0)  # [max_seq_len, rope_dim/2], set by setup_rope()
        self._cache_factory = cache_factory

    @property
    def args(self) -> DecoderArgs:
        return self._args

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return self._cache_factory(capacity, dtype, device)

    def setup_rope(self, device: torch.device | str | None = None) -> None:
        """Rotary angles, float32 on ``device`` (default: the weights' device)."""
        if device is None:
            device = self.lm_head.weight.device
        self.angles = rope_angles(self._args.max_seq_len, self.rope_dim,
                                  self._args.rope_base).to(device)

    def cast(self, dtype: torch.dtype) -> None:
        """Floating parameters to ``dtype``, but the routers marked ``router_fp32`` to float32."""
        keep = {id(p) for m in self.modules() if isinstance(m, SparseMoE) and m.router_fp32
                for p in (m.gate.weight, m.e_score_correction_bias) if p is not None}
        for p in self.parameters():
            p.data = p.data.to(torch.float32 if id(p) in keep else dtype)

    def set_expert_chunk_tokens(self, n: int) -> None:
        """Bound on token-slots one expert processes at once (applies to the next step)."""
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.expert_chunk_tokens = n

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[Segment]) -> tuple[torch.Tensor, list[RoutingStats]]:
        x = self.embed_tokens(tokens)  # [T, D]
        angles = self.angles[positions]  # [T, rope_dim/2]
        stats = []
        for layer in self.layers:
            x, s = layer(x, angles, segments)
            if s is not None:
                stats.append(s)
        last = torch.tensor([0, *(s.length for s in segments)],
                            device=x.device).cumsum(0)[1:] - 1  # [S]
        logits = self.lm_head(self.norm(x[last]))  # [S, V]
        return logits.float(), stats


_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_tensor(source: TensorSource, name: str, shape: tuple[int, ...],
               shared_name: str = "shared_experts") -> torch.Tensor | None:
    """The :class:`SparseMoE` parameters under their HF names, or None for any other ``name``.

    ``layers.N.mlp.w1`` ``[E, I, D]`` is HF's per-expert ``model.layers.N.mlp.experts.E.gate_proj.weight``
    stacked (``w3``: ``up_proj``, ``w2``: ``down_proj``); ``mlp.shared.*`` is
    ``mlp.{shared_name}.*``, ``mlp.shared_gate`` is ``mlp.shared_expert_gate`` and
    ``mlp.e_score_correction_bias`` is ``mlp.gate.e_score_correction_bias``.
    """
    prefix, _, leaf = name.rpartition(".mlp.")
    if not prefix:
        return None
    hf = f"model.{prefix}.mlp."
    if leaf in _EXPERT_PROJ:
        return torch.stack([source.take(f"{hf}experts.{e}.{_EXPERT_PROJ[leaf]}.weight", shape[1:])
                            for e in range(shape[0])])  # [E, ...]
    if leaf.startswith("shared."):
        return source.take(f"{hf}{shared_name}.{leaf.removeprefix('shared.')}", shape)
    if leaf == "shared_gate.weight":
        return source.take(f"{hf}shared_expert_gate.weight", shape)
    if leaf == "e_score_correction_bias":
        return source.take(f"{hf}gate.e_score_correction_bias", shape)
    return None


def load_by_name(model: nn.Module, source: TensorSource,
                 special: Callable[[str, tuple[int, ...]], torch.Tensor | None],
                 tie_embeddings: bool = False, ignore: Sequence[str] = ()) -> None:
    """Fill every parameter of ``model`` (built on the meta device) from ``source``:
    ``special(name, shape)`` supplies the restacked or permuted ones (None: take
    ``model.{name}`` as stored; ``lm_head.weight`` has no prefix, and with
    ``tie_embeddings`` and no ``lm_head.weight`` stored it is the embedding), then
    checks that no tensor was left over (but those whose names start with one of ``ignore``).

    Raises:
        CheckpointError: from :class:`TensorSource` (missing, shape, unexpected).
    """
    state: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict(keep_vars=True).items():
        shape = tuple(p.shape)
        t = special(name, shape)
        if t is None and name == "lm_head.weight":
            tied = tie_embeddings and not source.has(name)
            t = source.take("model.embed_tokens.weight" if tied else name, shape)
        elif t is None:
            t = source.take(f"model.{name}", shape)
        state[name] = t
    model.load_state_dict(state, assign=True, strict=True)
    source.check_all_used(ignore)


def gqa_tensor(source: TensorSource, name: str, shape: tuple[int, ...],
               args: DecoderArgs) -> torch.Tensor | None:
    """q/k projection weights and biases and the q/k norms of :class:`GQAAttention`, permuted
    from HF's half-split rotary layout (:func:`to_interleaved`); None for any other ``name``."""
    prefix, _, leaf = name.rpartition(".self_attn.")
    heads = {"q_proj": args.n_head, "k_proj": args.n_kv_head, "q_norm": 1, "k_norm": 1}
    module = leaf.split(".")[0]
    if not prefix or module not in heads:
        return None
    return to_interleaved(source.take(f"model.{name}", shape), heads[module])


def build_gqa_decoder(cfg: HFConfig, source: TensorSource, args: DecoderArgs,
                      mlp: Callable[[int], nn.Module], *, qkv_bias: bool, qk_norm: bool,
                      shared_name: str = "shared_experts") -> HFDecoder:
    """A decoder of :class:`GQAAttention` layers whose MLP is ``mlp(layer)``, built on the
    meta device and filled from ``source`` (Qwen2-MoE, Qwen3-MoE)."""
    check_activation(cfg)
    with torch.device("meta"):
        layers = [DecoderLayer(args, GQAAttention(args, i, qkv_bias, qk_norm), mlp(i))
                  for i in range(args.n_layer)]
        model = HFDecoder(args, layers, args.head_dim, lambda capacity, dtype, device: GQACache(
            args.n_layer, args.n_kv_head, args.head_dim, capacity, dtype, device))

    def special(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        t = gqa_tensor(source, name, shape, args)
        return t if t is not None else moe_tensor(source, name, shape, shared_name)

    load_by_name(model, source, special, cfg.get_bool("tie_word_embeddings", False))
    return model


def sparse_layers(cfg: HFConfig, n_layer: int) -> set[int]:
    """Layers with a sparse MoE MLP, HF Qwen2/Qwen3-MoE rule: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``."""
    step = cfg.get_int("decoder_sparse_step", default=1)
    dense = set(cfg.int_list("mlp_only_layers"))
    return {i for i in range(n_layer) if i not in dense and step > 0 and (i + 1) % step == 0}
