"""The memory model: a batch step's peak memory from its tokens, the model shape, skew and dtype.

Pure arithmetic (no torch), shared by ``moeguard plan`` and the benchmarks. It models the
worker's own code path (``moeguard_runtime.model`` / ``moe`` / ``engine``), one engine step at
a time: the worker has one engine thread, so the activations of two batches never coexist; only
their KV caches do.

**Peak of one step** (bytes above the loaded, idle process)::

    peak = KV(new sequences of the step) + STEP_CONSTANT + max(attention phase, MoE phase)

* **KV cache** of a sequence = 2 (K, V) x layers x KV heads x head_dim x capacity x dtype bytes,
  where capacity = prompt + max_new_tokens, allocated whole at admission (``KVCache``).
* **Attention phase** (one layer; layers run one after another)::

      ATTN_STREAM x T x D x b            residual stream, norm, QKV, rotary temporaries
    + mask_bytes_per_pair(b) x max(n x s1) the causal mask of the largest prefill segment
                                         (n queries over s1 keys: bool ones, its tril, and the
                                         copies SDPA makes of it: 2 x (2 + b) bytes a pair)
    + 2 x H x s1 x head_dim x b          keys and values repeated over the query heads (GQA)

* **MoE phase**::

      MOE_STREAM x T x D x b             residual stream, norm, output accumulator
    + n_top x (D + 3 x I) x b            the busiest expert's slice: gathered inputs [n, D] and
                                         SwiGLU temporaries w1 x, silu, w3 x [n, I] each
    + T x E x (b + 4)                    router logits and the float32 softmax
    + 32 x k x T                         dispatch indices (int64 sort order, token ids)

  with ``n_top = min(top_share x k x T, expert_chunk_tokens, capacity)``: the per-expert
  buffers grow with the **top expert's** token-slots, not the average, until the chunk bound
  (``MOEGUARD_EXPERT_CHUNK_TOKENS``) or the DeepSpeed capacity
  ``ceil(T x k / E x capacity_factor)`` cuts them.

* ``b`` = dtype bytes; with a 2-byte dtype the RMSNorm and rotary code upcast to float32, which
  adds ``UPCAST_STREAM x T x D x 4`` to both phases.

``top_share`` is the top expert's share of the step's ``T x k`` token-slots: ``1/E`` when perfectly
balanced, at most ``1/k`` (every token sends one slot to it). The worker's metric
``expert_skew_ratio = top / median`` converts with :func:`top_share_from_skew_ratio`.

**Coefficients.** ``ATTN_STREAM``, ``MOE_STREAM``, ``STEP_CONSTANT`` and the factor 2 of
:func:`mask_bytes_per_pair` are empirical: counting the tensors alive at each point gives about
4-6 residual-size tensors, but the RSS also keeps memory that glibc's heap has freed and not yet
returned. They were chosen by a grid search minimising the worst relative error on the eight
float32, unskewed, default-chunk configurations of the ``small`` preset (``bench/memory_configs.py``,
role ``calibration``) and then checked, unchanged, on the twenty others (skew, chunk bound,
capacity factor, decode, KV-heavy, bfloat16, three other shapes): bench/results/memory_model.md.
``UPCAST_STREAM`` is counted, not fitted, and the bfloat16 rows show it is not enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ATTN_STREAM = 6.0
"""Residual-size tensors (T x D x b) the attention phase holds at its peak, RSS included."""
MOE_STREAM = 7.0
"""Residual-size tensors the MoE phase holds at its peak, RSS included."""
UPCAST_STREAM = 2.0
"""Extra float32 residual-size tensors when the dtype is 2 bytes (norm and rotary upcasts)."""
STEP_CONSTANT = 2 * 1024 * 1024
"""Bytes every step touches whatever its size (allocator arenas, Python objects)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Shape:
    """The model's shape (the fields of ``moeguard_runtime.presets.ModelArgs`` the model needs)."""

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    intermediate_size: int
    num_experts: int
    top_k: int
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @classmethod
    def of(cls, args: object) -> Shape:
        """From any object with the ``ModelArgs`` attribute names."""
        return cls(**{f: int(getattr(args, f)) for f in cls.__dataclass_fields__})


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

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.constant_bytes + max(self.attention_bytes, self.moe_bytes)

    @property
    def phase(self) -> str:
        return "attention" if self.attention_bytes >= self.moe_bytes else "moe"


