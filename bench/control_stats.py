"""Pure arithmetic of the control-latency benchmark (:mod:`bench.control_latency`).

A *series* is a list of ``(unix_time_s, value)`` readings of one worker's budget gauge, oldest
first. No I/O here.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence

Series = Sequence[tuple[float, float]]


def first_time(series: Series, after: float, pred: object) -> float | None:
    """Time of the first reading at or after ``after`` whose value satisfies ``pred`` (a callable
    of the value), or None."""
    if not callable(pred):
        raise TypeError("pred must be callable")
    return next((t for t, v in series if t >= after and pred(v)), None)


def all_reached(series_by_worker: Mapping[str, Series], after: float, pred: object) -> float | None:
    """When the last of the workers first satisfied ``pred`` at or after ``after`` (every worker
    must have); None when one never did or there are no workers."""
    if not series_by_worker:
        return None
    times = [first_time(s, after, pred) for s in series_by_worker.values()]
    return None if any(t is None for t in times) else max(t for t in times if t is not None)


def steps(series: Series) -> list[float]:
    """The value after each change, in order (repeated readings collapsed)."""
    out: list[float] = []
    for _, v in series:
        if not out or v != out[-1]:
            out.append(v)
    return out


def direction_changes(values: Sequence[float]) -> int:
    """How many times the direction of movement flips (down then up, or up then down) along
    ``values``; equal neighbours are no movement. A monotone walk has 0."""
    dirs = [1 if b > a else -1 for a, b in itertools.pairwise(values) if b != a]
    return sum(1 for a, b in itertools.pairwise(dirs) if a != b)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """``n``, ``median``, ``min``, ``max`` of ``values`` (None for an empty list)."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}
