"""The leak signal: which part of the process memory grows.

:class:`GrowthTracker` keeps a sliding window of :class:`ProcessMemory` samples
and fits a least-squares slope to each part. :func:`classify` then names the
growth:

* ``native``: anonymous RSS grows while the Python heap's block count does not
  (fewer than one new block per :data:`BYTES_PER_BLOCK_NATIVE` bytes of
  growth). This is the shape of UCX's unbounded ``UCX_RCACHE_MAX_UNRELEASED``
  queue: RSS up by hundreds of MB a minute, heap flat, mappings changing.
* ``python_heap``: the Python heap's block count grows along with RSS.
* ``none``: anonymous RSS grows slower than ``threshold_bytes_per_s``.

The test-only faults that exercise it end to end live in
:mod:`moeguard_runtime.faults`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from moeguard_core import contract
from moeguard_runtime.memory.procmem import ProcessMemory

BYTES_PER_BLOCK_NATIVE = contract.LEAK_BYTES_PER_BLOCK_NATIVE
"""Growth with fewer than one new Python block per this many bytes is not the Python heap's."""
DEFAULT_THRESHOLD_BYTES_PER_S = 64 * 1024
"""Anonymous RSS growth below this (3.75 MiB/min) is read as no growth."""


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points, y-units per t-unit; 0 with < 2 points."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in points) / var


@dataclass(frozen=True)
class Growth:
    """Slopes over the window, per second."""

    rss_bytes: float
    rss_anonymous_bytes: float
    rss_file_bytes: float
    malloc_in_use_bytes: float
    mappings: float
    python_allocated_blocks: float
    window_s: float
    samples: int


class GrowthTracker:
    """Sliding window (``window_s`` seconds) of samples with their times (monotonic s)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, ProcessMemory]] = deque()

    def add(self, t: float, sample: ProcessMemory) -> None:
        self._samples.append((t, sample))
        while self._samples and t - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def growth(self) -> Growth:
        pts = list(self._samples)

        def s(get: Callable[[ProcessMemory], int | None]) -> float:
            return slope([(t, float(v)) for t, m in pts if (v := get(m)) is not None])

        span = pts[-1][0] - pts[0][0] if pts else 0.0
        return Growth(s(lambda m: m.rss), s(lambda m: m.rss_anonymous), s(lambda m: m.rss_file),
                      s(lambda m: m.malloc_in_use), s(lambda m: m.mappings),
                      s(lambda m: m.python_allocated_blocks), span, len(pts))


def classify(g: Growth, threshold_bytes_per_s: float = DEFAULT_THRESHOLD_BYTES_PER_S,
             min_samples: int = 5) -> str:
    """``none``, ``native`` or ``python_heap`` (see the module docstring)."""
    if g.samples < min_samples or g.rss_anonymous_bytes < threshold_bytes_per_s:
        return "none"
    if g.python_allocated_blocks * BYTES_PER_BLOCK_NATIVE < g.rss_anonymous_bytes:
        return "native"
    return "python_heap"
