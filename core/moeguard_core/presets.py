"""Model shape presets, shared by the worker and the operator (no torch import).

Each preset is a Mixtral-style decoder shape (pytorch-labs/gpt-fast
``mixtral-moe/model.py`` ``ModelArgs``). Parameter counts are computed by
:func:`parameter_count`, not typed in.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_SIZE = 259
"""Byte-level vocabulary: 256 byte values plus BOS (256), EOS (257) and PAD (258)."""


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Mixtral-style MoE decoder.

    Attributes:
        n_layer: decoder blocks.
        dim: hidden size D.
        n_head: attention heads; ``head_dim = dim // n_head``.
        n_kv_head: key/value heads (grouped-query attention).
        intermediate_size: expert SwiGLU width I.
        num_experts: experts E per MoE layer.
        top_k: experts per token k.
        max_seq_len: maximum context length in tokens (prompt + generated).
        vocab_size: tokenizer vocabulary.
        rope_base: rotary embedding base (Mixtral uses 1e6).
        norm_eps: RMSNorm epsilon.
    """

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    intermediate_size: int
    num_experts: int
    top_k: int
    max_seq_len: int
    vocab_size: int = VOCAB_SIZE
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


PRESETS: dict[str, ModelArgs] = {
    # For tests and the demo: milliseconds per step on a 2-core CPU. 452,288 parameters.
    "tiny": ModelArgs(n_layer=2, dim=64, n_head=4, n_kv_head=2, intermediate_size=128,
                      num_experts=8, top_k=2, max_seq_len=1024),
    # For benchmarks: 99,386,880 parameters (about 100M), 398 MB in fp32.
    "small": ModelArgs(n_layer=6, dim=512, n_head=8, n_kv_head=4, intermediate_size=1280,
                       num_experts=8, top_k=2, max_seq_len=4096),
    # Mixtral-8x7B's shape ratios (I/D = 3.5, head_dim 128, 4 query heads per KV head,
    # E=8, k=2, rope base 1e6) with D, heads and layers divided by 8:
    # 90,988,032 parameters.
    "mixtral-mini": ModelArgs(n_layer=4, dim=512, n_head=4, n_kv_head=1, intermediate_size=1792,
                              num_experts=8, top_k=2, max_seq_len=4096),
}


def parameter_count(args: ModelArgs) -> int:
    """Number of parameters of a model with shape ``args`` (embeddings untied)."""
    hd = args.head_dim
    attn = args.dim * args.n_head * hd + 2 * args.dim * args.n_kv_head * hd + args.n_head * hd * args.dim
    moe = args.dim * args.num_experts + args.num_experts * 3 * args.dim * args.intermediate_size
    per_layer = attn + moe + 2 * args.dim
    return args.n_layer * per_layer + 2 * args.vocab_size * args.dim + args.dim


def get_preset(name: str) -> ModelArgs:
    """Return the preset called ``name``.

    Raises:
        KeyError: with the known preset names, when ``name`` is not one of them.
    """
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise KeyError(f"unknown model preset {name!r}; known presets: {known}") from None


def shape_problems(args: ModelArgs) -> list[str]:
    """Why ``args`` is not a shape the worker can build (empty when it is).

    Rules of the attention and MoE code: ``dim`` divisible by ``n_head``, ``n_head``
    by ``n_kv_head`` (grouped-query attention), an even ``head_dim`` (rotary
    embeddings rotate pairs), and ``top_k <= num_experts``.
    """
    problems = []
    if args.dim % args.n_head:
        problems.append(f"dim ({args.dim}) must be a multiple of nHead ({args.n_head})")
    elif (args.dim // args.n_head) % 2:
        problems.append(f"dim / nHead ({args.dim // args.n_head}) must be even for rotary embeddings")
    if args.n_head % args.n_kv_head:
        problems.append(f"nHead ({args.n_head}) must be a multiple of nKvHead ({args.n_kv_head})")
    if args.top_k > args.num_experts:
        problems.append(f"topK ({args.top_k}) must be <= numExperts ({args.num_experts})")
    return problems
