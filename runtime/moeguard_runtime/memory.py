"""Memory guard: which figure the soft/hard limits are compared with, and the decision.

**The compared figure** is the container's cgroup usage when the process runs
in a cgroup with a memory limit: cgroup v2 ``memory.current`` (limit in
``memory.max``), or v1 ``memory.usage_in_bytes`` (limit in
``memory.limit_in_bytes``). That is the number the kernel's OOM killer compares
with the limit, and it also counts page cache, tmpfs and the container's other
processes. Without a limited cgroup (a laptop, a test) it is the process RSS.
The source in use is logged at start (``event=memory_source``) and exported as
the ``source`` label of ``moeguard_memory_usage_bytes``.

**Which figure each limit uses:** ``MOEGUARD_SOFT_LIMIT_BYTES`` and
``MOEGUARD_HARD_LIMIT_BYTES`` are compared with that host figure; on a GPU,
``MOEGUARD_GPU_SOFT_FRACTION`` and ``MOEGUARD_GPU_HARD_FRACTION`` of the device's
total are compared with the device memory in use (:func:`decide_device`), and
the worse of the two states wins.

**The decision** (:func:`decide`) is pure: above the hard limit new requests get
503; above the soft limit the budgets are multiplied by ``shrink_factor``; the
shrink is lifted only once usage is below ``soft * (1 - hysteresis)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


class MemoryState(IntEnum):
    NORMAL = 0
    SOFT = 1
    HARD = 2


@dataclass(frozen=True)
class MemoryReading:
    usage_bytes: int
    source: str  # "cgroup_v2", "cgroup_v1" or "rss"
    limit_bytes: int | None = None  # the cgroup's own limit, when limited


@dataclass(frozen=True)
class MemoryPolicy:
    soft_limit_bytes: int | None
    hard_limit_bytes: int | None
    shrink_factor: float = 0.5
    hysteresis: float = 0.1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def read_memory(root: Path = CGROUP_ROOT) -> MemoryReading:
    """The compared figure (see module docstring)."""
    current, limit = _read_int(root / "memory.current"), _read_int(root / "memory.max")
    if current is not None and limit is not None:
        return MemoryReading(current, "cgroup_v2", limit)
    current = _read_int(root / "memory" / "memory.usage_in_bytes")
    limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    if current is not None and limit is not None and limit < _V1_UNLIMITED:
        return MemoryReading(current, "cgroup_v1", limit)
    return MemoryReading(psutil.Process().memory_info().rss, "rss")


def decide(state: MemoryState, usage_bytes: int, policy: MemoryPolicy) -> MemoryState:
    """Next state from the current one and the compared figure (pure).

    HARD when usage > hard; SOFT when usage > soft, or when already SOFT/HARD
    and usage is still above ``soft * (1 - hysteresis)``; NORMAL otherwise. An
    unset limit never triggers.
    """
    hard, soft = policy.hard_limit_bytes, policy.soft_limit_bytes
    if hard is not None and usage_bytes > hard:
        return MemoryState.HARD
    if soft is None:
        return MemoryState.NORMAL
    if usage_bytes > soft:
        return MemoryState.SOFT
    if state != MemoryState.NORMAL and usage_bytes > soft * (1 - policy.hysteresis):
        return MemoryState.SOFT
    return MemoryState.NORMAL


def shrink_factor(state: MemoryState, policy: MemoryPolicy) -> float:
    """Budget multiplier for ``state``: 1.0 in NORMAL, ``policy.shrink_factor`` otherwise."""
    return 1.0 if state == MemoryState.NORMAL else policy.shrink_factor


def decide_device(state: MemoryState, used_bytes: int, total_bytes: int, soft_fraction: float,
                  hard_fraction: float, hysteresis: float = 0.1) -> MemoryState:
    """The same decision for GPU memory: device memory in use (``mem_get_info``
    total - free, which counts the CUDA context and other processes, not only
    torch's allocator) against ``soft_fraction`` and ``hard_fraction`` of the
    device's total."""
    policy = MemoryPolicy(int(total_bytes * soft_fraction), int(total_bytes * hard_fraction),
                          hysteresis=hysteresis)
    return decide(state, used_bytes, policy)
