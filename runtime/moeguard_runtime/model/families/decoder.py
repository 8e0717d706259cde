"""The decoder of the HF families (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3): shape,
dense and sparse MLPs, the pre-norm layer and the model the engine drives.

Module names follow HF's (``embed_tokens``, ``layers.N.self_attn``, ``layers.N.mlp.gate`` …)
so a checkpoint maps onto them by dropping the ``model.`` prefix
(:mod:`moeguard_runtime.model.families.weights`). The attention is the family's
(:mod:`moeguard_runtime.model.families.gqa`, :mod:`moeguard_runtime.model.families.deepseek_v3`).

Shapes: ``T`` packed tokens, ``D`` hidden size, ``H``/``KvH`` query/KV heads,
``hd`` head dim, ``E`` routed experts, ``k`` experts per token, ``I`` expert width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeguard_core.family_shape import qwen_sparse_layers
from moeguard_runtime.model.families.rope import RopeScaling, rope_scaling
from moeguard_runtime.model.families.routers import Router, SoftmaxTopK
from moeguard_runtime.model.hf_config import BuildOptions, HFConfig
from moeguard_runtime.model.model import KVCache, RMSNorm, Segment, embedding
from moeguard_runtime.model.moe import (
    ExpertDispatch,
    GateUpViews,
    MatmulChoice,
    MoeDispatch,
    PackedExperts,
    RoutingStats,
    device_expert_chunks,
    dispatch_experts,
    ep_routing,
    expert_capacity,
    host_expert_chunks,
    routing_stats,
    swiglu_mlp,
)
from moeguard_runtime.model.moe_device import PendingRouting, device_dispatch, grouped_mm_available
from moeguard_runtime.model.timing import mark


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
    rope: RopeScaling
    norm_eps: float
    num_experts: int
    top_k: int


def decoder_args(cfg: HFConfig, num_experts: int, head_dim: int | None = None) -> DecoderArgs:
    """The common fields of ``config.json`` (HF names), with the family's expert count.

    Raises:
        CheckpointError: a missing key, or a shape the attention or the router cannot take.
    """
    dim, n_head = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    if n_head < 1:
        raise cfg.error("num_attention_heads", f"must be >= 1, given {n_head}")
    args = DecoderArgs(
        n_layer=cfg.get_int("num_hidden_layers"), dim=dim, n_head=n_head,
        n_kv_head=cfg.get_int("num_key_value_heads", default=n_head),
        head_dim=head_dim or cfg.get_int("head_dim", default=dim // n_head),
        vocab_size=cfg.get_int("vocab_size"), max_seq_len=cfg.max_seq_len(),
        rope=rope_scaling(cfg), norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        num_experts=num_experts, top_k=cfg.get_int("num_experts_per_tok"))
    if args.n_kv_head < 1 or n_head % args.n_kv_head:
        raise cfg.error("num_key_value_heads", f"{args.n_kv_head} must divide "
                                               f"num_attention_heads ({n_head})")
    if args.head_dim < 2 or args.head_dim % 2:
        raise cfg.error("head_dim", f"{args.head_dim} must be even (rotary pairs)")
    if not 1 <= args.top_k <= num_experts:
        raise cfg.error("num_experts_per_tok", f"{args.top_k} must be in 1..{num_experts} experts")
    return args


def check_activation(cfg: HFConfig) -> None:
    act = cfg.data.get("hidden_act", "silu")
    if act != "silu":
        raise cfg.error("hidden_act", f"{act!r} is not supported (only silu, SwiGLU experts)")


def causal_mask(n: int, s0: int, device: torch.device) -> torch.Tensor | None:
    """``[n, s0 + n]`` bool: query ``i`` (position ``s0 + i``) sees keys ``0..s0 + i``; None for one query."""
    if n == 1:
        return None
    return torch.ones(n, s0 + n, dtype=torch.bool, device=device).tril(diagonal=s0)


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate x) * up x)`` (HF ``Qwen2MoeMLP``, ``DeepseekV3MLP``)."""

    def __init__(self, dim: int, intermediate_size: int,
                 matmul_backend: MatmulChoice = "onednn") -> None:
        super().__init__()
        self.matmul_backend: MatmulChoice = matmul_backend
        self.gate_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, D] → [T, D]."""
        return swiglu_mlp(x, self.gate_proj.weight, self.down_proj.weight, self.up_proj.weight,
                          self.matmul_backend)


class SparseMoE(GateUpViews, nn.Module):
    """Routed SwiGLU experts (grouped dispatch, :mod:`moeguard_runtime.model.moe`), plus optional
    shared experts: ungated (DeepSeek-V3 ``shared_experts``) or scaled by
    ``sigmoid(shared_expert_gate x)`` (Qwen2-MoE ``shared_expert``).

    The expert chunking and the capacity guardrail are those of
    :class:`moeguard_runtime.model.moe.MOEFeedForward` (``expert_chunk_tokens``,
    ``capacity_factor``); the routing statistics count routed token-slots only. The experts'
    gate and up projections are fused (``w13`` ``[E, 2I, D]``, :mod:`moeguard_runtime.model.moe`).
    """

    def __init__(self, dim: int, intermediate_size: int, num_experts: int, router: Router,
                 options: BuildOptions, *, shared_size: int = 0, shared_gate: bool = False,
                 score_bias: bool = False, router_fp32: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)  # weight [E, D]
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, dim))  # [E, 2I, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))  # [E, D, I]
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if score_bias else None
        self.shared = DenseMLP(dim, shared_size, options.matmul_backend) if shared_size else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.router = router
        self.num_experts, self.top_k = num_experts, router.top_k
        self.expert_chunk_tokens = options.expert_chunk_tokens
        self.capacity_factor = options.capacity_factor
        self.matmul_backend: MatmulChoice = options.matmul_backend
        self.dispatch: MoeDispatch = options.dispatch
        self.router_fp32 = router_fp32
        """Keep ``gate.weight`` and the bias float32 whatever the model's dtype (HF DeepSeek-V3's
        ``_keep_in_fp32_modules_strict``): a bfloat16 bias would reorder close experts."""
        self.expert_parallel: ExpertDispatch | None = None
        """Set on an expert-parallel leader: the routed experts run across the group."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats | PendingRouting]:
        """``x`` [T, D] → ``([T, D], routing)``, the dispatch chosen as
        :class:`moeguard_runtime.model.moe.MOEFeedForward` chooses it (host, or the device's
        ``F.grouped_mm`` on CUDA bfloat16, whose routing is read back with the step's tokens)."""
        t0 = mark(x.device)
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E] float32
        weights, experts = self.router(logits, self.e_score_correction_bias)  # [T, k] each
        t1 = mark(x.device)
        capacity = None
        if self.capacity_factor > 0:
            capacity = expert_capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        routing: RoutingStats | PendingRouting
        if self.expert_parallel is not None:
            out, routing = ep_routing(self.expert_parallel, x, weights, experts, self.num_experts, t0, t1)
        elif self.dispatch == "device" or (self.dispatch == "auto" and grouped_mm_available(x)):
            out, pending, dropped = device_dispatch(x, weights, experts, self.w13, self.w2,
                                                    self.expert_chunk_tokens, capacity)
            routing = PendingRouting(pending, dropped, (t0, t1, mark(x.device)),
                                     device_expert_chunks(experts.numel(), self.expert_chunk_tokens))
        else:
            out, counts, overflow = dispatch_experts(x, weights, experts, self.w13, self.w2,
                                                     self.expert_chunk_tokens, capacity,
                                                     self.matmul_backend)
            routing = routing_stats(counts, overflow, (t0, t1, mark(x.device)), host_expert_chunks(
                x, counts, self.expert_chunk_tokens, capacity, self.matmul_backend,
                isinstance(self.w13, PackedExperts)))
        if self.shared is not None:
            shared = self.shared(x)  # [T, D]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared  # [T, 1] * [T, D]
            out = out + shared
        return out, routing


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, args: DecoderArgs, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, angles: torch.Tensor,
                segments: Sequence[Segment]
                ) -> tuple[torch.Tensor, RoutingStats | PendingRouting | None]:
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
        self.embed_tokens = embedding(args.vocab_size, args.dim)
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
        self.angles = self._args.rope.angles(self._args.max_seq_len, self.rope_dim).to(device)

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
                segments: Sequence[Segment]
                ) -> tuple[torch.Tensor, list[RoutingStats | PendingRouting]]:
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


