"""A model's shape as the memory model needs it, for every family the worker serves.

:class:`FamilyShape` is read from an HF ``config.json`` (:func:`from_hf_config`, the field names
of ``transformers``' ``MixtralConfig``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``,
``DeepseekV3Config`` and ``OlmoeConfig``) or from an embedded preset (:func:`from_model_args`).
Pure arithmetic on plain values: no torch, no transformers.

What differs between the families, and where it is read from:

* **Routed experts**: ``num_local_experts`` (mixtral), ``num_experts`` (qwen2_moe, qwen3_moe,
  olmoe), ``n_routed_experts`` (deepseek_v3); ``num_experts_per_tok`` = k. Width of one expert:
  ``moe_intermediate_size`` (fine-grained experts: qwen2_moe, qwen3_moe, deepseek_v3), else
  ``intermediate_size`` (mixtral, olmoe).
* **Shared experts**, run on every token: qwen2_moe ``shared_expert_intermediate_size`` (one
  SwiGLU of that width, with a ``D -> 1`` sigmoid gate); deepseek_v3 ``n_shared_experts`` x
  ``moe_intermediate_size`` (one SwiGLU of the summed width, as HF ``DeepseekV3MoE`` builds it).
* **Dense layers** (a SwiGLU of ``intermediate_size`` instead of the MoE): deepseek_v3's first
  ``first_k_dense_replace`` layers; qwen2_moe / qwen3_moe layers in ``mlp_only_layers`` or not
  on the ``decoder_sparse_step`` (HF rule: layer ``i`` is sparse when ``(i + 1) % step == 0``).
* **Attention**: grouped-query attention with ``num_key_value_heads`` and ``head_dim``
  (default ``hidden_size / num_attention_heads``), or deepseek_v3's multi-head latent attention
  (``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``),
  whose cache holds the compressed latent and the shared rotary key only (DeepSeek-V3 technical
  report, §2.1.1: "only the blue-boxed vectors (c_t^KV and k_t^R) need to be cached").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from moeguard_core.presets import ModelArgs

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe")
"""``model_type`` values :func:`from_hf_config` reads (the worker's families)."""


class ConfigError(ValueError):
    """A ``config.json`` the memory model cannot read: the message names the key."""


@dataclass(frozen=True)
class FamilyShape:
    """One decoder's shape (sizes in elements; HF field names in the attribute docs).

    Attributes:
        n_layer: ``num_hidden_layers``.
        dim: ``hidden_size`` D.
        n_head: ``num_attention_heads`` H.
        n_kv_head: ``num_key_value_heads`` (GQA; MLA repeats nothing and ignores it).
        head_dim: ``head_dim`` (GQA; default D / H).
        intermediate_size: width I of one routed expert (``moe_intermediate_size`` where the
            family has it, else ``intermediate_size``).
        num_experts: routed experts E.
        top_k: ``num_experts_per_tok`` k.
        max_seq_len: ``max_position_embeddings``.
        vocab_size: ``vocab_size``.
        model_type: the family (``preset`` for the embedded presets).
        moe_layers: layers with an MoE MLP; the others (``n_layer - moe_layers``) are dense.
        dense_intermediate_size: a dense layer's SwiGLU width (``intermediate_size``).
        shared_intermediate_size: summed width of the shared experts (0: none).
        shared_gate: the shared expert has a ``D -> 1`` gate (qwen2_moe).
        kv_lora_rank: MLA's compressed KV width (0: GQA).
        q_lora_rank: MLA's compressed query width (0: a full ``q_proj``).
        qk_nope_head_dim: MLA's per-head non-rotary query/key width.
        qk_rope_head_dim: MLA's rotary query/key width (the cached ``k_rope`` is shared by heads).
        v_head_dim: MLA's per-head value width.
        qkv_bias: q, k, v projections have biases (qwen2_moe; ``attention_bias`` elsewhere).
        qk_norm: ``"head"`` (qwen3_moe: RMSNorm over head_dim), ``"proj"`` (olmoe: over the whole
            q / k projection) or ``""``.
        tie_embeddings: ``tie_word_embeddings``.
    """

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    top_k: int
    max_seq_len: int
    vocab_size: int
    model_type: str = "preset"
    moe_layers: int = -1
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    qkv_bias: bool = False
    qk_norm: str = ""
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.moe_layers < 0:
            object.__setattr__(self, "moe_layers", self.n_layer)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (deepseek_v3)."""
        return self.kv_lora_rank > 0

    @property
    def dense_layers(self) -> int:
        return self.n_layer - self.moe_layers

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: ``nope + rope`` (MLA) or ``head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim


def from_model_args(args: ModelArgs) -> FamilyShape:
    """An embedded preset (Mixtral-shaped: every layer MoE, GQA, no shared expert)."""
    return FamilyShape(args.n_layer, args.dim, args.n_head, args.n_kv_head, args.head_dim,
                       args.intermediate_size, args.num_experts, args.top_k, args.max_seq_len,
                       args.vocab_size)


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{key} must be a non-negative integer, given {value!r}")
            return value
    if default is None:
        raise ConfigError(f"missing key {' or '.join(keys)}")
    return default


def qwen_sparse_layers(n_layer: int, decoder_sparse_step: int, mlp_only_layers: Iterable[int]) -> set[int]:
    """Layers with a sparse MoE MLP, HF Qwen2/Qwen3-MoE rule (``Qwen2MoeDecoderLayer``): not in
    ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0`` (none when the step is 0)."""
    dense = set(mlp_only_layers)
    return {i for i in range(n_layer)
            if i not in dense and decoder_sparse_step > 0 and (i + 1) % decoder_sparse_step == 0}


def sparse_layer_count(cfg: dict[str, Any], n_layer: int) -> int:
    """Layers with an MoE MLP: deepseek_v3 ``n_layer - first_k_dense_replace``; qwen2_moe /
    qwen3_moe the HF rule (not in ``mlp_only_layers``, ``(i + 1) % decoder_sparse_step == 0``);
    every layer otherwise."""
    model_type = cfg.get("model_type")
    if model_type == "deepseek_v3":
        return max(0, n_layer - _int(cfg, "first_k_dense_replace", default=0))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return len(qwen_sparse_layers(n_layer, _int(cfg, "decoder_sparse_step", default=1),
                                      cfg.get("mlp_only_layers") or []))
    return n_layer


def from_hf_config(cfg: dict[str, Any]) -> FamilyShape:
    """The shape of an HF ``config.json`` (already parsed) of one of :data:`FAMILIES`.

    Raises:
        ConfigError: an unsupported ``model_type`` or a missing / malformed key (named).
    """
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    d, h = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    n_layer = _int(cfg, "num_hidden_layers")
    if h == 0 or d == 0:
        raise ConfigError("hidden_size and num_attention_heads must be positive")
    fine = model_type in ("qwen2_moe", "qwen3_moe", "deepseek_v3")
    expert_i = _int(cfg, "moe_intermediate_size") if fine else _int(cfg, "intermediate_size")
    dense_i = _int(cfg, "intermediate_size", default=0)
    shared = 0
    if model_type == "qwen2_moe":
        shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    elif model_type == "deepseek_v3":
        shared = _int(cfg, "n_shared_experts", default=0) * expert_i
    mla: dict[str, int] = {}
    if model_type == "deepseek_v3":
        mla = {"kv_lora_rank": _int(cfg, "kv_lora_rank"), "q_lora_rank": _int(cfg, "q_lora_rank", default=0),
               "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim"),
               "qk_rope_head_dim": _int(cfg, "qk_rope_head_dim"), "v_head_dim": _int(cfg, "v_head_dim")}
    return FamilyShape(
        n_layer=n_layer, dim=d, n_head=h, n_kv_head=_int(cfg, "num_key_value_heads", default=h),
        head_dim=_int(cfg, "head_dim", default=d // h),
        intermediate_size=expert_i,
        num_experts=_int(cfg, "n_routed_experts", "num_local_experts", "num_experts"),
        top_k=_int(cfg, "num_experts_per_tok"),
        max_seq_len=_int(cfg, "max_position_embeddings"), vocab_size=_int(cfg, "vocab_size"),
        model_type=str(model_type), moe_layers=sparse_layer_count(cfg, n_layer),
        dense_intermediate_size=dense_i, shared_intermediate_size=shared,
        shared_gate=model_type == "qwen2_moe" and shared > 0,
        qkv_bias=model_type == "qwen2_moe" or bool(cfg.get("attention_bias", False)),
        qk_norm={"qwen3_moe": "head", "olmoe": "proj"}.get(str(model_type), ""),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), **mla)


def replace(shape: FamilyShape, **fields: int) -> FamilyShape:
    """``shape`` with some fields overridden (``moeguard plan --shape``)."""
    return dataclasses.replace(shape, **fields)  # type: ignore[arg-type]


def attention_parameters(s: FamilyShape) -> int:
    """One layer's attention weights (elements): GQA ``q, k, v, o`` (+ biases, q/k norms) or
    MLA ``q_a, q_a_layernorm, q_b`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj`` (HF ``DeepseekV3Attention``)."""
    d, h = s.dim, s.n_head
    if s.mla:
        q = d * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * h * s.qk_head_dim if s.q_lora_rank \
            else d * h * s.qk_head_dim
        kv = d * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank \
            + s.kv_lora_rank * h * (s.qk_nope_head_dim + s.v_head_dim)
        return q + kv + h * s.v_head_dim * d
    q, kv = h * s.head_dim, s.n_kv_head * s.head_dim
    out = d * q + 2 * d * kv + q * d
    if s.qkv_bias:
        out += q + 2 * kv
    if s.qk_norm == "head":
        out += 2 * s.head_dim
    elif s.qk_norm == "proj":
        out += q + kv
    return out


def moe_parameters(s: FamilyShape) -> int:
    """One MoE layer's weights: router ``E x D`` (+ deepseek_v3's ``E`` score-correction bias),
    ``E x 3 x D x I`` routed experts, ``3 x D x I_shared`` shared (+ qwen2_moe's ``D`` gate)."""
    d = s.dim
    out = s.num_experts * d + s.num_experts * 3 * d * s.intermediate_size + 3 * d * s.shared_intermediate_size
    if s.shared_gate:
        out += d
    if s.model_type == "deepseek_v3":
        out += s.num_experts
    return out


def parameter_count(s: FamilyShape) -> int:
    """All weights (elements): embeddings (and an untied ``lm_head``), per layer attention,
    two RMSNorms and the MoE or dense MLP, the final norm. Equals
    ``presets.parameter_count`` for a preset, and HF's ``num_parameters()`` for a family
    (deepseek_v3: plus the ``E`` score-correction bias per MoE layer, a buffer in HF but a
    tensor of the checkpoint)."""
    per_layer = attention_parameters(s) + 2 * s.dim
    mlp = s.moe_layers * moe_parameters(s) + s.dense_layers * 3 * s.dim * s.dense_intermediate_size
    heads = (1 if s.tie_embeddings else 2) * s.vocab_size * s.dim
    return s.n_layer * per_layer + mlp + heads + s.dim
