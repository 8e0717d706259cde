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
* **Long requests**: a prompt of at least ``long_request_threshold_tokens`` is
  long; a batch holds at most ``max_long_requests_per_batch`` of them, and a
  long head that does not fit waits at the front like any other.
* **Prefill is capped more strictly than decode**: at most
  :func:`prefill_batch_cap` (``ceil(max_concurrent_batches / 2)``) batches may
  hold a partly prefilled prompt at once.
* The queue is bounded (``max_queue_requests`` budget, ``max_queue_tokens``
  prompt tokens) and a waiting request expires after ``queue_timeout_seconds``
  (Triton's ``default_timeout_microseconds`` with ``timeout_action`` REJECT).
  Requests in the system (waiting + running) are capped by
  ``max_concurrent_requests`` (TGI, where the excess gets 429).
* **Overload mode** (:meth:`Scheduler.set_overload`): one batch in flight,
  decode budget reduced, contexts over a threshold refused at submission, and
  interactive requests leave the queue before batch ones (Triton priority
  levels). Outside overload mode the queue is FIFO whatever the priority.
* Budgets changed with :meth:`Scheduler.set_budgets`,
  :meth:`Scheduler.set_shrink_factor` or :meth:`Scheduler.set_overload` apply
  from the next step planned.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moeguard_runtime import contract
from moeguard_runtime.contract import Budgets


@dataclass(frozen=True)
class QueueLimits:
    """Limits that are not budgets: static, from the environment at start.

    Attributes:
        max_concurrent_requests: requests in the system, waiting plus running
            (TGI ``max_concurrent_requests``); beyond it, HTTP 429.
        max_queue_tokens: prompt tokens waiting in the queue; beyond it, 429. It bounds
            waiting work, not a prompt: a request into an empty queue is queued whatever
            its length (a prompt longer than the bound would otherwise get a retryable
            429 forever; the context, ``max_seq_len``, is what bounds a prompt).
        long_request_threshold_tokens: a request whose prompt has at least this
            many tokens is *long* and counts against
            ``Budgets.max_long_requests_per_batch``.
    """

    max_concurrent_requests: int = contract.DEFAULT_MAX_CONCURRENT_REQUESTS
    max_queue_tokens: int = 65_536
    long_request_threshold_tokens: int = contract.DEFAULT_LONG_REQUEST_THRESHOLD_TOKENS


@dataclass(frozen=True)
class OverloadPolicy:
    """What overload mode changes (see :func:`overload_budgets`).

    Attributes:
        max_context_tokens: prompt plus ``max_tokens`` above this are refused
            while overload is on (HTTP 503, reason ``overload_context_limit``).
        decode_factor: decode budget multiplier while overload is on.
    """

    max_context_tokens: int
    decode_factor: float = 0.5


PRIORITIES = ("interactive", "batch")
"""Request priority classes; while overload is on, interactive ones leave the queue first."""


class Rejected(Exception):
    """A request refused at submission; ``reason`` is a metric label value and
    ``status`` the HTTP status (429 for caps and queue bounds, 503 otherwise)."""

    def __init__(self, reason: str, message: str, retry_after_s: int = 1,
                 status: int = 429) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.status = status


@dataclass
class _Request:
    req_id: str
    prompt_tokens: int
    max_new_tokens: int
    arrival: float
    priority: str = "interactive"
    seq: int = 0
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
    is in ``prefill``); ``budgets``: the budgets this step was planned under;
    ``active_batches``: batches in flight when it was planned.
    """

    step: int
    batch: int
    prefill: tuple[tuple[str, int, int], ...]
    decode: tuple[str, ...]
    admitted: tuple[str, ...]
    budgets: Budgets
    active_batches: int = 1

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.prefill)


@dataclass
class ScheduleResult:
    plan: StepPlan | None
    expired: list[str] = field(default_factory=list)
    budgets_applied: Budgets | None = None


def shrink(budgets: Budgets, factor: float) -> Budgets:
    """Budgets scaled by ``factor`` in (0, 1], each floored at 1 (concurrent batches,
    the long-request cap, the queue length and timeout kept)."""
    if factor >= 1.0:
        return budgets
    return budgets.model_copy(update={
        "max_prefill_tokens": max(1, math.floor(budgets.max_prefill_tokens * factor)),
        "max_decode_tokens": max(1, math.floor(budgets.max_decode_tokens * factor)),
        "max_batch_requests": max(1, math.floor(budgets.max_batch_requests * factor)),
    })


def overload_budgets(budgets: Budgets, policy: OverloadPolicy) -> Budgets:
    """Budgets while overload mode is on: aggressive batching off (one batch in
    flight, so batches never overlap) and decode concurrency reduced by
    ``policy.decode_factor`` (floored at 1)."""
    return budgets.model_copy(update={
        "max_concurrent_batches": 1,
        "max_decode_tokens": max(1, math.floor(budgets.max_decode_tokens * policy.decode_factor)),
    })


def prefill_batch_cap(budgets: Budgets) -> int:
    """Batches that may hold a partly prefilled prompt at once: ``ceil(B / 2)`` of
    the ``B = max_concurrent_batches``, so prefill (whose activations and KV
    writes are the memory peak) is capped more strictly than decode."""
    return max(1, math.ceil(budgets.max_concurrent_batches / 2))


class Scheduler:
    """Plans engine steps. Not thread-safe: the caller holds a lock."""

    def __init__(self, budgets: Budgets, limits: QueueLimits,
                 clock: Callable[[], float], overload: OverloadPolicy | None = None) -> None:
        self.limits = limits
        self._clock = clock
        self._base = budgets
        self._factor = 1.0
        self._overload_policy = overload or OverloadPolicy(max_context_tokens=1 << 30)
        self._overload = False
        self._effective = budgets
        self._pending: Budgets | None = None
        self._waiting: dict[str, deque[_Request]] = {p: deque() for p in PRIORITIES}
        self._queue_tokens = 0
        self._requests: dict[str, _Request] = {}
        self._batches: list[list[str]] = []
        self._rr = 0
        self._step = 0
        self._decode_stamp = 0
        self._seq = 0

    # --- state -----------------------------------------------------------------
    @property
    def budgets(self) -> Budgets:
        """Budgets in effect (after the shrink factor and overload) for the step last planned."""
        return self._effective

    @property
    def next_budgets(self) -> Budgets:
        """Budgets the next step will be planned under."""
        return self._pending or self._effective

    @property
    def overload(self) -> bool:
        return self._overload

    @property
    def overload_policy(self) -> OverloadPolicy:
        return self._overload_policy

    @property
    def queue_requests(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def queue_tokens(self) -> int:
        return self._queue_tokens

    @property
    def running_requests(self) -> int:
        return len(self._requests) - self.queue_requests

    @property
    def batches(self) -> list[list[str]]:
        return [list(b) for b in self._batches]

    def is_long(self, prompt_tokens: int) -> bool:
        return prompt_tokens >= self.limits.long_request_threshold_tokens

    # --- inputs ----------------------------------------------------------------
    def _recompute(self) -> None:
        b = shrink(self._base, self._factor)
        self._pending = overload_budgets(b, self._overload_policy) if self._overload else b

    def set_budgets(self, budgets: Budgets) -> None:
        """New base budgets; they take effect when the next step is planned."""
        self._base = budgets
        self._recompute()

    def set_shrink_factor(self, factor: float) -> None:
        """Scale the budgets by ``factor`` (memory soft limit); from the next step."""
        self._factor = min(1.0, max(factor, 1e-3))
        self._recompute()

    def set_overload(self, on: bool, policy: OverloadPolicy | None = None) -> None:
        """Switch overload mode (and optionally its policy); budgets change from the next step."""
        if policy is not None:
            self._overload_policy = policy
        self._overload = on
        self._recompute()

    def submit(self, req_id: str, prompt_tokens: int, max_new_tokens: int,
               priority: str = "interactive") -> None:
        """Queue a request, or raise :class:`Rejected` (caps, queue bounds, overload context)."""
        lim, b = self.limits, self.next_budgets
        if priority not in self._waiting:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        context = prompt_tokens + max_new_tokens
        if self._overload and context > self._overload_policy.max_context_tokens:
            limit = self._overload_policy.max_context_tokens
            raise Rejected("overload_context_limit",
                           f"overload mode is on: prompt + max_tokens must be <= {limit} tokens "
                           f"(given {prompt_tokens} + {max_new_tokens} = {context})",
                           retry_after_s=10, status=503)
        if len(self._requests) >= lim.max_concurrent_requests:
            raise Rejected("concurrency_limit",
                           f"Model is overloaded: {len(self._requests)} requests in flight, "
                           f"max_concurrent_requests is {lim.max_concurrent_requests}")
        waiting = self.queue_requests
        if waiting >= b.max_queue_requests:
            raise Rejected("queue_full",
                           f"queue is full: {waiting} requests waiting, "
                           f"max_queue_requests is {b.max_queue_requests}")
        if self._queue_tokens and self._queue_tokens + prompt_tokens > lim.max_queue_tokens:
            raise Rejected("queue_tokens_full",
                           f"queue is full: {self._queue_tokens} + {prompt_tokens} prompt tokens "
                           f"would exceed max_queue_tokens {lim.max_queue_tokens}")
        self._seq += 1
        req = _Request(req_id, prompt_tokens, max_new_tokens, self._clock(), priority, self._seq)
        self._requests[req_id] = req
        self._waiting[priority].append(req)
        self._queue_tokens += prompt_tokens

    def finish(self, req_id: str) -> None:
        """Remove a finished or cancelled request, wherever it is (idempotent)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        queue = self._waiting[req.priority]
        if req in queue:
            queue.remove(req)
            self._queue_tokens -= req.prompt_tokens
            return
        for batch in self._batches:
            if req_id in batch:
                batch.remove(req_id)
        self._batches = [b for b in self._batches if b]

    # --- planning ----------------------------------------------------------------
    def _head(self) -> _Request | None:
        """The request at the front: the earliest arrival, except that while
        overload is on an interactive request goes before every batch one."""
        inter, batch = self._waiting["interactive"], self._waiting["batch"]
        if self._overload and inter:
            return inter[0]
        heads = [q[0] for q in (inter, batch) if q]
        return min(heads, key=lambda r: r.seq) if heads else None

    def _pop_head(self, head: _Request) -> None:
        self._waiting[head.priority].popleft()
        self._queue_tokens -= head.prompt_tokens

    def _expire(self, now: float) -> list[str]:
        timeout = self.next_budgets.queue_timeout_seconds
        expired = []
        for queue in self._waiting.values():
            for req in list(queue):
                if now - req.arrival > timeout:
                    queue.remove(req)
                    self._queue_tokens -= req.prompt_tokens
                    del self._requests[req.req_id]
                    expired.append(req.req_id)
        return expired

    def _prefilling(self, batch: list[str]) -> bool:
        return any(not self._requests[r].decoding for r in batch)

    def schedule(self) -> ScheduleResult:
        """Expire timed-out waiters, apply pending budgets, plan one step (or none)."""
        result = ScheduleResult(None, self._expire(self._clock()))
        if self._pending is not None:
            self._effective, self._pending = self._pending, None
            result.budgets_applied = self._effective
        b = self._effective
        candidates = list(range(len(self._batches)))
        prefilling = sum(1 for batch in self._batches if self._prefilling(batch))
        if (self.queue_requests and len(self._batches) < b.max_concurrent_batches
                and prefilling < prefill_batch_cap(b)):
            candidates.append(len(self._batches))  # a new batch
        for attempt in range(len(candidates)):  # round robin; skip batches with nothing to do
            index = candidates[(self._rr + attempt) % len(candidates)]
            plan = self._plan_batch(index, b)
            if plan is not None:
                self._rr += attempt + 1
                result.plan = plan
                self._step += 1
                break
        return result

    def _plan_batch(self, index: int, b: Budgets) -> StepPlan | None:
        if index == len(self._batches):
            self._batches.append([])
        batch = self._batches[index]
        members = [self._requests[r] for r in batch]
        decoding = sorted((r for r in members if r.decoding), key=lambda r: r.last_decode_step)
        decode = decoding[:b.max_decode_tokens]
        prefill: list[tuple[str, int, int]] = []
        budget = b.max_prefill_tokens
        for r in members:
            if not r.decoding and budget > 0:
                n = min(r.prompt_tokens - r.prefilled, budget)
                prefill.append((r.req_id, r.prefilled, n))
                r.prefilled += n
                budget -= n
        admitted = self._admit(batch, members, budget, b)
        prefill += admitted
        if not batch:
            self._batches.remove(batch)
        if not prefill and not decode:
            return None
        for r in decode:  # a global stamp, so ties keep least-recently-used order
            r.last_decode_step = self._decode_stamp
            self._decode_stamp += 1
        return StepPlan(self._step, index, tuple(prefill), tuple(r.req_id for r in decode),
                        tuple(r for r, _, _ in admitted), b, len(self._batches))

    def _admit(self, batch: list[str], members: list[_Request], budget: int,
               b: Budgets) -> list[tuple[str, int, int]]:
        """Move queue heads into ``batch`` while they fit (TGI's rule, plus the
        long-request cap and the prefill batch cap); returns their first chunks."""
        others_prefilling = sum(1 for other in self._batches
                                if other is not batch and self._prefilling(other))
        if not any(not r.decoding for r in members) and others_prefilling >= prefill_batch_cap(b):
            return []  # this batch would become one more prefilling batch
        long_in_batch = sum(1 for r in members if self.is_long(r.prompt_tokens))
        admitted: list[tuple[str, int, int]] = []
        while len(batch) < b.max_batch_requests:
            head = self._head()
            if head is None:
                break
            first_chunk = min(head.prompt_tokens, b.max_prefill_tokens)
            if first_chunk > budget:
                break  # TGI: the head waits at the front; nobody overtakes it
            if self.is_long(head.prompt_tokens):
                if long_in_batch >= b.max_long_requests_per_batch:
                    break  # the head waits for a batch with room for one more long request
                long_in_batch += 1
            self._pop_head(head)
            batch.append(head.req_id)
            admitted.append((head.req_id, 0, first_chunk))
            head.prefilled = first_chunk
            budget -= first_chunk
        return admitted
