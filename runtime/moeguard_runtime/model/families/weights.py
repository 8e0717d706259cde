"""From HF tensor names and layouts to the families' modules.

Module names follow HF's, so most tensors are ``model.`` + the parameter name; only
the experts are restacked (``experts.E.gate_proj`` and ``up_proj`` → the fused ``w13[E]``, feeding
:func:`moeguard_runtime.model.moe.dispatch_experts`) and the q/k rows permuted to
the interleaved rotary layout of :func:`moeguard_runtime.model.model.apply_rope`
(:func:`to_interleaved`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from moeguard_runtime.model.checkpoint import hf_to_interleaved
from moeguard_runtime.model.hf_config import TensorSource


def to_interleaved(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a ``[n_heads * hd, ...]`` q/k weight, bias or per-head norm weight from HF's
    half-split rotary layout (``rotate_half``) to the interleaved pairs of ``apply_rope``
    (as gpt-fast's ``convert_hf_checkpoint.py``). A 1-D tensor is treated as one column."""
    if t.dim() == 1:
        return hf_to_interleaved(t[:, None], n_heads)[:, 0]
    return hf_to_interleaved(t, n_heads)





def moe_tensor(source: TensorSource, name: str, shape: tuple[int, ...],
               shared_name: str = "shared_experts") -> torch.Tensor | None:
    """The :class:`SparseMoE` parameters under their HF names, or None for any other ``name``.

    ``layers.N.mlp.w13`` ``[E, 2I, D]`` is HF's per-expert ``model.layers.N.mlp.experts.E.gate_proj.weight``
    (rows ``0..I-1``) and ``up_proj.weight`` (rows ``I..2I-1``) stacked, ``w2`` ``[E, D, I]`` the
    ``down_proj`` weights stacked; ``mlp.shared.*`` is
    ``mlp.{shared_name}.*``, ``mlp.shared_gate`` is ``mlp.shared_expert_gate`` and
    ``mlp.e_score_correction_bias`` is ``mlp.gate.e_score_correction_bias``.
    """
    prefix, _, leaf = name.rpartition(".mlp.")
    if not prefix:
        return None
    hf = f"model.{prefix}.mlp."
    if leaf == "w13":
        return expert_stack(source, lambda e: (f"{hf}experts.{e}.gate_proj.weight", f"{hf}experts.{e}.up_proj.weight"),
                            (shape[1] // 2, shape[2]), shape)
    if leaf == "w2":
        return expert_stack(source, lambda e: (f"{hf}experts.{e}.down_proj.weight",), shape[1:], shape)  # [E, D, I]
    if leaf.startswith("shared."):
        return source.take(f"{hf}{shared_name}.{leaf.removeprefix('shared.')}", shape)
    if leaf == "shared_gate.weight":
        return source.take(f"{hf}shared_expert_gate.weight", shape)
    if leaf == "e_score_correction_bias":
        return source.take(f"{hf}gate.e_score_correction_bias", shape)
    return None


def expert_stack(source: TensorSource, names: Callable[[int], Sequence[str]], part: tuple[int, ...],
                 shape: tuple[int, ...]) -> torch.Tensor:
    """The ``[E, ...]`` stack ``shape`` of per-expert tensors: expert ``e``'s row block is its ``names(e)``
    tensors (each ``part``) concatenated along rows (``w13``: gate rows, then up rows, as
    :func:`moeguard_runtime.model.moe.stack_gate_up`; ``w2``: one ``down_proj``), copied once, in the first tensor's dtype.

    Expert parallelism (``source.expert_block`` ``[lo, hi)``): only the block's tensors are read; the others are
    checked (present, ``part``) and skipped (:meth:`TensorSource.skip`) and their rows never written: the
    ``torch.empty`` stack is virtual memory whose untouched pages are never resident, and
    :func:`moeguard_runtime.parallel.expert_parallel.keep_experts` copies the block out before the cast and the move to the
    device, so a rank's memory holds its block, never the whole stack.

    Raises:
        CheckpointError: a tensor is missing or of another shape (:meth:`TensorSource.take`).
    """
    lo, hi = source.expert_block or (0, shape[0])
    out: torch.Tensor | None = None
    for e in range(shape[0]):
        if not lo <= e < hi:
            for name in names(e):
                source.skip(name, part)
            continue
        parts = [source.take(name, part) for name in names(e)]
        if out is None:
            out = torch.empty(shape, dtype=parts[0].dtype)
        row = 0
        for t in parts:
            out[e, row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
    if out is None:
        raise ValueError(f"no expert in the block [{lo}, {hi}) of {shape[0]}")
    return out


def load_by_name(model: nn.Module, source: TensorSource,
                 special: Callable[[str, tuple[int, ...]], torch.Tensor | None],
                 tie_embeddings: bool = False, ignore: Sequence[str] = ()) -> None:
    """Fill every parameter of ``model`` (built on the meta device) from ``source``:
    ``special(name, shape)`` supplies the restacked or permuted ones (None: take
    ``model.{name}`` as stored; ``lm_head.weight`` has no prefix, and with
    ``tie_embeddings`` and no ``lm_head.weight`` stored it is the embedding), then
    checks that no tensor was left over (but those whose names start with one of ``ignore``).

    Raises:
        CheckpointError: from :class:`TensorSource` (missing, shape, unexpected).
    """
    state: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict(keep_vars=True).items():
        shape = tuple(p.shape)
        t = special(name, shape)
        if t is None and name == "lm_head.weight":
            tied = tie_embeddings and not source.has(name)
            t = source.take("model.embed_tokens.weight" if tied else name, shape)
        elif t is None:
            t = source.take(f"model.{name}", shape)
        state[name] = t
    model.load_state_dict(state, assign=True, strict=True)
    source.check_all_used(ignore)
