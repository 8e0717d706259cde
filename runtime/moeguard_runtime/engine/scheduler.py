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
  decode budget reduced, contexts over a threshold refused at submission.
* **Priority** (:class:`PriorityPolicy`, in every mode; vLLM's
  ``--scheduling-policy priority``, Triton's priority levels, llm-d's
  criticality). Two classes, :data:`PRIORITIES`: ``interactive`` before
  ``batch``. With the ``priority`` policy (the default):

  - *order*: the queue is ordered by class, then arrival (vLLM sorts its
    waiting queue by ``(priority, arrival_time)``);
  - *preemption*: while an interactive request waits and no batch has room for
    it (request slots, the long-request cap, the prefill batch cap), running
    batch requests are preempted at the step boundary, latest arrival first
    (vLLM picks ``max(running, key=(priority, arrival_time))``). Their KV cache
    is kept, so they resume where they stopped, ahead of later batch arrivals
    (vLLM's swap, in place; nothing is recomputed). A preempted request does
    not expire in the queue;
  - *interactive first in each step*: while any interactive request is in the
    worker (waiting or running), a step carries at most
    ``batch_tokens_with_interactive`` tokens (prefill plus decode) of batch
    requests, 0 by default: batch work runs only in steps no interactive work
    needs (Triton's strict priority levels, at step granularity). At any time
    ``max_batch_step_tokens`` (no limit by default) bounds a batch step, and
    with it the wait of an interactive request arriving while one runs;
  - *shedding*: an interactive request that meets a full cap (concurrency,
    queue length, queue tokens) takes the place of batch requests: queued ones
    first, then preempted ones, then (concurrency only) running ones, latest
    arrival first. Each is ended with HTTP 503 ``priority_shed`` (an SSE error
    event for a stream already answered) rather than the interactive request
    being refused: batch absorbs the refusals.

  The ``fcfs`` policy is the behaviour before: arrival order, no preemption,
  no shedding; only overload mode moves interactive requests ahead.
* **Memory** (a :class:`StepFitter`, ``memory_admission.StepFit``, passed to
  :meth:`Scheduler.schedule`): decode tokens go in first, then every prefill
  chunk is cut to the largest size whose predicted peak fits under the hard
  limit (a queue head's KV cache counted at its admission); a chunk that does
  not fit even at the smallest size waits, and TGI's rule keeps everybody
  behind a waiting head. :meth:`Scheduler.memory_blocked` names the requests
  that cannot progress at all.
* Budgets changed with :meth:`Scheduler.set_budgets`,
  :meth:`Scheduler.set_shrink_factor` or :meth:`Scheduler.set_overload` apply
  from the next step planned.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from moeguard_core import contract
from moeguard_core.contract import Budgets


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
"""Request priority classes, highest first (a class's index is its rank: 0 goes first)."""
INTERACTIVE, BATCH = PRIORITIES
SCHEDULING_POLICIES = ("priority", "fcfs")
"""``MOEGUARD_SCHEDULING_POLICY`` values (vLLM ``--scheduling-policy``); ``priority`` is the default."""
CRITICALITIES = {"critical": INTERACTIVE, "standard": INTERACTIVE, "sheddable": BATCH}
"""llm-d / Gateway API Inference Extension criticality (``Critical``, ``Standard``, ``Sheddable``;
any case) to class: sheddable work is batch, the rest interactive."""
PRIORITY_NAMES = (*PRIORITIES, "Critical", "Standard", "Sheddable", *CRITICALITIES)
"""The names a request body's ``priority`` may hold, exactly (the ``X-Priority`` header takes any case)."""
MAX_PRIORITY = 2**53 - 1
"""Bound of an integer priority, either sign: the largest integer a JSON number carries exactly (I-JSON, RFC 7493
§2.2; beyond it a client's or a validator's double rounds: a schema bound of 2**63 - 1 let 2**63 + 191 pass a
JSON Schema check and fail ours)."""
PRIORITY_HELP = ("interactive or batch; a criticality (Critical, Standard, Sheddable); or an "
                 "integer as vLLM's priority (lower is earlier: <= 0 interactive, > 0 batch)")
"""What a request's priority may be, for error messages and the API's description."""


def priority_class(value: str | int) -> str:
    """The class (:data:`PRIORITIES`) of a request's priority as a client gives it.

    Accepted: a class name; an llm-d criticality (:data:`CRITICALITIES`, any case); an integer
    (or its decimal text) read as vLLM's ``priority``, where lower is earlier and 0 the default:
    ``<= 0`` is interactive, ``> 0`` batch.

    Raises:
        ValueError: anything else (a bool is not an integer here); the message lists what is accepted.
    """
    if isinstance(value, bool):
        raise ValueError(f"must be {PRIORITY_HELP}")
    if isinstance(value, int):
        return INTERACTIVE if value <= 0 else BATCH
    text = value.strip().lower()
    if text in PRIORITIES:
        return text
    if text in CRITICALITIES:
        return CRITICALITIES[text]
    digits = text[1:] if text[:1] in "+-" else text
    if digits.isascii() and digits.isdigit() and len(digits) <= 19:
        return priority_class(int(text))
    raise ValueError(f"must be {PRIORITY_HELP}")


@dataclass(frozen=True)
class PriorityPolicy:
    """How the two classes share the worker (the module docstring gives the rules).

    Attributes:
        scheduling: ``priority`` (interactive first: order, preemption, shedding, steps) or ``fcfs``
            (arrival order; only overload mode moves interactive requests ahead), as vLLM's
            ``--scheduling-policy``.
        batch_tokens_with_interactive: tokens (prefill plus decode) of batch requests one step may
            carry while an interactive request is in the worker; 0: none. A step's cost grows with
            its tokens, so every batch token beside interactive work delays it; on a device where
            decode steps are bandwidth-bound, a few hundred cost little and keep batch moving.
        max_batch_step_tokens: tokens of batch requests in one step at any time (None: only the
            budgets bound them). A step cannot be interrupted: an interactive request that arrives
            while a batch step runs waits for its end, so this bounds that wait, at the price of
            batch throughput (more, smaller steps). Sarathi-Serve's per-step token budget, applied
            to batch work only; vLLM's ``long_prefill_token_threshold`` caps a long prompt's chunk
            the same way.
    """

    scheduling: str = "priority"
    batch_tokens_with_interactive: int = 0
    max_batch_step_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        if self.batch_tokens_with_interactive < 0:
            raise ValueError(f"batch_tokens_with_interactive must be >= 0, got "
                             f"{self.batch_tokens_with_interactive}")
        if self.max_batch_step_tokens is not None and self.max_batch_step_tokens < 1:
            raise ValueError(f"max_batch_step_tokens must be >= 1 or None, got {self.max_batch_step_tokens}")

    @property
    def by_priority(self) -> bool:
        return self.scheduling == "priority"


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


SHED_REASON = "priority_shed"
"""Reason (HTTP 503, ``Retry-After``) of a batch request ended to make room for an interactive one."""


@dataclass
class _Request:
    req_id: str
    prompt_tokens: int
    max_new_tokens: int
    arrival: float
    priority: str = INTERACTIVE
    seq: int = 0
    prefilled: int = 0
    last_decode_step: int = -1
    queued_tokens: int = 0
    """Prompt tokens it adds to ``queue_tokens`` while waiting (0 once preempted: its KV is kept)."""
    preemptions: int = 0
    decoded: int = 0
    """Decode tokens planned so far (its context is ``prefilled + decoded``)."""

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_tokens

    @property
    def rank(self) -> int:
        return PRIORITIES.index(self.priority)

    @property
    def started(self) -> bool:
        """Admitted once (it waits again only after a preemption)."""
        return self.preemptions > 0


@dataclass(frozen=True)
class StepPlan:
    """What the engine runs next.

    ``prefill``: ``(req_id, start, n)`` chunks; ``decode``: request ids;
    ``admitted``: ids that entered this step from the queue for the first time
    (their first chunk is in ``prefill``); ``resumed``: preempted ids that
    re-entered a batch (their KV cache was kept: they go on from where they
    stopped); ``budgets``: the budgets this step was planned under;
    ``active_batches``: batches in flight when it was planned; ``prefill_batches``: when this step carries
    prefill, the batches in flight whose prefill work overlaps it: this one, those holding a partly
    prefilled prompt, and those whose last step carried prefill (a burst admitted into several batches
    in one round of the round robin); 0 when it carries none; ``long_admitted``: how many of
    ``admitted`` have a long prompt.
    """

    step: int
    batch: int
    prefill: tuple[tuple[str, int, int], ...]
    decode: tuple[str, ...]
    admitted: tuple[str, ...]
    budgets: Budgets
    active_batches: int = 1
    resumed: tuple[str, ...] = ()
    prefill_batches: int = 0
    long_admitted: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.prefill)


@dataclass
class ScheduleResult:
    """One :meth:`Scheduler.schedule`: the plan (or None), the ids that expired in the
    queue, the ids preempted (back to the queue, KV kept) and the budgets applied, if new."""

    plan: StepPlan | None
    expired: list[str] = field(default_factory=list)
    budgets_applied: Budgets | None = None
    preempted: list[str] = field(default_factory=list)


class StepFitter(Protocol):
    """Keeps a step's composition within memory (``memory_admission.StepFit``)."""

    def add_decode(self, context_tokens: int) -> None: ...

    def cap(self, start: int, n: int, new_kv_tokens: int = 0) -> int: ...

    def fits_kv(self, new_kv_tokens: int) -> bool: ...

    def add(self, start: int, n: int, new_kv_tokens: int = 0) -> None: ...


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
                 clock: Callable[[], float], overload: OverloadPolicy | None = None,
                 priority: PriorityPolicy | None = None) -> None:
        self.limits = limits
        self.priority_policy = priority or PriorityPolicy()
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
        self._prefilled_last: set[int] = set()
        """``id()`` of the batches in flight whose last step carried prefill tokens."""
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
        """Requests waiting, preempted ones included (as vLLM's ``num_requests_waiting``)."""
        return sum(len(q) for q in self._waiting.values())

    @property
    def queue_tokens(self) -> int:
        """Prompt tokens waiting (those of preempted requests are in their KV caches: not counted)."""
        return self._queue_tokens

    @property
    def running_requests(self) -> int:
        return len(self._requests) - self.queue_requests

    @property
    def batches_in_flight(self) -> int:
        return len(self._batches)

    @property
    def batches(self) -> list[list[str]]:
        return [list(b) for b in self._batches]

    @property
    def long_requests_running(self) -> int:
        """Long requests (:meth:`is_long`) admitted and not finished: in a batch, or preempted (waiting
        again with their KV cache kept)."""
        running = sum(1 for batch in self._batches for r in batch if self.is_long(self._requests[r].prompt_tokens))
        preempted = sum(1 for queue in self._waiting.values() for r in queue
                        if r.started and self.is_long(r.prompt_tokens))
        return running + preempted

    def counts_by_priority(self) -> dict[str, dict[str, int]]:
        """Requests per class and state: ``waiting`` (never admitted), ``preempted`` (waiting
        again, KV kept) and ``running`` (in a batch); the states are disjoint."""
        out = {p: {"waiting": 0, "preempted": 0, "running": 0} for p in PRIORITIES}
        for p, queue in self._waiting.items():
            for r in queue:
                out[p]["preempted" if r.started else "waiting"] += 1
        for batch in self._batches:
            for req_id in batch:
                out[self._requests[req_id].priority]["running"] += 1
        return out

    def priority_of(self, req_id: str) -> str | None:
        """The class of a request in the scheduler, None when it is not (or no longer) there."""
        req = self._requests.get(req_id)
        return None if req is None else req.priority

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
               priority: str = INTERACTIVE, prefilled: bool = False) -> list[str]:
        """Queue a request. ``prefilled``: another worker ran its prompt (disaggregated prefill/decode,
        issue 33): it is admitted with no prefill chunk, its KV cache (``prompt_tokens + max_new_tokens``)
        within the memory fit, and decodes in the step that admits it; it adds nothing to ``queue_tokens``.

        Returns:
            The ids of lower-class requests shed to make room for it under the ``priority``
            policy (already removed; the caller ends each with HTTP 503 :data:`SHED_REASON`).
            Usually empty.

        Raises:
            ValueError: ``priority`` is not one of :data:`PRIORITIES`.
            Rejected: the overload context cap, or a cap or queue bound that shedding cannot
                relieve (``concurrency_limit``, ``queue_full``, ``queue_tokens_full``; 429).
        """
        if priority not in self._waiting:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        context = prompt_tokens + max_new_tokens
        if self._overload and context > self._overload_policy.max_context_tokens:
            limit = self._overload_policy.max_context_tokens
            raise Rejected("overload_context_limit",
                           f"overload mode is on: prompt + max_tokens must be <= {limit} tokens "
                           f"(given {prompt_tokens} + {max_new_tokens} = {context})",
                           retry_after_s=10, status=503)
        victims = self._victims(PRIORITIES.index(priority), prompt_tokens)
        for victim in victims:
            self._remove(victim)
        self._seq += 1
        queued = 0 if prefilled else prompt_tokens
        req = _Request(req_id, prompt_tokens, max_new_tokens, self._clock(), priority, self._seq,
                       prefilled=prompt_tokens if prefilled else 0, queued_tokens=queued)
        self._requests[req_id] = req
        self._waiting[priority].append(req)
        self._queue_tokens += queued
        return [v.req_id for v in victims]

    def refusal_before_prompt(self) -> Rejected | None:
        """The cap refusal (``concurrency_limit``, ``queue_full``) any new request would get now,
        whatever its prompt; the queue-token bound needs the prompt and is not checked here."""
        return self._cap_refusal(len(self._requests), self.queue_requests, 0, 0)

    def _cap_refusal(self, in_system: int, waiting: int, queue_tokens: int,
                     prompt_tokens: int) -> Rejected | None:
        """The refusal of the first cap a new request of ``prompt_tokens`` would pass, given
        these counts; None when it fits."""
        lim, b = self.limits, self.next_budgets
        if in_system >= lim.max_concurrent_requests:
            return Rejected("concurrency_limit",
                            f"Model is overloaded: {in_system} requests in flight, "
                            f"max_concurrent_requests is {lim.max_concurrent_requests}")
        if waiting >= b.max_queue_requests:
            return Rejected("queue_full",
                            f"queue is full: {waiting} requests waiting, "
                            f"max_queue_requests is {b.max_queue_requests}")
        if queue_tokens and queue_tokens + prompt_tokens > lim.max_queue_tokens:  # a lone request always queues
            return Rejected("queue_tokens_full",
                            f"queue is full: {queue_tokens} + {prompt_tokens} prompt tokens "
                            f"would exceed max_queue_tokens {lim.max_queue_tokens}")
        return None

    def _victims(self, rank: int, prompt_tokens: int) -> list[_Request]:
        """The lower-class requests whose removal lets a new request of class ``rank`` pass every
        cap (none when it fits, or under ``fcfs``): queued ones first, then preempted ones, then,
        for the concurrency cap only, running ones; lowest class and latest arrival first.

        Raises:
            Rejected: the cap that removing every eligible request would still not relieve.
        """
        in_system, waiting, tokens = len(self._requests), self.queue_requests, self._queue_tokens
        refusal = self._cap_refusal(in_system, waiting, tokens, prompt_tokens)
        if refusal is None:
            return []
        if not self.priority_policy.by_priority:
            raise refusal
        latest_lowest = sorted((r for r in self._requests.values() if r.rank > rank),
                               key=lambda r: (r.rank, r.seq), reverse=True)
        queued = [r for r in latest_lowest if self._is_waiting(r) and not r.started]
        preempted = [r for r in latest_lowest if self._is_waiting(r) and r.started]
        running = [r for r in latest_lowest if not self._is_waiting(r)]
        victims: list[_Request] = []
        while refusal is not None:
            pools = {"concurrency_limit": (queued, preempted, running),
                     "queue_full": (queued, preempted),
                     "queue_tokens_full": (queued,)}[refusal.reason]
            victim = next((pool.pop(0) for pool in pools if pool), None)
            if victim is None:
                raise refusal
            victims.append(victim)
            in_system -= 1
            if self._is_waiting(victim):
                waiting -= 1
                tokens -= victim.queued_tokens
            refusal = self._cap_refusal(in_system, waiting, tokens, prompt_tokens)
        return victims

    def _is_waiting(self, req: _Request) -> bool:
        return req in self._waiting[req.priority]

    def _leave_batch(self, req_id: str) -> None:
        for batch in self._batches:
            if req_id in batch:
                batch.remove(req_id)
        self._batches = [b for b in self._batches if b]

    def _remove(self, req: _Request) -> None:
        """Take ``req`` out of the queue or its batch, and out of the scheduler."""
        self._requests.pop(req.req_id, None)
        queue = self._waiting[req.priority]
        if req in queue:
            queue.remove(req)
            self._queue_tokens -= req.queued_tokens
            return
        self._leave_batch(req.req_id)

    def finish(self, req_id: str) -> None:
        """Remove a finished or cancelled request, wherever it is (idempotent)."""
        req = self._requests.get(req_id)
        if req is not None:
            self._remove(req)

    # --- planning ----------------------------------------------------------------
    def _head(self) -> _Request | None:
        """The request at the front: under ``priority`` the first of the highest class (within a
        class, by arrival; a preempted request keeps its place); under ``fcfs`` the earliest
        arrival, except that while overload is on an interactive request goes first."""
        inter, batch = self._waiting[INTERACTIVE], self._waiting[BATCH]
        if (self.priority_policy.by_priority or self._overload) and inter:
            return inter[0]
        heads = [q[0] for q in (inter, batch) if q]
        return min(heads, key=lambda r: r.seq) if heads else None

    def _pop_head(self, head: _Request) -> None:
        self._waiting[head.priority].popleft()
        self._queue_tokens -= head.queued_tokens
        head.queued_tokens = 0

    def _expire(self, now: float) -> list[str]:
        """Drop requests that waited longer than the queue timeout (never a preempted one:
        it was admitted once, and resumes)."""
        timeout = self.next_budgets.queue_timeout_seconds
        expired = []
        for queue in self._waiting.values():
            for req in list(queue):
                if not req.started and now - req.arrival > timeout:
                    self._remove(req)
                    expired.append(req.req_id)
        return expired

    def _prefilling(self, batch: list[str]) -> bool:
        return any(not self._requests[r].decoding for r in batch)

    def _has_room(self, head: _Request, b: Budgets) -> bool:
        """Whether some batch (or a new one) could take ``head`` now, prefill budget aside:
        a request slot, the long-request cap and the prefill batch cap."""
        prefilling = [self._prefilling(batch) for batch in self._batches]
        cap = prefill_batch_cap(b)
        if len(self._batches) < b.max_concurrent_batches and sum(prefilling) < cap:
            return True
        long_head = self.is_long(head.prompt_tokens) and not head.decoding
        for batch, busy in zip(self._batches, prefilling, strict=True):
            if len(batch) >= b.max_batch_requests:
                continue
            if long_head and sum(self.is_long(self._requests[r].prompt_tokens)
                                 for r in batch) >= b.max_long_requests_per_batch:
                continue
            if busy or sum(prefilling) < cap:
                return True
        return False

    def _preempt_for_head(self, b: Budgets) -> list[str]:
        """Under ``priority``: while the queue's head has no room, move the latest-arrived running
        request of a lower class back to the queue (KV kept); returns their ids."""
        preempted: list[str] = []
        if not self.priority_policy.by_priority:
            return preempted
        head = self._head()
        while head is not None and not self._has_room(head, b):
            running = [self._requests[r] for batch in self._batches for r in batch]
            lower = [r for r in running if r.rank > head.rank]
            if not lower:
                break
            victim = max(lower, key=lambda r: (r.rank, r.seq))
            self._leave_batch(victim.req_id)
            victim.preemptions += 1
            queue = self._waiting[victim.priority]
            at = next((i for i, r in enumerate(queue) if r.seq > victim.seq), len(queue))
            queue.insert(at, victim)  # its place by arrival: ahead of later requests of its class
            preempted.append(victim.req_id)
        return preempted

    def _batch_allowance(self) -> int | None:
        """Tokens of lower-class requests a step may carry now (None: no limit): under ``fcfs``
        none; with an interactive request in the worker ``batch_tokens_with_interactive``,
        else ``max_batch_step_tokens``."""
        policy = self.priority_policy
        if not policy.by_priority:
            return None
        step_cap = policy.max_batch_step_tokens
        if any(r.rank == 0 for r in self._requests.values()):
            with_interactive = policy.batch_tokens_with_interactive
            return with_interactive if step_cap is None else min(with_interactive, step_cap)
        return step_cap

    def schedule(self, fit: StepFitter | None = None) -> ScheduleResult:
        """Expire timed-out waiters, apply pending budgets, preempt for a higher-class head
        (``priority`` policy), plan one step (or none); ``fit`` keeps the step within memory."""
        result = ScheduleResult(None, self._expire(self._clock()))
        if self._pending is not None:
            self._effective, self._pending = self._pending, None
            result.budgets_applied = self._effective
        b = self._effective
        result.preempted = self._preempt_for_head(b)
        allowance = self._batch_allowance()
        candidates = list(range(len(self._batches)))
        prefilling = sum(1 for batch in self._batches if self._prefilling(batch))
        if (self.queue_requests and len(self._batches) < b.max_concurrent_batches
                and prefilling < prefill_batch_cap(b)):
            candidates.append(len(self._batches))  # a new batch
        for attempt in range(len(candidates)):  # round robin; skip batches with nothing to do
            index = candidates[(self._rr + attempt) % len(candidates)]
            plan = self._plan_batch(index, b, allowance, fit)
            if plan is not None:
                self._rr += attempt + 1
                result.plan = plan
                self._step += 1
                break
        return result

    def memory_blocked(self, fits_alone: Callable[[int, int, bool], bool]) -> list[str]:
        """The requests that cannot progress for memory when no step could be planned: the members
        still prefilling and the queue head for which ``fits_alone(prompt_tokens, max_new_tokens,
        kv_allocated)`` (their smallest step, alone) is False."""
        candidates = [self._requests[r] for batch in self._batches for r in batch
                      if not self._requests[r].decoding]
        if (head := self._head()) is not None:
            candidates.append(head)
        return [r.req_id for r in candidates
                if not fits_alone(r.prompt_tokens, r.max_new_tokens, r.started or r.prefilled > 0)]

    def _plan_batch(self, index: int, b: Budgets, allowance: int | None,
                    fit: StepFitter | None = None) -> StepPlan | None:
        """Plan a step of batch ``index`` (a new one when it equals the count); ``allowance``:
        tokens of lower-class members this step may carry (None: no limit); ``fit``: memory."""
        if index == len(self._batches):
            self._batches.append([])
        batch = self._batches[index]
        members = [self._requests[r] for r in batch]
        by_priority = self.priority_policy.by_priority
        if by_priority:
            members.sort(key=lambda r: (r.rank, r.seq))
        allow = [allowance]  # lower-class tokens left in this step (None: no limit)

        def take(r: _Request, n: int) -> int:
            """How many of ``n`` tokens ``r`` may have within the allowance."""
            if r.rank == 0 or allow[0] is None:
                return n
            n = min(n, allow[0])
            allow[0] -= n
            return n

        decoding = sorted((r for r in members if r.decoding),
                          key=lambda r: (r.rank if by_priority else 0, r.last_decode_step))
        decode: list[_Request] = []
        for r in decoding:
            if len(decode) < b.max_decode_tokens and take(r, 1):
                decode.append(r)
                if fit is not None:
                    fit.add_decode(r.prefilled + r.decoded)
        prefill: list[tuple[str, int, int]] = []
        admitted: list[str] = []
        resumed: list[str] = []
        budget = b.max_prefill_tokens
        for top in ((True, False) if by_priority else (None,)):
            for r in members:  # the next chunk of members still prefilling
                if top is not None and (r.rank == 0) != top:
                    continue
                if not r.decoding and budget > 0:
                    n = min(r.prompt_tokens - r.prefilled, budget)
                    if fit is not None:
                        n = fit.cap(r.prefilled, n)
                    n = take(r, n)
                    if n:
                        if fit is not None:
                            fit.add(r.prefilled, n)
                        prefill.append((r.req_id, r.prefilled, n))
                        r.prefilled += n
                        budget -= n
            budget = self._admit(batch, budget, b, top, allow, prefill, admitted, resumed, fit)
        chunked = {r for r, _, _ in prefill}
        arrived = [r for r in admitted if self._requests[r].decoding]  # prefilled elsewhere: KV at admission
        for req_id in [*resumed, *arrived]:  # a request whose prompt is done decodes in this step
            r = self._requests[req_id]
            if req_id not in chunked and len(decode) < b.max_decode_tokens and take(r, 1):
                decode.append(r)
                if fit is not None:
                    fit.add_decode(r.prefilled + r.decoded)
        if not batch:
            self._batches.remove(batch)
        if not prefill and not decode:
            return None
        for r in decode:  # a global stamp, so ties keep least-recently-used order
            r.last_decode_step = self._decode_stamp
            self._decode_stamp += 1
            r.decoded += 1
        live = {id(other) for other in self._batches}
        self._prefilled_last = {k for k in self._prefilled_last if k in live and k != id(batch)}
        prefill_batches = 0
        if prefill:
            self._prefilled_last.add(id(batch))
            prefill_batches = sum(1 for other in self._batches
                                  if other is batch or self._prefilling(other) or id(other) in self._prefilled_last)
        long_admitted = sum(1 for r in admitted if self.is_long(self._requests[r].prompt_tokens))
        return StepPlan(self._step, index, tuple(prefill), tuple(r.req_id for r in decode),
                        tuple(admitted), b, len(self._batches), tuple(resumed), prefill_batches, long_admitted)

    def _admit(self, batch: list[str], budget: int, b: Budgets, top: bool | None,
               allow: list[int | None], prefill: list[tuple[str, int, int]], admitted: list[str],
               resumed: list[str], fit: StepFitter | None = None) -> int:
        """Move queue heads into ``batch`` while they fit (TGI's rule, plus the long-request cap,
        the prefill batch cap and the lower-class allowance ``allow[0]``); ``top``: only heads of
        the highest class (True), only the others (False), any (None). Appends their chunks to
        ``prefill`` (a resumed request whose prompt was done has none: it decodes from the next
        step) and their ids to ``admitted`` or ``resumed``; returns the prefill budget left. With ``fit``
        a head is admitted only when its KV cache (allocated at admission) and a first chunk fit; the
        chunk is cut to what fits."""
        others_prefilling = sum(1 for other in self._batches
                                if other is not batch and self._prefilling(other))
        if not self._prefilling(batch) and others_prefilling >= prefill_batch_cap(b):
            return budget  # this batch would become one more prefilling batch
        long_in_batch = sum(1 for r in batch if self.is_long(self._requests[r].prompt_tokens))
        while len(batch) < b.max_batch_requests:
            head = self._head()
            if head is None or (top is not None and (head.rank == 0) != top):
                break
            first_chunk = min(head.prompt_tokens - head.prefilled, b.max_prefill_tokens)
            limited = head.rank > 0 and allow[0] is not None
            if limited:
                if allow[0] is None or allow[0] < 1:
                    break  # lower-class work beyond this step's allowance waits
                first_chunk = min(first_chunk, allow[0])  # chunked to the allowance
            if first_chunk > budget:
                break  # TGI: the head waits at the front; nobody overtakes it
            new_kv = 0 if head.started else head.prompt_tokens + head.max_new_tokens
            if fit is not None and (first_chunk or new_kv):
                fitted = fit.cap(head.prefilled, first_chunk, new_kv)
                if first_chunk and not fitted:
                    break  # its memory is not there yet: it waits at the front
                if not first_chunk and new_kv and not fit.fits_kv(new_kv):
                    break  # a prefilled request's KV (it arrives at admission) does not fit yet
                first_chunk = fitted
            if self.is_long(head.prompt_tokens):
                if long_in_batch >= b.max_long_requests_per_batch:
                    break  # the head waits for a batch with room for one more long request
                long_in_batch += 1
            if limited and allow[0] is not None:
                allow[0] -= first_chunk
            self._pop_head(head)
            if fit is not None:
                fit.add(head.prefilled, first_chunk, new_kv)
            batch.append(head.req_id)
            (resumed if head.started else admitted).append(head.req_id)
            if first_chunk:
                prefill.append((head.req_id, head.prefilled, first_chunk))
                head.prefilled += first_chunk
                budget -= first_chunk
        return budget
