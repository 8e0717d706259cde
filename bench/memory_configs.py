"""The configurations the memory model is validated on (``bench.memory_validate``).

Each is one engine step measured in a fresh process by :mod:`bench.memory_probe`.
``role`` is ``fit`` for the ten configurations whose measurements fixed the model's empirical
coefficients (``bench.memory_fit``: the eight float32, unskewed, default-chunk ``small`` steps, one
unskewed bfloat16 step for the 2-byte term and one ``tiny`` step for the constant; see
``docs/memory-model.md``) and ``check`` for all the others, which played no part in choosing them.
"""

from __future__ import annotations

from typing import Any

MIXTRAL_MINI = {"n_layer": 4, "dim": 512, "n_head": 4, "n_kv_head": 1, "intermediate_size": 1792,
                "num_experts": 8, "top_k": 2, "max_seq_len": 4096}
WIDE_E16K4 = {"n_layer": 4, "dim": 256, "n_head": 4, "n_kv_head": 4, "intermediate_size": 1024,
              "num_experts": 16, "top_k": 4, "max_seq_len": 4096}


def _c(name: str, role: str = "check", **cfg: Any) -> dict[str, Any]:
    return {"name": name, "role": role, **cfg}


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
