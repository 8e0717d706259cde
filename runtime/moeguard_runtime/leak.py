"""The leak signal: which part of the process memory grows, and test-only faults.

:class:`GrowthTracker` keeps a sliding window of :class:`ProcessMemory` samples
and fits a least-squares slope to each part. :func:`classify` then names the
growth:

* ``native``: anonymous RSS grows while the Python heap's block count does not
  (fewer than one new block per :data:`BYTES_PER_BLOCK_NATIVE` bytes of
  growth). This is the shape of UCX's unbounded ``UCX_RCACHE_MAX_UNRELEASED``
  queue: RSS up by hundreds of MB a minute, heap flat, mappings changing.
* ``python_heap``: the Python heap's block count grows along with RSS.
* ``none``: anonymous RSS grows slower than ``threshold_bytes_per_s``.

The faults (:class:`FaultLeaker`) exist so the signal can be tested end to end:
``MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND`` maps and touches anonymous
memory (outside every Python and malloc counter), and
``MOEGUARD_FAULT_LEAK_PYTHON_BYTES_PER_SECOND`` keeps small Python objects.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from moeguard_runtime.procmem import ProcessMemory

BYTES_PER_BLOCK_NATIVE = 4096
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


class FaultLeaker:
    """Test-only: leak memory at a set rate from a daemon thread, every 0.1 s.

    ``anon_bps``: anonymous private mappings, each touched page by page so it
    is resident; they are kept, never unmapped. ``python_bps``: 100-byte
    ``bytes`` objects kept in a list (about 133 bytes of heap each).
    """

    TICK_S = 0.1

    def __init__(self, anon_bps: int, python_bps: int) -> None:
        self.anon_bps, self.python_bps = anon_bps, python_bps
        self._maps: list[mmap.mmap] = []
        self._objects: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-leaker", daemon=True)

    @property
    def enabled(self) -> bool:
        return self.anon_bps > 0 or self.python_bps > 0

    def start(self) -> None:
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        anon_chunk = int(self.anon_bps * self.TICK_S)
        py_count = int(self.python_bps * self.TICK_S / 133)
        while not self._stop.wait(self.TICK_S):
            if anon_chunk > 0:
                size = -(-anon_chunk // mmap.PAGESIZE) * mmap.PAGESIZE
                region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                for off in range(0, size, mmap.PAGESIZE):
                    region[off] = 1
                self._maps.append(region)
            for i in range(py_count):
                self._objects.append(i.to_bytes(8, "little") * 12 + b"leak")
