"""The worker loop: scheduler + engine + memory guard + telemetry, on one thread.

HTTP handlers call :meth:`Worker.submit` and :meth:`Worker.cancel` (cheap, under
a lock); a dedicated thread plans steps with the scheduler and runs them on the
engine, outside the lock, so the event loop stays responsive while torch
works. Results go back through each request's ``sink`` callback (the server
passes one that hops onto the event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from moeguard_runtime.budget_watch import NO_GENERATION, decide_update
from moeguard_runtime.config import Settings
from moeguard_runtime.contract import Budgets
from moeguard_runtime.engine import Engine
from moeguard_runtime.memory import (
    MemoryPolicy,
    MemoryReading,
    MemoryState,
    decide,
    read_memory,
    shrink_factor,
)
from moeguard_runtime.scheduler import Rejected, Scheduler, StepPlan
from moeguard_runtime.telemetry import RateLimitedLog, Telemetry

MEMORY_CHECK_INTERVAL_S = 0.25


@dataclass(frozen=True)
class GenerationRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class Event:
    """What a request's sink receives: tokens, then one ``finish`` or ``error``."""

    kind: Literal["token", "finish", "error"]
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
                 memory_reader: Callable[[], MemoryReading] = read_memory) -> None:
        self.settings = settings
        self.engine = engine
        self.telemetry = telemetry
        self.log = log
        self._clock = clock
        self._read_memory = memory_reader
        self.scheduler = Scheduler(settings.budgets, settings.limits, clock)
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

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.check_memory(force=True)
        self._thread.start()

    def stop(self) -> None:
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
                           f"{self.policy.hard_limit_bytes} bytes", retry_after_s=5)
        with self._cond:
            self.scheduler.submit(request.req_id, len(request.prompt), request.max_new_tokens)
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
        decision = decide_update(data, self.budget_generation)
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
        with self._cond:
            self.scheduler.set_budgets(doc.budgets)
            self.budget_generation = doc.generation
            self._cond.notify()
        self.telemetry.budget_generation.labels(**self.telemetry.labels).set(doc.generation)
        self.log.event("budget_received", force=True, generation=doc.generation,
                       reason=doc.reason, overload_mode=doc.overload_mode,
                       **doc.budgets.model_dump())

    def check_memory(self, force: bool = False) -> None:
        """Read the compared figure (rate-limited) and move the soft/hard state."""
        now = self._clock()
        if not force and now < self._next_memory_check:
            return
        self._next_memory_check = now + MEMORY_CHECK_INTERVAL_S
        reading = self._read_memory()
        if self.last_memory is None:
            self.log.event("memory_source", force=True, source=reading.source,
                           usage_bytes=reading.usage_bytes, cgroup_limit_bytes=reading.limit_bytes,
                           soft_limit_bytes=self.policy.soft_limit_bytes,
                           hard_limit_bytes=self.policy.hard_limit_bytes)
        self.last_memory = reading
        self.telemetry.memory_usage.labels(**self.telemetry.l(source=reading.source)).set(
            reading.usage_bytes)
        state = decide(self.memory_state, reading.usage_bytes, self.policy)
        if state != self.memory_state:
            old_factor = shrink_factor(self.memory_state, self.policy)
            factor = shrink_factor(state, self.policy)
            self.memory_state = state
            if factor != old_factor:
                with self._cond:
                    self.scheduler.set_shrink_factor(factor)
            self.log.event("memory_state", force=True, state=state.name.lower(),
                           usage_bytes=reading.usage_bytes, source=reading.source,
                           shrink_factor=factor)
        self.telemetry.memory_state.labels(**self.telemetry.labels).set(int(state))

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
        for _, active in expired:
            if active is not None:
                self.telemetry.rejections.labels(**self.telemetry.l(reason="queue_timeout")).inc()
                active.sink(Event("error", status=503, reason="queue_timeout",
                                  message=f"request waited in the queue longer than "
                                          f"{self.settings.limits.queue_timeout_s} s"))
        if result.budgets_applied is not None:
            self._budgets_applied(result.budgets_applied)
        if result.plan is not None:
            self._run_step(result.plan)

    def _budgets_applied(self, budgets: Budgets) -> None:
        factor = shrink_factor(self.memory_state, self.policy)
        self.telemetry.set_budgets(budgets, factor)
        self.log.event("budget_applied", force=True, generation=self.budget_generation,
                       shrink_factor=factor, **budgets.model_dump())

    def _run_step(self, plan: StepPlan) -> None:
        with self._cond:
            admitted = [(r, self._active.get(r)) for r in plan.admitted]
        for req_id, active in admitted:
            if active is not None and req_id not in self.engine.sequences:
                r = active.request
                self.engine.add(req_id, r.prompt, r.max_new_tokens, r.temperature, r.seed)
        prefill = [(r, n) for r, _, n in plan.prefill if r in self.engine.sequences]
        decode = [r for r in plan.decode if r in self.engine.sequences]
        self.log.event("inference_batch_start", step=plan.step, batch=plan.batch,
                       prefill_tokens=plan.prefill_tokens, decode_tokens=len(plan.decode),
                       requests=len(prefill) + len(decode))
        t0 = time.perf_counter()
        try:
            out = self.engine.step(prefill, decode)
        except Exception as exc:
            self.log.event("inference_batch_error", force=True, error=repr(exc)[:500])
            self._fail([r for r, _ in prefill] + decode, exc)
            return
        seconds = time.perf_counter() - t0
        self.telemetry.observe_step(out.prefill_tokens, out.decode_tokens, out.routing, seconds)
        now = self._clock()
        finished: list[tuple[str, _Active | None]] = []
        with self._cond:
            for req_id in out.finished:
                self.scheduler.finish(req_id)
                finished.append((req_id, self._active.pop(req_id, None)))
                self._to_release.append(req_id)
            sinks = {r: self._active.get(r) for r in out.new_tokens}
            sinks.update({r: a for r, a in finished})
            self._update_queue_gauges()
        for req_id, token in out.new_tokens.items():
            active = sinks.get(req_id)
            if active is None:
                continue
            if active.first_token_at is None:
                active.first_token_at = now
                self.telemetry.ttft.labels(**self.telemetry.labels).observe(now - active.arrival)
            if req_id not in out.finished or out.finished[req_id] == "length":
                active.sink(Event("token", token=token))
        for req_id, active in finished:
            if active is not None:
                self.telemetry.e2e.labels(**self.telemetry.labels).observe(now - active.arrival)
                active.sink(Event("finish", finish_reason=out.finished[req_id]))

    def _fail(self, req_ids: list[str], exc: Exception) -> None:
        with self._cond:
            failed = [(r, self._active.pop(r, None)) for r in req_ids]
            for r in req_ids:
                self.scheduler.finish(r)
                self._to_release.append(r)
        for _, active in failed:
            if active is not None:
                active.sink(Event("error", status=500, reason="engine_error",
                                  message=f"inference failed: {exc!r}"[:500]))
