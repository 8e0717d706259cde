"""The memory guard of the worker loop: read the compared figures (host and device,
at most every :data:`MEMORY_CHECK_INTERVAL_S`), export them, and move the
normal/soft/hard state (:mod:`moeguard_runtime.memory.memory` holds the pure rules)."""

from __future__ import annotations

from collections.abc import Callable

from moeguard_runtime.config import Settings
from moeguard_runtime.engine.scheduler import Rejected
from moeguard_runtime.memory.memory import (
    MemoryPolicy,
    MemoryReading,
    MemoryState,
    decide,
    decide_device,
    shrink_factor,
)
from moeguard_runtime.memory.procmem import DeviceMemory
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

MEMORY_CHECK_INTERVAL_S = 0.25
ALLOCATION_FAILURE_HOLD_S = 30.0
"""After an allocation failure in a step, the budgets stay shrunk (state at least SOFT, as on a
soft-limit breach) for this many seconds from the last failed step: no usage figure says when the
pressure is over. When they are up the state is the measured one at once: the hold feeds neither
the soft limit's hysteresis nor the overload trigger's hold (docs/api.md, "Out of memory in a step")."""


class MemoryGuard:
    """The state and last readings; the readers are injected (tests)."""

    def __init__(self, settings: Settings, telemetry: Telemetry, log: RateLimitedLog,
                 read_memory: Callable[[], MemoryReading],
                 read_device: Callable[[], DeviceMemory | None]) -> None:
        self.settings = settings
        self.policy = MemoryPolicy(settings.soft_limit_bytes, settings.hard_limit_bytes,
                                   settings.soft_shrink_factor)
        self.state = MemoryState.NORMAL
        """The state in effect: :attr:`measured_state`, raised to SOFT while an allocation failure's hold lasts."""
        self.measured_state = MemoryState.NORMAL
        """The state of the readings alone (with the limits' hysteresis), without the hold."""
        self.last_memory: MemoryReading | None = None
        self.last_device: DeviceMemory | None = None
        self._telemetry, self._log = telemetry, log
        self._read_memory, self._read_device = read_memory, read_device
        self._next_check = 0.0
        self._hold_soft_until = -1e18
        for name, value in (("soft", settings.soft_limit_bytes), ("hard", settings.hard_limit_bytes)):
            if value is not None:
                telemetry.memory_limit.labels(**telemetry.l(limit=name)).set(value)

    @property
    def allocation_hold_until(self) -> float:
        """When the last allocation failure's hold ends (monotonic s; in the past when none holds)."""
        return self._hold_soft_until

    @property
    def shrink_factor(self) -> float:
        """Budget multiplier of the current state."""
        return shrink_factor(self.state, self.policy)

    def refuse_above_hard(self) -> None:
        """Raises :class:`Rejected` (503 ``memory_hard_limit``) above the hard limit."""
        if self.state == MemoryState.HARD and self.last_memory is not None:
            raise Rejected("memory_hard_limit",
                           f"worker memory {self.last_memory.usage_bytes} bytes "
                           f"({self.last_memory.source}) is above the hard limit "
                           f"{self.policy.hard_limit_bytes} bytes", retry_after_s=5, status=503)

    def allocation_failed(self, now: float) -> float | None:
        """An engine step failed to allocate at ``now`` (monotonic s): hold the state at least at
        SOFT for :data:`ALLOCATION_FAILURE_HOLD_S` s, so the budgets drop by the soft limit's
        ``shrink_factor`` (the soft-limit path: the same factor, and the Auto overload trigger
        sees memory pressure). Returns the new shrink factor when it changed (the caller applies
        it to the scheduler), else None."""
        self._hold_soft_until = now + ALLOCATION_FAILURE_HOLD_S
        return self._move(max(self.state, MemoryState.SOFT), "allocation_failure")

    def _move(self, state: MemoryState, reason: str) -> float | None:
        """Move to ``state``; log it and return the new shrink factor when the factor changed."""
        if state == self.state:
            return None
        old_factor = self.shrink_factor
        self.state = state
        factor = self.shrink_factor
        reading, device = self.last_memory, self.last_device
        self._log.event("memory_state", force=True, state=state.name.lower(), reason=reason,
                        usage_bytes=reading.usage_bytes if reading else None,
                        source=reading.source if reading else None,
                        gpu_used_bytes=device.used if device else None, shrink_factor=factor)
        self._telemetry.memory_state.labels(**self._telemetry.labels).set(int(state))
        return factor if factor != old_factor else None

    def due(self, now: float, force: bool = False) -> bool:
        """Whether a check is due at ``now`` (monotonic s); schedules the next one."""
        if not force and now < self._next_check:
            return False
        self._next_check = now + MEMORY_CHECK_INTERVAL_S
        return True

    def check(self, now: float = 0.0) -> float | None:
        """Read, export, and move the state at ``now`` (monotonic s: an allocation failure's hold
        ends then). Returns the new shrink factor when it changed (the caller applies it to the
        scheduler), else None."""
        reading, device = self._read_memory(), self._read_device()
        s, tel = self.settings, self._telemetry
        if self.last_memory is None:
            self._log.event("memory_source", force=True, source=reading.source,
                            usage_bytes=reading.usage_bytes, cgroup_limit_bytes=reading.limit_bytes,
                            cgroup_path=reading.cgroup_path,
                            soft_limit_bytes=self.policy.soft_limit_bytes,
                            hard_limit_bytes=self.policy.hard_limit_bytes,
                            gpu=device is not None, gpu_soft_fraction=s.gpu_soft_fraction,
                            gpu_hard_fraction=s.gpu_hard_fraction)
        self.last_memory, self.last_device = reading, device
        tel.memory_usage.labels(**tel.l(source=reading.source)).set(reading.usage_bytes)
        if reading.limit_bytes is not None:
            tel.memory_cgroup_limit.labels(**tel.l(source=reading.source)).set(reading.limit_bytes)
        state = decide(self.measured_state, reading.usage_bytes, self.policy)
        if device is not None:
            tel.set_device(device)
            state = max(state, decide_device(self.measured_state, device.used, device.total,
                                             s.gpu_soft_fraction, s.gpu_hard_fraction))
        self.measured_state = state
        reason = "limit"
        if now < self._hold_soft_until and state < MemoryState.SOFT:
            state, reason = MemoryState.SOFT, "allocation_failure"
        changed = self._move(state, reason)
        tel.memory_state.labels(**tel.labels).set(int(state))
        return changed
