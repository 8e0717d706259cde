"""The memory validation's chunked-prefill rows (issue 13): the step a ``chunks`` row runs, its
prediction on the ``small`` preset worked out by hand, and the serving section's figures."""

from __future__ import annotations

from typing import Any

import pytest
from bench.memory_configs import SERVING_CHUNK_CONFIGS
from bench.memory_validate import error, predict, serving_section, step_of, worst_under

from moeguard_core import memory_model as mm

pytestmark = pytest.mark.unit

# small: 6 layers, D 512, 8 heads (head_dim 64), 4 KV heads, I 1280, E 8, k 2; float32.
KV_PER_TOKEN = 2 * 6 * 4 * 64 * 4  # 12,288 B


def row(chunks: list[list[int]], share: float = 0.5, **extra: Any) -> dict[str, Any]:
    t = sum(n for _, _, n in chunks)
    slots = 2 * t
    return {"name": "r", "preset": "small", "chunks": chunks, "top_expert_slots": [int(share * slots)] * 6,
            "routed_slots": [slots] * 6, **extra}


def test_step_of_counts_kv_only_for_chunks_at_zero() -> None:
    step = step_of(row([[2048, 0, 256], [2048, 1024, 256], [2048, 1792, 256]]))
    assert step.prefill == ((0, 256), (1024, 256), (1792, 256))
    assert step.new_kv_tokens == 2048 + 16  # the chunk at 0 only: prompt + max_new
    assert step.tokens == 768
    assert step_of(row([[2048, 1792, 256]], max_new=100)).new_kv_tokens == 0
    whole = step_of({"prefill": [512], "chunks": [[1000, 0, 100]], "max_new": 8})
    assert whole.prefill == ((0, 512), (0, 100)) and whole.new_kv_tokens == 520 + 1008


def test_last_chunk_of_a_long_prompt_by_hand() -> None:
    est, share = predict(row([[2048, 1792, 256]]))
    assert share == 0.5
    assert est.kv_bytes == 0
    stream = 12 * 256 * 512 * 4  # ATTN_STREAM x T x D x b = 6,291,456
    mask = 6 * 256 * 2048  # (2 + 4) B x 256 queries x 2048 keys = 3,145,728
    repeat = 2 * 8 * 2048 * 64 * 4  # K/V repeated over 8 heads, 2048 keys = 8,388,608
    assert est.attention_bytes == stream + mask + repeat == 17_825_792
    assert est.moe_bytes == 4 * 256 * 512 * 4 + 256 * (512 + 2 * 1280) * 4 + 256 * 8 * 8 + 32 * 2 * 256
    assert est.phase == "attention"
    assert est.total_bytes == 17_825_792  # 17.0 MiB


def test_first_chunk_allocates_the_whole_prompts_kv() -> None:
    est, _ = predict(row([[2048, 0, 256]]))
    assert est.kv_bytes == 2064 * KV_PER_TOKEN == 25_362_432
    attention = 12 * 256 * 512 * 4 + 6 * 256 * 256 + 2 * 8 * 256 * 64 * 4
    assert est.attention_bytes == attention == 7_733_248
    assert est.total_bytes == 33_095_680


def test_concurrent_chunks_take_the_largest_segment_and_all_tokens() -> None:
    est, _ = predict(row([[2048, 0, 256], [2048, 512, 256], [2048, 1024, 256], [2048, 1792, 256]]))
    stream = 12 * 1024 * 512 * 4  # all 1,024 tokens
    assert est.attention_bytes == stream + 6 * 256 * 2048 + 2 * 8 * 2048 * 64 * 4 == 36_700_160
    assert est.busiest_expert_slots == 1024  # share 0.5 x k 2 x T 1024, under the 2048 chunk bound
    assert est.total_bytes == 25_362_432 + 36_700_160 == 62_062_592


def test_error_sign_and_worst_under_prediction() -> None:
    assert error(80, 100) == pytest.approx(-0.2)
    assert error(120, 100) == pytest.approx(0.2)
    assert worst_under({"a": 0.1, "b": -0.25, "c": -0.05}) == "**-25.0%** (b)"
    assert worst_under({"a": 0.1, "b": 0.03}).startswith("none: every row is over-predicted (the closest, b")


def test_serving_section_figures() -> None:
    mib = mm.MiB
    r = row([[2048, 1792, 256]], name="last chunk", measured=20 * mib, measured_runs=[19 * mib, 20 * mib, 21 * mib],
            measured_from_idle=25 * mib, measured_from_idle_runs=[24 * mib, 25 * mib, 26 * mib],
            rss_before=900 * mib, rss_idle=896 * mib, probe_jobs=1)
    text = "\n".join(serving_section([r]))
    # predicted 17.0 MiB: -15.0 % against 20, -32.0 % against 25, ratio 20 / 17 = 1.18, retained 4 MiB
    assert "| last chunk | 1792+256 | 0.500 | attention | 17.0 | 20.0 | -15.0% | 1.18 | 25.0 | -32.0% | 4.0 | 19.0, 20.0, 21.0 | 24.0, 25.0, 26.0 | 4.0 |" in text
    assert "over current use: **-15.0%** (last chunk)" in text
    assert "from idle (retained heap included): **-32.0%** (last chunk)" in text
    assert "measured / predicted over current use: **1.18** (last chunk); in a single run: 1.24 (last chunk)" in text
    assert "(1 probe at a time)" in text
    assert serving_section([]) == []


def test_serving_configs_are_check_rows_on_small_float32() -> None:
    assert 12 <= len(SERVING_CHUNK_CONFIGS) <= 16
    for c in SERVING_CHUNK_CONFIGS:
        assert c["role"] == "check" and c["preset"] == "small" and "dtype" not in c
        assert all(start + n <= length == 2048 and n in (256, 512) for length, start, n in c["chunks"])
    assert {c.get("retained", 0) for c in SERVING_CHUNK_CONFIGS} == {0, 2048}
    assert sum(len(c["chunks"]) > 1 for c in SERVING_CHUNK_CONFIGS) == 2
