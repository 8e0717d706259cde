"""``model_type: qwen2_moe`` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), after HF ``modeling_qwen2_moe.py``.

Differs from Mixtral by: q/k/v biases (``qkv_bias``); softmax top-k routing
renormalized only when ``norm_topk_prob``; fine-grained experts of width
``moe_intermediate_size``; a shared expert of width
``shared_expert_intermediate_size`` added to every token's output, scaled by
``sigmoid(shared_expert_gate x)``; dense layers (``mlp_only_layers``,
``decoder_sparse_step``) of width ``intermediate_size``.
"""

from __future__ import annotations

from moeguard_runtime.model.families.decoder import HFDecoder, decoder_args, qwen_mlps
from moeguard_runtime.model.families.gqa import AttentionSpec, build_gqa_decoder
from moeguard_runtime.model.hf_config import BuildOptions, HFConfig, TensorSource


def build(cfg: HFConfig, source: TensorSource, options: BuildOptions) -> HFDecoder:
    """The Qwen2-MoE decoder of ``cfg``, filled from ``source``.

    Raises:
        CheckpointError: a missing or bad ``config.json`` key, or any tensor problem.
    """
    args = decoder_args(cfg, cfg.get_int("num_experts", "num_local_experts"))
    mlp = qwen_mlps(cfg, args, options, shared_expert=True)
    return build_gqa_decoder(cfg, source, args, mlp,
                             AttentionSpec(qkv_bias=cfg.get_bool("qkv_bias", True)),
                             shared_name="shared_expert")
