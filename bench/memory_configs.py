"""The configurations the memory model is validated on (``bench.memory_validate``).

Each is one engine step measured in a fresh process by :mod:`bench.memory_probe`.
``role`` is ``fit`` for the ten configurations whose measurements fixed the model's empirical
coefficients (``bench.memory_fit``: the eight float32, unskewed, default-chunk ``small`` steps, one
unskewed bfloat16 step for the 2-byte term and one ``tiny`` step for the constant; see
``docs/memory-model.md``) and ``check`` for all the others, which played no part in choosing them. ``FAMILY_CONFIGS``: each HF
family (:data:`HF_FAMILIES`) at serving chunk sizes, one skewed case each (issue 10).
``SERVING_CHUNK_CONFIGS``: chunked-prefill steps as the worker serves them (issue 13), a chunk of
256 or 512 tokens at several offsets of a 2048-token prompt, skewed and not, with and without the
heap a process keeps after one long request (``retained``); see :mod:`bench.memory_probe`.
"""

from __future__ import annotations

from typing import Any

MIXTRAL_MINI = {"n_layer": 4, "dim": 512, "n_head": 4, "n_kv_head": 1, "intermediate_size": 1792,
                "num_experts": 8, "top_k": 2, "max_seq_len": 4096}
WIDE_E16K4 = {"n_layer": 4, "dim": 256, "n_head": 4, "n_kv_head": 4, "intermediate_size": 1024,
              "num_experts": 16, "top_k": 4, "max_seq_len": 4096}


def _c(name: str, role: str = "check", **cfg: Any) -> dict[str, Any]:
    return {"name": name, "role": role, **cfg}


# The HF families (issue 10), loaded from a random ``save_pretrained`` folder by the worker's loader:
# hidden 512, a real vocabulary, the family's own features (fine-grained and shared experts, q/k
# norms, MLA with a dense first layer). ``config.json`` fields, ``transformers``' names.
_HF_COMMON = {"vocab_size": 32000, "hidden_size": 512, "num_attention_heads": 8,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}
HF_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"model_type": "mixtral", **_HF_COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2,
                "intermediate_size": 1792, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", **_HF_COMMON, "num_hidden_layers": 2, "num_key_value_heads": 8,
                  "intermediate_size": 1408, "moe_intermediate_size": 352,
                  "shared_expert_intermediate_size": 1408, "num_experts": 16, "num_experts_per_tok": 4},
    "qwen3_moe": {"model_type": "qwen3_moe", **_HF_COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2,
                  "head_dim": 128, "intermediate_size": 1408, "moe_intermediate_size": 384,
                  "num_experts": 16, "num_experts_per_tok": 4},
    "deepseek_v3": {"model_type": "deepseek_v3", **_HF_COMMON, "num_hidden_layers": 3,
                    "num_key_value_heads": 8, "intermediate_size": 1408, "moe_intermediate_size": 256,
                    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 128,
                    "q_lora_rank": 192, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64},
    "olmoe": {"model_type": "olmoe", **_HF_COMMON, "num_hidden_layers": 2, "num_key_value_heads": 8,
              "intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 4},
}


def _family_configs(family: str) -> list[dict[str, Any]]:
    """Serving chunk sizes (512, 2048, four 512-token prompts, decode beside a prefill chunk) and one
    skewed routing case, each a ``check`` (none was used to fit the coefficients)."""
    hf = HF_FAMILIES[family]
    return [
        _c(f"{family} 1x512", hf_config=hf, prefill=[512]),
        _c(f"{family} 1x2048", hf_config=hf, prefill=[2048]),
        _c(f"{family} 4x512", hf_config=hf, prefill=[512] * 4),
        _c(f"{family} 1x2048 skewed", hf_config=hf, prefill=[2048], skewed=True),
        _c(f"{family} decode 32 @256 + 1x512", hf_config=hf, decode=32, decode_context=256, prefill=[512]),
    ]


