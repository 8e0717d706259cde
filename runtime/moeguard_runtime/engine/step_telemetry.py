"""What one engine step reports: the batch-start and routing log events, the step's
metrics and stage durations, and the memory snapshot. Called by the step loop;
every function here only formats and records (no clock, no device access)."""

from __future__ import annotations

from collections.abc import Sequence

from moeguard_runtime.engine.engine import Engine, StepOutput
from moeguard_runtime.engine.scheduler import StepPlan
from moeguard_runtime.memory.procmem import DeviceMemory, ProcessMemory
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry, top_share


def log_batch_start(log: RateLimitedLog, plan: StepPlan, engine: Engine,
                    prefill: Sequence[tuple[str, int]], decode: Sequence[str], long_requests: int = 0) -> None:
    """``event=inference_batch_start`` (rate-limited): the batch id, its requests, prefill and decode
    tokens, the batches in flight (and those prefilling), and ``long_requests`` (long requests running
    or preempted in the worker)."""
    if not log.allowed("inference_batch_start"):
        return
    lengths = [len(engine.sequences[r].prompt) for r in (*dict(prefill), *decode)]
    log.event("inference_batch_start", step=plan.step, batch=plan.batch,
              requests=len(prefill) + len(decode), input_tokens=plan.prefill_tokens,
              prefill_tokens=sum(n for _, n in prefill), decode_tokens=len(decode),
              longest_request=max(lengths, default=0), active_decode_sequences=len(decode),
              concurrent_batches=plan.active_batches, batches_in_flight=plan.active_batches,
              prefill_batches=plan.prefill_batches, long_requests=long_requests)


def record_step(tel: Telemetry, log: RateLimitedLog, plan: StepPlan, out: StepOutput,
                seconds: float) -> None:
    """The step's metrics, its stage durations (``prefill`` or ``decode`` is the step
    less the MoE layers' routing and expert time, seconds), and
    ``event=moe_routing_stats`` (rate-limited). Reads the routing marks: call after
    the step has synchronised the device (:meth:`Engine.step` returns after it)."""
    routing_s = sum(r.routing_seconds for r in out.routing)
    expert_s = sum(r.expert_seconds for r in out.routing)
    tel.observe_step(out.prefill_tokens, out.decode_tokens, out.routing, seconds)
    tel.stage("prefill" if out.prefill_tokens else "decode", max(0.0, seconds - routing_s - expert_s))
    tel.stage("routing", routing_s)
    tel.stage("expert", expert_s)
    if out.routing and log.allowed("moe_routing_stats"):
        layer = max(range(len(out.routing)), key=lambda i: out.routing[i].expert_skew_ratio)
        top = out.routing[layer]
        counts = top.tokens_per_expert
        log.event("moe_routing_stats", step=plan.step, layers=len(out.routing),
                  top_skew_layer=layer, top_skew_ratio=round(top.expert_skew_ratio, 3),
                  top_expert=max(range(len(counts)), key=counts.__getitem__) if counts else -1,
                  top_share=round(top_share(top), 4),
                  top_expert_tokens=",".join(str(r.top_expert_tokens) for r in out.routing),
                  median_expert_tokens=",".join(f"{r.median_expert_tokens:g}" for r in out.routing),
                  skew_ratio=",".join(f"{r.expert_skew_ratio:.2f}" for r in out.routing),
                  overflow_tokens=",".join(str(r.overflow_tokens) for r in out.routing),
                  expert_chunks=",".join(str(r.expert_chunks) for r in out.routing))


def log_memory_snapshot(log: RateLimitedLog, stage: str, m: ProcessMemory, d: DeviceMemory | None,
                        kv_cache_bytes: int) -> None:
    """``event=memory_snapshot`` of ``m`` (process) and ``d`` (device, or None); bytes."""
    log.event("memory_snapshot", stage=stage, rss_bytes=m.rss,
              rss_anonymous_bytes=m.rss_anonymous, rss_file_bytes=m.rss_file,
              python_allocated_blocks=m.python_allocated_blocks,
              malloc_in_use_bytes=m.malloc_in_use, mappings=m.mappings,
              gpu_allocated_bytes=d.allocated if d else None,
              gpu_reserved_bytes=d.reserved if d else None,
              pinned_bytes=d.pinned if d else None, kv_cache_bytes=kv_cache_bytes)
