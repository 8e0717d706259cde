"""``model_type: qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B), after HF ``modeling_qwen3_moe.py``.

Differs from Mixtral by: an explicit ``head_dim``; a per-head RMSNorm of q and k
(``q_norm``, ``k_norm``) before the rotation; softmax top-k routing renormalized
only when ``norm_topk_prob``; fine-grained experts of width
``moe_intermediate_size``; dense SwiGLU layers (width ``intermediate_size``) where
``mlp_only_layers``/``decoder_sparse_step`` say so. No shared expert.
"""

from __future__ import annotations

from moeguard_runtime.model.families.decoder import HFDecoder, decoder_args, qwen_mlps
from moeguard_runtime.model.families.gqa import AttentionSpec, build_gqa_decoder
from moeguard_runtime.model.hf_config import BuildOptions, HFConfig, TensorSource


def build(cfg: HFConfig, source: TensorSource, options: BuildOptions) -> HFDecoder:
    """The Qwen3-MoE decoder of ``cfg``, filled from ``source``.

    Raises:
        CheckpointError: a missing or bad ``config.json`` key, or any tensor problem.
    """
    args = decoder_args(cfg, cfg.get_int("num_experts", "num_local_experts"))
    if cfg.get_bool("attention_bias", False):
        raise cfg.error("attention_bias", "true is not supported for qwen3_moe")
    mlp = qwen_mlps(cfg, args, options)
    return build_gqa_decoder(cfg, source, args, mlp, AttentionSpec(qk_norm="head"))
