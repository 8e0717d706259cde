"""The worker: one engine thread that joins the step loop, the memory guard, the
overload trigger, the leak sampler and the budget updates.

Each job lives in its own module; this one wires them and keeps the surface the
server and the tests use (:meth:`Worker.submit`, :meth:`Worker.cancel`,
:meth:`Worker.on_budget_data`, :meth:`Worker.check_memory`, ``ready``):

* :mod:`moeguard_runtime.engine.step_loop`: plan, run and deliver steps (and the OOM rule);
* :mod:`moeguard_runtime.memory.allocation`: allocation failures, and readiness and liveness after them;
* :mod:`moeguard_runtime.engine.memory_guard`: host/device memory, soft/hard state;
* :mod:`moeguard_runtime.engine.overload_trigger`: overload sources and the Auto trigger;
* :mod:`moeguard_runtime.telemetry.leak_sampler`: the leak signal's samples;
* :mod:`moeguard_runtime.engine.step_telemetry`: what a step logs and records;
* :mod:`moeguard_runtime.faults`: the test-only fault injectors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from moeguard_core import contract
from moeguard_core.contract import Budgets
from moeguard_core.memory_admission import MemoryAdmission, StepPredictor
from moeguard_core.ucx import SCAN_INTERVAL_S, UcxInfo, risky
from moeguard_runtime.config import Settings
from moeguard_runtime.engine.budget_watch import NO_GENERATION, decide_update
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.generation import Event, GenerationRequest, Sink
from moeguard_runtime.engine.kv_handoff import KVHandoff
from moeguard_runtime.engine.memory_guard import MemoryGuard
from moeguard_runtime.engine.overload_trigger import OverloadTrigger
from moeguard_runtime.engine.scheduler import BATCH, OverloadPolicy, Rejected, Scheduler
from moeguard_runtime.engine.step_loop import IDLE_WAIT_S, StepLoop
from moeguard_runtime.engine.step_telemetry import log_memory_snapshot
from moeguard_runtime.faults import FaultLeaker
from moeguard_runtime.memory.allocation import AllocationHealth
from moeguard_runtime.memory.memory import MemoryReading, MemoryState, read_memory
from moeguard_runtime.memory.procmem import (
    DeviceMemory,
    ProcessMemory,
    read_device_memory,
    read_process_memory,
)
from moeguard_runtime.memory.ucx_scan import current_info
from moeguard_runtime.parallel.expert_parallel import ExpertParallelGroup
from moeguard_runtime.telemetry.leak_sampler import LeakSampler
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

__all__ = ["Event", "GenerationRequest", "Sink", "Worker"]


class Worker:
    """Owns the engine thread. ``clock`` is monotonic seconds; it, the memory readers and
    ``idle_wait_s`` (the idle loop's longest wait, 0 to never block) are injected for tests;
    ``admission``: memory-aware admission (:mod:`moeguard_core.memory_admission`), None: off;
    ``predictor``: the memory model of the steps for the peak breakdown (default: the admission's);
    ``read_ucx``: the UCX state of the process (:func:`ucx_scan.current_info`), read every
    :data:`ucx.SCAN_INTERVAL_S`; ``handoff``: a prefill or decode worker's KV handoff (issue 33), None for a
    single worker."""

    def __init__(self, settings: Settings, engine: Engine, telemetry: Telemetry,
                 log: RateLimitedLog, clock: Callable[[], float] = time.monotonic,
                 memory_reader: Callable[[], MemoryReading] = read_memory,
                 device_reader: Callable[[], DeviceMemory | None] | None = None,
                 process_reader: Callable[[], ProcessMemory] = read_process_memory,
                 idle_wait_s: float = IDLE_WAIT_S, admission: MemoryAdmission | None = None,
                 predictor: StepPredictor | None = None,
                 read_ucx: Callable[[], UcxInfo] = current_info, handoff: KVHandoff | None = None) -> None:
        self.settings, self.engine, self.telemetry, self.log = settings, engine, telemetry, log
        self._clock = clock
        self._read_process = process_reader
        self.memory = MemoryGuard(settings, telemetry, log, memory_reader,
                                  device_reader or (lambda: read_device_memory(settings.device)))
        self.leaks = LeakSampler(telemetry, log, process_reader)
        policy = OverloadPolicy(self._context_cap(None))
        self.overload_trigger = OverloadTrigger(settings.overload_mode, policy, telemetry, log)
        self.scheduler = Scheduler(settings.budgets, settings.limits, self._now, policy, settings.priority)
        self.loop = StepLoop(self.scheduler, engine, telemetry, log, self._now, settings.faults,
                             self._budgets_applied, self.memory_snapshot, idle_wait_s,
                             self._allocation_failed, AllocationHealth(settings.unrecovered_oom_s),
                             admission, memory_reader, predictor, handoff)
        self._read_ucx = read_ucx
        self._next_ucx_scan = 0.0
        self.budget_generation = NO_GENERATION
        self._leaker = FaultLeaker.from_faults(settings.faults)
        self._stop = threading.Event()
        self._draining = False
        self.ep_lost: str | None = None
        """Why the expert-parallel group broke (:meth:`group_lost`), None while it works or without one."""
        self.ep_group: ExpertParallelGroup | None = None
        """The expert-parallel group of a leader (``__main__``), None for the single-process worker."""
        self.on_group_lost: Callable[[str], None] | None = None
        """Called once after :meth:`group_lost` answered the requests in flight (``__main__``: exit)."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        telemetry.set_budgets(settings.budgets)
        self.overload_trigger.apply(self.scheduler)

    def _now(self) -> float:
        return self._clock()

    def _context_cap(self, from_document: int | None) -> int:
        return contract.overload_context_cap(from_document or self.settings.overload_max_context_tokens,
                                             self.engine.args.max_seq_len)

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.check_memory(force=True)
        self._thread.start()
        if self._leaker.enabled:
            self.log.event("fault_enabled", force=True, leak_anon_bytes_per_second=self._leaker.anon_bps,
                           leak_python_bytes_per_second=self._leaker.python_bps)
        self._leaker.start()

    def stop(self) -> None:
        """Stop the engine thread (after a drain: nothing is in flight)."""
        self._leaker.stop()
        self._stop.set()
        with self.loop.cond:
            self.loop.cond.notify_all()
        self._thread.join(timeout=5)

    def drain(self) -> None:
        """Stop admitting (SIGTERM): :meth:`submit` refuses with 503 ``shutting_down``, readiness fails;
        what was accepted runs on (:meth:`in_flight`) until it ends or :meth:`cut` ends it."""
        self._draining = True
        self.log.event("drain_start", force=True, in_flight=len(self.loop.in_flight()))

    @property
    def draining(self) -> bool:
        return self._draining

    def in_flight(self) -> int:
        """Requests accepted and not yet ended."""
        return len(self.loop.in_flight())

    def cut(self, message: str) -> int:
        """End every request still in flight with a 503 ``shutting_down`` error (a JSON 503 with
        Retry-After, or an SSE error event for a stream already answering); returns how many."""
        ids = self.loop.in_flight()
        for priority in self.loop.classes(ids):
            self.telemetry.refused("shutting_down", priority)
        if ids:
            self.loop.fail(ids, 503, "shutting_down", message)
        self.log.event("drain_cut", force=True, requests=len(ids))
        return len(ids)

    def group_lost(self, message: str) -> None:
        """The expert-parallel group broke (a rank died or hung; any thread): end every request in flight
        with 503 ``expert_parallel_group_unavailable``, refuse new ones the same way, fail readiness, then
        call :attr:`on_group_lost` (the process exits, LeaderWorkerSet recreates the group)."""
        if self.ep_lost is not None:
            return
        self.ep_lost = message
        ids = self.loop.in_flight()
        for priority in self.loop.classes(ids):
            self.telemetry.refused(contract.EP_GROUP_UNAVAILABLE, priority)
        if ids:
            self.loop.fail(ids, 503, contract.EP_GROUP_UNAVAILABLE,
                           f"the expert-parallel group is unavailable ({message}); retry on another replica")
        self.log.event("ep_group_lost", force=True, reason=message, requests_failed=len(ids))
        with self.loop.cond:
            self.loop.cond.notify_all()
        if self.on_group_lost is not None:
            self.on_group_lost(message)

    @property
    def alive(self) -> bool:
        return self.not_alive_reason is None

    @property
    def not_alive_reason(self) -> str | None:
        """Why ``/healthz`` answers 503, or None while alive: the engine loop stopped, or steps
        have failed to allocate memory for longer than ``MOEGUARD_UNRECOVERED_OOM_SECONDS``
        (:meth:`allocation.AllocationHealth.not_alive_reason`), so the kubelet restarts it."""
        if not self._thread.is_alive():
            return "engine loop stopped"
        return self.loop.health.not_alive_reason(self._clock())

    @property
    def ready(self) -> bool:
        return self.not_ready_reason is None

    @property
    def not_ready_reason(self) -> str | None:
        """Why ``/readyz`` answers 503, or None when ready: the engine loop stopped, memory above
        the hard limit, the last step (or probe step) failed to allocate
        (:meth:`allocation.AllocationHealth.not_ready_reason`), or, with a budget ConfigMap named
        (``MOEGUARD_BUDGET_CONFIGMAP``), no valid budget document applied yet (the env's defaults
        are never served in place of the spec's)."""
        if self._draining:
            return "shutting down (SIGTERM): draining the requests in flight"
        if self.ep_lost is not None:
            return f"{contract.EP_GROUP_UNAVAILABLE}: {self.ep_lost}"
        if not self.alive:
            return self.not_alive_reason or "engine loop stopped"
        if self.memory.state == MemoryState.HARD:
            return "above the hard memory limit"
        if (oom := self.loop.health.not_ready_reason(self._clock())) is not None:
            return oom
        if self.settings.budget_configmap is not None and self.budget_generation == NO_GENERATION:
            return f"waiting for the first valid budget document (ConfigMap {self.settings.budget_configmap})"
        return None

    # --- state read by the server, the tests and the benchmarks -------------------
    @property
    def memory_state(self) -> MemoryState:
        return self.memory.state

    @property
    def overload_sources(self) -> dict[str, bool]:
        return self.overload_trigger.sources

    @property
    def overload(self) -> bool:
        return self.overload_trigger.active

    @property
    def leak_kind(self) -> str:
        return self.leaks.kind

    # --- called from HTTP handlers ------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue ``request``; raises :class:`scheduler.Rejected` (reason ``memory_hard_limit``
        above the hard limit, ``shutting_down`` after SIGTERM, else the scheduler's caps and queue bounds).
        A refusal is counted by class (``moeguard_priority_rejections_total``); the caller counts it by reason."""
        try:
            self._refuse_shutting_down()
            self.memory.refuse_above_hard()
            self.loop.submit(request, sink)
        except Rejected as rej:
            tel = self.telemetry
            tel.priority_rejections.labels(**tel.l(priority=request.priority, reason=rej.reason)).inc()
            raise

    def refuse_early(self) -> None:
        """Raise the :class:`scheduler.Rejected` that any request would get now, whatever its body,
        so the server refuses before it reads, parses or tokenizes the body (a refusal must cost
        almost nothing next to a decode step): ``shutting_down``, ``memory_hard_limit``,
        ``concurrency_limit`` (requests in the system at ``max_concurrent_requests``) and
        ``queue_full`` (``max_queue_requests`` waiting), with :meth:`submit`'s statuses and
        Retry-After. The caps are refused early only when no batch request is in the worker (or
        under ``fcfs``): otherwise an interactive request could take a batch request's place, which
        needs its body's priority, so :meth:`submit` decides. The bounds that need the prompt
        (``max_queue_tokens``, the overload context cap) stay in :meth:`submit`, which also checks
        these again under the same lock."""
        self._refuse_shutting_down()
        self.memory.refuse_above_hard()
        with self.loop.cond:
            s = self.scheduler
            sheddable = s.priority_policy.by_priority and any(
                n for n in s.counts_by_priority()[BATCH].values())
            refusal = None if sheddable else s.refusal_before_prompt()
        if refusal is not None:
            raise refusal

    def _refuse_shutting_down(self) -> None:
        if self.ep_lost is not None:
            raise Rejected(contract.EP_GROUP_UNAVAILABLE,
                           f"the expert-parallel group is unavailable ({self.ep_lost}); retry on another replica",
                           retry_after_s=5, status=503)
        if self._draining:
            raise Rejected("shutting_down", "the worker is shutting down (SIGTERM); retry on another replica",
                           retry_after_s=1, status=503)

    def cancel(self, req_id: str) -> None:
        """Drop a request (client gone); its sink receives nothing more."""
        self.loop.cancel(req_id)

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
        max_ctx = self._context_cap(doc.overload_max_context_tokens)
        self.overload_trigger.policy = OverloadPolicy(max_context_tokens=max_ctx)
        with self.loop.cond:
            self.scheduler.set_budgets(doc.budgets)
            self.budget_generation = doc.generation
            self.overload_trigger.sources["operator"] = doc.overload_mode == "On"
            self.overload_trigger.queue_trigger = doc.overload_queue_trigger
            self.overload_trigger.apply(self.scheduler)
            self.loop.cond.notify()
        self.telemetry.budget_generation.labels(**self.telemetry.labels).set(doc.generation)
        self.log.event("budget_received", force=True, generation=doc.generation,
                       reason=doc.reason, overload_mode=doc.overload_mode,
                       overload_queue_trigger=str(doc.overload_queue_trigger).lower(),
                       overload_max_context_tokens=max_ctx, **doc.budgets.model_dump())

    # --- the engine thread ---------------------------------------------------------
    def check_memory(self, force: bool = False) -> None:
        """Check memory (rate-limited), sample the leak signal, run the overload trigger."""
        now = self._clock()
        if not self.memory.due(now, force):
            return
        factor = self.memory.check(now)
        reading = self.memory.last_memory
        if reading is not None and self.loop.idle:
            self.telemetry.memory_idle_footprint.labels(**self.telemetry.labels).set(reading.usage_bytes)
        if factor is not None:
            with self.loop.cond:
                self.scheduler.set_shrink_factor(factor)
        self.leaks.sample(now, force)
        self.scan_ucx(now, force)
        with self.loop.cond:
            self.overload_trigger.trigger(self.scheduler, now, self.memory.measured_state == MemoryState.NORMAL,
                                          self.memory.allocation_hold_until)

    def scan_ucx(self, now: float, force: bool = False) -> None:
        """Every :data:`ucx.SCAN_INTERVAL_S` (or ``force``): read the UCX state and, when it changed, set
        ``moeguard_ucx_info`` and log ``event=ucx_info`` (with ``risky``, :func:`ucx.risky`)."""
        if not force and now < self._next_ucx_scan:
            return
        self._next_ucx_scan = now + SCAN_INTERVAL_S
        info = self._read_ucx()
        if self.telemetry.set_ucx(info.labels()):
            self.log.event("ucx_info", force=True, risky="true" if risky(info) else "false", **info.labels())

    def memory_snapshot(self, stage: str) -> None:
        """``event=memory_snapshot`` (rate-limited; nothing is read when it would be dropped)."""
        if self.log.allowed("memory_snapshot"):
            log_memory_snapshot(self.log, stage, self._read_process(), self.memory.last_device,
                                self.engine.kv_cache_bytes())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception as exc:  # never let the loop die
                self.log.event("engine_loop_error", force=True, error=repr(exc)[:500])
                time.sleep(0.1)

    def _iteration(self) -> None:
        self.check_memory()
        self.loop.iteration()

    def _allocation_failed(self) -> None:
        """A step failed to allocate (engine thread): drop the budgets as on a soft-limit breach, and
        overload mode (Auto) on, both for the hold (``memory_guard.ALLOCATION_FAILURE_HOLD_S``)."""
        now = self._clock()
        factor = self.memory.allocation_failed(now)
        with self.loop.cond:
            if factor is not None:
                self.scheduler.set_shrink_factor(factor)
            self.overload_trigger.trigger(self.scheduler, now, self.memory.measured_state == MemoryState.NORMAL,
                                          self.memory.allocation_hold_until)

    def _budgets_applied(self, budgets: Budgets) -> None:
        factor = self.memory.shrink_factor
        self.telemetry.set_budgets(budgets, factor)
        self.log.event("budget_applied", force=True, generation=self.budget_generation,
                       shrink_factor=factor, overload=self.scheduler.overload,
                       **budgets.model_dump())
