"""Load a local safetensors checkpoint, in moeguard's or HF Mixtral's tensor names.

A checkpoint is one ``*.safetensors`` file or a folder of them (shards). Each
tensor is opened with ``safetensors.safe_open`` (memory-mapped, no copy until a
tensor is used); only the experts are copied, to stack them into ``[E, D, I]`` (``w2``)
and the fused ``[E, 2I, D]`` (``w13``: ``w1``, the gate projection, then ``w3``, the up
projection, as vLLM and SGLang store them). Native checkpoints saved before the fusion
(``feed_forward.w1``/``w3``) are fused on load too.

HF ``MixtralForCausalLM`` names → this model's (gpt-fast layout):

=============================================================  ==============================
``model.embed_tokens.weight``                                    ``tok_embeddings.weight``
``model.layers.N.self_attn.{q,k,v}_proj.weight`` (concatenated)  ``layers.N.attention.wqkv.weight``
``model.layers.N.self_attn.o_proj.weight``                       ``layers.N.attention.wo.weight``
``model.layers.N.block_sparse_moe.gate.weight``                  ``layers.N.feed_forward.gate.weight``
``model.layers.N.block_sparse_moe.experts.E.w{1,3}.weight``      ``layers.N.feed_forward.w13[E]`` (halves)
``model.layers.N.block_sparse_moe.experts.E.w2.weight``          ``layers.N.feed_forward.w2[E]``
``model.layers.N.input_layernorm.weight``                        ``layers.N.attention_norm.weight``
``model.layers.N.post_attention_layernorm.weight``               ``layers.N.ffn_norm.weight``
``model.norm.weight`` / ``lm_head.weight``                       ``norm.weight`` / ``output.weight``
=============================================================  ==============================

HF rotates the two halves of each head (``rotate_half``); this model rotates
interleaved pairs (Meta/gpt-fast). As gpt-fast's ``convert_hf_checkpoint.py``
does, ``q_proj`` and ``k_proj`` rows are permuted from HF's layout to the
interleaved one (:func:`hf_to_interleaved`). The tokenizer is byte-level, so a
checkpoint's vocabulary must be :data:`presets.VOCAB_SIZE`; any shape mismatch
is an error that names the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from moeguard_core.presets import ModelArgs
from moeguard_runtime.model.moe import fuse_gate_up, stack_gate_up

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_SIMPLE = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "block_sparse_moe.gate.weight": "feed_forward.gate.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a ``[n_heads * hd, D]`` q/k projection from HF's half-split rotary
    layout to the interleaved one (inverse of :func:`interleaved_to_hf`)."""
    hd = w.shape[0] // n_heads
    return w.view(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)


def interleaved_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from the interleaved rotary layout to HF's."""
    hd = w.shape[0] // n_heads
    return w.view(n_heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors file in {p}")
        return files
    if not p.is_file():
        raise CheckpointError(f"checkpoint {p} does not exist")
    return [p]


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (memory-mapped)."""
    out: dict[str, torch.Tensor] = {}
    for f in _files(path):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    out[name] = sf.get_tensor(name)
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ValueError
            raise CheckpointError(f"cannot read {f}: {exc}") from None
    return out


def from_hf_names(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Map HF Mixtral names onto this model's (names already native pass through, unfused
    ``w1``/``w3`` pairs fused)."""
    if not any(k.startswith("model.") for k in tensors):
        return fuse_native(tensors)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name in _HF_TOP:
            out[_HF_TOP[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if m is None:
            raise CheckpointError(f"unexpected tensor {name!r} in an HF Mixtral checkpoint")
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _HF_SIMPLE:
            out[f"layers.{layer}.{_HF_SIMPLE[rest]}"] = t
        elif (e := re.match(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", rest)):
            experts.setdefault((layer, e.group(2)), {})[int(e.group(1))] = t
        elif (q := re.match(r"self_attn\.([qkv])_proj\.weight$", rest)):
            qkv.setdefault(layer, {})[q.group(1)] = t
        else:
            raise CheckpointError(f"unexpected tensor {name!r} in an HF Mixtral checkpoint")
    for (layer, w), by_expert in experts.items():
        if sorted(by_expert) != list(range(args.num_experts)):
            raise CheckpointError(f"layer {layer} {w}: experts {sorted(by_expert)}, "
                                  f"expected 0..{args.num_experts - 1}")
    for (layer, w), by_expert in experts.items():
        stacked = [by_expert[i] for i in range(args.num_experts)]
        if w == "w2":
            out[f"layers.{layer}.feed_forward.w2"] = torch.stack(stacked)  # [E, D, I]
        elif w == "w1":
            if (layer, "w3") not in experts:
                raise CheckpointError(f"layer {layer}: w1 without w3")
            up = experts[(layer, "w3")]
            out[f"layers.{layer}.feed_forward.w13"] = stack_gate_up(
                stacked, [up[i] for i in range(args.num_experts)])  # [E, 2I, D]
        elif (layer, "w1") not in experts:
            raise CheckpointError(f"layer {layer}: w3 without w1")
    for layer, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"layer {layer}: q/k/v projections incomplete ({sorted(parts)})")
        out[f"layers.{layer}.attention.wqkv.weight"] = torch.cat([
            hf_to_interleaved(parts["q"], args.n_head), hf_to_interleaved(parts["k"], args.n_kv_head),
            parts["v"]])
    return out


def fuse_native(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native names with every ``X.w1``/``X.w3`` pair (``[E, I, D]`` each, the layout before
    the fusion) replaced by ``X.w13`` (``[E, 2I, D]``); other tensors pass through."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".w1")]:
        up = name.removesuffix(".w1") + ".w3"
        if up in out:
            out[name.removesuffix(".w1") + ".w13"] = fuse_gate_up(out.pop(name), out.pop(up))
    return out


def load_state_dict(path: str, args: ModelArgs,
                    expected: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The state dict of the checkpoint at ``path`` for a model of shape ``args``.

    Args:
        expected: every tensor name the model holds, with its shape (the caller's
            ``model.state_dict()`` on the meta device; this module does not import
            the model).

    Raises:
        CheckpointError: unreadable file, unknown or missing tensor, wrong shape.
    """
    state = from_hf_names(read_tensors(path), args)
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise CheckpointError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unknown[:5]}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(state[name].shape)}, "
                                  f"the preset needs {tuple(shape)}")
    return state
