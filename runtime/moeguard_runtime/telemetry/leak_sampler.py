"""The leak signal sampled from the worker loop: one process-memory sample every
:data:`GROWTH_SAMPLE_INTERVAL_S`, a window of :data:`GROWTH_WINDOW_S`, exported and
logged when its kind changes (:mod:`moeguard_runtime.memory.leak` holds the arithmetic)."""

from __future__ import annotations

from collections.abc import Callable

from moeguard_runtime.memory.leak import GrowthTracker, classify
from moeguard_runtime.memory.procmem import ProcessMemory
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

GROWTH_SAMPLE_INTERVAL_S = 1.0
"""Seconds between two process-memory samples of the leak signal."""
GROWTH_WINDOW_S = 60.0


class LeakSampler:
    """``read_process`` is injected for tests; ``kind`` is the last classification."""

    def __init__(self, telemetry: Telemetry, log: RateLimitedLog,
                 read_process: Callable[[], ProcessMemory]) -> None:
        self.growth = GrowthTracker(GROWTH_WINDOW_S)
        self.kind = "none"
        self._telemetry, self._log, self._read_process = telemetry, log, read_process
        self._next_sample = 0.0

    def sample(self, now: float, force: bool = False) -> None:
        """Take a sample if one is due at ``now`` (monotonic s) or ``force``."""
        if not force and now < self._next_sample:
            return
        self._next_sample = now + GROWTH_SAMPLE_INTERVAL_S
        self.growth.add(now, self._read_process())
        growth = self.growth.growth()
        kind = classify(growth)
        self._telemetry.set_growth(growth, kind)
        if kind != self.kind:
            self._log.event("memory_growth", force=True, kind=kind,
                            rss_anonymous_bytes_per_second=round(growth.rss_anonymous_bytes),
                            python_blocks_per_second=round(growth.python_allocated_blocks, 1),
                            mappings_per_second=round(growth.mappings, 2),
                            window_s=round(growth.window_s, 1))
            self.kind = kind
