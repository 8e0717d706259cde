"""Overload mode: its sources, and the worker's own trigger (mode ``Auto``).

Overload mode is on when any source asks for it (exported as
``moeguard_overload_active{source}``): the operator (``overloadMode: On`` in the
budget document), the environment (``MOEGUARD_OVERLOAD_MODE=On``), or, only in
mode ``Auto``, the worker itself: on when memory is above the soft limit or the
queue holds at least :data:`OVERLOAD_QUEUE_ON` of ``max_queue_requests``; off
again once memory is below the soft limit, the queue at most
:data:`OVERLOAD_QUEUE_OFF` of it, and :data:`OVERLOAD_HOLD_S` seconds have
passed since the last trigger. The queue part is the worker's proxy for an SLO it
cannot see: where the operator decides overload from SLO attainment (its budget
document's ``overloadQueueTrigger: false``, the ``predictive`` policy), the worker's
own trigger keeps only memory and allocation failures (issue 30: halving decode
because the queue is full halved the throughput of a worker that met its SLOs).
An allocation failure in a step holds it on for exactly its hold (``memory_guard.ALLOCATION_FAILURE_HOLD_S`` from the last failed
step, the documented 30 s): that hold is a known end, not a reading, so it is not
prolonged by :data:`OVERLOAD_HOLD_S` (it was, to 35 s: issue 29).
"""

from __future__ import annotations

from moeguard_runtime.engine.scheduler import OverloadPolicy, Scheduler
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

OVERLOAD_HOLD_S = 5.0
OVERLOAD_QUEUE_ON, OVERLOAD_QUEUE_OFF = 0.8, 0.4


def worker_wants_overload(active: bool, pressure: bool, calm: bool) -> bool:
    """The self-trigger's next state: on under pressure, kept on until calm."""
    return pressure or (active and not calm)


class OverloadTrigger:
    """The sources of overload mode and the policy it applies; pushes both into the
    scheduler (callers hold the scheduler's lock, or call before the loop starts)."""

    def __init__(self, mode: str, policy: OverloadPolicy, telemetry: Telemetry,
                 log: RateLimitedLog) -> None:
        self.mode = mode
        self.policy = policy
        self.sources = {"operator": False, "worker": False, "env": mode == "On"}
        self.queue_trigger = True
        """Queue depth counts as pressure (the budget document's ``overloadQueueTrigger``)."""
        self._telemetry, self._log = telemetry, log
        self._last_trigger = -1e18

    @property
    def active(self) -> bool:
        return any(self.sources.values())

    def apply(self, scheduler: Scheduler) -> None:
        """Push the state into ``scheduler``, export it, log a change."""
        on = self.active
        changed = on != scheduler.overload
        scheduler.set_overload(on, self.policy)
        tel = self._telemetry
        for source, active in self.sources.items():
            tel.overload.labels(**tel.l(source=source)).set(int(active))
        if changed:
            self._log.event("overload_mode", force=True, active=on,
                            sources=",".join(k for k, v in self.sources.items() if v) or "none",
                            max_context_tokens=self.policy.max_context_tokens)

    def trigger(self, scheduler: Scheduler, now: float, memory_normal: bool,
                held_until: float | None = None) -> None:
        """The worker's own trigger at ``now`` (monotonic s); mode ``Auto`` only. ``memory_normal``:
        the readings are below the soft limit (``MemoryGuard.measured_state``); ``held_until``: the end
        of an allocation failure's hold (monotonic s), on until then and calm from then on."""
        if self.mode != "Auto":
            return
        max_queue = scheduler.next_budgets.max_queue_requests
        queue = scheduler.queue_requests
        queue_pressure = self.queue_trigger and queue >= OVERLOAD_QUEUE_ON * max_queue
        pressure = not memory_normal or queue_pressure
        if pressure:
            self._last_trigger = now
        held = held_until is not None and now < held_until
        queue_calm = not self.queue_trigger or queue <= OVERLOAD_QUEUE_OFF * max_queue
        calm = (memory_normal and not held and queue_calm and now - self._last_trigger >= OVERLOAD_HOLD_S)
        want = worker_wants_overload(self.sources["worker"], pressure or held, calm)
        if want != self.sources["worker"]:
            self.sources["worker"] = want
            self.apply(scheduler)
