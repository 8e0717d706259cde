"""Expert parallelism gives the single-process model's logits (issue 15).

Real process groups of 2 and 4 local ranks (gloo over the loopback, :func:`bench.expert_parallel_bench.run_group`:
the ranks shard the experts, the leader dispatches each MoE layer's routed tokens to their owners, as the
worker does) against one process, on the same weights and prompts: one packed prefill of three prompts,
then 4 greedy decode steps of all three, every step's last-token logits compared in fp32
(``max|ep - single| / max|single|`` at most 1e-5). Models: the default ``tiny`` preset, and a random HF
checkpoint of every served family (Qwen2-MoE's shared expert, DeepSeek-V3's grouped sigmoid router and
dense first layer, OLMoE, Qwen3-MoE, Mixtral).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bench.expert_parallel_bench import ModelSpec, run_group
from bench.family_checkpoints import checkpoint_folder

MAX_REL_ERR = 1e-5
VOCAB = 512
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(model_type="qwen2_moe", **COMMON, intermediate_size=96, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False),
    "qwen3_moe": dict(model_type="qwen3_moe", **COMMON, head_dim=32, intermediate_size=96,
                      moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", **COMMON, intermediate_size=96, num_local_experts=8,
                    num_experts_per_tok=2),
    "olmoe": dict(model_type="olmoe", **COMMON, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                  eos_token_id=2),
    "deepseek_v3": dict(model_type="deepseek_v3", **{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3},
                        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, kv_lora_rank=32,
                        q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, num_mtp_layers=0),
}
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 31)), [7, 9] * 6]
JOB = {"prompts": PROMPTS, "decode_steps": 4}


def _max_rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert len(got) == len(ref)
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref, strict=True))


def _check(spec: ModelSpec, ranks_list: tuple[int, ...]) -> dict[int, float]:
    ref, _ = run_group(1, spec, "logits", JOB)
    errs = {}
    for ranks in ranks_list:
        got, followers = run_group(ranks, spec, "logits", JOB)
        errs[ranks] = _max_rel_err(got, ref)
        assert sorted(followers) == list(range(1, ranks))
        assert sum(f["slots"] for f in followers.values()) > 0, "no token reached a follower"
    print(f"max relative error by rank count: {errs}")
    assert all(e <= MAX_REL_ERR for e in errs.values()), errs
    return errs


def test_default_preset_same_logits_with_1_2_and_4_ranks() -> None:
    _check(ModelSpec("tiny"), (2, 4))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_same_logits_with_1_2_and_4_ranks(family: str) -> None:
    folder = checkpoint_folder(FAMILIES[family], seed=0)
    _check(ModelSpec(checkpoint=str(folder)), (2, 4) if family in ("qwen2_moe", "deepseek_v3") else (2,))