CONFIGS: list[dict[str, Any]] = [
    # small preset (6 x 512, I 1280, E 8, k 2), float32
    _c("small 1x1024", "fit", preset="small", prefill=[1024]),
    _c("small 1x2048", "fit", preset="small", prefill=[2048]),
    _c("small 1x4000", "fit", preset="small", prefill=[4000]),
    _c("small 4x512", "fit", preset="small", prefill=[512] * 4),
    _c("small 1x256", "fit", preset="small", prefill=[256]),
    _c("small 16x128", "fit", preset="small", prefill=[128] * 16),
    _c("small 4x1024", "fit", preset="small", prefill=[1024] * 4),
    _c("small 2x3000", "fit", preset="small", prefill=[3000] * 2),
    _c("small 1x2048 skewed", preset="small", prefill=[2048], skewed=True),
    _c("small 4x1024 skewed", preset="small", prefill=[1024] * 4, skewed=True),
    _c("small 1x4000 skewed", preset="small", prefill=[4000], skewed=True),
    _c("small decode 32 @256", preset="small", decode=32, decode_context=256),
    _c("small decode 64 @128 + 1x512", preset="small", decode=64, decode_context=128, prefill=[512]),
    _c("small 1x2048 chunk 256", preset="small", prefill=[2048], chunk=256),
    _c("small 1x2048 skewed chunk 256", preset="small", prefill=[2048], skewed=True, chunk=256),
    _c("small 4x1024 skewed cf 1.25", preset="small", prefill=[1024] * 4, skewed=True, capacity_factor=1.25),
    _c("small 8x256 max_new 1500 (KV)", preset="small", prefill=[256] * 8, max_new=1500),
    # bfloat16
    _c("small bf16 1x2048", "fit", preset="small", dtype="bfloat16", prefill=[2048]),
    _c("small bf16 1x2048 skewed", preset="small", dtype="bfloat16", prefill=[2048], skewed=True),
    _c("small bf16 4x512", preset="small", dtype="bfloat16", prefill=[512] * 4),
    _c("small bf16 1x1024", preset="small", dtype="bfloat16", prefill=[1024]),
    _c("small bf16 2x1024 skewed", preset="small", dtype="bfloat16", prefill=[1024] * 2, skewed=True),
    # other shapes
    _c("mixtral-mini 1x2048", shape=MIXTRAL_MINI, prefill=[2048]),
    _c("mixtral-mini 1x2048 skewed", shape=MIXTRAL_MINI, prefill=[2048], skewed=True),
    _c("mixtral-mini 2x1024", shape=MIXTRAL_MINI, prefill=[1024] * 2),
    _c("E16 k4 D256 1x2048", shape=WIDE_E16K4, prefill=[2048]),
    _c("E16 k4 D256 1x2048 skewed", shape=WIDE_E16K4, prefill=[2048], skewed=True),
    _c("E16 k4 D256 4x1024 skewed cf 1.0", shape=WIDE_E16K4, prefill=[1024] * 4, skewed=True,
       capacity_factor=1.0),
    _c("tiny 1x1000", "fit", preset="tiny", prefill=[1000], max_new=8),
    _c("tiny 1x512", preset="tiny", prefill=[512], max_new=8),
    _c("tiny 4x1000", preset="tiny", prefill=[1000] * 4, max_new=8),
    _c("tiny 8x500 skewed", preset="tiny", prefill=[500] * 8, skewed=True, max_new=8),
]

FAMILY_CONFIGS: list[dict[str, Any]] = [c for f in HF_FAMILIES for c in _family_configs(f)]
CONFIGS += FAMILY_CONFIGS

SERVING_PROMPT = 2048
"""Prompt length of the chunked rows: the chunks are slices of it."""
RETAINED = 2048
"""Prompt tokens of the long request served (and released, heap kept) before a ``retained`` row."""


def _serving(n: int, starts: tuple[int, ...], skewed: bool, retained: bool) -> dict[str, Any]:
    """``small`` (float32, the worker's default dtype) running one ``n``-token chunk of a
    ``SERVING_PROMPT``-token prompt at each of ``starts`` in one step; a ``check`` row."""
    where = "+".join(f"@{s}" for s in starts)
    name = (f"small chunk {'x'.join([str(n)] if len(starts) == 1 else [str(len(starts)), str(n)])} {where}"
            f"/{SERVING_PROMPT}{' skewed' if skewed else ''}{f' retained {RETAINED}' if retained else ''}")
    return _c(name, preset="small", chunks=[[SERVING_PROMPT, s, n] for s in starts], skewed=skewed,
              **({"retained": RETAINED} if retained else {}))


SERVING_CHUNK_CONFIGS: list[dict[str, Any]] = [
    *[_serving(256, (s,), skewed, retained) for retained in (False, True) for skewed, s in
      [(True, 0), (True, 1024), (True, 1792), (False, 1792)]],
    *[_serving(512, (s,), skewed, retained) for retained in (False, True) for skewed, s in
      [(True, 0), (True, 1536), (False, 1536)]],
    _serving(256, (0, 512, 1024, 1792), True, True),
    _serving(512, (0, 1536), False, False),
]
CONFIGS += SERVING_CHUNK_CONFIGS
