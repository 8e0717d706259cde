"""The memory model per HF family: shapes read from ``config.json``, each family's terms
(shared experts, fine-grained experts, MLA's compressed cache, dense first layers), checked
against numbers computed by hand from the published configurations."""

from __future__ import annotations

import math
from typing import Any

import pytest

from moeguard_core import family_shape as fs
from moeguard_core import memory_model as mm
from moeguard_core.presets import get_preset, parameter_count

pytestmark = pytest.mark.unit

# The published config.json files' fields that the model reads (Hugging Face Hub).
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "max_position_embeddings": 163840, "vocab_size": 129280, "tie_word_embeddings": False}
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "vocab_size": 151936, "tie_word_embeddings": False}
QWEN15_MOE_A27B: dict[str, Any] = {
    "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
    "max_position_embeddings": 8192, "vocab_size": 151936, "tie_word_embeddings": False}
MIXTRAL_8X7B: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 32768, "vocab_size": 32000, "tie_word_embeddings": False}


def test_mla_kv_cache_is_the_latent_and_the_rope_key() -> None:
    shape = fs.from_hf_config(DEEPSEEK_V3)
    assert shape.mla
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B (bf16)
    assert mm.kv_bytes_per_token(shape, 2) == 61 * 576 * 2 == 70_272
    # against 2 x 61 x 128 heads x 192 x 2 B = 5,996,544 B for full per-head K/V: 85x smaller
    assert 2 * 61 * 128 * 192 * 2 // mm.kv_bytes_per_token(shape, 2) == 85
    assert "kv_lora_rank 512" in mm.kv_arithmetic(shape, 2)


def test_gqa_kv_cache_uses_the_config_head_dim() -> None:
    # Qwen3-30B-A3B: head_dim 128 although 2048 / 32 = 64: 2 x 48 x 4 x 128 x 2 B
    assert mm.kv_bytes_per_token(fs.from_hf_config(QWEN3_30B_A3B), 2) == 98_304
    # Mixtral-8x7B: 2 x 32 x 8 x 128 x 2 B = 128 KiB a token
    assert mm.kv_bytes_per_token(fs.from_hf_config(MIXTRAL_8X7B), 2) == 131_072


def test_shapes_read_each_family_fields() -> None:
    ds = fs.from_hf_config(DEEPSEEK_V3)
    assert (ds.intermediate_size, ds.num_experts, ds.top_k) == (2048, 256, 8)  # fine-grained experts
    assert ds.shared_intermediate_size == 1 * 2048  # n_shared_experts x moe_intermediate_size
    assert (ds.dense_layers, ds.moe_layers, ds.dense_intermediate_size) == (3, 58, 18432)
    qw2 = fs.from_hf_config(QWEN15_MOE_A27B)
    assert (qw2.intermediate_size, qw2.shared_intermediate_size, qw2.shared_gate) == (1408, 5632, True)
    assert qw2.qkv_bias and qw2.dense_layers == 0
    mx = fs.from_hf_config(MIXTRAL_8X7B)
    assert (mx.intermediate_size, mx.num_experts, mx.shared_intermediate_size) == (14336, 8, 0)
    # qwen: layer i is sparse when not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert fs.sparse_layer_count({**QWEN15_MOE_A27B, "num_hidden_layers": 4, "mlp_only_layers": [1],
                                  "decoder_sparse_step": 2}, 4) == 1  # layers 1 (listed) and 3: only 3


def test_parameter_counts_of_published_models() -> None:
    # DeepSeek-V3: 671B parameters without the MTP module (technical report, §1), plus 58 x 256 biases
    assert fs.parameter_count(fs.from_hf_config(DEEPSEEK_V3)) == 671_026_419_200
    assert round(fs.parameter_count(fs.from_hf_config(MIXTRAL_8X7B)) / 1e9, 1) == 46.7  # "46.7B total"
    assert round(fs.parameter_count(fs.from_hf_config(QWEN15_MOE_A27B)) / 1e9, 1) == 14.3  # "14.3B"
    assert round(fs.parameter_count(fs.from_hf_config(QWEN3_30B_A3B)) / 1e9, 1) == 30.5  # "30.5B"
    small = get_preset("small")
    assert fs.parameter_count(fs.from_model_args(small)) == parameter_count(small)


def test_shared_expert_term_by_hand() -> None:
    # qwen2_moe-like: D 64, routed I 32, shared I 256, E 8, k 2, one layer
    shape = fs.FamilyShape(n_layer=1, dim=64, n_head=4, n_kv_head=4, head_dim=16, intermediate_size=32,
                           num_experts=8, top_k=2, max_seq_len=1024, vocab_size=100,
                           model_type="qwen2_moe", shared_intermediate_size=256, shared_gate=True)
    est = mm.step_peak(shape, mm.Step(prefill=((0, 100),)), mm.Routing(top_share=0.25))
    t, d, b = 100, 64, 4
    busiest = 50 * (64 + 2 * 32) * 4  # 0.25 x 2 x 100 slots: 25,600 B
    shared = 100 * (64 + 2 * 256) * 4  # all T tokens through the shared expert: 230,400 B
    assert shared == 230_400 > busiest
    router = t * 8 * (4 + 4) + 32 * 2 * t
    assert est.moe_bytes == int(mm.MOE_STREAM * t * d * b) + shared + router
    assert any(name.startswith("MoE: shared expert") and v == shared for name, v, _ in est.terms)


