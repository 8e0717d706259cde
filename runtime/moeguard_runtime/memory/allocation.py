"""Allocation failures in an engine step: which errors are one, and the worker's health after them.

**Which errors** (:func:`allocation_failure_kind`): the device allocator's
``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class), a
host ``MemoryError``, and a ``RuntimeError`` whose message is one of the
allocators' own (:data:`HOST_MARKERS`, :data:`DEVICE_MARKERS`): torch's CPU
allocator (``c10/core/impl/alloc_cpu.cpp``), oneDNN primitive creation (its
scratchpad and JIT buffers; an address-space limit such as ``prlimit --as``
surfaces there), ``std::bad_alloc`` from C++ code, ``ENOMEM``'s text, and the CUDA
libraries' allocation statuses. The step loop answers the step's requests 503
``out_of_memory`` with ``Retry-After`` (:mod:`moeguard_runtime.engine.step_loop`), where
any other error is a 500 ``engine_error``.

**Health** (:class:`AllocationHealth`, pure, the clock injected): every failed step
counts, every step that runs resets the count.

* After :data:`NOT_READY_AFTER_FAILURES` failed step (the first), ``/readyz`` answers 503
  with the reason (:meth:`AllocationHealth.not_ready_reason`), so the Service stops
  sending traffic. Not after three: a burst of requests that fits in one or two steps
  would have left the worker ready while every step it ran failed (issue 29).
* An unready pod gets no traffic, so nothing would show that allocations work
  again: while not ready for this reason, the loop runs a one-token probe step
  every :data:`PROBE_INTERVAL_S` (:meth:`AllocationHealth.probe_due`). The first
  that runs (or a request's step that runs) makes the worker ready again: a
  transient failure costs about a second of readiness.
* When no step has run for ``unrecovered_s`` seconds since the first failure of
  the run (``MOEGUARD_UNRECOVERED_OOM_SECONDS``, default
  :data:`DEFAULT_UNRECOVERED_S`), ``/healthz`` answers 503 too
  (:meth:`AllocationHealth.not_alive_reason`): the kubelet's liveness probe
  (the operator's: 3 failures 10 s apart) restarts the container, the cure left
  for memory that only a new process gets back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ONEDNN_CREATE_FAILURE = "could not create a primitive"
"""oneDNN's message when a primitive (its JIT code, its scratchpad) cannot be created."""
HOST_MARKERS = (
    "DefaultCPUAllocator: can't allocate memory",
    ONEDNN_CREATE_FAILURE,
    "std::bad_alloc",
    "Cannot allocate memory",
)
"""Messages of host allocation failures that torch raises as ``RuntimeError``: its CPU
allocator, oneDNN's primitive creation, C++ ``bad_alloc``, ``strerror(ENOMEM)``."""
DEVICE_MARKERS = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)
"""Messages of device allocation failures raised as a plain ``RuntimeError`` (cuBLAS and
cuDNN workspaces; older torch's CUDA allocator)."""
NOT_READY_AFTER_FAILURES = 1
"""Failed steps in a row after which ``/readyz`` answers 503: the first, until a step or a probe runs."""
PROBE_INTERVAL_S = 1.0
"""Seconds between probe steps while not ready for allocation failures."""
DEFAULT_UNRECOVERED_S = 60.0
"""Seconds without a step that runs, from the first failure of a run of failures, after which
``/healthz`` answers 503 (``MOEGUARD_UNRECOVERED_OOM_SECONDS``)."""


def allocation_failure_kind(exc: BaseException) -> str | None:
    """``"cuda"`` (a device allocator), ``"host"`` (host memory), or None when ``exc`` is not an
    allocation failure (see the module docstring; the label of ``moeguard_oom_errors_total``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "cuda"
    if isinstance(exc, MemoryError):
        return "host"
    if isinstance(exc, RuntimeError):
        text = str(exc)
        if any(m in text for m in DEVICE_MARKERS):
            return "cuda"
        if any(m in text for m in HOST_MARKERS):
            return "host"
    return None


@dataclass
class AllocationHealth:
    """Consecutive allocation failures and what they mean for readiness and liveness.

    Times are the worker's monotonic clock, seconds. ``unrecovered_s``: see the module docstring.
    """

    unrecovered_s: float = DEFAULT_UNRECOVERED_S
    consecutive: int = 0
    """Steps (probes included) that failed to allocate since the last one that ran."""
    first_failure_at: float | None = None
    """When the current run of failures began; None when the last step ran."""
    last_attempt_at: float = 0.0
    last_error: str = ""

    def failed(self, now: float, error: str) -> None:
        """A step (or probe) at ``now`` failed to allocate; ``error`` is its message."""
        self.consecutive += 1
        if self.first_failure_at is None:
            self.first_failure_at = now
        self.last_attempt_at, self.last_error = now, error[:200]

    def succeeded(self, now: float) -> None:
        """A step (or probe) at ``now`` ran: the run of failures is over."""
        self.consecutive, self.first_failure_at, self.last_attempt_at = 0, None, now

    @property
    def degraded(self) -> bool:
        """Not ready for allocation failures (:data:`NOT_READY_AFTER_FAILURES` in a row)."""
        return self.consecutive >= NOT_READY_AFTER_FAILURES

    def probe_due(self, now: float) -> bool:
        """Whether the loop should run a probe step at ``now``."""
        return self.degraded and now - self.last_attempt_at >= PROBE_INTERVAL_S

    def not_ready_reason(self, now: float) -> str | None:
        """Why ``/readyz`` answers 503 for allocation failures, or None."""
        if not self.degraded or self.first_failure_at is None:
            return None
        steps = "engine step" if self.consecutive == 1 else f"{self.consecutive} engine steps"
        return (f"out of memory: the last {steps} failed to allocate memory, for "
                f"{now - self.first_failure_at:.1f} s; a probe step every {PROBE_INTERVAL_S:g} s "
                f"clears it once allocation works (last error: {self.last_error})")

    def not_alive_reason(self, now: float) -> str | None:
        """Why ``/healthz`` answers 503: no step has run for ``unrecovered_s`` s since the first
        failure (and the worker is not ready); None otherwise."""
        if not self.degraded or self.first_failure_at is None:
            return None
        if now - self.first_failure_at < self.unrecovered_s:
            return None
        return (f"engine cannot allocate memory: no step has run for {now - self.first_failure_at:.1f} s "
                f"(limit {self.unrecovered_s:g} s, MOEGUARD_UNRECOVERED_OOM_SECONDS) over "
                f"{self.consecutive} failed steps (last error: {self.last_error})")
