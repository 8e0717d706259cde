"""The worker loop: scheduler + engine + memory guard + telemetry, on one thread.

HTTP handlers call :meth:`Worker.submit` and :meth:`Worker.cancel` (cheap, under
a lock); a dedicated thread plans steps with the scheduler and runs them on the
engine, outside the lock, so the event loop stays responsive while torch
works. Results go back through each request's ``sink`` callback (the server
passes one that hops onto the event loop).

**Overload mode** is on when any source asks for it (exported as
``moeguard_overload_active{source}``): the operator (``overloadMode: On`` in the
budget document), the environment (``MOEGUARD_OVERLOAD_MODE=On``), or, only in
mode ``Auto``, the worker itself: on when memory is above the soft limit or the
queue holds at least 80 % of ``max_queue_requests``; off again once memory is
below the soft limit, the queue under 40 %, and :data:`OVERLOAD_HOLD_S` seconds
have passed since the last trigger.

**Out of memory** in a step (``torch.cuda.OutOfMemoryError``, or a host
``MemoryError``, including a KV cache that cannot be allocated) fails that
step's requests with HTTP 503 ``out_of_memory``, is logged as
``event=inference_oom kind=cuda|host`` and counted; the loop goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from moeguard_runtime.budget_watch import NO_GENERATION, decide_update
from moeguard_runtime.config import Settings
from moeguard_runtime.contract import Budgets
from moeguard_runtime.engine import Engine
from moeguard_runtime.leak import FaultLeaker, GrowthTracker, classify
from moeguard_runtime.memory import (
    MemoryPolicy,
    MemoryReading,
    MemoryState,
    decide,
    decide_device,
    read_memory,
    shrink_factor,
)
from moeguard_runtime.procmem import (
    DeviceMemory,
    ProcessMemory,
    read_device_memory,
    read_process_memory,
)
from moeguard_runtime.scheduler import OverloadPolicy, Rejected, Scheduler, StepPlan
from moeguard_runtime.telemetry import RateLimitedLog, Telemetry
from moeguard_runtime.timing import clock

MEMORY_CHECK_INTERVAL_S = 0.25
GROWTH_SAMPLE_INTERVAL_S = 1.0
"""Seconds between two process-memory samples of the leak signal."""
GROWTH_WINDOW_S = 60.0
OVERLOAD_HOLD_S = 5.0
OVERLOAD_QUEUE_ON, OVERLOAD_QUEUE_OFF = 0.8, 0.4


@dataclass(frozen=True)
class GenerationRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    priority: str = "interactive"


@dataclass(frozen=True)
class Event:
    """What a request's sink receives: ``admitted`` once, when the request leaves the
    queue for a batch (its KV cache allocated, just before its first step), then
    tokens, then one ``finish`` or ``error``. A request refused or timed out in
    the queue, or whose KV cache cannot be allocated, receives only ``error``, so
    a streaming response can still answer with an HTTP error status."""

    kind: Literal["admitted", "token", "finish", "error"]
    token: int = -1
    finish_reason: str = ""
    status: int = 200
    reason: str = ""
    message: str = ""


Sink = Callable[[Event], None]


@dataclass
class _Active:
    request: GenerationRequest
    sink: Sink
    arrival: float
    first_token_at: float | None = None


class Worker:
    """Owns the engine thread. ``clock`` is monotonic seconds (injected for tests)."""

    def __init__(self, settings: Settings, engine: Engine, telemetry: Telemetry,
                 log: RateLimitedLog, clock: Callable[[], float] = time.monotonic,
                 memory_reader: Callable[[], MemoryReading] = read_memory,
                 device_reader: Callable[[], DeviceMemory | None] | None = None,
                 process_reader: Callable[[], ProcessMemory] = read_process_memory) -> None:
        self.settings = settings
        self.engine = engine
        self.telemetry = telemetry
        self.log = log
        self._clock = clock
        self._read_memory = memory_reader
        self._read_device = device_reader or (lambda: read_device_memory(settings.device))
        self._read_process = process_reader
        max_ctx = settings.overload_max_context_tokens or engine.args.max_seq_len // 2
        self.overload_policy = OverloadPolicy(max_context_tokens=max_ctx)
        self.scheduler = Scheduler(settings.budgets, settings.limits, clock, self.overload_policy)
        self.overload_sources = {"operator": False, "worker": False,
                                 "env": settings.overload_mode == "On"}
        self._last_overload_trigger = -1e18
        self.growth = GrowthTracker(GROWTH_WINDOW_S)
        self._next_growth_sample = 0.0
        self.leak_kind = "none"
        self.last_device: DeviceMemory | None = None
        self._leaker = FaultLeaker(settings.fault_leak_anon_bps, settings.fault_leak_python_bps)
        self.policy = MemoryPolicy(settings.soft_limit_bytes, settings.hard_limit_bytes,
                                   settings.soft_shrink_factor)
        self.memory_state = MemoryState.NORMAL
        self.last_memory: MemoryReading | None = None
        self._next_memory_check = 0.0
        self.budget_generation = NO_GENERATION
        self._cond = threading.Condition()
        self._active: dict[str, _Active] = {}
        self._to_release: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        telemetry.set_budgets(settings.budgets)
        for name, value in (("soft", settings.soft_limit_bytes), ("hard", settings.hard_limit_bytes)):
            if value is not None:
                telemetry.memory_limit.labels(**telemetry.l(limit=name)).set(value)
        self._apply_overload()

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.check_memory(force=True)
        self._thread.start()
        if self._leaker.enabled:
            self.log.event("fault_enabled", force=True, leak_anon_bytes_per_second=self._leaker.anon_bps,
                           leak_python_bytes_per_second=self._leaker.python_bps)
        self._leaker.start()

    def stop(self) -> None:
        self._leaker.stop()
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return self.alive and self.memory_state != MemoryState.HARD

    # --- called from HTTP handlers ------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue ``request``; raises :class:`Rejected` (reason ``memory_hard_limit``
        above the hard limit, else the scheduler's caps and queue bounds)."""
        if self.memory_state == MemoryState.HARD and self.last_memory is not None:
            raise Rejected("memory_hard_limit",
                           f"worker memory {self.last_memory.usage_bytes} bytes "
                           f"({self.last_memory.source}) is above the hard limit "
                           f"{self.policy.hard_limit_bytes} bytes", retry_after_s=5, status=503)
        with self._cond:
            self.scheduler.submit(request.req_id, len(request.prompt), request.max_new_tokens,
                                  request.priority)
            self._active[request.req_id] = _Active(request, sink, self._clock())
            self._update_queue_gauges()
            self._cond.notify()

    def cancel(self, req_id: str) -> None:
        """Drop a request (client gone); its sink receives nothing more."""
        with self._cond:
            if self._active.pop(req_id, None) is not None:
                self.scheduler.finish(req_id)
                self._to_release.append(req_id)
                self._update_queue_gauges()

    def _update_queue_gauges(self) -> None:
        """Call with the lock held."""
        self.telemetry.set_queue(self.scheduler.queue_requests, self.scheduler.queue_tokens,
                                 self.scheduler.running_requests)

    def on_budget_data(self, data: Mapping[str, str] | None) -> None:
        """Budget ConfigMap content from the watch: validate, then apply or refuse."""
        decision = decide_update(data, self.budget_generation, self.engine.args.max_seq_len)
        result = {"apply": "applied", "reject": "rejected", "ignore": "ignored"}[decision.action]
        self.telemetry.budget_updates.labels(**self.telemetry.l(result=result)).inc()
        if decision.action == "reject":
            self.log.event("budget_rejected", force=True, reason=decision.reason,
                           kept_generation=self.budget_generation)
            return
        if decision.action == "ignore" or decision.document is None:
            self.log.event("budget_ignored", reason=decision.reason)
            return
        doc = decision.document
        max_ctx = (doc.overload_max_context_tokens or self.settings.overload_max_context_tokens
                   or self.engine.args.max_seq_len // 2)
        self.overload_policy = OverloadPolicy(max_context_tokens=max_ctx)
        with self._cond:
            self.scheduler.set_budgets(doc.budgets)
            self.budget_generation = doc.generation
            self.overload_sources["operator"] = doc.overload_mode == "On"
            self._apply_overload()
            self._cond.notify()
        self.telemetry.budget_generation.labels(**self.telemetry.labels).set(doc.generation)
        self.log.event("budget_received", force=True, generation=doc.generation,
                       reason=doc.reason, overload_mode=doc.overload_mode,
                       overload_max_context_tokens=max_ctx, **doc.budgets.model_dump())

    @property
    def overload(self) -> bool:
        return any(self.overload_sources.values())

    def _apply_overload(self) -> None:
        """Push the overload state into the scheduler (call with the lock held, or before start)."""
        on = self.overload
        changed = on != self.scheduler.overload
        self.scheduler.set_overload(on, self.overload_policy)
        for source, active in self.overload_sources.items():
            self.telemetry.overload.labels(**self.telemetry.l(source=source)).set(int(active))
        if changed:
            self.log.event("overload_mode", force=True, active=on,
                           sources=",".join(k for k, v in self.overload_sources.items() if v) or "none",
                           max_context_tokens=self.overload_policy.max_context_tokens)

    def _overload_trigger(self, now: float) -> None:
        """The worker's own trigger (mode Auto only): see the module docstring."""
        if self.settings.overload_mode != "Auto":
            return
        max_queue = self.scheduler.next_budgets.max_queue_requests
        queue = self.scheduler.queue_requests
        pressure = (self.memory_state != MemoryState.NORMAL
                    or queue >= OVERLOAD_QUEUE_ON * max_queue)
        if pressure:
            self._last_overload_trigger = now
        calm = (self.memory_state == MemoryState.NORMAL and queue <= OVERLOAD_QUEUE_OFF * max_queue
                and now - self._last_overload_trigger >= OVERLOAD_HOLD_S)
        want = pressure or (self.overload_sources["worker"] and not calm)
        if want != self.overload_sources["worker"]:
            self.overload_sources["worker"] = want
            self._apply_overload()

    def check_memory(self, force: bool = False) -> None:
        """Read the compared figures (rate-limited), move the soft/hard state, and
        sample the leak signal every :data:`GROWTH_SAMPLE_INTERVAL_S`."""
        now = self._clock()
        if not force and now < self._next_memory_check:
            return
        self._next_memory_check = now + MEMORY_CHECK_INTERVAL_S
        reading = self._read_memory()
        device = self._read_device()
        if self.last_memory is None:
            self.log.event("memory_source", force=True, source=reading.source,
                           usage_bytes=reading.usage_bytes, cgroup_limit_bytes=reading.limit_bytes,
                           cgroup_path=reading.cgroup_path,
                           soft_limit_bytes=self.policy.soft_limit_bytes,
                           hard_limit_bytes=self.policy.hard_limit_bytes,
                           gpu=device is not None,
                           gpu_soft_fraction=self.settings.gpu_soft_fraction,
                           gpu_hard_fraction=self.settings.gpu_hard_fraction)
        self.last_memory, self.last_device = reading, device
        tel = self.telemetry
        tel.memory_usage.labels(**tel.l(source=reading.source)).set(reading.usage_bytes)
        if reading.limit_bytes is not None:
            tel.memory_cgroup_limit.labels(**tel.l(source=reading.source)).set(reading.limit_bytes)
        state = decide(self.memory_state, reading.usage_bytes, self.policy)
        if device is not None:
            tel.set_device(device)
            state = max(state, decide_device(self.memory_state, device.used, device.total,
                                             self.settings.gpu_soft_fraction,
                                             self.settings.gpu_hard_fraction))
        if state != self.memory_state:
            old_factor = shrink_factor(self.memory_state, self.policy)
            factor = shrink_factor(state, self.policy)
            self.memory_state = state
            if factor != old_factor:
                with self._cond:
                    self.scheduler.set_shrink_factor(factor)
            self.log.event("memory_state", force=True, state=state.name.lower(),
                           usage_bytes=reading.usage_bytes, source=reading.source,
                           gpu_used_bytes=device.used if device else None, shrink_factor=factor)
        tel.memory_state.labels(**tel.labels).set(int(state))
        if force or now >= self._next_growth_sample:
            self._next_growth_sample = now + GROWTH_SAMPLE_INTERVAL_S
            self.growth.add(now, self._read_process())
            growth = self.growth.growth()
            kind = classify(growth)
            tel.set_growth(growth, kind)
            if kind != self.leak_kind:
                self.log.event("memory_growth", force=True, kind=kind,
                               rss_anonymous_bytes_per_second=round(growth.rss_anonymous_bytes),
                               python_blocks_per_second=round(growth.python_allocated_blocks, 1),
                               mappings_per_second=round(growth.mappings, 2),
                               window_s=round(growth.window_s, 1))
                self.leak_kind = kind
        with self._cond:
            self._overload_trigger(now)

    def memory_snapshot(self, stage: str) -> None:
        """``event=memory_snapshot`` (rate-limited; nothing is read when it would be dropped)."""
        if not self.log.allowed("memory_snapshot"):
            return
        m = self._read_process()
        d = self.last_device
        self.log.event("memory_snapshot", stage=stage, rss_bytes=m.rss,
                       rss_anonymous_bytes=m.rss_anonymous, rss_file_bytes=m.rss_file,
                       python_allocated_blocks=m.python_allocated_blocks,
                       malloc_in_use_bytes=m.malloc_in_use, mappings=m.mappings,
                       gpu_allocated_bytes=d.allocated if d else None,
                       gpu_reserved_bytes=d.reserved if d else None,
                       pinned_bytes=d.pinned if d else None,
                       kv_cache_bytes=self.engine.kv_cache_bytes())

    # --- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception as exc:  # never let the loop die
                self.log.event("engine_loop_error", force=True, error=repr(exc)[:500])
                time.sleep(0.1)

    def _iteration(self) -> None:
        self.check_memory()
        with self._cond:
            release, self._to_release = self._to_release, []
            result = self.scheduler.schedule()
            expired = [(r, self._active.pop(r, None)) for r in result.expired]
            self._update_queue_gauges()
            if result.plan is None and not expired and not release:
                self._cond.wait(timeout=MEMORY_CHECK_INTERVAL_S)
        for req_id in release:
            self.engine.release(req_id)
        timeout = self.scheduler.next_budgets.queue_timeout_seconds
        for _, active in expired:
            if active is not None:
                self.telemetry.rejections.labels(**self.telemetry.l(reason="queue_timeout")).inc()
                active.sink(Event("error", status=503, reason="queue_timeout",
                                  message=f"request waited in the queue longer than "
                                          f"queue_timeout_seconds {timeout} s"))
        if result.budgets_applied is not None:
            self._budgets_applied(result.budgets_applied)
        if result.plan is not None:
            self._run_step(result.plan)

    def _budgets_applied(self, budgets: Budgets) -> None:
        factor = shrink_factor(self.memory_state, self.policy)
        self.telemetry.set_budgets(budgets, factor)
        self.log.event("budget_applied", force=True, generation=self.budget_generation,
                       shrink_factor=factor, overload=self.scheduler.overload,
                       **budgets.model_dump())

    def _run_step(self, plan: StepPlan) -> None:
        tel = self.telemetry
        now = self._clock()
        with self._cond:
            admitted = [(r, self._active.get(r)) for r in plan.admitted]
        step_ids = [r for r, _, _ in plan.prefill] + list(plan.decode)
        t0 = clock(self.engine.device)
        try:
            for req_id, active in admitted:
                if active is not None and req_id not in self.engine.sequences:
                    r = active.request
                    tel.stage("queue", now - active.arrival)
                    self.engine.add(req_id, r.prompt, r.max_new_tokens, r.temperature, r.seed)
            for req_id, active in admitted:
                if active is not None and req_id in self.engine.sequences:
                    active.sink(Event("admitted"))
            prefill = [(r, n) for r, _, n in plan.prefill if r in self.engine.sequences]
            decode = [r for r in plan.decode if r in self.engine.sequences]
            if self.log.allowed("inference_batch_start"):
                lengths = [len(self.engine.sequences[r].prompt) for r in (*dict(prefill), *decode)]
                self.log.event("inference_batch_start", step=plan.step, batch=plan.batch,
                               requests=len(prefill) + len(decode),
                               input_tokens=plan.prefill_tokens,
                               longest_request=max(lengths, default=0),
                               active_decode_sequences=len(decode),
                               concurrent_batches=plan.active_batches)
            self.memory_snapshot("post_pack_pre_forward")
            if self.settings.fault_step_delay_s > 0:
                time.sleep(self.settings.fault_step_delay_s)
            out = self.engine.step(prefill, decode)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            kind = "cuda" if isinstance(exc, torch.cuda.OutOfMemoryError) else "host"
            tel.oom.labels(**tel.l(kind=kind)).inc()
            self.log.event("inference_oom", force=True, kind=kind, step=plan.step,
                           requests=len(step_ids), prefill_tokens=plan.prefill_tokens,
                           error=repr(exc)[:300])
            if kind == "cuda":
                torch.cuda.empty_cache()
            self._fail(step_ids, 503, "out_of_memory",
                       f"the batch ran out of memory ({kind}); the request was not completed, "
                       f"retry later")
            return
        except Exception as exc:
            self.log.event("inference_batch_error", force=True, error=repr(exc)[:500])
            self._fail(step_ids, 500, "engine_error", f"inference failed: {exc!r}"[:500])
            return
        t1 = clock(self.engine.device)
        routing_s = sum(r.routing_seconds for r in out.routing)
        expert_s = sum(r.expert_seconds for r in out.routing)
        tel.observe_step(out.prefill_tokens, out.decode_tokens, out.routing, t1 - t0)
        tel.stage("prefill" if out.prefill_tokens else "decode", max(0.0, t1 - t0 - routing_s - expert_s))
        tel.stage("routing", routing_s)
        tel.stage("expert", expert_s)
        if out.routing and self.log.allowed("moe_routing_stats"):
            self.log.event("moe_routing_stats", step=plan.step, layers=len(out.routing),
                           top_expert_tokens=",".join(str(r.top_expert_tokens) for r in out.routing),
                           median_expert_tokens=",".join(f"{r.median_expert_tokens:g}"
                                                         for r in out.routing),
                           skew_ratio=",".join(f"{r.expert_skew_ratio:.2f}" for r in out.routing),
                           overflow_tokens=",".join(str(r.overflow_tokens) for r in out.routing))
        self._deliver(out.new_tokens, out.finished)
        tel.stage("postprocess", clock(self.engine.device) - t1)

    def _deliver(self, new_tokens: dict[str, int], finished_reasons: dict[str, str]) -> None:
        now = self._clock()
        finished: list[tuple[str, _Active | None]] = []
        with self._cond:
            for req_id in finished_reasons:
                self.scheduler.finish(req_id)
                finished.append((req_id, self._active.pop(req_id, None)))
                self._to_release.append(req_id)
            sinks = {r: self._active.get(r) for r in new_tokens}
            sinks.update({r: a for r, a in finished})
            self._update_queue_gauges()
        for req_id, token in new_tokens.items():
            active = sinks.get(req_id)
            if active is None:
                continue
            if active.first_token_at is None:
                active.first_token_at = now
                self.telemetry.ttft.labels(**self.telemetry.labels).observe(now - active.arrival)
            if req_id not in finished_reasons or finished_reasons[req_id] == "length":
                active.sink(Event("token", token=token))
        for req_id, active in finished:
            if active is not None:
                self.telemetry.e2e.labels(**self.telemetry.labels).observe(now - active.arrival)
                active.sink(Event("finish", finish_reason=finished_reasons[req_id]))

    def _fail(self, req_ids: list[str], status: int, reason: str, message: str) -> None:
        with self._cond:
            failed = [(r, self._active.pop(r, None)) for r in req_ids]
            for r in req_ids:
                self.scheduler.finish(r)
                self._to_release.append(r)
            self._update_queue_gauges()
        for _, active in failed:
            if active is not None:
                active.sink(Event("error", status=status, reason=reason, message=message))
