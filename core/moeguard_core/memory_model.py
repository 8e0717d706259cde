"""The memory model: a batch step's peak memory from its tokens, the model shape, skew and dtype.

Pure arithmetic (no torch), shared by ``moeguard plan`` and the benchmarks. It models the
worker's own code path (``moeguard_runtime.model.model`` / ``moe`` / ``engine``), one engine step at
a time: the worker has one engine thread, so the activations of two batches never coexist; only
their KV caches do.

**Peak of one step** (bytes above the loaded, idle process)::

    peak = KV(new sequences of the step) + STEP_CONSTANT
           + max(attention phase, MoE phase, dense MLP phase)

* **KV cache** of a sequence = 2 (K, V) x layers x KV heads x head_dim x capacity x dtype bytes,
  where capacity = prompt + max_new_tokens, allocated whole at admission (``KVCache``); with
  MLA (deepseek_v3) layers x (``kv_lora_rank`` + ``qk_rope_head_dim``) x capacity x dtype bytes
  (:func:`kv_bytes_per_token`).
* **Attention phase** (one layer; layers run one after another)::

      ATTN_STREAM x T x D x b            residual stream, norm, QKV, rotary temporaries, SDPA output
    + MASK_FACTOR x (2 + b) x max(n x s1) the causal mask of the largest prefill segment (n queries
                                         over s1 keys): the bool tril (1 B), SDPA's inverted copy
                                         while it converts it (1 B), the additive mask (b B)
    + 2 x H x s1 x head_dim x b          keys and values repeated over the query heads (GQA)

* **MoE phase**::

      MOE_STREAM x T x D x b             residual stream, norm, output accumulator
    + n_top x (D + 2 x I) x b            the busiest expert's slice: gathered inputs [n, D] and the
                                         fused gate/up result w13 x [n, 2I] (its gate half activated
                                         and multiplied in place); the output [n, D] reuses the
                                         gathered size
    + T x E x (b + 4)                    router logits and the float32 softmax
    + 32 x k x T                         dispatch indices (int64 sort order, token ids)

  with ``n_top = min(top_share x k x T, expert_chunk_tokens, capacity)``: the per-expert
  buffers grow with the **top expert's** token-slots, not the average, until the chunk bound
  (``MOEGUARD_EXPERT_CHUNK_TOKENS``) or the DeepSpeed capacity
  ``ceil(T x k / E x capacity_factor)`` cuts them.

* **Families** (:mod:`moeguard_core.family_shape` reads them from ``config.json``): ``I`` is the
  routed expert's width (``moe_intermediate_size`` for the fine-grained families). A **shared
  expert** (qwen2_moe ``shared_expert_intermediate_size``, deepseek_v3 ``n_shared_experts x
  moe_intermediate_size``) runs on all ``T`` tokens after the routed experts, whose buffers are
  freed by then: the MoE phase holds ``max(busiest expert, T x (D + 2 x I_shared) x b)``.
  **Dense layers** (deepseek_v3 ``first_k_dense_replace``, qwen ``mlp_only_layers``) have their
  own phase, ``MOE_STREAM x T x D x b + T x (D + 2 x intermediate_size) x b``. **MLA**
  replaces the repeated K/V by its queries and per-step up-projected keys and values
  (:func:`mla_attention_bytes`). GQA with ``H x head_dim > D`` (qwen3_moe) adds
  ``2 x T x (H x head_dim - D) x b`` (:func:`wide_heads_bytes`).

* ``b`` = dtype bytes. With a 2-byte dtype, (a) the RMSNorm and rotary code upcast to float32,
  which adds ``UPCAST_STREAM x T x D x 4`` to both phases (counted), and (b) on CPU the MoE phase
  holds ``LOWP_EXPERT_WEIGHT x layers x active experts x I x D x b`` more (empirical): bfloat16
  steps were measured as large as float32 ones when the tokens spread over all experts (small
  1x2048: 109 MiB bf16, 106 MiB float32), but 40 % smaller when every token went to the same two
  experts (67 MiB), so the excess follows the experts a step touches. One bf16 ``F.linear`` or
  SwiGLU measured alone, warm, keeps no float32 copy, so the mechanism is not pinned down; the
  term is a fitted description, not a count. ``active experts`` is interpolated from the top share
  (:func:`active_experts`).

``top_share`` is the top expert's share of the step's ``T x k`` token-slots: ``1/E`` when perfectly
balanced, at most ``1/k`` (every token sends one slot to it). The worker's metric
``expert_skew_ratio = top / median`` converts with :func:`top_share_from_skew_ratio`.

**Coefficients.** ``ATTN_STREAM``, ``MOE_STREAM``, ``MASK_FACTOR``, ``STEP_CONSTANT`` and
``LOWP_EXPERT_WEIGHT`` are empirical: the RSS keeps memory that glibc's heap has freed and not yet
returned, so the resident peak is more than the live tensors. ``python -m bench.memory_fit`` chose
them by a grid search minimising the worst relative error on the ten configurations of role ``fit``
in ``bench/memory_configs.py`` (eight float32 unskewed ``small`` steps, one bfloat16 step, one
``tiny`` step), medians of three fresh-process runs each; the 22 others (role ``check``: skew, chunk
bound, capacity factor, decode, KV-heavy, bfloat16, three other shapes) played no part.
Results: bench/results/memory_model.md. The fit put the float32 peak in the attention phase on
every configuration measured (``ATTN_STREAM`` 12 absorbs what the attention layer's temporaries
and the heap keep), so on this CPU path, at the default chunk bound, the top-expert share moves the
predicted float32 peak only through the MoE phase when it exceeds the attention phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeguard_core.family_shape import FamilyShape, from_model_args
from moeguard_core.presets import ModelArgs as Shape

__all__ = ["FamilyShape", "Shape", "ShapeLike"]  # Shape: a preset shape is the preset dataclass itself

ShapeLike = Shape | FamilyShape
"""A preset (``ModelArgs``) or any family's shape (:class:`FamilyShape`, from a ``config.json``)."""


