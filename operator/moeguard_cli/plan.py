"""Starting budgets from a model shape and a memory limit: the memory model, inverted.

``moeguard plan`` answers "which budgets keep this shape under this limit at this skew?" with
:mod:`moeguard_core.memory_model` (validated against measured peaks; bench/results/memory_model.md).
Every term is printed with its arithmetic so that it can be checked by hand.

* **Weights** = parameters x bytes per element (``family_shape.parameter_count``: a preset's
  ``presets.parameter_count``; for a ``config.json`` its family's attention (GQA or MLA), shared
  experts, dense first layers and (un)tied embeddings).
* **Runtime overhead**: the process without its weights (torch, Python; on a GPU the CUDA
  context); default 512 MiB (measured here on CPU: about 410 MiB for ``tiny``, 550 MiB for
  ``small``, as cgroup usage). **Headroom**: a fraction of the limit (default 10 %) for
  fragmentation and page cache.
* **available** = limit - weights - overhead - headroom.
* **maxPrefillTokens**: the largest multiple of 16 whose worst step (one prefill chunk ending at
  ``max_seq_len``, plus a full decode step) has a modelled peak within ``prefill_fraction`` of
  available (default 0.3). The step's peak grows with the busiest expert's token-slots, from the
  expected skew (top / median expert tokens), and is cut by the expert chunk bound.
* **KV capacity** = available - that worst step's peak, in tokens of KV cache; running sequences
  = KV capacity / ``context_tokens`` (prompt + max_tokens each; default ``max_seq_len``, where
  every sequence may reach the model's limit).
* **maxBatchRequests** = running sequences / ``maxConcurrentBatches`` (the engine runs one step
  at a time, so batches add their KV caches but not their step peaks); **maxDecodeTokens** = the
  same (every member decodes each step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeguard_core.family_shape import FamilyShape, parameter_count
from moeguard_core.memory_model import (
    DTYPE_BYTES,
    MiB,
    ShapeLike,
    as_family,
    kv_arithmetic,
    kv_bytes_per_token,
    top_share_from_skew_ratio,
    worst_case_peak,
)

__all__ = ["DTYPE_BYTES", "MiB", "Plan", "PlanInput", "batching_yaml", "estimate"]


@dataclass(frozen=True)
class PlanInput:
    """What ``plan`` needs: a model shape (a preset's ``ModelArgs`` or a family's
    :class:`FamilyShape`), a memory limit and the knobs of the estimate."""

    args: ShapeLike
    memory_bytes: int
    dtype: str = "bfloat16"
    skew: float = 4.0
    headroom: float = 0.10
    overhead_bytes: int = 512 * MiB
    prefill_fraction: float = 0.30
    concurrent_batches: int = 2
    context_tokens: int | None = None
    expert_chunk_tokens: int = 2048
    capacity_factor: float = 0.0


@dataclass
class Plan:
    """The estimate, each term with the arithmetic that produced it."""

    weights_bytes: int
    kv_bytes_per_token: int
    step_peak_bytes: int
    available_bytes: int
    max_prefill_tokens: int
    max_decode_tokens: int
    max_batch_requests: int
    max_concurrent_batches: int
    floor_prefill_tokens: int
    fits: bool
    top_share: float = 0.0
    lines: list[tuple[str, str, str]] = field(default_factory=list)


def _round_down(n: float, multiple: int) -> int:
    return max(0, int(n) // multiple * multiple)


def _step_peak(shape: FamilyShape, prefill: int, decode: int, p: PlanInput, share: float) -> int:
    _, est = worst_case_peak(shape, prefill, decode, 0, share, p.dtype, p.expert_chunk_tokens,
                             p.capacity_factor)
    return est.total_bytes


def estimate(p: PlanInput) -> Plan:
    """Starting budgets for ``p`` (see the module docstring for every term)."""
    a = shape = as_family(p.args)
    b = DTYPE_BYTES[p.dtype]
    params = parameter_count(a)
    weights = params * b
    kv = kv_bytes_per_token(shape, b)
    share = top_share_from_skew_ratio(p.skew, a.num_experts, a.top_k)
    context = min(p.context_tokens or a.max_seq_len, a.max_seq_len)
    headroom = int(p.memory_bytes * p.headroom)
    available = p.memory_bytes - weights - p.overhead_bytes - headroom
    lines = [
        ("parameters", f"{params:,}", f"family_shape.parameter_count ({a.model_type})"),
        ("weights", f"{weights / MiB:,.1f} MiB", f"{params:,} x {b} B ({p.dtype})"),
        ("KV cache per token", f"{kv:,} B", kv_arithmetic(a, b)),
        ("busiest expert share", f"{share:.3f} of slots",
         f"skew {p.skew:g} / (skew + E {a.num_experts} - 1), within [1/E, 1/k]"),
        ("overhead + headroom", f"{(p.overhead_bytes + headroom) / MiB:,.1f} MiB",
         f"{p.overhead_bytes / MiB:.0f} MiB + {p.headroom:.0%} of {p.memory_bytes / MiB:,.0f} MiB"),
        ("available", f"{available / MiB:,.1f} MiB", "limit - weights - overhead - headroom"),
    ]
    if available <= 0:
        return Plan(weights, kv, 0, available, 0, 0, 0, p.concurrent_batches, 0, False, share, lines)
    step_budget = available * p.prefill_fraction
    # Decode tokens share the step with the prefill chunk; size the decode part first from a
    # provisional request count, then find the largest prefill chunk (binary search, multiples of 16).
    provisional = max(1, int(available * (1 - p.prefill_fraction) / (kv * context)) // p.concurrent_batches)
    lo, hi = 0, min(a.max_seq_len, 1_048_576) // 16
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _step_peak(shape, mid * 16, provisional, p, share) <= step_budget:
            lo = mid
        else:
            hi = mid - 1
    prefill = lo * 16
    peak = _step_peak(shape, prefill, provisional, p, share) if prefill else 0
    kv_tokens = max(0, available - peak) // kv
    running = int(kv_tokens // context)
    requests = max(0, min(running // p.concurrent_batches, 65_536))
    decode = requests
    floor = max(16, _round_down(prefill / 8, 16)) if prefill >= 16 else 0
    fits = prefill >= 16 and requests >= 1
    _, worst = worst_case_peak(shape, prefill, provisional, 0, share, p.dtype, p.expert_chunk_tokens,
                               p.capacity_factor)
    lines += [
        ("maxPrefillTokens", f"{prefill:,}",
         f"largest multiple of 16 with worst step <= {p.prefill_fraction:.0%} x available "
         f"= {step_budget / MiB:,.1f} MiB"),
        ("worst step peak", f"{peak / MiB:,.1f} MiB",
         f"{worst.phase} phase; chunk of {prefill:,} ending at {a.max_seq_len} + {provisional} decode tokens"),
        *[(f"  {name}", f"{v / MiB:,.2f} MiB", how) for name, v, how in worst.terms if v],
        ("KV capacity", f"{kv_tokens:,} tokens", f"(available - worst step) / {kv:,} B"),
        ("running sequences", f"{running:,}", f"KV capacity / {context:,} context tokens each"),
        ("maxBatchRequests", f"{requests:,}", f"running / {p.concurrent_batches} concurrent batches"),
        ("maxDecodeTokens", f"{decode:,}", "= maxBatchRequests (every member decodes each step)"),
        ("floors.maxPrefillTokens", f"{floor:,}", "maxPrefillTokens / 8, at least 16"),
    ]
    return Plan(weights, kv, peak, available, prefill, decode, requests, p.concurrent_batches, floor, fits,
                share, lines)


def batching_yaml(plan: Plan) -> str:
    """The ``spec.batching`` block to paste into a MoEInferenceService."""
    return (
        "batching:\n"
        f"  maxPrefillTokens: {plan.max_prefill_tokens}\n"
        f"  maxDecodeTokens: {plan.max_decode_tokens}\n"
        f"  maxBatchRequests: {plan.max_batch_requests}\n"
        f"  maxConcurrentBatches: {plan.max_concurrent_batches}\n"
        "  floors:\n"
        f"    maxPrefillTokens: {plan.floor_prefill_tokens}\n"
    )
