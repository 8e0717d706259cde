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
GROWTH_WARMUP_S = 15.0
"""A worker's first seconds of sampling, whose growth is never judged a leak: a fresh process grows its allocator's
arenas and lazy state by tens of KiB/s (a clean worker beside loaded neighbours measured 69 KB/s of anonymous RSS
and Python blocks a few seconds after start, over the 64 KiB/s threshold: a ``python_heap`` flag at birth, CI of
stop 40). The slopes are exported meanwhile; the window starts afresh when the warm-up ends, so the first judgement
(after :func:`classify`'s 5 samples) reads only grown-up samples. The operator's rule is the same, longer
(``--leak-warmup-seconds``)."""


class LeakSampler:
    """``read_process`` is injected for tests; ``kind`` is the last classification."""

    def __init__(self, telemetry: Telemetry, log: RateLimitedLog,
                 read_process: Callable[[], ProcessMemory]) -> None:
        self.growth = GrowthTracker(GROWTH_WINDOW_S)
        self.kind = "none"
        self._telemetry, self._log, self._read_process = telemetry, log, read_process
        self._next_sample = 0.0
        self._first_sample: float | None = None
        self._judging = False
        """Whether the warm-up is over (the window then holds only samples taken after it)."""

    def sample(self, now: float, force: bool = False) -> None:
        """Take a sample if one is due at ``now`` (monotonic s) or ``force``."""
        if not force and now < self._next_sample:
            return
        self._next_sample = now + GROWTH_SAMPLE_INTERVAL_S
        if self._first_sample is None:
            self._first_sample = now
        if not self._judging and now >= self._first_sample + GROWTH_WARMUP_S:
            self._judging = True
            self.growth = GrowthTracker(GROWTH_WINDOW_S)  # the window starts afresh with the first grown-up sample
        self.growth.add(now, self._read_process())
        growth = self.growth.growth()
        kind = classify(growth) if self._judging else "none"
        self._telemetry.set_growth(growth, kind)
        if kind != self.kind:
            self._log.event("memory_growth", force=True, kind=kind,
                            rss_anonymous_bytes_per_second=round(growth.rss_anonymous_bytes),
                            python_blocks_per_second=round(growth.python_allocated_blocks, 1),
                            mappings_per_second=round(growth.mappings, 2),
                            window_s=round(growth.window_s, 1))
            self.kind = kind
