"""Memory guard: which figure the soft/hard limits are compared with, and the decision.

**The compared figure** is the container's working set when the process runs
in a cgroup with a memory limit: its usage, cgroup v2 ``memory.current`` (limit
in ``memory.max``) or v1 ``memory.usage_in_bytes`` (limit in
``memory.limit_in_bytes``), minus the inactive file pages of ``memory.stat``
(v2 ``inactive_file``, v1 ``total_inactive_file``), which the kernel reclaims
before it OOM-kills: the kubelet's and cAdvisor's
``container_memory_working_set_bytes``, what its evictions compare. Page cache
the container keeps (a checkpoint read from disk) would otherwise count as
used and hold the worker above its limits with nothing to free; anonymous
memory, tmpfs, active file pages and the container's other processes count. The cgroup is the worker's own, read from ``/proc/self/cgroup``
(v2 line ``0::/path``, v1 ``memory`` line), looked up under the mounted
hierarchy with its ancestors, the smallest limit winning; when that path is not
mounted (a container without a cgroup namespace) the mount root, which inside a
container is the container's cgroup. Without a limited cgroup (a laptop, a
test) it is the process RSS.
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
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
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
    cgroup_path: str | None = None  # the directory read, when a cgroup


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


def own_cgroups(proc_cgroup: Path = PROC_SELF_CGROUP) -> tuple[str | None, str | None]:
    """``(v2 path, v1 memory path)`` of this process from ``/proc/self/cgroup``: the
    unified line ``0::/path`` and the v1 line whose controllers include ``memory``
    (``4:memory:/path``). None where the line (or the file) is missing."""
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return None, None
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _chain(mount: Path, path: str | None) -> list[Path]:
    """The process's cgroup directory under ``mount`` and its ancestors up to
    ``mount``, innermost first. When ``path`` is not there (a container without a
    cgroup namespace, whose own cgroup is mounted as the root), ``[mount]``."""
    parts = [p for p in (path or "").split("/") if p]
    if parts and ".." not in parts and mount.joinpath(*parts).is_dir():
        return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [mount]


def inactive_file_bytes(directory: Path, key: str) -> int:
    """``key`` (``inactive_file``, v1 ``total_inactive_file``) of ``memory.stat`` in bytes; 0 when absent."""
    try:
        text = (directory / "memory.stat").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _tightest(dirs: list[Path], usage_file: str, limit_file: str,
              unlimited: int | None) -> tuple[int, int, Path] | None:
    """``(usage, limit, dir)`` of the directory with the smallest limit (the one the
    kernel enforces first), or None when none has both files and a limit."""
    best: tuple[int, int, Path] | None = None
    for d in dirs:
        limit = _read_int(d / limit_file)
        if limit is None or (unlimited is not None and limit >= unlimited):
            continue
        usage = _read_int(d / usage_file)
        if usage is not None and (best is None or limit < best[1]):
            best = (usage, limit, d)
    return best


def read_memory(root: Path = CGROUP_ROOT,
                proc_cgroup: Path = PROC_SELF_CGROUP) -> MemoryReading:
    """The compared figure (see module docstring).

    The worker's own cgroup comes from ``proc_cgroup``; the v2 files are read
    under ``root`` (the unified mount), the v1 files under ``root/memory``, in
    that cgroup's directory and its ancestors (a limit set on the pod's level
    binds the container too), falling back to the mount root (inside a container
    the root is the container's cgroup) and then to the process RSS.
    """
    v2_path, v1_path = own_cgroups(proc_cgroup)
    found = _tightest(_chain(root, v2_path), "memory.current", "memory.max", None)
    if found is not None:
        working_set = max(0, found[0] - inactive_file_bytes(found[2], "inactive_file"))
        return MemoryReading(working_set, "cgroup_v2", found[1], str(found[2]))
    found = _tightest(_chain(root / "memory", v1_path), "memory.usage_in_bytes",
                      "memory.limit_in_bytes", _V1_UNLIMITED)
    if found is not None:
        working_set = max(0, found[0] - inactive_file_bytes(found[2], "total_inactive_file"))
        return MemoryReading(working_set, "cgroup_v1", found[1], str(found[2]))
    return MemoryReading(psutil.Process().memory_info().rss, "rss")


def start_headroom(reading: MemoryReading, hard_limit_bytes: int | None) -> int | None:
    """Bytes left under the tightest limit: the cgroup's (where the kernel OOM-kills) and
    ``MOEGUARD_HARD_LIMIT_BYTES``, minus the compared figure (negative when over); None when neither
    limit exists (pure). What a start-up step that allocates a known amount checks first."""
    limits = [x for x in (reading.limit_bytes, hard_limit_bytes) if x]
    return min(limits) - reading.usage_bytes if limits else None


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
