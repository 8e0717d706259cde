"""The step loop: plan a step with the scheduler, run it on the engine, deliver.

HTTP handlers :meth:`StepLoop.submit` and :meth:`StepLoop.cancel` (cheap, under
the lock); the engine thread calls :meth:`StepLoop.iteration`, which plans under
the lock and runs the step outside it, so the event loop stays responsive while
torch works. Results go back through each request's ``sink`` (the server passes
one that hops onto the event loop).

**Priority** (:class:`scheduler.PriorityPolicy`): a batch request the scheduler sheds to make room for an
interactive one ends with HTTP 503 ``priority_shed`` (an SSE error event when its stream has already
answered); a preempted one stays in flight, its sink simply receives no token until it resumes.

**Out of memory** in a step (an allocation failure,
:func:`allocation.allocation_failure_kind`: the device's ``OutOfMemoryError``, a
host ``MemoryError``, or the CPU allocator's or oneDNN's ``RuntimeError``,
including a KV cache that cannot be allocated) fails that step's requests with
HTTP 503 ``out_of_memory`` and ``Retry-After``, is logged as
``event=inference_oom kind=cuda|host`` and counted. Then the caches that may hold
its broken state are reset (:func:`reset_after_allocation_failure`; oneDNN,
whose failed primitives keep failing, is left for ``F.linear``), the
budgets drop as on a soft-limit breach (the ``on_allocation_failure`` callback:
:meth:`memory_guard.MemoryGuard.allocation_failed`), and the loop goes on;
:class:`allocation.AllocationHealth` turns failures into readiness (from the first
failed step) and liveness answers, with probe steps while not ready. Any other error in a step
is a 500 ``engine_error``, but a broken expert-parallel group
(:class:`expert_parallel.GroupUnavailable`) is a 503 ``expert_parallel_group_unavailable``.

**Memory** (with a :class:`memory_admission.MemoryAdmission`): each step is planned through a
``StepFit`` above the memory in use, read just before (:mod:`moeguard_core.memory_admission`), under
``min(hard limit, the memory cgroup's limit)`` (the one in effect is exported as
``moeguard_memory_admission_limit_bytes{limit}`` and logged, ``event=memory_admission_limit``, at the
first reading and on every change); the reading the engine thread takes while it holds no sequence
keeps the idle footprint. A request that cannot fit even alone now is refused at submission with
``memory_predicted``: 400 when it could never fit (not even above the idle footprint), else 503 with
``Retry-After`` (on an idle worker too, after a ``malloc_trim`` and a second look: its use then can be
the allocator's caches after a burst). One that cannot progress when no step can run at all is ended
with 503 ``memory_predicted`` after a ``malloc_trim`` and a second look. After each step the measured
peak (``VmHWM`` over the resident set before it) corrects the model and is exported.

**Diagnosis signals** (issue 14): each planned step's prefill batches and long admissions
(``StepPlan.prefill_batches``, ``long_admitted``), the batches and long requests in flight with the
queue gauges, and, with a memory model (``predictor``: the admission's, else one of its own), each
step's predicted peak stage by stage into a 30 s window (:mod:`moeguard_runtime.memory.peak_breakdown`);
after every iteration the KV cache held (the caches' tensor bytes) and the window's largest step are exported.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moeguard_core.contract import EP_GROUP_UNAVAILABLE, Budgets
from moeguard_core.memory_admission import MemoryAdmission, StepFit, StepPredictor
from moeguard_core.memory_model import Step
from moeguard_runtime.engine.engine import Engine, StepOutput
from moeguard_runtime.engine.generation import Event, GenerationRequest, Sink
from moeguard_runtime.engine.kv_handoff import KV_TRANSFER_REASON, KVHandoff
from moeguard_runtime.engine.scheduler import SHED_REASON, Rejected, Scheduler, StepPlan
from moeguard_runtime.engine.step_telemetry import log_batch_start, record_step
from moeguard_runtime.faults import AllocationFault, Faults, delay_step
from moeguard_runtime.memory.allocation import (
    ONEDNN_CREATE_FAILURE,
    AllocationHealth,
    allocation_failure_kind,
)
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.memory.peak_breakdown import Breakdown, PeakWindow, breakdown
from moeguard_runtime.memory.procmem import read_peak_rss, reset_peak_rss, trim_malloc
from moeguard_runtime.model.moe import leave_onednn
from moeguard_runtime.model.timing import clock
from moeguard_runtime.parallel.expert_parallel import GroupUnavailable
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

IDLE_WAIT_S = 0.25
"""Longest wait for work when idle (the memory guard's interval: it runs between waits)."""
PROBE_ID = "probe-allocation"
"""Sequence id of the one-token probe step run while not ready for allocation failures."""
MEMORY_REASON = "memory_predicted"
"""Reason of a request refused because its smallest step is predicted not to fit under the hard limit."""
MEMORY_RETRY_AFTER_S = 5


def reset_after_allocation_failure(engine: Engine, error: str) -> int:
    """Reset what may hold a failed step's memory or broken state: Python's garbage (tensors
    kept by reference cycles), torch's CUDA caching allocator (``torch.cuda.empty_cache``, the
    cached blocks and their fragmentation) on a CUDA device, and glibc's free heap
    (``malloc_trim(0)``: freed arenas still count against an address-space limit). oneDNN's
    caches cannot be reset, and a primitive that failed to be created keeps failing: on
    ``error`` :data:`allocation.ONEDNN_CREATE_FAILURE` the model's matmuls leave oneDNN
    (:func:`moe.leave_onednn`). Returns how many modules left it. The failed sequences' KV
    caches are released by the caller."""
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    trim_malloc()
    return leave_onednn(engine.model) if ONEDNN_CREATE_FAILURE in error else 0


@dataclass
class _Active:
    request: GenerationRequest
    sink: Sink
    arrival: float
    first_token_at: float | None = None
    tokens: int = 0
    """Tokens delivered so far (the TPOT observation's count)."""


def time_per_output_token(first_token_at: float, last_token_at: float, tokens: int) -> float:
    """A request's TPOT, seconds: ``(last - first token) / (tokens - 1)``; 0.0 for one token (nothing after the
    first): DistServe's definition, as ``bench/slo.py`` computes it from the client's side."""
    return 0.0 if tokens <= 1 else max(0.0, last_token_at - first_token_at) / (tokens - 1)


class StepLoop:
    """The requests in flight and the loop over steps. ``clock``: monotonic seconds;
    ``idle_wait_s`` 0 never blocks (tests that drive the loop by hand)."""

    def __init__(self, scheduler: Scheduler, engine: Engine, telemetry: Telemetry,
                 log: RateLimitedLog, clock: Callable[[], float], faults: Faults,
                 on_budgets_applied: Callable[[Budgets], None],
                 memory_snapshot: Callable[[str], None], idle_wait_s: float = IDLE_WAIT_S,
                 on_allocation_failure: Callable[[], None] = lambda: None,
                 health: AllocationHealth | None = None,
                 admission: MemoryAdmission | None = None,
                 read_memory: Callable[[], MemoryReading] | None = None,
                 predictor: StepPredictor | None = None, handoff: KVHandoff | None = None) -> None:
        self.scheduler, self.engine = scheduler, engine
        self.handoff = handoff
        """Disaggregated prefill/decode (None: a single worker): reads prefilled requests' KV at admission, offers
        and holds ``offer_kv`` requests' KV at their finish."""
        self.telemetry, self.log = telemetry, log
        self.cond = threading.Condition()
        """Guards the scheduler and the requests in flight."""
        self._clock = clock
        self._faults = faults
        self._alloc_fault = AllocationFault(faults)
        self._on_allocation_failure = on_allocation_failure
        self.health = health or AllocationHealth()
        """Consecutive allocation failures: readiness, liveness and probe steps."""
        self._on_budgets_applied = on_budgets_applied
        self._memory_snapshot = memory_snapshot
        self._idle_wait_s = idle_wait_s
        self._active: dict[str, _Active] = {}
        self._to_release: list[str] = []
        self.admission = admission if read_memory is not None else None
        """Memory-aware admission (None: off); ``read_memory`` reads what the limits are compared with
        (and the cgroup's limit)."""
        self._read_memory = read_memory or (lambda: MemoryReading(0, "rss"))
        self._limit_reported = False
        self._trimmed_for_memory = False
        self.predictor = predictor or self.admission
        """The memory model of the steps (the admission's when on), for the peak breakdown; None: no model."""
        self.peaks = PeakWindow()
        self._shown_peak: Breakdown | None = None

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue ``request``; raises :class:`scheduler.Rejected` (caps, queue bounds). Batch requests
        shed to make room for it end with HTTP 503 ``priority_shed``."""
        with self.cond:
            self._refuse_for_memory(request)
            if request.remote_prefill is not None and self.handoff is None:
                raise ValueError("this worker takes no prefilled requests (it has no KV transport)")
            shed = self.scheduler.submit(request.req_id, len(request.prompt), request.max_new_tokens,
                                         request.priority, prefilled=request.remote_prefill is not None)
            self._active[request.req_id] = _Active(request, sink, self._clock())
            self.update_queue_gauges()
            self.cond.notify()
        self.telemetry.context_tokens.labels(**self.telemetry.labels).observe(
            len(request.prompt) + request.max_new_tokens)
        if shed:
            self._shed(shed, request.priority)

    def _refuse_for_memory(self, request: GenerationRequest) -> None:
        """Raise :class:`scheduler.Rejected` ``memory_predicted`` when the request's smallest step does
        not fit above the memory in use now (on an idle worker, after a ``malloc_trim`` and a second look):
        400 when it could never fit (:meth:`MemoryAdmission.never_fits`: not even above the idle
        footprint), else 503 with ``Retry-After``. Call with the lock held."""
        adm = self.admission
        if adm is None:
            return
        prompt, max_new = len(request.prompt), request.max_new_tokens
        usage = self._read_usage()
        need = adm.refusal(usage, prompt, max_new)
        if need is None:
            return
        idle = not self._active and not self.engine.sequences
        if idle:
            trim_malloc()
            usage = self._read_usage()
            need = adm.refusal(usage, prompt, max_new)
            if need is None:
                return
        what = (f"the request's smallest step (its KV cache of {prompt} + {max_new} tokens and its last "
                f"prefill chunk) is predicted at {need} bytes; with {usage} bytes in use that passes "
                f"{adm.describe_limit()}")
        footprint = usage if adm.idle_usage_bytes is None else min(usage, adm.idle_usage_bytes)
        never = adm.never_fits(prompt, max_new, usage)
        if never is not None:
            raise Rejected(MEMORY_REASON, f"{what}; it would need {never} bytes even on the idle worker "
                           f"(its idle footprint: {footprint} bytes in use), so it can never be served here; "
                           f"send a shorter prompt or fewer max_tokens", status=400)
        if not idle:
            why = "the requests in flight hold memory: retry when they have finished"
        elif usage > footprint:
            why = (f"the idle worker holds {usage - footprint} bytes more than its idle footprint (not "
                   f"given back since: the allocator's caches after earlier requests, or the container's "
                   f"other processes and tmpfs): retry later")
        else:
            why = (f"the memory model's correction is {adm.correction.factor:.2f} after recent steps (it "
                   f"falls back to {adm.correction.floor:.2f}): retry later")
        raise Rejected(MEMORY_REASON, f"{what}; it fits the idle worker ({footprint} bytes in use), but {why}",
                       retry_after_s=MEMORY_RETRY_AFTER_S, status=503)

    def _read_usage(self, engine_thread: bool = False) -> int:
        """The memory in use now (bytes); the reading's cgroup limit goes into the admission's limit
        (logged and exported at the first reading and when the limit in effect changes), and, read by the
        engine thread while it holds no sequence, its use into the idle footprint."""
        reading = self._read_memory()
        adm = self.admission
        if adm is None:
            return reading.usage_bytes
        idle = engine_thread and not self.engine.sequences
        if adm.observe_reading(reading.usage_bytes, reading.limit_bytes, idle) or not self._limit_reported:
            self._limit_reported = True
            self.telemetry.set_admission_limit(adm.limit_source, adm.limit_bytes)
            self.log.event("memory_admission_limit", force=True, limit=adm.limit_source,
                           limit_bytes=adm.limit_bytes, hard_limit_bytes=adm.hard_limit_bytes,
                           cgroup_limit_bytes=reading.limit_bytes, cgroup_path=reading.cgroup_path)
        return reading.usage_bytes

    def _fit(self) -> StepFit | None:
        """The memory fit of the next step, above the memory in use now (None: admission off)."""
        return None if self.admission is None else self.admission.fit(self._read_usage(engine_thread=True))

    def _fits_alone(self, usage: int) -> Callable[[int, int, bool], bool]:
        adm = self.admission
        assert adm is not None
        return lambda prompt, max_new, kv: adm.refusal(usage, prompt, max_new, kv) is None

    def _memory_blocked(self, req_ids: list[str], fit: StepFit) -> None:
        """No step could run and ``req_ids`` cannot fit even alone: the first time, give glibc's free
        heap back (``malloc_trim``) and look again next iteration; the second, end them with 503
        ``memory_predicted`` (an SSE error event for a stream that has answered)."""
        if not self._trimmed_for_memory:
            self._trimmed_for_memory = True
            trim_malloc()
            return
        self._trimmed_for_memory = False
        for priority in self.classes(req_ids):
            self.telemetry.refused(MEMORY_REASON, priority)
        assert self.admission is not None
        self.log.event("memory_predicted", force=True, requests=len(req_ids), usage_bytes=fit.usage_bytes,
                       limit_bytes=self.admission.limit_bytes, limit=self.admission.limit_source,
                       correction=round(self.admission.correction.factor, 3), ids=",".join(req_ids)[:300])
        self.fail(req_ids, 503, MEMORY_REASON,
                  f"no step of this request is predicted to fit under {self.admission.describe_limit()} "
                  f"with {fit.usage_bytes} bytes in use, and nothing else is running that would free "
                  f"memory; retry later")

    def _shed(self, req_ids: list[str], for_priority: str) -> None:
        """End ``req_ids``, already out of the scheduler, with 503 :data:`scheduler.SHED_REASON`."""
        for priority in self.classes(req_ids):
            self.telemetry.refused(SHED_REASON, priority)
        self.log.event("priority_shed", force=True, requests=len(req_ids), for_priority=for_priority,
                       ids=",".join(req_ids)[:300])
        self.fail(req_ids, 503, SHED_REASON,
                  f"shed to make room for {for_priority} work (priority scheduling: batch work yields "
                  f"to interactive work when the worker is full); retry later")

    def cancel(self, req_id: str) -> None:
        """Drop a request (client gone); its sink receives nothing more."""
        with self.cond:
            if self._active.pop(req_id, None) is not None:
                self.scheduler.finish(req_id)
                self._to_release.append(req_id)
                self.update_queue_gauges()

    def classes(self, req_ids: list[str]) -> list[str]:
        """The priority class of each of ``req_ids`` still in flight."""
        with self.cond:
            return [a.request.priority for r in req_ids if (a := self._active.get(r)) is not None]

    def in_flight(self) -> list[str]:
        """Ids of the requests accepted and not yet ended (queued or running)."""
        with self.cond:
            return list(self._active)

    def update_queue_gauges(self) -> None:
        """Call with the lock held."""
        s = self.scheduler
        self.telemetry.set_queue(s.queue_requests, s.queue_tokens, s.running_requests, s.counts_by_priority())
        self.telemetry.set_batches(s.batches_in_flight, s.long_requests_running)

    def update_memory_gauges(self) -> None:
        """``moeguard_kv_cache_bytes`` (the engine's caches now) and the peak breakdown of the window
        (all stages 0 but the weights when no step was planned within it). Engine thread."""
        tel = self.telemetry
        tel.kv_cache_bytes.labels(**tel.labels).set(self.engine.kv_cache_bytes())
        largest = self.peaks.largest(self._clock())
        if largest is not self._shown_peak:
            self._shown_peak = largest
            shown = largest or Breakdown(0, 0, 0, 0, tel.model_weight_bytes)
            tel.set_peak_breakdown(shown.stages())

    @property
    def idle(self) -> bool:
        """No request in the worker: nothing queued or running, no sequence holding a KV cache."""
        with self.cond:
            return not self._active and not self.engine.sequences

    def iteration(self) -> None:
        """Release finished caches, expire queued requests, run at most one step;
        waits up to ``idle_wait_s`` (default :data:`IDLE_WAIT_S`) for work when there is none."""
        with self.cond:
            release, self._to_release = self._to_release, []
        for req_id in release:  # before the memory reading the plan is fitted above
            self.engine.release(req_id)
        if self.handoff is not None and self.handoff.offered:
            _, unread = self.handoff.settle(self.engine, self._clock())
            if unread:
                self.log.event("kv_offer_expired", force=True, requests=len(unread), ids=",".join(unread)[:300])
        fit = self._fit()
        blocked: list[str] = []
        with self.cond:
            result = self.scheduler.schedule(fit)
            expired = [(r, self._active.pop(r, None)) for r in result.expired]
            preempted = [a.request.priority for r in result.preempted
                         if (a := self._active.get(r)) is not None]
            if fit is not None and result.plan is None and fit.blocked:
                blocked = self.scheduler.memory_blocked(self._fits_alone(fit.usage_bytes))
            self.update_queue_gauges()
            if result.plan is None and not expired and not release and not blocked:
                self.cond.wait(timeout=self._idle_wait_s)
        if fit is not None and fit.shrunk:
            self.telemetry.memory_chunk_shrinks.labels(**self.telemetry.labels).inc(fit.shrunk)
        if blocked and fit is not None:
            self._memory_blocked(blocked, fit)
        timeout = self.scheduler.next_budgets.queue_timeout_seconds
        for priority in preempted:
            self.telemetry.preemptions.labels(**self.telemetry.l(priority=priority)).inc()
        if result.preempted:
            self.log.event("preempted", requests=len(result.preempted), ids=",".join(result.preempted)[:300])
        for _, active in expired:
            if active is not None:
                self.telemetry.refused("queue_timeout", active.request.priority)
                active.sink(Event("error", status=503, reason="queue_timeout",
                                  message=f"request waited in the queue longer than "
                                          f"queue_timeout_seconds {timeout} s"))
        if result.budgets_applied is not None:
            self._on_budgets_applied(result.budgets_applied)
        if result.plan is not None:
            self._trimmed_for_memory = False
            self.run_step(result.plan, fit)
        elif self.health.probe_due(self._clock()):
            self.probe()
        self.update_memory_gauges()

    def forward(self, prefill: list[tuple[str, int]], decode: list[str]) -> StepOutput:
        """The engine's step, after the test-only faults (a delay, a failed allocation)."""
        delay_step(self._faults)
        self._alloc_fault.check(self.engine.device)
        return self.engine.step(prefill, decode)

    def probe(self) -> None:
        """A one-token prefill of a sequence of its own, to learn whether steps allocate again
        (:class:`allocation.AllocationHealth`); its KV cache is released at once."""
        now = self._clock()
        error: str | None = None
        try:
            self.engine.add(PROBE_ID, [0], 1)
            self.forward([(PROBE_ID, 1)], [])
        except Exception as exc:
            error = f"{allocation_failure_kind(exc) or 'other'}: {exc!r}"
        self.engine.release(PROBE_ID)
        if error is not None:  # out of the except block: its traceback holds the probe's tensors
            self.health.failed(now, error)
            self._reset(error)
            self.log.event("allocation_probe", result="failed",
                           consecutive_failures=self.health.consecutive, error=error[:300])
            return
        self.health.succeeded(now)
        self.log.event("allocation_probe", force=True, result="ok")

    def run_step(self, plan: StepPlan, fit: StepFit | None = None) -> None:
        """Admit ``plan``'s new requests (KV caches), run the step, deliver its tokens; with ``fit``
        (the plan's memory fit) measure the step's peak and correct the memory model."""
        tel = self.telemetry
        now = self._clock()
        with self.cond:
            admitted = [(r, self._active.get(r)) for r in plan.admitted]
            waiting = self.scheduler.queue_requests
        step_ids = [r for r, _, _ in plan.prefill] + list(plan.decode)
        tel.observe_plan(plan.prefill_batches, plan.long_admitted, waiting)
        kv_held = self.engine.kv_cache_bytes()
        rss_before = reset_peak_rss() if fit is not None else None
        t0 = clock(self.engine.device)
        failure: tuple[str, str] | None = None
        arrived: dict[str, int] = {}  # prefilled elsewhere, KV read: their first tokens
        unread: list[tuple[str, str]] = []
        try:
            new_kv_tokens = 0
            for req_id, active in admitted:
                if active is not None and req_id not in self.engine.sequences:
                    r = active.request
                    tel.stage("queue", now - active.arrival)
                    if r.remote_prefill is not None and self.handoff is not None:
                        if (why := self.handoff.receive(self.engine, req_id, r)) is not None:
                            unread.append((req_id, why))
                            continue
                        arrived[req_id] = r.remote_prefill.first_token
                    else:
                        self.engine.add(req_id, r.prompt, r.max_new_tokens, r.temperature, r.seed, r.sampling,
                                        r.constraint)
                    new_kv_tokens += len(r.prompt) + r.max_new_tokens
            if unread:
                self._kv_unread(unread)
            seqs = self.engine.sequences
            prefill = [(r, n) for r, _, n in plan.prefill if r in seqs]
            decode = [r for r in plan.decode if r in seqs and seqs[r].finish_reason is None]
            self._predict_peak(plan, decode, new_kv_tokens, kv_held, now)
            log_batch_start(self.log, plan, self.engine, prefill, decode, self.scheduler.long_requests_running)
            self._memory_snapshot("post_pack_pre_forward")
            out = self.forward(prefill, decode)
        except GroupUnavailable as exc:  # a rank of the expert-parallel group died or hung
            self.fail(step_ids, 503, EP_GROUP_UNAVAILABLE, f"the expert-parallel group is unavailable: {exc}"[:500])
            return
        except Exception as exc:
            kind = allocation_failure_kind(exc)
            if kind is None:
                self.log.event("inference_batch_error", force=True, error=repr(exc)[:500])
                self.fail(step_ids, 500, "engine_error", f"inference failed: {exc!r}"[:500])
                return
            failure = (kind, repr(exc))
        if failure is not None:  # handled out of the except block: its traceback holds the step's tensors
            self.allocation_failed(plan, step_ids, *failure)
            return
        self.health.succeeded(now)
        if fit is not None:
            self._observe_memory(fit, rss_before, out)
        if self.predictor is not None:  # the routing the next steps are predicted at
            self.predictor.observe_routing(out.routing)
        if self.admission is not None and self.admission is not self.predictor:
            self.admission.observe_routing(out.routing)
        # after the step ran: a stream answers 200 only then, so a failed first step is a plain 503
        for req_id, active in admitted:
            if active is not None and req_id in self.engine.sequences:
                active.sink(Event("admitted"))
        t1 = clock(self.engine.device)
        record_step(tel, self.log, plan, out, t1 - t0)
        if arrived:  # the prefill worker's tokens first (a sequence may have ended with it)
            self.deliver(arrived, {r: f for r in arrived if (f := self.engine.sequences[r].finish_reason)})
            if self.handoff is not None:
                seconds_each, nbytes = self.handoff.take_transfers()
                for seconds in seconds_each:
                    tel.kv_transfer_seconds.labels(**tel.labels).observe(seconds)
                tel.kv_transfer_bytes.labels(**tel.labels).inc(nbytes)
        self.deliver(out.new_tokens, out.finished, out.logprobs)
        tel.stage("postprocess", clock(self.engine.device) - t1)

    def _predict_peak(self, plan: StepPlan, decode: list[str], new_kv_tokens: int, kv_held: int,
                      now: float) -> None:
        """Predict the step's peak with the memory model (before its routing is observed), stage by stage
        (:func:`peak_breakdown.breakdown`: ``kv_held`` bytes of KV cache held before it, ``new_kv_tokens``
        of capacity it allocates), and keep it in the window. Nothing without a model."""
        if self.predictor is None:
            return
        seqs = self.engine.sequences
        step = Step(tuple((start, n) for r, start, n in plan.prefill if r in seqs),
                    tuple(seqs[r].num_computed for r in decode), new_kv_tokens)
        self.peaks.add(now, breakdown(self.predictor.estimate(step), kv_held, self.telemetry.model_weight_bytes))

    def _observe_memory(self, fit: StepFit, rss_before: int | None, out: StepOutput) -> None:
        """Correct the memory model with the step's measured peak."""
        adm, tel = self.admission, self.telemetry
        assert adm is not None
        peak = read_peak_rss() if rss_before is not None else None
        if peak is None or rss_before is None:
            return
        predicted = fit.predicted_raw()
        measured = max(0, peak - rss_before)
        ratio = adm.observe_step(predicted, measured)
        tel.memory_step_peak.labels(**tel.l(figure="predicted")).set(predicted)
        tel.memory_step_peak.labels(**tel.l(figure="measured")).set(measured)
        tel.memory_correction.labels(**tel.labels).set(adm.correction.factor)
        if ratio is not None:
            tel.memory_prediction_error.labels(**tel.labels).observe(ratio - 1.0)

    def allocation_failed(self, plan: StepPlan, step_ids: list[str], kind: str, error: str) -> None:
        """End the step's requests with 503 ``out_of_memory``, release their KV caches, reset the
        caches (:func:`reset_after_allocation_failure`), count it, and drop the budgets
        (``on_allocation_failure``)."""
        tel = self.telemetry
        tel.oom.labels(**tel.l(kind=kind)).inc()
        self.health.failed(self._clock(), error)
        self._on_allocation_failure()  # before the answers: a client that got its 503 sees the new state
        self.fail(step_ids, 503, "out_of_memory",
                  f"the batch ran out of memory ({kind}); the request was not completed, "
                  f"retry later")
        with self.cond:
            release, self._to_release = self._to_release, []
        for req_id in release:
            self.engine.release(req_id)
        self._reset(error)
        self.log.event("inference_oom", force=True, kind=kind, step=plan.step,
                       requests=len(step_ids), prefill_tokens=plan.prefill_tokens,
                       consecutive_failures=self.health.consecutive, error=error[:300])

    def _reset(self, error: str) -> None:
        """:func:`reset_after_allocation_failure`, logging ``event=matmul_backend_fallback`` when the
        matmuls left oneDNN."""
        if (modules := reset_after_allocation_failure(self.engine, error)) > 0:
            self.log.event("matmul_backend_fallback", force=True, matmul_backend="torch", modules=modules,
                           reason=ONEDNN_CREATE_FAILURE)

    def deliver(self, new_tokens: dict[str, int], finished_reasons: dict[str, str],
                logprobs: dict[str, tuple[float, tuple[tuple[int, float], ...]]] | None = None) -> None:
        """Send each request its new token (with its ``logprobs`` entry, where it asked), then ``finish`` to those
        finished."""
        now = self._clock()
        finished: list[tuple[str, _Active | None]] = []
        offers = self._offer_finished(finished_reasons, now)
        with self.cond:
            for req_id in finished_reasons:
                self.scheduler.finish(req_id)
                finished.append((req_id, self._active.pop(req_id, None)))
                if not isinstance(offers.get(req_id), Mapping):  # an offered sequence is held until read
                    self._to_release.append(req_id)
            sinks = {r: self._active.get(r) for r in new_tokens}
            sinks.update({r: a for r, a in finished})
            self.update_queue_gauges()
        for req_id, token in new_tokens.items():
            active = sinks.get(req_id)
            if active is None:
                continue
            active.tokens += 1
            if active.first_token_at is None:
                active.first_token_at = now
                self.telemetry.ttft.labels(**self.telemetry.l(priority=active.request.priority)).observe(
                    now - active.arrival)
            if req_id not in finished_reasons or finished_reasons[req_id] == "length":
                logprob, top = (logprobs or {}).get(req_id, (None, ()))
                active.sink(Event("token", token=token, logprob=logprob, top_logprobs=top))
        for req_id, active in finished:
            offer = offers.get(req_id)
            if active is not None and isinstance(offer, str):
                self.telemetry.refused(KV_TRANSFER_REASON, active.request.priority)
                active.sink(Event("error", status=503, reason=KV_TRANSFER_REASON, message=offer))
                continue
            if active is not None:
                self.telemetry.e2e.labels(**self.telemetry.l(priority=active.request.priority)).observe(
                    now - active.arrival)
                if active.first_token_at is not None:
                    self.telemetry.tpot.labels(**self.telemetry.l(priority=active.request.priority)).observe(
                        time_per_output_token(active.first_token_at, now, active.tokens))
                active.sink(Event("finish", finish_reason=finished_reasons[req_id],
                                  kv_offer=offer if isinstance(offer, Mapping) else None))

    def _offer_finished(self, finished_reasons: dict[str, str], now: float) -> dict[str, Mapping[str, Any] | str]:
        """Offer the KV of the finished ``offer_kv`` requests (a prefill worker's): each one's offer, or why it
        failed."""
        if self.handoff is None:
            return {}
        with self.cond:
            wanted = [r for r in finished_reasons
                      if (a := self._active.get(r)) is not None and a.request.offer_kv and r in self.engine.sequences]
        return {r: self.handoff.offer(self.engine, r, now) for r in wanted}

    def _kv_unread(self, unread: list[tuple[str, str]]) -> None:
        """End the admitted requests whose KV could not be read with 503 ``kv_transfer_failed``."""
        for req_id, why in unread:
            with self.cond:
                active = self._active.get(req_id)
            if active is not None:
                self.telemetry.refused(KV_TRANSFER_REASON, active.request.priority)
            self.log.event("kv_transfer_failed", force=True, request=req_id, error=why[:300])
            self.fail([req_id], 503, KV_TRANSFER_REASON, why)

    def fail(self, req_ids: list[str], status: int, reason: str, message: str) -> None:
        """End ``req_ids`` with an ``error`` event."""
        with self.cond:
            failed = [(r, self._active.pop(r, None)) for r in req_ids]
            for r in req_ids:
                self.scheduler.finish(r)
                self._to_release.append(r)
            self.update_queue_gauges()
        for _, active in failed:
            if active is not None:
                active.sink(Event("error", status=status, reason=reason, message=message))