def kv_bytes_per_token(shape: Shape, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes."""
    return 2 * shape.n_layer * shape.n_kv_head * shape.head_dim * dtype_bytes


def top_share_from_skew_ratio(skew_ratio: float, num_experts: int, top_k: int) -> float:
    """Top expert's share of the slots from ``expert_skew_ratio`` (top / median), taking the
    other ``E - 1`` experts at the median: ``r / (r + E - 1)``, clipped to ``[1/E, 1/k]``."""
    r = max(float(skew_ratio), 1.0)
    return min(max(r / (r + num_experts - 1), 1.0 / num_experts), 1.0 / top_k)


def busiest_expert_slots(tokens: int, shape: Shape, routing: Routing) -> int:
    """Token-slots the busiest expert processes at once: ``top_share x k x T`` cut by the
    chunk bound and, with a capacity factor, by DeepSpeed's capacity."""
    share = min(max(routing.top_share, 1.0 / shape.num_experts), 1.0 / shape.top_k)
    n = math.ceil(share * shape.top_k * tokens)
    if routing.capacity_factor > 0:
        cap = max(routing.min_capacity,
                  math.ceil(tokens * shape.top_k / shape.num_experts * routing.capacity_factor))
        n = min(n, cap)
    return min(n, routing.expert_chunk_tokens)


def mask_bytes_per_pair(dtype_bytes: int) -> int:
    """Bool ``ones``, its ``tril`` copy, and SDPA's additive mask in the query dtype (2 + b bytes),
    doubled: the measured peaks of long single prompts need twice that (SDPA's CPU path makes
    a second copy of the converted mask)."""
    return 2 * (2 + dtype_bytes)


def step_peak(shape: Shape, step: Step, routing: Routing, dtype: str = "float32") -> Estimate:
    """Predicted peak bytes of one engine step above the idle process (module docstring)."""
    b = DTYPE_BYTES[dtype]
    t = step.tokens
    d, i, e, k = shape.dim, shape.intermediate_size, shape.num_experts, shape.top_k
    upcast = int(UPCAST_STREAM * t * d * 4) if b < 4 else 0
    pairs = max([n * (s + n) for s, n in step.prefill] + [c + 1 for c in step.decode_contexts], default=0)
    longest = max([s + n for s, n in step.prefill] + [c + 1 for c in step.decode_contexts], default=0)
    attn_stream = int(ATTN_STREAM * t * d * b)
    mask = mask_bytes_per_pair(b) * pairs
    repeat = 2 * shape.n_head * longest * shape.head_dim * b
    attention = attn_stream + mask + repeat + upcast
    n_top = busiest_expert_slots(t, shape, routing)
    moe_stream = int(MOE_STREAM * t * d * b)
    expert = n_top * (d + 3 * i) * b
    router = t * e * (b + 4) + 32 * k * t
    moe = moe_stream + expert + router + upcast
    kv = step.new_kv_tokens * kv_bytes_per_token(shape, b)
    terms = [
        ("KV cache of admitted sequences", kv,
         f"{step.new_kv_tokens:,} tokens x {kv_bytes_per_token(shape, b):,} B"),
        ("attention: stream", attn_stream, f"{ATTN_STREAM:g} x T {t:,} x D {d} x {b} B"),
        ("attention: causal mask", mask, f"{mask_bytes_per_pair(b)} B x {pairs:,} query-key pairs"),
        ("attention: repeated K/V", repeat, f"2 x H {shape.n_head} x {longest:,} keys x {shape.head_dim} x {b} B"),
        ("MoE: stream", moe_stream, f"{MOE_STREAM:g} x T {t:,} x D {d} x {b} B"),
        ("MoE: busiest expert", expert, f"{n_top:,} slots x (D {d} + 3 x I {i}) x {b} B"),
        ("MoE: router and dispatch", router, f"T {t:,} x E {e} x ({b} + 4) B + 32 x k {k} x T"),
    ]
    if upcast:
        terms.append(("float32 upcasts (2-byte dtype)", upcast, f"{UPCAST_STREAM:g} x T {t:,} x D {d} x 4 B"))
    terms.append(("step constant", STEP_CONSTANT, "allocator arenas, Python objects"))
    return Estimate(kv, attention, moe, STEP_CONSTANT, n_top, terms)


def budget_step(shape: Shape, max_prefill_tokens: int, max_decode_tokens: int) -> Step:
    """The worst step the budgets allow: one prefill chunk of ``max_prefill_tokens`` ending at
    ``max_seq_len`` (the largest mask), plus ``max_decode_tokens`` decode tokens at full context."""
    p = min(max_prefill_tokens, shape.max_seq_len)
    return Step(prefill=((shape.max_seq_len - p, p),) if p else (),
                decode_contexts=(shape.max_seq_len - 1,) * max_decode_tokens)


def worst_case_peak(shape: Shape, max_prefill_tokens: int, max_decode_tokens: int,
                    running_sequences: int, top_share: float, dtype: str = "float32",
                    expert_chunk_tokens: int = 2048, capacity_factor: float = 0.0) -> tuple[int, Estimate]:
    """Peak bytes above the idle process when ``running_sequences`` sequences hold full
    ``max_seq_len`` KV caches and the worst step of the budgets runs: ``(total, step estimate)``."""
    est = step_peak(shape, budget_step(shape, max_prefill_tokens, max_decode_tokens),
                    Routing(top_share, expert_chunk_tokens, capacity_factor), dtype)
    kv_all = running_sequences * shape.max_seq_len * kv_bytes_per_token(shape, DTYPE_BYTES[dtype])
    return kv_all + est.total_bytes, est
