"""``model_type: olmoe`` (OLMoE-1B-7B), after HF ``modeling_olmoe.py``.

Differs from Qwen3-MoE by: the RMSNorm of q and k spans the whole projection
(``hidden_size`` and ``num_key_value_heads * head_dim`` wide), not each head;
an optional ``clip_qkv`` clamp of q, k and v; ``attention_bias`` on all four
projections; every layer sparse; ``norm_topk_prob`` false by default.
"""

from __future__ import annotations

from moeguard_runtime.model.families.decoder import HFDecoder, SparseMoE, decoder_args
from moeguard_runtime.model.families.gqa import AttentionSpec, build_gqa_decoder
from moeguard_runtime.model.families.routers import SoftmaxTopK
from moeguard_runtime.model.hf_config import BuildOptions, HFConfig, TensorSource


def build(cfg: HFConfig, source: TensorSource, options: BuildOptions) -> HFDecoder:
    """The OLMoE decoder of ``cfg``, filled from ``source``.

    Raises:
        CheckpointError: a missing or bad ``config.json`` key, or any tensor problem.
    """
    args = decoder_args(cfg, cfg.get_int("num_experts", "num_local_experts"))
    if args.head_dim * args.n_head != args.dim:
        raise cfg.error("head_dim", f"{args.head_dim} must be hidden_size / num_attention_heads "
                                    f"for olmoe (its q_norm spans hidden_size)")
    bias = cfg.get_bool("attention_bias", False)
    clip = cfg.data.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
        raise cfg.error("clip_qkv", f"must be a number or null, given {clip!r}")
    spec = AttentionSpec(qkv_bias=bias, o_bias=bias, qk_norm="full",
                         clip_qkv=None if clip is None else float(clip))
    router = SoftmaxTopK(args.top_k, cfg.get_bool("norm_topk_prob", False))
    return build_gqa_decoder(
        cfg, source, args,
        lambda layer: SparseMoE(args.dim, cfg.get_int("intermediate_size"), args.num_experts,
                                router, options),
        spec)
