"""safetensors checkpoints in moeguard's and HF Mixtral's tensor names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moeguard_core.presets import get_preset
from moeguard_runtime.model.checkpoint import (
    CheckpointError,
    hf_to_interleaved,
    interleaved_to_hf,
)
from moeguard_runtime.model.model import Segment, Transformer, build_model

pytestmark = pytest.mark.unit
ARGS = get_preset("tiny")


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """Write a model in HF ``MixtralForCausalLM`` names (the inverse of the loader)."""
    a = model.args
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
           "model.norm.weight": sd["norm.weight"], "lm_head.weight": sd["output.weight"]}
    hd = a.head_dim
    for i in range(a.n_layer):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = sd[p + "attention.wqkv.weight"].split(
            [a.n_head * hd, a.n_kv_head * hd, a.n_kv_head * hd])
        out[h + "self_attn.q_proj.weight"] = interleaved_to_hf(q, a.n_head).contiguous()
        out[h + "self_attn.k_proj.weight"] = interleaved_to_hf(k, a.n_kv_head).contiguous()
        out[h + "self_attn.v_proj.weight"] = v.contiguous()
        out[h + "self_attn.o_proj.weight"] = sd[p + "attention.wo.weight"]
        out[h + "block_sparse_moe.gate.weight"] = sd[p + "feed_forward.gate.weight"]
        out[h + "input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
        w1, w3 = sd[p + "feed_forward.w13"].chunk(2, dim=1)  # the fused [E, 2I, D]: gate rows, then up
        for w, t in (("w1", w1), ("w2", sd[p + "feed_forward.w2"]), ("w3", w3)):
            for e in range(a.num_experts):
                out[h + f"block_sparse_moe.experts.{e}.{w}.weight"] = t[e].contiguous()
    return out


def logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    from moeguard_runtime.model.model import KVCache

    cache = KVCache(model.args, len(tokens))
    with torch.inference_mode():
        out, _ = model(torch.tensor(tokens), torch.arange(len(tokens)),
                       [Segment(cache, 0, len(tokens))])
    return out


def test_permutations_are_inverse() -> None:
    w = torch.randn(4 * 16, 64)
    torch.testing.assert_close(hf_to_interleaved(interleaved_to_hf(w, 4), 4), w)
    assert not torch.equal(interleaved_to_hf(w, 4), w)


@pytest.mark.parametrize("layout", ["native", "hf", "hf-sharded"])
def test_checkpoint_round_trip_gives_the_same_logits(tmp_path: Path, layout: str) -> None:
    src = build_model(ARGS, seed=7)
    if layout == "native":
        path = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    else:
        tensors = to_hf(src)
        path = tmp_path / "ckpt"
        path.mkdir()
        if layout == "hf":
            save_file(tensors, str(path / "model.safetensors"))
        else:
            names = sorted(tensors)
            save_file({n: tensors[n] for n in names[::2]}, str(path / "model-00001.safetensors"))
            save_file({n: tensors[n] for n in names[1::2]}, str(path / "model-00002.safetensors"))
    loaded = build_model(ARGS, seed=999, checkpoint=str(path))
    tokens = list(b"checkpoint")
    torch.testing.assert_close(logits(loaded, tokens), logits(src, tokens))


def test_bad_checkpoints_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        build_model(ARGS, checkpoint=str(tmp_path / "nope.safetensors"))
    tensors = to_hf(build_model(ARGS, seed=1))
    tensors["model.embed_tokens.weight"] = torch.zeros(32000, ARGS.dim)
    save_file(tensors, str(tmp_path / "big-vocab.safetensors"))
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight has shape \(32000, 64\)"):
        build_model(ARGS, checkpoint=str(tmp_path / "big-vocab.safetensors"))
    del tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.mystery.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "odd.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        build_model(ARGS, checkpoint=str(tmp_path / "odd.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        build_model(ARGS, checkpoint=str(tmp_path / "junk.safetensors"))
