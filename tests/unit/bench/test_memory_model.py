"""The memory model's arithmetic, checked by hand on small numbers."""

from __future__ import annotations

import math

import pytest

from moeguard_core import memory_model as mm

pytestmark = pytest.mark.unit

SHAPE = mm.Shape(n_layer=2, dim=64, n_head=4, n_kv_head=2, intermediate_size=128, num_experts=8, top_k=2,
                 max_seq_len=1024)


def test_kv_bytes_per_token() -> None:
    assert mm.kv_bytes_per_token(SHAPE, 4) == 2 * 2 * 2 * 16 * 4


def test_top_share_from_skew_ratio_bounds() -> None:
    assert mm.top_share_from_skew_ratio(1.0, 8, 2) == pytest.approx(1 / 8)
    assert mm.top_share_from_skew_ratio(4.0, 8, 2) == pytest.approx(4 / 11)
    assert mm.top_share_from_skew_ratio(1000.0, 8, 2) == pytest.approx(0.5)  # at most 1/k
    assert mm.top_share_from_skew_ratio(0.1, 8, 2) == pytest.approx(1 / 8)


def test_busiest_expert_slots_chunk_and_capacity() -> None:
    balanced = mm.busiest_expert_slots(1000, SHAPE, mm.Routing(top_share=1 / 8))
    assert balanced == 250  # 1000 x 2 / 8
    skewed = mm.busiest_expert_slots(1000, SHAPE, mm.Routing(top_share=0.5))
    assert skewed == 1000
    assert mm.busiest_expert_slots(1000, SHAPE, mm.Routing(top_share=0.5, expert_chunk_tokens=128)) == 128
    cap = math.ceil(1000 * 2 / 8 * 1.25)
    assert mm.busiest_expert_slots(1000, SHAPE, mm.Routing(top_share=0.5, capacity_factor=1.25)) == cap


def test_step_peak_terms_by_hand() -> None:
    step = mm.Step(prefill=((0, 100),), decode_contexts=(10,), new_kv_tokens=116)
    est = mm.step_peak(SHAPE, step, mm.Routing(top_share=0.25), "float32")
    t, d, b = 101, 64, 4
    assert est.kv_bytes == 116 * mm.kv_bytes_per_token(SHAPE, 4)
    mask = int(mm.MASK_FACTOR * mm.mask_bytes_per_pair(4) * 100 * 100)
    repeat = 2 * 4 * 100 * 16 * 4
    assert est.attention_bytes == int(mm.ATTN_STREAM * t * d * b) + mask + repeat
    n_top = math.ceil(0.25 * 2 * t)
    assert est.busiest_expert_slots == n_top
    assert est.moe_bytes == int(mm.MOE_STREAM * t * d * b) + n_top * (d + 2 * 128) * b + t * 8 * 8 + 32 * 2 * t
    assert est.total_bytes == est.kv_bytes + mm.STEP_CONSTANT + max(est.attention_bytes, est.moe_bytes)
    assert sum(v for name, v, _ in est.terms if not name.startswith(("attention", "MoE"))) == \
        est.kv_bytes + mm.STEP_CONSTANT


def test_bfloat16_adds_upcasts_and_halves_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    # The term's arithmetic, whatever value the fit gives it (bench.memory_fit; 0 at the last fit).
    monkeypatch.setattr(mm, "LOWP_EXPERT_WEIGHT", 1.875)
    step = mm.Step(prefill=((0, 512),))
    f32 = mm.step_peak(SHAPE, step, mm.Routing(top_share=0.125), "float32")
    bf16 = mm.step_peak(SHAPE, step, mm.Routing(top_share=0.125), "bfloat16")
    upcast = int(mm.UPCAST_STREAM * 512 * 64 * 4)
    lowp = int(mm.LOWP_EXPERT_WEIGHT * 2 * 8 * 128 * 64 * 2)  # 2 layers x 8 active experts x I x D x 2 B
    assert bf16.moe_bytes - upcast - lowp < f32.moe_bytes
    assert any("upcast" in name for name, _, _ in bf16.terms)
    assert any("active expert" in name for name, v, _ in bf16.terms if v == lowp)


def test_active_experts_from_top_share() -> None:
    assert mm.active_experts(1000, SHAPE, 1 / 8) == 8  # balanced: all
    assert mm.active_experts(1000, SHAPE, 0.5) == 2  # every token on the same k
    assert 2 < mm.active_experts(1000, SHAPE, 0.3) < 8
    assert mm.active_experts(1, SHAPE, 1 / 8) == 2  # at most T x k


def test_skew_raises_the_peak_until_the_chunk_bound() -> None:
    step = mm.Step(prefill=((0, 2000),))
    low = mm.step_peak(SHAPE, step, mm.Routing(top_share=0.125)).moe_bytes
    high = mm.step_peak(SHAPE, step, mm.Routing(top_share=0.5)).moe_bytes
    bounded = mm.step_peak(SHAPE, step, mm.Routing(top_share=0.5, expert_chunk_tokens=500)).moe_bytes
    assert low < high
    assert high - low == (2000 - 500) * (64 + 2 * 128) * 4  # 1000 x 2 x 0.5 vs 0.125 slots
    assert bounded == low  # the chunk bound (500 = the balanced count) erases the skew


def test_worst_case_peak_adds_running_kv() -> None:
    total0, est = mm.worst_case_peak(SHAPE, 256, 4, 0, 0.25)
    total3, _ = mm.worst_case_peak(SHAPE, 256, 4, 3, 0.25)
    assert total0 == est.total_bytes
    assert total3 - total0 == 3 * 1024 * mm.kv_bytes_per_token(SHAPE, 4)
    step = mm.budget_step(SHAPE, 256, 4)
    assert step.prefill == ((1024 - 256, 256),) and step.decode_contexts == (1023,) * 4