def as_family(shape: ShapeLike) -> FamilyShape:
    return shape if isinstance(shape, FamilyShape) else from_model_args(shape)

ATTN_STREAM = 12.0
"""Residual-size tensors (T x D x b) the attention phase holds at its peak, RSS included."""
MOE_STREAM = 4.0
"""Residual-size tensors the MoE phase holds at its peak, RSS included."""
UPCAST_STREAM = 2.0
"""Extra float32 residual-size tensors when the dtype is 2 bytes (norm and rotary upcasts)."""
LOWP_EXPERT_WEIGHT = 0.0
"""With a 2-byte dtype on CPU: resident bytes per (layer, expert that receives tokens), in units
of one expert weight matrix (I x D x b), held until the step ends. Refitted to 0 once the probe warmed
up with the measured scenario itself: the earlier 1.875 was one-time oneDNN bf16 setup, not a per-step
buffer. Kept as a term so a future kernel that does hold converted weights can be fitted again."""
STEP_CONSTANT = 0
"""Bytes every step touches whatever its size (allocator arenas, Python objects)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Step:
    """What one engine step carries.

    Attributes:
        prefill: ``(start, n)`` per prefill chunk: ``n`` prompt tokens at positions
            ``start..start+n-1`` (a whole prompt is ``(0, len)``).
        decode_contexts: for each decoding sequence, the tokens already in its cache.
        new_kv_tokens: KV capacity (prompt + max_new_tokens) of sequences admitted by this
            step, whose caches are allocated at admission.
    """

    prefill: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()
    new_kv_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode_contexts)


@dataclass(frozen=True)
class Routing:
    """How tokens reach the experts.

    Attributes:
        top_share: the top expert's share of the step's token-slots (``1/E`` balanced, ``<= 1/k``).
        expert_chunk_tokens: most token-slots one expert processes at once.
        capacity_factor: 0 (dropless) or DeepSpeed's capacity factor.
        min_capacity: DeepSpeed's ``min_capacity``.
    """

    top_share: float
    expert_chunk_tokens: int = 2048
    capacity_factor: float = 0.0
    min_capacity: int = 4


@dataclass
class Estimate:
    """A step's predicted peak, term by term, with the arithmetic of each."""

    kv_bytes: int
    attention_bytes: int
    moe_bytes: int
    constant_bytes: int
    busiest_expert_slots: int
    terms: list[tuple[str, int, str]] = field(default_factory=list)
    dense_bytes: int = 0
    """A dense layer's MLP phase (deepseek_v3's first layers, qwen's ``mlp_only_layers``); 0: none."""

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.constant_bytes + max(self.attention_bytes, self.moe_bytes, self.dense_bytes)

    @property
    def phase(self) -> str:
        top = max(self.attention_bytes, self.moe_bytes, self.dense_bytes)
        return "attention" if self.attention_bytes == top else "moe" if self.moe_bytes == top else "dense MLP"


