"""Rotary position embeddings of the HF families: default RoPE and YaRN.

Angles are ``pos * inv_freq`` (RoFormer); :func:`moeguard_runtime.model.model.apply_rope`
rotates with them. YaRN (Peng et al. 2023, "YaRN: Efficient Context Window
Extension", §3; HF ``modeling_rope_utils._compute_yarn_parameters``) blends
interpolated (``inv_freq / factor``) and original frequencies with a linear ramp
between the dims that turn ``beta_fast`` and ``beta_slow`` times over
``original_max_position_embeddings``, and scales the rotated q and k by an
``attention_factor`` (HF multiplies cos and sin by it; rotation being linear, that
is the same). DeepSeek-V3 also multiplies the softmax scale by
``mscale(factor, mscale_all_dim)^2`` (:meth:`RopeScaling.softmax_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeguard_runtime.model.hf_config import HFConfig

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1 (YaRN eq. 22's sqrt(1/t))."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """A config's rotary embedding. ``kind`` "default" uses only ``base``."""

    base: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def inv_freq(self, dim: int) -> torch.Tensor:
        """``[dim / 2]`` float32 inverse frequencies (computed in float32, as HF does)."""
        pos_freqs = self.base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if self.kind == "default":
            return 1.0 / pos_freqs

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(self.base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF: prevent a division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # [dim/2], 1 where the original frequency is kept
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + \
            (1.0 / pos_freqs) * extrapolation

    def angles(self, max_seq_len: int, dim: int) -> torch.Tensor:
        """``[max_seq_len, dim / 2]`` float32 rotary angles ``pos * inv_freq``."""
        pos = torch.arange(max_seq_len, dtype=torch.float32)
        return torch.outer(pos, self.inv_freq(dim))

    def softmax_scale(self, scale: float) -> float:
        """DeepSeek-V3's softmax scale under YaRN (HF ``yarn_apply_mscale``)."""
        if self.kind != "default" and self.mscale_all_dim:
            m = yarn_mscale(self.factor, self.mscale_all_dim)
            return scale * m * m
        return scale


def rope_scaling(cfg: HFConfig, default_base: float = 10_000.0,
                 supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> RopeScaling:
    """The rotary embedding of ``cfg``: ``rope_parameters`` (transformers 5), or ``rope_theta``
    and ``rope_scaling`` (older files). Raises CheckpointError naming the key for a
    ``rope_type`` not in ``supported`` (llama3, dynamic, longrope ... are never served wrong)."""
    key = "rope_parameters" if cfg.data.get("rope_parameters") else "rope_scaling"
    params = cfg.data.get(key) or {}
    if not isinstance(params, dict):
        raise cfg.error(key, f"must be an object, given {params!r}")
    kind = params.get("rope_type", params.get("type")) or "default"
    base = params.get("rope_theta", cfg.data.get("rope_theta", default_base))
    if isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 0:
        raise cfg.error("rope_theta", f"must be a positive number, given {base!r}")
    if kind not in supported:
        raise cfg.error(key, f"rope_type {kind!r} is not supported ({', '.join(supported)} "
                             f"{'is' if len(supported) == 1 else 'are'})")
    if kind == "default":
        return RopeScaling(float(base))
    original = params.get("original_max_position_embeddings") or \
        cfg.data.get("original_max_position_embeddings") or cfg.get_int("max_position_embeddings")
    factor = params.get("factor") or cfg.get_int("max_position_embeddings") / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return RopeScaling(float(base), "yarn", float(factor), int(original),
                       float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                       float(attention_factor), float(mscale_all_dim or 0.0),
                       bool(params.get("truncate", True)))
