"""``model_type: mixtral`` (Mixtral-8x7B, 8x22B) from an HF folder, served by the embedded
gpt-fast model (:class:`moeguard_runtime.model.model.Transformer`) with the checkpoint's real
vocabulary. Names map as in :mod:`moeguard_runtime.model.checkpoint` (q/k rows permuted to
the interleaved rotary layout, experts stacked, ``w1``/``w3`` fused into ``w13``); HF ``modeling_mixtral.py`` is the
reference (softmax top-k router, always renormalized).
"""

from __future__ import annotations

import torch

from moeguard_core.presets import ModelArgs, shape_problems
from moeguard_runtime.model.checkpoint import hf_to_interleaved
from moeguard_runtime.model.families.decoder import check_activation
from moeguard_runtime.model.families.rope import rope_scaling
from moeguard_runtime.model.families.weights import expert_stack
from moeguard_runtime.model.hf_config import BuildOptions, HFConfig, TensorSource
from moeguard_runtime.model.model import Transformer


def model_args(cfg: HFConfig) -> ModelArgs:
    """``config.json`` → :class:`ModelArgs`. Raises CheckpointError for shapes the model
    cannot take (e.g. a ``head_dim`` other than ``hidden_size / num_attention_heads``)."""
    dim, n_head = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    args = ModelArgs(n_layer=cfg.get_int("num_hidden_layers"), dim=dim, n_head=n_head,
                     n_kv_head=cfg.get_int("num_key_value_heads", default=n_head),
                     intermediate_size=cfg.get_int("intermediate_size"),
                     num_experts=cfg.get_int("num_local_experts", "num_experts"),
                     top_k=cfg.get_int("num_experts_per_tok"), max_seq_len=cfg.max_seq_len(),
                     vocab_size=cfg.get_int("vocab_size"),
                     rope_base=rope_scaling(cfg, 1e6, ("default",)).base,  # model.py: no YaRN
                     norm_eps=cfg.get_float("rms_norm_eps", 1e-5))
    head_dim = cfg.data.get("head_dim")
    if head_dim is not None and head_dim != args.head_dim:
        raise cfg.error("head_dim", f"{head_dim} must be hidden_size / num_attention_heads "
                                    f"({args.head_dim}) for mixtral")
    problems = shape_problems(args)
    if problems:
        raise cfg.error("shape", "; ".join(problems))
    check_activation(cfg)
    return args


def build(cfg: HFConfig, source: TensorSource, options: BuildOptions) -> Transformer:
    """The Mixtral decoder of ``cfg`` filled from ``source``.

    Raises:
        CheckpointError: a missing or bad ``config.json`` key, or any tensor problem.
    """
    args = model_args(cfg)
    with torch.device("meta"):
        model = Transformer(args, options.expert_chunk_tokens, options.capacity_factor,
                            options.matmul_backend, options.dispatch)
    hd, d, inter = args.head_dim, args.dim, args.intermediate_size
    state: dict[str, torch.Tensor] = {
        "tok_embeddings.weight": source.take("model.embed_tokens.weight", (args.vocab_size, d)),
        "norm.weight": source.take("model.norm.weight", (d,)),
    }
    tied = cfg.get_bool("tie_word_embeddings", False) and not source.has("lm_head.weight")
    state["output.weight"] = source.take("model.embed_tokens.weight" if tied else "lm_head.weight",
                                         (args.vocab_size, d))
    for i in range(args.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        q = source.take(f"{hf}self_attn.q_proj.weight", (args.n_head * hd, d))
        k = source.take(f"{hf}self_attn.k_proj.weight", (args.n_kv_head * hd, d))
        v = source.take(f"{hf}self_attn.v_proj.weight", (args.n_kv_head * hd, d))
        state[f"{ours}attention.wqkv.weight"] = torch.cat(
            [hf_to_interleaved(q, args.n_head), hf_to_interleaved(k, args.n_kv_head), v])
        state[f"{ours}attention.wo.weight"] = source.take(f"{hf}self_attn.o_proj.weight",
                                                          (d, args.n_head * hd))
        state[f"{ours}feed_forward.gate.weight"] = source.take(
            f"{hf}block_sparse_moe.gate.weight", (args.num_experts, d))
        experts = f"{hf}block_sparse_moe.experts."
        e_all = args.num_experts

        def gate_up(e: int, x: str = experts) -> tuple[str, ...]:
            return f"{x}{e}.w1.weight", f"{x}{e}.w3.weight"

        def down(e: int, x: str = experts) -> tuple[str, ...]:
            return (f"{x}{e}.w2.weight",)

        # [E, 2I, D]: w1 (gate) rows, then w3 (up); [E, D, I]
        state[f"{ours}feed_forward.w13"] = expert_stack(source, gate_up, (inter, d), (e_all, 2 * inter, d))
        state[f"{ours}feed_forward.w2"] = expert_stack(source, down, (d, inter), (e_all, d, inter))
        state[f"{ours}attention_norm.weight"] = source.take(f"{hf}input_layernorm.weight", (d,))
        state[f"{ours}ffn_norm.weight"] = source.take(f"{hf}post_attention_layernorm.weight", (d,))
    model.load_state_dict(state, assign=True, strict=True)
    source.check_all_used()
    return model
