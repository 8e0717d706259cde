"""Starting budgets from a model shape and a memory limit: a documented estimate.

Until the measured memory model of issue 6 lands, ``moeguard plan`` uses this first-order estimate.
Every term is printed with its arithmetic so that it can be checked by hand.

* **Weights** = parameters x bytes per element (``presets.parameter_count``; embeddings untied).
* **KV cache per token** = 2 (K and V) x layers x KV heads x head_dim x bytes — the standard figure
  used to size vLLM's KV blocks and TGI's ``max_batch_total_tokens``.
* **Activation peak per prefill token** (one layer at a time; attention is chunked):
  hidden state and residual (2·D), Q/K/V (D + 2·KV·head_dim), router logits in float32 (E·4 bytes,
  softmax in float32 as in HF ``MixtralSparseMoeBlock``), the top-k gathered expert inputs and outputs
  (2·k·D), and the **MoE expert buffer** of the busiest expert: SwiGLU intermediate 3·I for each of its
  token-slots. Under skew ``s`` (top expert / median), the busiest expert holds about
  ``min(s·k/E, 1)`` slots per token — the per-expert gather buffers grow with the top expert's count,
  not the average (the vLLM fused-MoE OOMs at long prefill, fixed by chunking activations; DeepSpeed /
  GShard capacity = tokens·k/E·capacity_factor for the balanced case).
* **Runtime overhead**: the CUDA context / torch allocator and the Python process (default 512 MiB),
  and a **headroom** fraction of the limit (default 10%) for fragmentation and page cache.

The memory left after weights, overhead and headroom is split: ``prefill_fraction`` (default 0.3) for
prefill activations, the rest for the KV cache. ``maxConcurrentBatches`` batches can be in flight at
once, and overlapping batches add their peaks, so the prefill share is divided among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeguard_runtime.presets import ModelArgs, parameter_count

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 1024 * 1024


@dataclass(frozen=True)
class PlanInput:
    """What ``plan`` needs: a model shape, a memory limit and the knobs of the estimate."""

    args: ModelArgs
    memory_bytes: int
    dtype: str = "bfloat16"
    skew: float = 4.0
    headroom: float = 0.10
    overhead_bytes: int = 512 * MiB
    prefill_fraction: float = 0.30
    concurrent_batches: int = 2


@dataclass
class Plan:
    """The estimate, each term with the arithmetic that produced it."""

    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_prefill_token: int
    available_bytes: int
    max_prefill_tokens: int
    max_decode_tokens: int
    max_batch_requests: int
    max_concurrent_batches: int
    floor_prefill_tokens: int
    fits: bool
    lines: list[tuple[str, str, str]] = field(default_factory=list)


def _round_down(n: float, multiple: int) -> int:
    return max(0, int(n) // multiple * multiple)


def estimate(p: PlanInput) -> Plan:
    """Starting budgets for ``p`` (see the module docstring for every term)."""
    a = p.args
    b = DTYPE_BYTES[p.dtype]
    params = parameter_count(a)
    weights = params * b
    kv_dim = a.n_kv_head * a.head_dim
    kv = 2 * a.n_layer * kv_dim * b
    top_share = min(p.skew * a.top_k / a.num_experts, 1.0)
    act_elems = 2 * a.dim + (a.dim + 2 * kv_dim) + 2 * a.top_k * a.dim + top_share * 3 * a.intermediate_size
    act = int(act_elems * b + a.num_experts * 4)
    headroom = int(p.memory_bytes * p.headroom)
    available = p.memory_bytes - weights - p.overhead_bytes - headroom
    lines = [
        ("parameters", f"{params:,}", "presets.parameter_count"),
        ("weights", f"{weights / MiB:,.1f} MiB", f"{params:,} x {b} B ({p.dtype})"),
        ("KV cache per token", f"{kv:,} B", f"2 x {a.n_layer} layers x {a.n_kv_head} kv heads x {a.head_dim} x {b} B"),
        ("busiest expert share", f"{top_share:.3f} slots/token", f"min(skew {p.skew} x k {a.top_k} / E {a.num_experts}, 1)"),
        ("activation per prefill token", f"{act:,} B",
         f"({2 * a.dim} + {a.dim + 2 * kv_dim} + {2 * a.top_k * a.dim} + {top_share:.3f} x 3 x {a.intermediate_size}) x {b} B"
         f" + {a.num_experts} x 4 B"),
        ("overhead + headroom", f"{(p.overhead_bytes + headroom) / MiB:,.1f} MiB",
         f"{p.overhead_bytes / MiB:.0f} MiB + {p.headroom:.0%} of {p.memory_bytes / MiB:,.0f} MiB"),
        ("available", f"{available / MiB:,.1f} MiB", "limit - weights - overhead - headroom"),
    ]
    if available <= 0:
        return Plan(weights, kv, act, available, 0, 0, 0, p.concurrent_batches, 0, False, lines)
    prefill_mem = available * p.prefill_fraction / p.concurrent_batches
    prefill = min(_round_down(prefill_mem / act, 16), 1_048_576)
    kv_tokens = available * (1 - p.prefill_fraction) / kv
    decode = max(1, min(int(kv_tokens // a.max_seq_len), 1_048_576))
    requests = max(1, min(decode, 65_536))
    floor = max(16, _round_down(prefill / 8, 16)) if prefill >= 16 else 0
    fits = prefill >= 16
    lines += [
        ("maxPrefillTokens", f"{prefill:,}",
         f"{p.prefill_fraction:.0%} x available / {p.concurrent_batches} batches / {act:,} B, down to a multiple of 16"),
        ("KV capacity", f"{int(kv_tokens):,} tokens", f"{1 - p.prefill_fraction:.0%} x available / {kv:,} B"),
        ("maxDecodeTokens", f"{decode:,}", f"KV capacity / max_seq_len {a.max_seq_len} (every sequence may reach it)"),
        ("maxBatchRequests", f"{requests:,}", "= maxDecodeTokens"),
        ("floors.maxPrefillTokens", f"{floor:,}", "maxPrefillTokens / 8, at least 16"),
    ]
    return Plan(weights, kv, act, available, prefill, decode, requests, p.concurrent_batches, floor, fits, lines)


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
