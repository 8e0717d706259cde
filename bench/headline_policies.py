"""The headline experiment's three batching policies, as worker environments, and its limits.

Pure: the memory limits, the moeguard policy's knobs, each policy's environment and the
``moeguard plan`` budgets they start from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
PRESET = "small"
HARD_LIMIT = 1152 * MiB
"""Chosen so that request-count batching hits it on this traffic: a first run at 1400 MiB saw its
cgroup peak at 1273 MiB (idle 797 MiB) with no kill."""
SOFT_LIMIT = 980 * MiB
"""0.85 x hard."""

HUGE = {"prefill": 1_048_576, "decode": 1_048_576, "requests": 65_536, "queue": 1_048_576}


QUEUE_TIMEOUT_S = float(os.environ.get("BENCH_QUEUE_TIMEOUT_S", "2"))
"""The moeguard policy's queue timeout: a request that has not started within 2 s is refused
(the trace's requests take ~1-4 s to serve here; waiting longer than that only adds latency)."""


MOEGUARD_BATCHES = int(os.environ.get("BENCH_MOEGUARD_BATCHES", "1"))
"""One batch in flight: the engine runs batches' steps in turn, so with two batches each request
decodes every other step; one batch with the plan's request count decodes every step."""
STEP_PREFILL_TOKENS = int(os.environ.get("BENCH_STEP_PREFILL_TOKENS", "256"))
"""Prefill tokens per step chosen for decode latency (chunked prefill, as vLLM's
``max_num_batched_tokens``): every step that carries a prefill chunk also carries the running
requests' decode tokens, so the chunk sets their time per output token. The plan's figure is the
memory ceiling; the policy uses the smaller of the two."""

PLAN_OVERHEAD = 450 * MiB
"""Least runtime overhead (the idle worker's memory besides its weights) the plan uses: the fresh
worker measured 800 MiB of cgroup usage here (421 MiB besides its 379 MiB of weights); the run
measures it again (:func:`bench.headline.measure_idle`) and takes the larger figure."""
LONG_REQUEST_THRESHOLD_TOKENS = 512
"""A prompt of at least this many tokens counts as long (at most one per batch in the full policy)."""
PLAN_CONTEXT = 1024
"""Expected context (prompt + max_tokens) per running sequence used to size the KV share;
above the p90 of the scaled trace's prompts plus max_tokens (676 + 32); longer requests are
what the soft limit, the long-request cap and the bounded queue are for."""


def moeguard_env(b: dict[str, int]) -> dict[str, str]:
    """The full moeguard policy: plan budgets, concurrency cap, bounded queue, limits, overload."""
    running = MOEGUARD_BATCHES * b["max_batch_requests"]
    queue = b["max_batch_requests"]  # one batch's worth waiting: it can start within a step or two
    prefill = min(b["max_prefill_tokens"], STEP_PREFILL_TOKENS)
    return {
        "MOEGUARD_MAX_PREFILL_TOKENS": str(prefill),
        "MOEGUARD_MAX_DECODE_TOKENS": str(b["max_decode_tokens"]),
        "MOEGUARD_MAX_BATCH_REQUESTS": str(b["max_batch_requests"]),
        "MOEGUARD_MAX_CONCURRENT_BATCHES": str(MOEGUARD_BATCHES),
        "MOEGUARD_MAX_LONG_REQUESTS_PER_BATCH": "1",  # KV is planned at PLAN_CONTEXT per sequence
        # named here (not the worker's default, 2048 since the contract unified the defaults):
        # the committed results ran with 512, and prompts here are at most PLAN_CONTEXT long
        "MOEGUARD_LONG_REQUEST_THRESHOLD_TOKENS": str(LONG_REQUEST_THRESHOLD_TOKENS),
        "MOEGUARD_MAX_QUEUE_REQUESTS": str(queue),
        "MOEGUARD_MAX_QUEUE_TOKENS": str(8 * prefill),
        "MOEGUARD_MAX_CONCURRENT_REQUESTS": str(running + queue),
        "MOEGUARD_QUEUE_TIMEOUT_SECONDS": f"{QUEUE_TIMEOUT_S:g}",
        "MOEGUARD_SOFT_LIMIT_BYTES": str(SOFT_LIMIT),
        "MOEGUARD_HARD_LIMIT_BYTES": str(HARD_LIMIT),
        "MOEGUARD_OVERLOAD_MODE": "Auto",
    }


def policy_env(plan_budgets: dict[str, int]) -> dict[str, dict[str, str]]:
    """Environment of each policy. Everything not named here is the worker's default."""
    unbounded_queue = {
        "MOEGUARD_MAX_QUEUE_REQUESTS": str(HUGE["queue"]),
        "MOEGUARD_MAX_QUEUE_TOKENS": str(1 << 30),
        "MOEGUARD_MAX_CONCURRENT_REQUESTS": str(1 << 20),
        "MOEGUARD_QUEUE_TIMEOUT_SECONDS": "3600",
        "MOEGUARD_OVERLOAD_MODE": "Off",
        "MOEGUARD_MAX_LONG_REQUESTS_PER_BATCH": str(HUGE["requests"]),
    }
    return {
        # 1. the seed's "before": at most 16 requests per batch, no token budget, no queue bound.
        "request-count": {
            **unbounded_queue,
            "MOEGUARD_MAX_PREFILL_TOKENS": str(HUGE["prefill"]),
            "MOEGUARD_MAX_DECODE_TOKENS": str(HUGE["decode"]),
            "MOEGUARD_MAX_BATCH_REQUESTS": "16",
            "MOEGUARD_MAX_CONCURRENT_BATCHES": "2",
        },
        # 2. token budgets alone: moeguard's prefill/decode budgets (from `moeguard plan`), no
        #    request cap per batch, no concurrency cap, no queue bound, no memory limits.
        "token-budgets": {
            **unbounded_queue,
            "MOEGUARD_MAX_PREFILL_TOKENS": str(plan_budgets["max_prefill_tokens"]),
            "MOEGUARD_MAX_DECODE_TOKENS": "16",  # the request-count policy's decode width per batch
            "MOEGUARD_MAX_BATCH_REQUESTS": str(HUGE["requests"]),
            "MOEGUARD_MAX_CONCURRENT_BATCHES": "2",
        },
        # 3. full moeguard, as a platform engineer would deploy it: `moeguard plan` budgets for the
        #    soft limit and the expected context, a concurrency cap (what the batches can run plus
        #    a short queue), a bounded queue with a short timeout (a request that cannot start within
        #    QUEUE_TIMEOUT_S gets a fast 429/503 with Retry-After instead of a slow success), soft and
        #    hard memory limits, overload mode Auto.
        "moeguard": moeguard_env(plan_budgets),
    }


def plan_overhead(idle_bytes: int, weights_bytes: int) -> int:
    """The runtime overhead for the plan: the measured idle worker less its weights, rounded up to
    8 MiB, and never below PLAN_OVERHEAD (a served worker sits higher than a fresh one)."""
    return max(PLAN_OVERHEAD, -(-(idle_bytes - weights_bytes) // (8 * MiB)) * 8 * MiB)


def weights_bytes() -> int:
    """The ``small`` preset's float32 weights."""
    sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "core")]
    from moeguard_core.presets import get_preset, parameter_count

    return parameter_count(get_preset(PRESET)) * 4  # float32


def plan_budgets(overhead: int = 0) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """The moeguard policy's budgets: `moeguard plan` for this shape, the soft limit, the measured
    runtime overhead and the expected context."""
    sys.path.insert(0, str(ROOT / "operator"))
    sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "core")]
    from moeguard_cli.plan import PlanInput, estimate
    from moeguard_core.presets import get_preset

    p = estimate(PlanInput(args=get_preset(PRESET), memory_bytes=SOFT_LIMIT, dtype="float32", skew=4.0,
                           headroom=0.0, overhead_bytes=overhead or PLAN_OVERHEAD,
                           concurrent_batches=MOEGUARD_BATCHES, context_tokens=PLAN_CONTEXT))
    if not p.fits:
        raise RuntimeError(f"plan says the model does not fit the soft limit ({SOFT_LIMIT / MiB:.0f} MiB) with "
                           f"{(overhead or PLAN_OVERHEAD) / MiB:.0f} MiB of runtime overhead")
    return ({"max_prefill_tokens": p.max_prefill_tokens, "max_decode_tokens": p.max_decode_tokens,
             "max_batch_requests": p.max_batch_requests}, p.lines)
