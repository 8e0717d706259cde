"""Continuous-batching scheduler: admission, bounded queue, budgets. Pure; clock injected.

Vocabulary (``contract.Budgets``; TGI/vLLM names in its descriptions):

* A **batch** is a group of up to ``max_batch_requests`` running requests that
  step together. Up to ``max_concurrent_batches`` batches are in flight; the one
  engine thread runs their steps in turn (round robin), like model instances
  sharing a device. Running requests are therefore at most
  ``max_batch_requests * max_concurrent_batches``.
* A **step** of a batch carries decode tokens, one per fully prefilled member
  (at most ``max_decode_tokens``; the least recently decoded go first), and
  prefill tokens (at most ``max_prefill_tokens``): first the next chunk of
  members still prefilling, then new requests admitted from the queue head.
  A prompt longer than the budget is prefilled in chunks over several steps
  (chunked prefill, as vLLM ``max_num_batched_tokens``).
* **TGI's rule**: the queue head is admitted only when its first chunk,
  ``min(prompt_tokens, max_prefill_tokens)``, fits in what is left of this
  step's prefill budget and the batch has room; otherwise it waits at the front
  and nothing behind it overtakes it.
* The queue is bounded (``max_queue_requests``, ``max_queue_tokens`` prompt
  tokens) and a waiting request expires after ``queue_timeout_s`` (Triton's
  ``default_timeout_microseconds`` with ``timeout_action`` REJECT). Requests
  in the system (waiting + running) are capped by ``max_concurrent_requests``
  (TGI, where the excess gets 429).
* Budgets changed with :meth:`Scheduler.set_budgets` or
  :meth:`Scheduler.set_shrink_factor` apply from the next step planned.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moeguard_runtime.contract import Budgets


@dataclass(frozen=True)
class QueueLimits:
    """Limits that are not budgets (set from the environment at start)."""

    max_concurrent_requests: int = 128
    max_queue_requests: int = 64
    max_queue_tokens: int = 65_536
    queue_timeout_s: float = 30.0


class Rejected(Exception):
    """A request refused at submission; ``reason`` is a metric label value."""

    def __init__(self, reason: str, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class _Request:
    req_id: str
    prompt_tokens: int
    max_new_tokens: int
    arrival: float
    prefilled: int = 0
    last_decode_step: int = -1

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_tokens


@dataclass(frozen=True)
class StepPlan:
    """What the engine runs next.

    ``prefill``: ``(req_id, start, n)`` chunks; ``decode``: request ids;
    ``admitted``: ids that entered this step from the queue (their first chunk
    is in ``prefill``); ``budgets``: the budgets this step was planned under.
    """

    step: int
    batch: int
    prefill: tuple[tuple[str, int, int], ...]
    decode: tuple[str, ...]
    admitted: tuple[str, ...]
    budgets: Budgets

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.prefill)


@dataclass
class ScheduleResult:
    plan: StepPlan | None
    expired: list[str] = field(default_factory=list)
    budgets_applied: Budgets | None = None


def shrink(budgets: Budgets, factor: float) -> Budgets:
    """Budgets scaled by ``factor`` in (0, 1], each floored at 1 (concurrent batches kept)."""
    if factor >= 1.0:
        return budgets
    return budgets.model_copy(update={
        "max_prefill_tokens": max(1, math.floor(budgets.max_prefill_tokens * factor)),
        "max_decode_tokens": max(1, math.floor(budgets.max_decode_tokens * factor)),
        "max_batch_requests": max(1, math.floor(budgets.max_batch_requests * factor)),
    })


class Scheduler:
    """Plans engine steps. Not thread-safe: the caller holds a lock."""

    def __init__(self, budgets: Budgets, limits: QueueLimits,
                 clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._base = budgets
        self._factor = 1.0
        self._effective = budgets
        self._pending: Budgets | None = None
        self._waiting: deque[_Request] = deque()
        self._queue_tokens = 0
        self._requests: dict[str, _Request] = {}
        self._batches: list[list[str]] = []
        self._rr = 0
        self._step = 0
        self._decode_stamp = 0

    # --- state -----------------------------------------------------------------
    @property
    def budgets(self) -> Budgets:
        """Budgets in effect (after the shrink factor) for the step last planned."""
        return self._effective

    @property
    def queue_requests(self) -> int:
        return len(self._waiting)

    @property
    def queue_tokens(self) -> int:
        return self._queue_tokens

    @property
    def running_requests(self) -> int:
        return len(self._requests) - len(self._waiting)

    @property
    def batches(self) -> list[list[str]]:
        return [list(b) for b in self._batches]

    # --- inputs ----------------------------------------------------------------
    def set_budgets(self, budgets: Budgets) -> None:
        """New base budgets; they take effect when the next step is planned."""
        self._base = budgets
        self._pending = shrink(budgets, self._factor)

    def set_shrink_factor(self, factor: float) -> None:
        """Scale the budgets by ``factor`` (memory soft limit); from the next step."""
        self._factor = min(1.0, max(factor, 1e-3))
        self._pending = shrink(self._base, self._factor)

    def submit(self, req_id: str, prompt_tokens: int, max_new_tokens: int) -> None:
        """Queue a request, or raise :class:`Rejected` (caps and queue bounds)."""
        lim = self.limits
        if len(self._requests) >= lim.max_concurrent_requests:
            raise Rejected("concurrency_limit",
                           f"Model is overloaded: {len(self._requests)} requests in flight, "
                           f"max_concurrent_requests is {lim.max_concurrent_requests}")
        if len(self._waiting) >= lim.max_queue_requests:
            raise Rejected("queue_full",
                           f"queue is full: {len(self._waiting)} requests waiting, "
                           f"max_queue_requests is {lim.max_queue_requests}")
        if self._queue_tokens + prompt_tokens > lim.max_queue_tokens:
            raise Rejected("queue_tokens_full",
                           f"queue is full: {self._queue_tokens} + {prompt_tokens} prompt tokens "
                           f"would exceed max_queue_tokens {lim.max_queue_tokens}")
        req = _Request(req_id, prompt_tokens, max_new_tokens, self._clock())
        self._requests[req_id] = req
        self._waiting.append(req)
        self._queue_tokens += prompt_tokens

    def finish(self, req_id: str) -> None:
        """Remove a finished or cancelled request, wherever it is (idempotent)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        if req in self._waiting:
            self._waiting.remove(req)
            self._queue_tokens -= req.prompt_tokens
            return
        for batch in self._batches:
            if req_id in batch:
                batch.remove(req_id)
        self._batches = [b for b in self._batches if b]

    # --- planning ----------------------------------------------------------------
    def _expire(self, now: float) -> list[str]:
        expired = []
        for req in list(self._waiting):
            if now - req.arrival > self.limits.queue_timeout_s:
                self._waiting.remove(req)
                self._queue_tokens -= req.prompt_tokens
                del self._requests[req.req_id]
                expired.append(req.req_id)
        return expired

    def schedule(self) -> ScheduleResult:
        """Expire timed-out waiters, apply pending budgets, plan one step (or none)."""
        result = ScheduleResult(None, self._expire(self._clock()))
        if self._pending is not None:
            self._effective, self._pending = self._pending, None
            result.budgets_applied = self._effective
        b = self._effective
        candidates = list(range(len(self._batches)))
        if self._waiting and len(self._batches) < b.max_concurrent_batches:
            candidates.append(len(self._batches))  # a new batch
        if not candidates:
            return result
        index = candidates[self._rr % len(candidates)]
        self._rr += 1
        if index == len(self._batches):
            self._batches.append([])
        batch = self._batches[index]
        members = [self._requests[r] for r in batch]
        decoding = sorted((r for r in members if r.decoding), key=lambda r: r.last_decode_step)
        decode = decoding[:b.max_decode_tokens]
        for r in decode:  # a global stamp, so ties keep least-recently-used order
            r.last_decode_step = self._decode_stamp
            self._decode_stamp += 1
        prefill: list[tuple[str, int, int]] = []
        budget = b.max_prefill_tokens
        for r in members:
            if not r.decoding and budget > 0:
                n = min(r.prompt_tokens - r.prefilled, budget)
                prefill.append((r.req_id, r.prefilled, n))
                r.prefilled += n
                budget -= n
        admitted = []
        while self._waiting and len(batch) < b.max_batch_requests:
            head = self._waiting[0]
            first_chunk = min(head.prompt_tokens, b.max_prefill_tokens)
            if first_chunk > budget:
                break  # TGI: the head waits at the front; nobody overtakes it
            self._waiting.popleft()
            self._queue_tokens -= head.prompt_tokens
            batch.append(head.req_id)
            prefill.append((head.req_id, 0, first_chunk))
            head.prefilled = first_chunk
            budget -= first_chunk
            admitted.append(head.req_id)
        if not batch:
            self._batches.remove(batch)
        if not prefill and not decode:
            return result
        result.plan = StepPlan(self._step, index, tuple(prefill),
                               tuple(r.req_id for r in decode), tuple(admitted), b)
        self._step += 1
        return result