def kv_bytes_per_token(shape: ShapeLike, dtype_bytes: int) -> int:
    """One token's cache over all layers, bytes.

    * GQA: 2 (K and V) x layers x KV heads (``num_key_value_heads``) x ``head_dim`` x bytes.
    * MLA (deepseek_v3): layers x (``kv_lora_rank`` + ``qk_rope_head_dim``) x bytes: the
      compressed latent ``c_t^KV`` and the decoupled rotary key ``k_t^R`` shared by all heads
      (DeepSeek-V3 technical report §2.1.1; the worker's ``MLACache``). DeepSeek-V3 itself:
      61 x (512 + 64) x 2 B = 70,272 B a token in bf16.
    """
    s = as_family(shape)
    if s.mla:
        return s.n_layer * (s.kv_lora_rank + s.qk_rope_head_dim) * dtype_bytes
    return 2 * s.n_layer * s.n_kv_head * s.head_dim * dtype_bytes


def kv_arithmetic(shape: ShapeLike, dtype_bytes: int) -> str:
    """:func:`kv_bytes_per_token` written out, for ``moeguard plan``."""
    s = as_family(shape)
    if s.mla:
        return (f"{s.n_layer} layers x (kv_lora_rank {s.kv_lora_rank} + qk_rope_head_dim "
                f"{s.qk_rope_head_dim}) x {dtype_bytes} B (MLA latent)")
    return f"2 x {s.n_layer} layers x {s.n_kv_head} kv heads x {s.head_dim} x {dtype_bytes} B"


def top_share_from_skew_ratio(skew_ratio: float, num_experts: int, top_k: int) -> float:
    """Top expert's share of the slots from ``expert_skew_ratio`` (top / median), taking the
    other ``E - 1`` experts at the median: ``r / (r + E - 1)``, clipped to ``[1/E, 1/k]``."""
    r = max(float(skew_ratio), 1.0)
    return min(max(r / (r + num_experts - 1), 1.0 / num_experts), 1.0 / top_k)


def busiest_expert_slots(tokens: int, shape: ShapeLike, routing: Routing) -> int:
    """Token-slots the busiest expert processes at once: ``top_share x k x T`` cut by the
    chunk bound and, with a capacity factor, by DeepSpeed's capacity."""
    shape = as_family(shape)
    share = min(max(routing.top_share, 1.0 / shape.num_experts), 1.0 / shape.top_k)
    n = math.ceil(share * shape.top_k * tokens)
    if routing.capacity_factor > 0:
        cap = max(routing.min_capacity,
                  math.ceil(tokens * shape.top_k / shape.num_experts * routing.capacity_factor))
        n = min(n, cap)
    return min(n, routing.expert_chunk_tokens)


MASK_FACTOR = 1.0
"""Resident bytes of the causal mask per counted byte (``mask_bytes_per_pair``) in a whole step;
empirical: above 1 where the step's RSS keeps more of the mask's pages than one SDPA call alone."""


def mask_bytes_per_pair(dtype_bytes: int) -> int:
    """The bool ``tril`` mask (1 B), SDPA's inverted bool copy while it converts it (1 B) and the
    additive mask in the query dtype (b B): ``2 + b``. Counted; measured alone (one SDPA call with
    a bool mask, fresh process) as 5.5 B a pair in float32 and 4 in bfloat16."""
    return 2 + dtype_bytes


def active_experts(tokens: int, shape: ShapeLike, top_share: float) -> int:
    """Experts that receive at least one token-slot: all ``E`` when balanced (``top_share`` 1/E),
    only ``k`` when every token picks the same experts (``top_share`` 1/k), linear in between;
    at most ``T x k``."""
    shape = as_family(shape)
    e, k = shape.num_experts, shape.top_k
    if e <= k:
        return min(e, tokens * k)
    share = min(max(top_share, 1.0 / e), 1.0 / k)
    frac = (1.0 / k - share) / (1.0 / k - 1.0 / e)  # 1 balanced, 0 fully skewed
    return min(e, tokens * k, k + math.ceil(frac * (e - k)))


def swiglu_bytes(tokens: int, shape: ShapeLike, width: int, dtype_bytes: int) -> int:
    """One SwiGLU MLP of ``width`` over ``tokens`` rows: its input ``[n, D]`` and the two
    ``[n, width]`` buffers (gate, activated and multiplied in place; up); the output reuses
    the input's size. The busiest routed expert, a shared expert (``n = T``) and a dense
    layer's MLP (``n = T``) all have this form."""
    return tokens * (as_family(shape).dim + 2 * width) * dtype_bytes


