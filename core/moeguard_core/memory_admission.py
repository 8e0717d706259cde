"""Memory-aware admission: never start a step that would not fit under the hard limit.

Admission by *current* use lets a step start whose own peak passes the limit: a cgroup limit a
little above the worker's steady use and one long prompt under a large prefill budget, and the
kernel kills the worker in the middle of the prefill (issue 13 §1). Here every step is predicted
before it runs, by the memory model (:mod:`moeguard_core.memory_model`, the code ``moeguard
plan`` uses), from its composition: the KV caches of the sequences it admits, its prefill chunks
(their masks and attention buffers) and decode tokens, and the MoE buffers at the **observed**
top-expert share of token-slots::

    predicted increment = correction x step_peak(step).total_bytes          (bytes above current use)
    the step fits       <=> current use + predicted increment <= limit
    limit               =   min(hard limit, memory cgroup limit)

``current use`` is the figure the hard limit is compared with (:mod:`moeguard_runtime.memory.memory`: the
cgroup's working set, else the RSS), read once per planned step. It already holds the
running sequences' KV caches and the heap the process keeps after earlier requests, which a step
reuses before it grows the resident set: counting both is the safe side.

**The limit** (:attr:`MemoryAdmission.limit_bytes`) is ``MOEGUARD_HARD_LIMIT_BYTES`` or, when the memory
cgroup the worker runs in (the tightest of its own and its ancestors', read with every reading:
:meth:`MemoryAdmission.observe_reading`) is smaller, the cgroup's limit: the kernel OOM-kills at the
cgroup's limit whatever the hard limit says (issue 29: a cgroup of 901 MiB under a hard limit of
1,080 MiB, a 4,031-token stream fitted under the hard limit and killed). Which one is in effect is
:attr:`MemoryAdmission.limit_source` (``hard`` or ``cgroup``; the worker exports and logs it).

What the scheduler does with it (:class:`StepFit`, passed to ``Scheduler.schedule``):

* a prefill chunk is cut to the largest size that fits (binary search; the peak grows with the
  chunk), never below :data:`MIN_PREFILL_CHUNK_TOKENS` (or what is left of the prompt): if even that
  does not fit, the chunk waits for a later step;
* a queue head is admitted only when its KV cache and its first chunk fit;
* when nothing at all can run (no step), a request whose smallest step does not fit on its own is
  ended with 503 ``memory_predicted`` (an SSE error event when its stream has already answered),
  after one ``malloc_trim`` and a fresh reading.

At submission (:meth:`MemoryAdmission.refusal`), a request whose smallest step (its KV cache plus
its last chunk of :data:`MIN_PREFILL_CHUNK_TOKENS`, the one with the largest mask) does not fit now
is refused up front with ``memory_predicted``: 400 (not retryable) only when it could never fit
(:meth:`MemoryAdmission.never_fits`: not even above the worker's **idle footprint**, at the correction's
floor), else 503 with ``Retry-After``. The idle footprint (:attr:`MemoryAdmission.idle_usage_bytes`) is
the smallest use read while the worker held no sequence (from the first reading after the model
loaded on): not the current use of an idle worker, which after a burst of long prompts still holds
the allocator's caches and fragments (glibc arenas ``malloc_trim`` does not give back) and a
correction raised by the burst's steps; judged on those, a prompt served a minute earlier was
answered 400 "can never be served here" (issue 29).

**The correction factor** (:class:`Correction`): after each step the measured increment
(resident-set high-water mark during the step minus the resident set before it,
:func:`procmem.reset_peak_rss`) is compared with the raw prediction. The factor is the largest
measured/predicted ratio of the last :data:`CORRECTION_WINDOW_STEPS` steps whose prediction was at
least :data:`CORRECTION_MIN_PREDICTED_BYTES`, never below its floor (:data:`CORRECTION_FLOOR`, the
validation set's worst ratio at serving chunk sizes) and at most :data:`MAX_CORRECTION`: it only ever scales the model up, the unsafe side
is corrected, an over-prediction is kept. Exported: ``moeguard_memory_prediction_error_ratio``
(measured / predicted - 1), ``moeguard_memory_prediction_correction_ratio``.

The model is of the CPU path; on a CUDA device the GPU fractions (``memory_guard``) still apply and
this host-side admission still bounds the host's share.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from moeguard_core.memory_model import (
    DTYPE_BYTES,
    Estimate,
    MiB,
    Routing,
    ShapeLike,
    Step,
    as_family,
    kv_bytes_per_token,
    step_peak,
    top_share_from_skew_ratio,
)


class RoutingStats(Protocol):
    """What admission reads of one layer's routing in a step: the worker's
    ``moeguard_runtime.model.moe.RoutingStats`` is one. A Protocol, so that torch stays out of the
    operator, which imports this module for its spec checks."""

    @property
    def routed_slots(self) -> int: ...

    @property
    def top_expert_tokens(self) -> int: ...

MIN_PREFILL_CHUNK_TOKENS = 16
"""The smallest prefill chunk the fit cuts to (fewer only at a prompt's end): below it a long prompt's
prefill would take thousands of steps; a request whose chunk of this size does not fit waits or is refused."""
CORRECTION_WINDOW_STEPS = 128
"""Steps over which the correction factor keeps its largest measured/predicted ratio."""
CORRECTION_MIN_PREDICTED_BYTES = 4 * MiB
"""Steps predicted smaller than this are not used for the correction: their increments are within the
allocator's and the other threads' noise."""
CORRECTION_FLOOR = 1.2
"""The correction factor's starting value and floor: the validation set's worst measured/predicted ratio
over current use at serving chunk sizes, 1.17 in a single run (1.12 median), on a new request's first
256-token chunk under skew (``bench/results/memory_model.md``, section "Serving chunks"), rounded up."""
MAX_CORRECTION = 4.0
"""The correction factor's ceiling: a measurement four times the prediction says something other than this
step moved the resident set (another thread, a leak), which the soft and hard limits handle."""
PRIOR_SKEW_RATIO = 4.0
"""Top/median expert skew assumed until steps have been observed (``moeguard plan``'s default ``--skew``)."""
DEFAULT_EXPERT_CHUNK_TOKENS = 2048
"""``moe.DEFAULT_EXPERT_CHUNK_TOKENS`` (``MOEGUARD_EXPERT_CHUNK_TOKENS``'s default), restated without torch."""
TOP_SHARE_WINDOW_STEPS = 32
"""Steps over which the largest observed top-expert share is kept."""


@dataclass
class Correction:
    """The online correction factor of the memory model (module docstring)."""

    floor: float = 1.0
    window: deque[float] = field(default_factory=lambda: deque(maxlen=CORRECTION_WINDOW_STEPS))

    def __post_init__(self) -> None:
        if not 1.0 <= self.floor <= MAX_CORRECTION:
            raise ValueError(f"correction floor {self.floor} must be in [1, {MAX_CORRECTION}]")

    @property
    def factor(self) -> float:
        """``min(MAX_CORRECTION, max(floor, largest ratio in the window))``."""
        return min(MAX_CORRECTION, max(self.floor, max(self.window, default=0.0)))

    def observe(self, predicted_bytes: int, measured_bytes: int) -> float | None:
        """Record one step: ``predicted_bytes`` (raw model) and ``measured_bytes`` (high-water mark over
        the resident set before the step). Returns ``measured / predicted``, or None for a step under
        :data:`CORRECTION_MIN_PREDICTED_BYTES` (not recorded)."""
        if predicted_bytes < CORRECTION_MIN_PREDICTED_BYTES:
            return None
        ratio = max(0, measured_bytes) / predicted_bytes
        self.window.append(ratio)
        return ratio


class StepPredictor:
    """The memory model of a worker's steps at the routing it observes (no limit: used with admission on
    or off, e.g. for ``moeguard_memory_peak_breakdown_bytes``).

    Args:
        shape: the served model's shape (a preset's ``ModelArgs``, or ``family_shape.from_hf_config``).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        expert_chunk_tokens, capacity_factor: the worker's MoE settings (they bound the busiest expert).
    """

    def __init__(self, shape: ShapeLike, dtype: str, expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
                 capacity_factor: float = 0.0) -> None:
        self.shape = as_family(shape)
        self.dtype = dtype
        self.expert_chunk_tokens = expert_chunk_tokens
        self.capacity_factor = capacity_factor
        self.kv_bytes_per_token = kv_bytes_per_token(self.shape, DTYPE_BYTES[dtype])
        self._prior_share = top_share_from_skew_ratio(PRIOR_SKEW_RATIO, self.shape.num_experts, self.shape.top_k)
        self._shares: deque[float] = deque(maxlen=TOP_SHARE_WINDOW_STEPS)

    # --- the inputs it learns ------------------------------------------------------
    @property
    def top_share(self) -> float:
        """The top expert's share of token-slots the predictions use: the largest of the last
        :data:`TOP_SHARE_WINDOW_STEPS` observed steps, or the prior (skew :data:`PRIOR_SKEW_RATIO`)."""
        return max(self._shares, default=self._prior_share)

    def observe_routing(self, routing: Sequence[RoutingStats]) -> None:
        """Record a step's routing: its largest top-expert share among layers with at least
        ``4 x E`` routed token-slots (the skew metric's rule: fewer say nothing about the router)."""
        e = self.shape.num_experts
        shares = [r.top_expert_tokens / r.routed_slots for r in routing if r.routed_slots >= 4 * e]
        if shares:
            self._shares.append(max(shares))

    # --- predictions ----------------------------------------------------------------
    def estimate(self, step: Step) -> Estimate:
        """The memory model's prediction of ``step``, term by term (bytes above the resident set before it)."""
        routing = Routing(self.top_share, self.expert_chunk_tokens, self.capacity_factor)
        return step_peak(self.shape, step, routing, self.dtype)

    def raw(self, step: Step) -> int:
        """The memory model's peak of ``step`` in bytes above the resident set before it."""
        return self.estimate(step).total_bytes


class MemoryAdmission(StepPredictor):
    """Predicts a worker's steps and fits them under ``min(hard_limit_bytes, the cgroup's limit)``.

    Args:
        shape: the served model's shape (a preset's ``ModelArgs``, or ``family_shape.from_hf_config``).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        hard_limit_bytes: the worker's hard limit (``MOEGUARD_HARD_LIMIT_BYTES``); the cgroup's limit
            comes with the readings (:meth:`observe_reading`).
        expert_chunk_tokens, capacity_factor: the worker's MoE settings (they bound the busiest expert).
        correction_floor: the correction factor's starting value and floor (>= 1; default
            :data:`CORRECTION_FLOOR`).
    """

    def __init__(self, shape: ShapeLike, dtype: str, hard_limit_bytes: int,
                 expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS, capacity_factor: float = 0.0,
                 correction_floor: float = CORRECTION_FLOOR) -> None:
        super().__init__(shape, dtype, expert_chunk_tokens, capacity_factor)
        self.hard_limit_bytes = hard_limit_bytes
        self.cgroup_limit_bytes: int | None = None
        """The memory cgroup's limit last read (bytes), None when the worker runs in no limited cgroup."""
        self.idle_usage_bytes: int | None = None
        """The worker's idle footprint: the smallest use read while it held no sequence (bytes), None
        before the first such reading."""
        self.correction = Correction(correction_floor)

    # --- the limit and the footprint it is judged on ----------------------------------
    @property
    def limit_bytes(self) -> int:
        """The limit steps are fitted under: ``min(hard limit, cgroup limit)``, bytes."""
        cgroup = self.cgroup_limit_bytes
        return self.hard_limit_bytes if cgroup is None else min(self.hard_limit_bytes, cgroup)

    @property
    def limit_source(self) -> str:
        """``cgroup`` when the cgroup's limit is below the hard limit (it is in effect), else ``hard``."""
        cgroup = self.cgroup_limit_bytes
        return "cgroup" if cgroup is not None and cgroup < self.hard_limit_bytes else "hard"

    def describe_limit(self) -> str:
        """The limit in effect in words, for refusal messages."""
        if self.limit_source == "cgroup":
            return (f"the memory cgroup's limit of {self.limit_bytes} bytes (below the hard memory limit "
                    f"of {self.hard_limit_bytes} bytes)")
        return f"the hard memory limit of {self.hard_limit_bytes} bytes"

    def observe_reading(self, usage_bytes: int, cgroup_limit_bytes: int | None, idle: bool) -> bool:
        """Record a memory reading: the cgroup's limit (``None``: no limited cgroup) and, when ``idle``
        (the worker holds no sequence), the idle footprint. Returns whether the limit in effect changed."""
        before = self.limit_bytes, self.limit_source
        self.cgroup_limit_bytes = cgroup_limit_bytes
        if idle and (self.idle_usage_bytes is None or usage_bytes < self.idle_usage_bytes):
            self.idle_usage_bytes = usage_bytes
        return (self.limit_bytes, self.limit_source) != before

    # --- predictions and refusals ------------------------------------------------------
    def predict(self, step: Step) -> int:
        """:meth:`raw` times the correction factor, bytes."""
        return math.ceil(self.raw(step) * self.correction.factor)

    def smallest_step(self, prompt_tokens: int, max_new_tokens: int, kv_allocated: bool = False) -> Step:
        """The smallest step that must fit for a request to finish: its last prefill chunk of
        :data:`MIN_PREFILL_CHUNK_TOKENS` (the one over the most keys), with its KV cache
        (``prompt + max_new_tokens`` tokens) unless already allocated."""
        m = min(prompt_tokens, MIN_PREFILL_CHUNK_TOKENS)
        return Step(prefill=((prompt_tokens - m, m),),
                    new_kv_tokens=0 if kv_allocated else prompt_tokens + max_new_tokens)

    def refusal(self, usage_bytes: int, prompt_tokens: int, max_new_tokens: int,
                kv_allocated: bool = False) -> int | None:
        """The predicted bytes of the request's :meth:`smallest_step` when it does not fit above
        ``usage_bytes`` under :attr:`limit_bytes`, else None."""
        need = self.predict(self.smallest_step(prompt_tokens, max_new_tokens, kv_allocated))
        return need if usage_bytes + need > self.limit_bytes else None

    def never_fits(self, prompt_tokens: int, max_new_tokens: int, usage_bytes: int) -> int | None:
        """The bytes of the request's :meth:`smallest_step` at the correction's floor when it does not
        fit even above the idle footprint (:attr:`idle_usage_bytes`; ``usage_bytes``, the use now, before
        any idle reading) under :attr:`limit_bytes`: it can never be served by this worker (a 400). None
        when it would fit on the idle worker: a refusal now is retryable (503). The floor, not the
        current factor: the factor falls back to it once the window's large ratios have passed."""
        idle = usage_bytes if self.idle_usage_bytes is None else min(usage_bytes, self.idle_usage_bytes)
        raw = self.raw(self.smallest_step(prompt_tokens, max_new_tokens))
        need = math.ceil(raw * self.correction.floor)
        return need if idle + need > self.limit_bytes else None

    def fit(self, usage_bytes: int) -> StepFit:
        """A fit for the next step, above ``usage_bytes``."""
        return StepFit(self, usage_bytes)

    def observe_step(self, predicted_raw_bytes: int, measured_bytes: int) -> float | None:
        """:meth:`Correction.observe`."""
        return self.correction.observe(predicted_raw_bytes, measured_bytes)


class StepFit:
    """One step's composition as the scheduler builds it, kept under the hard limit
    (``Scheduler.schedule``'s ``fit``)."""

    def __init__(self, admission: MemoryAdmission, usage_bytes: int) -> None:
        self.admission = admission
        self.usage_bytes = usage_bytes
        self.prefill: list[tuple[int, int]] = []
        self.decode: list[int] = []
        self.new_kv_tokens = 0
        self.shrunk = 0
        """Prefill chunks cut below what the budgets allowed."""
        self.blocked = 0
        """Chunks (or admissions) that did not fit even at the smallest size."""
        self._factor = admission.correction.factor
        self._limit = admission.limit_bytes

    def step(self, extra: tuple[int, int] | None = None, extra_kv: int = 0) -> Step:
        """The composition so far, plus a candidate chunk ``(start, n)`` and its new KV tokens."""
        prefill = tuple(self.prefill) + ((extra,) if extra and extra[1] else ())
        return Step(prefill, tuple(self.decode), self.new_kv_tokens + extra_kv)

    def _fits(self, start: int, n: int, new_kv_tokens: int) -> bool:
        need = math.ceil(self.admission.raw(self.step((start, n), new_kv_tokens)) * self._factor)
        return self.usage_bytes + need <= self._limit

    def cap(self, start: int, n: int, new_kv_tokens: int = 0) -> int:
        """The largest chunk ``m <= n`` at ``start`` that fits with the step so far (and
        ``new_kv_tokens`` of KV cache the chunk's admission allocates); at least
        ``min(n, MIN_PREFILL_CHUNK_TOKENS)``, else 0 (it does not fit: the chunk waits)."""
        if n <= 0:
            return n if self._fits(start, 0, new_kv_tokens) else 0
        if self._fits(start, n, new_kv_tokens):
            return n
        lo = min(n, MIN_PREFILL_CHUNK_TOKENS)
        if not self._fits(start, lo, new_kv_tokens):
            self.blocked += 1
            return 0
        hi = n  # invariant: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(start, mid, new_kv_tokens):
                lo = mid
            else:
                hi = mid
        self.shrunk += 1
        return lo

    def fits_kv(self, new_kv_tokens: int) -> bool:
        """Whether ``new_kv_tokens`` more positions of KV cache fit with the step so far (a request whose
        prompt another worker prefilled: its cache arrives whole at admission); counts a refusal in
        ``blocked``."""
        if self._fits(0, 0, new_kv_tokens):
            return True
        self.blocked += 1
        return False

    def add(self, start: int, n: int, new_kv_tokens: int = 0) -> None:
        """Put a chunk (from :meth:`cap`) into the step."""
        if n:
            self.prefill.append((start, n))
        self.new_kv_tokens += new_kv_tokens

    def add_decode(self, context_tokens: int) -> None:
        """Put a decode token over ``context_tokens`` cached positions into the step."""
        self.decode.append(context_tokens)

    def predicted_raw(self) -> int:
        """The raw model's peak of the step as composed, bytes."""
        return self.admission.raw(self.step())