def test_dense_first_layers_have_their_own_phase() -> None:
    # deepseek_v3-like with 1 dense layer of I 4096 over 2 layers; D 64
    shape = fs.FamilyShape(n_layer=2, dim=64, n_head=4, n_kv_head=4, head_dim=16, intermediate_size=32,
                           num_experts=8, top_k=2, max_seq_len=1024, vocab_size=100, model_type="deepseek_v3",
                           moe_layers=1, dense_intermediate_size=4096, kv_lora_rank=32, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=24)
    est = mm.step_peak(shape, mm.Step(prefill=((0, 100),)), mm.Routing(top_share=0.125))
    # 4 x T x D x 4 B + T x (D + 2 x 4096) x 4 B = 102,400 + 3,302,400
    assert est.dense_bytes == 102_400 + 3_302_400
    assert est.phase == "dense MLP"
    assert est.total_bytes == est.kv_bytes + mm.STEP_CONSTANT + est.dense_bytes


def test_mla_attention_terms_by_hand() -> None:
    shape = fs.FamilyShape(n_layer=1, dim=64, n_head=4, n_kv_head=4, head_dim=16, intermediate_size=32,
                           num_experts=8, top_k=2, max_seq_len=1024, vocab_size=100, model_type="deepseek_v3",
                           kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
    step = mm.Step(prefill=((0, 100),), new_kv_tokens=116)
    est = mm.step_peak(shape, step, mm.Routing(top_share=0.125))
    assert est.kv_bytes == 116 * 1 * (32 + 8) * 4  # the latent and the rope key, one layer
    queries = 2 * 100 * 4 * 24 * 4  # [T, H, nope + rope], twice
    keys_values = 100 * 4 * (16 + 24 + 24) * 4  # kv_b_proj's [s1, H, nope + v] and keys [s1, H, nope + rope]
    assert mm.mla_attention_bytes(shape, 100, 100, 4) == queries + keys_values == 179_200
    # v 24 == q/k 24: the fused SDPA kernel, no math-path scores
    assert mm.math_sdpa_bytes(shape, 100 * 100, 4) == 0
    mask = int(mm.MASK_FACTOR * 6 * 100 * 100)
    assert est.attention_bytes == int(mm.ATTN_STREAM * 100 * 64 * 4) + mask + queries + keys_values
    # v 16 != 24: SDPA falls back to its math path, scores H x pairs x b, MLA_MATH_SCORES times
    narrow_v = fs.replace(shape, v_head_dim=16)
    assert mm.math_sdpa_bytes(narrow_v, 10_000, 4) == math.floor(mm.MLA_MATH_SCORES * 4 * 10_000 * 4)


def test_unknown_family_and_missing_key_are_named() -> None:
    with pytest.raises(fs.ConfigError, match="model_type 'llama' is not supported"):
        fs.from_hf_config({"model_type": "llama"})
    broken = {k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}
    with pytest.raises(fs.ConfigError, match="missing key kv_lora_rank"):
        fs.from_hf_config(broken)
    with pytest.raises(fs.ConfigError, match="hidden_size must be a non-negative integer"):
        fs.from_hf_config({**MIXTRAL_8X7B, "hidden_size": "4096"})


def test_parameter_count_equals_transformers_on_tiny_configs() -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    common = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    configs = [
        transformers.MixtralConfig(**common, intermediate_size=96, num_local_experts=4),
        transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80, num_experts=8, mlp_only_layers=[1]),
        transformers.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=96, moe_intermediate_size=48,
                                    num_experts=8, tie_word_embeddings=True),
        transformers.OlmoeConfig(**common, intermediate_size=48, num_experts=8),
        transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=96,
                                      moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
                                      n_shared_experts=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                                      qk_rope_head_dim=8, v_head_dim=24, first_k_dense_replace=1),
    ]
    for cfg in configs:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        shape = fs.from_hf_config(cfg.to_dict())
        bias = shape.moe_layers * shape.num_experts if shape.model_type == "deepseek_v3" else 0  # a buffer in HF
        assert fs.parameter_count(shape) == model.num_parameters() + bias, cfg.model_type


def test_queries_wider_than_the_residual_stream() -> None:
    # Qwen3-30B-A3B: H 32 x head_dim 128 = 4096 over D 2048: q and the attention output, 2 x T x 2048 x b more
    shape = fs.from_hf_config(QWEN3_30B_A3B)
    assert mm.wide_heads_bytes(shape, 1000, 2) == 2 * 1000 * 2048 * 2 == 8_192_000
    assert mm.wide_heads_bytes(fs.from_hf_config(MIXTRAL_8X7B), 1000, 2) == 0  # 32 x 128 = D
    assert mm.wide_heads_bytes(fs.from_hf_config(DEEPSEEK_V3), 1000, 2) == 0  # MLA: counted elsewhere
    est = mm.step_peak(shape, mm.Step(prefill=((0, 1000),)), mm.Routing(top_share=1 / 128), "bfloat16")
    assert ("attention: queries and output wider than D", 8_192_000) in [(n, v) for n, v, _ in est.terms]