MLA_MATH_SCORES = 2.3
"""Score-size tensors (``H x n x s1 x b``) that SDPA's math fallback holds at its peak. On the CPU,
torch's fused SDPA kernel needs the value head width to equal the query/key width; MLA's
``v_head_dim`` (128 for DeepSeek-V3) differs from ``qk_nope_head_dim + qk_rope_head_dim`` (192), so
the call falls back to the math path, which materialises the scores, their softmax and a
masked copy. Measured alone (one SDPA call, fresh process, H 8, n = s1 = 2048, float32, qk 96,
v 64): 316 MiB against 20 MiB with v 96, of which the bool mask's 5.5 B per pair is counted
by the mask term: (316 - 22) / 128 MiB of scores = 2.3. Not fitted on the validation set."""


def wide_heads_bytes(shape: FamilyShape, tokens: int, dtype_bytes: int) -> int:
    """GQA whose query width ``H x head_dim`` exceeds ``D`` (qwen3_moe: 32 x 128 = 4096 over D 2048):
    the queries ``[T, H x head_dim]`` and the attention output before ``o_proj`` are wider than the
    residual-size tensors ``ATTN_STREAM`` counts, by ``T x (H x head_dim - D) x b`` each. Counted,
    not fitted; 0 for MLA (its queries are in :func:`mla_attention_bytes`) and when ``H x head_dim <= D``."""
    if shape.mla:
        return 0
    return 2 * tokens * max(0, shape.n_head * shape.head_dim - shape.dim) * dtype_bytes


def mla_attention_bytes(shape: FamilyShape, tokens: int, longest: int, dtype_bytes: int) -> int:
    """MLA's per-step temporaries beyond the residual stream (the worker's ``MLAttention``):
    the queries ``[T, H, nope + rope]`` and their copy with rotated rope half, and, for the
    longest segment of ``s1`` keys, ``kv_b_proj``'s per-head keys and values
    ``[s1, H, nope + v]`` and the keys with the shared rotary key appended ``[s1, H, nope + rope]``
    (the latent is up-projected per step; only the latent is cached)."""
    s, b = shape, dtype_bytes
    queries = 2 * tokens * s.n_head * s.qk_head_dim * b
    keys_values = longest * s.n_head * (s.qk_nope_head_dim + s.v_head_dim + s.qk_head_dim) * b
    return queries + keys_values


def math_sdpa_bytes(shape: FamilyShape, pairs: int, dtype_bytes: int) -> int:
    """SDPA's math-path scores when the value width differs from the query/key width (MLA):
    ``MLA_MATH_SCORES x H x query-key pairs x b`` of the largest segment; 0 otherwise."""
    if not shape.mla or shape.v_head_dim == shape.qk_head_dim or pairs <= 0:
        return 0
    return int(MLA_MATH_SCORES * shape.n_head * pairs * dtype_bytes)


