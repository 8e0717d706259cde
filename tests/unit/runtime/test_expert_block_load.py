"""A rank loads only its experts from an HF checkpoint (``BuildOptions.expert_block``, issue 15): the same
weights as the whole load's block, the other experts' tensors checked but never read."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from bench.family_checkpoints import checkpoint_folder
from safetensors.torch import load_file, save_file

from moeguard_runtime.model.checkpoint import CheckpointError
from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint
from moeguard_runtime.model.hf_config import BuildOptions, TensorSource
from moeguard_runtime.parallel.expert_parallel import moe_modules

pytestmark = pytest.mark.unit

COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(model_type="qwen3_moe", **COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", **COMMON, intermediate_size=48, num_local_experts=8,
                    num_experts_per_tok=2),
}


def _experts(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.w13.detach(), m.w2.detach()) for m in moe_modules(model)]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_block_load_holds_the_whole_loads_block_and_nothing_else(family: str) -> None:
    folder = checkpoint_folder(CONFIGS[family])
    whole = _experts(load_hf_checkpoint(folder, options=BuildOptions(expert_block=None)).model)
    taken: list[str] = []
    original = TensorSource.take

    def spy(self: TensorSource, name: str, shape: Any) -> torch.Tensor:
        taken.append(name)
        return original(self, name, shape)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TensorSource, "take", spy)
        block = _experts(load_hf_checkpoint(folder, options=BuildOptions(expert_block=(2, 4))).model)
    assert len(block) == len(whole) == 2
    for (w13, w2), (full13, full2) in zip(block, whole, strict=True):
        assert w13.shape[0] == w2.shape[0] == 2
        assert torch.equal(w13, full13[2:4]) and torch.equal(w2, full2[2:4])
    read = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in taken if ".experts." in n})
    assert read == [2, 3]  # the other experts' tensors were never read


def test_a_block_load_still_checks_the_other_experts_tensors(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint_folder(CONFIGS["qwen3_moe"]), folder)
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.1.mlp.experts.6.down_proj.weight"  # another rank's expert
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts.6.down_proj.weight' has shape"):
        load_hf_checkpoint(folder, options=BuildOptions(expert_block=(0, 2)))