def sparse_layers(cfg: HFConfig, n_layer: int) -> set[int]:
    """Layers with a sparse MoE MLP, HF Qwen2/Qwen3-MoE rule: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``."""
    return qwen_sparse_layers(n_layer, cfg.get_int("decoder_sparse_step", default=1),
                              cfg.int_list("mlp_only_layers"))


def qwen_mlps(cfg: HFConfig, args: DecoderArgs, options: BuildOptions,
              shared_expert: bool = False) -> Callable[[int], nn.Module]:
    """The MLP of each layer of a Qwen2-MoE/Qwen3-MoE ``cfg`` (HF ``Qwen2MoeDecoderLayer``,
    ``Qwen3MoeDecoderLayer``): a :class:`SparseMoE` of ``moe_intermediate_size`` experts with
    softmax top-k routing (renormalized when ``norm_topk_prob``) on the layers of
    :func:`sparse_layers`, a :class:`DenseMLP` of ``intermediate_size`` elsewhere; with
    ``shared_expert`` (Qwen2-MoE) the sparse layers add a shared expert of
    ``shared_expert_intermediate_size`` scaled by its sigmoid gate.

    Raises:
        CheckpointError: a missing or bad ``config.json`` key.
    """
    sparse = sparse_layers(cfg, args.n_layer)
    moe_size, dense_size = cfg.get_int("moe_intermediate_size"), cfg.get_int("intermediate_size")
    shared_size = cfg.get_int("shared_expert_intermediate_size") if shared_expert else 0
    router = SoftmaxTopK(args.top_k, cfg.get_bool("norm_topk_prob", False))

    def mlp(layer: int) -> nn.Module:
        if layer in sparse:
            return SparseMoE(args.dim, moe_size, args.num_experts, router, options,
                             shared_size=shared_size, shared_gate=shared_expert)
        return DenseMLP(args.dim, dense_size)

    return mlp