def step_peak(shape: ShapeLike, step: Step, routing: Routing, dtype: str = "float32") -> Estimate:
    """Predicted peak bytes of one engine step above the idle process (module docstring)."""
    shape = as_family(shape)
    b = DTYPE_BYTES[dtype]
    t = step.tokens
    d, i, e, k = shape.dim, shape.intermediate_size, shape.num_experts, shape.top_k
    upcast = int(UPCAST_STREAM * t * d * 4) if b < 4 else 0
    n_active = active_experts(t, shape, routing.top_share) if t else 0
    lowp = int(LOWP_EXPERT_WEIGHT * shape.n_layer * n_active * i * d * b) if b < 4 else 0
    pairs = max([n * (s + n) for s, n in step.prefill] + [c + 1 for c in step.decode_contexts], default=0)
    longest = max([s + n for s, n in step.prefill] + [c + 1 for c in step.decode_contexts], default=0)
    attn_stream = int(ATTN_STREAM * t * d * b)
    mask = int(MASK_FACTOR * mask_bytes_per_pair(b) * pairs)
    if shape.mla:
        repeat = mla_attention_bytes(shape, t, longest, b)
        repeat_how = (f"2 x T {t:,} x H {shape.n_head} x {shape.qk_head_dim} + {longest:,} keys x H"
                      f" {shape.n_head} x ({shape.qk_nope_head_dim} + {shape.v_head_dim} + {shape.qk_head_dim}),"
                      f" x {b} B")
    else:
        repeat = 2 * shape.n_head * longest * shape.head_dim * b
        repeat_how = f"2 x H {shape.n_head} x {longest:,} keys x {shape.head_dim} x {b} B"
    scores = math_sdpa_bytes(shape, pairs, b)
    wide = wide_heads_bytes(shape, t, b)
    attention = attn_stream + mask + repeat + scores + wide + upcast
    n_top = busiest_expert_slots(t, shape, routing)
    moe_stream = int(MOE_STREAM * t * d * b)
    expert = swiglu_bytes(n_top, shape, i, b)
    shared = swiglu_bytes(t, shape, shape.shared_intermediate_size, b) if shape.shared_intermediate_size else 0
    router = t * e * (b + 4) + 32 * k * t
    moe = (moe_stream + max(expert, shared) + router + upcast + lowp) if shape.moe_layers else 0
    dense = 0
    if shape.dense_layers:
        dense = moe_stream + swiglu_bytes(t, shape, shape.dense_intermediate_size, b) + upcast
    kv = step.new_kv_tokens * kv_bytes_per_token(shape, b)
    terms = [
        ("KV cache of admitted sequences", kv,
         f"{step.new_kv_tokens:,} tokens x {kv_bytes_per_token(shape, b):,} B"),
        ("attention: stream", attn_stream, f"{ATTN_STREAM:g} x T {t:,} x D {d} x {b} B"),
        ("attention: causal mask", mask,
         f"{MASK_FACTOR:g} x {mask_bytes_per_pair(b)} B x {pairs:,} query-key pairs"),
        ("attention: MLA queries and per-head K/V" if shape.mla else "attention: repeated K/V", repeat, repeat_how),
        ("MoE: stream", moe_stream, f"{MOE_STREAM:g} x T {t:,} x D {d} x {b} B"),
        ("MoE: busiest expert", expert, f"{n_top:,} slots x (D {d} + 2 x I {i}) x {b} B"),
        ("MoE: router and dispatch", router, f"T {t:,} x E {e} x ({b} + 4) B + 32 x k {k} x T"),
    ]
    if wide:
        terms.append(("attention: queries and output wider than D", wide,
                      f"2 x T {t:,} x (H {shape.n_head} x {shape.head_dim} - D {d}) x {b} B"))
    if scores:
        terms.append(("attention: SDPA math path (MLA: v width != q/k width)", scores,
                      f"{MLA_MATH_SCORES:g} x H {shape.n_head} x {pairs:,} query-key pairs x {b} B"))
    if shared:
        terms.append(("MoE: shared expert (after the routed ones; the larger counts)", shared,
                      f"T {t:,} x (D {d} + 2 x I_shared {shape.shared_intermediate_size}) x {b} B"))
    if dense:
        terms.append(("dense MLP layer", dense, f"{MOE_STREAM:g} x T x D x {b} B + T {t:,} x (D {d} + 2 x I_dense"
                                                f" {shape.dense_intermediate_size}) x {b} B"))
    if upcast:
        terms.append(("float32 upcasts (2-byte dtype)", upcast, f"{UPCAST_STREAM:g} x T {t:,} x D {d} x 4 B"))
    if lowp:
        terms.append(("MoE: 2-byte dtype, per active expert", lowp,
                      f"{LOWP_EXPERT_WEIGHT:g} x {shape.n_layer} layers x {n_active} experts x I {i} x D {d} x {b} B"))
    terms.append(("step constant", STEP_CONSTANT, "allocator arenas, Python objects"))
    return Estimate(kv, attention, moe, STEP_CONSTANT, n_top, terms, dense)


def budget_step(shape: ShapeLike, max_prefill_tokens: int, max_decode_tokens: int) -> Step:
    """The worst step the budgets allow: one prefill chunk of ``max_prefill_tokens`` ending at
    ``max_seq_len`` (the largest mask), plus ``max_decode_tokens`` decode tokens at full context."""
    p = min(max_prefill_tokens, shape.max_seq_len)
    return Step(prefill=((shape.max_seq_len - p, p),) if p else (),
                decode_contexts=(shape.max_seq_len - 1,) * max_decode_tokens)


def worst_case_peak(shape: ShapeLike, max_prefill_tokens: int, max_decode_tokens: int,
                    running_sequences: int, top_share: float, dtype: str = "float32",
                    expert_chunk_tokens: int = 2048, capacity_factor: float = 0.0) -> tuple[int, Estimate]:
    """Peak bytes above the idle process when ``running_sequences`` sequences hold full
    ``max_seq_len`` KV caches and the worst step of the budgets runs: ``(total, step estimate)``."""
    est = step_peak(shape, budget_step(shape, max_prefill_tokens, max_decode_tokens),
                    Routing(top_share, expert_chunk_tokens, capacity_factor), dtype)
    kv_all = running_sequences * shape.max_seq_len * kv_bytes_per_token(shape, DTYPE_BYTES[dtype])
    return kv_all + est.total_bytes, est
