"""Memory cgroups for processes that must be confined like a container (test/bench tooling, not product).

A :class:`MemoryCgroup` is one directory in the memory hierarchy whose limit is a container's
``resources.limits.memory``: the kernel OOM-kills a process in it exactly where a node would. Both
hierarchies are supported:

* cgroup v1 (this machine, CI): the ``memory`` controller's mount (``/sys/fs/cgroup/memory``); limit
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted), usage
  ``memory.usage_in_bytes``, kills counted by ``oom_kill`` in ``memory.oom_control``;
* cgroup v2: a ``cgroup2`` mount whose ``cgroup.controllers`` lists ``memory``; limit ``memory.max``
  (``memory.swap.max`` 0), usage ``memory.current``, kills ``oom_kill`` in ``memory.events``.

A process is put in its cgroup before it execs (:meth:`MemoryCgroup.wrap`: a shell writes its own pid
to ``cgroup.procs``, then execs the command), so everything it allocates is charged there. The worker
finds its cgroup itself through ``/proc/self/cgroup`` (``moeguard_runtime.memory.memory.read_memory``), so no
bind mount is needed: its guard reads this limit and this usage.

:func:`memory_hierarchy` raises :class:`MemcgUnavailable` (naming what it tried) when no writable memory
hierarchy exists; callers must say so loudly, never fall back silently.

Used by ``hack/pod_workers.py`` (one cgroup per worker pod) and the benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC_MOUNTS = Path("/proc/self/mounts")


class MemcgUnavailable(RuntimeError):
    """No writable memory cgroup hierarchy on this machine (the message says what was tried)."""


@dataclass(frozen=True)
class Hierarchy:
    """A mounted memory hierarchy: ``version`` 1 or 2, ``mount`` its root directory."""

    version: int
    mount: Path

    @property
    def limit_file(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    @property
    def usage_file(self) -> str:
        return "memory.usage_in_bytes" if self.version == 1 else "memory.current"

    @property
    def events_file(self) -> str:
        return "memory.oom_control" if self.version == 1 else "memory.events"


def find_hierarchies(mounts_text: str, controllers: dict[Path, str] | None = None) -> list[Hierarchy]:
    """Memory hierarchies in ``/proc/self/mounts`` text, v1 first (pure when ``controllers``, a map
    from a cgroup2 mount to its ``cgroup.controllers`` content, is given; else that file is read)."""
    found: list[Hierarchy] = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount, fstype, options = Path(fields[1]), fields[2], fields[3].split(",")
        if fstype == "cgroup" and "memory" in options:
            found.append(Hierarchy(1, mount))
        elif fstype == "cgroup2":
            text = (controllers or {}).get(mount)
            if text is None and controllers is None:
                try:
                    text = (mount / "cgroup.controllers").read_text()
                except OSError:
                    text = ""
            if "memory" in (text or "").split():
                found.append(Hierarchy(2, mount))
    return sorted(found, key=lambda h: h.version)


def memory_hierarchy() -> Hierarchy:
    """The first memory hierarchy where a child cgroup can be made (tried by making and removing one).

    Raises:
        MemcgUnavailable: none is mounted or none is writable (not root, read-only mount); the message
            names each mount tried and why it failed.
    """
    tried = []
    for h in find_hierarchies(PROC_MOUNTS.read_text()):
        probe = h.mount / f"moeguard-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return h
        except OSError as exc:
            tried.append(f"cgroup v{h.version} at {h.mount}: {exc.strerror}")
    raise MemcgUnavailable("no writable memory cgroup: " + ("; ".join(tried) or
                           "neither a cgroup v1 'memory' mount nor a cgroup2 mount with the memory "
                           f"controller in {PROC_MOUNTS}") + " (run as root with the memory controller mounted)")


def _count(text: str, key: str) -> int:
    m = re.search(rf"^{key} (\d+)$", text, re.MULTILINE)
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup directory (``path``) in ``hierarchy``."""

    hierarchy: Hierarchy
    path: Path

    @classmethod
    def create(cls, relative: str, limit_bytes: int, hierarchy: Hierarchy | None = None) -> MemoryCgroup:
        """Make (or reuse) cgroup ``relative`` (e.g. ``moeguard-pods-0/ns_pod``) under the hierarchy's
        root with a hard memory limit of ``limit_bytes`` and no swap.

        Raises:
            MemcgUnavailable: see :func:`memory_hierarchy`.
            ValueError: ``limit_bytes`` is not positive, or ``relative`` leaves the hierarchy.
            OSError: the kernel refused the limit (e.g. below the cgroup's current usage).
        """
        if limit_bytes <= 0:
            raise ValueError(f"memory limit must be > 0 bytes, given {limit_bytes}")
        parts = [p for p in relative.split("/") if p]
        if not parts or ".." in parts:
            raise ValueError(f"cgroup path {relative!r} must be a relative path inside the hierarchy")
        h = hierarchy or memory_hierarchy()
        path = h.mount
        for part in parts:
            if h.version == 2:  # a child gets the memory controller only if its parent delegates it
                control = path / "cgroup.subtree_control"
                if "memory" not in control.read_text().split():
                    control.write_text("+memory")
            path = path / part
            path.mkdir(exist_ok=True)
        cg = cls(h, path)
        if h.version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (path / "memory.memsw.limit_in_bytes").exists():  # swap accounted: no swapping either
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        return cg

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def limit_bytes(self) -> int:
        text = self._read(self.hierarchy.limit_file).strip()
        return -1 if text == "max" else int(text)

    def usage_bytes(self) -> int:
        return int(self._read(self.hierarchy.usage_file))

    def oom_kills(self) -> int:
        """Processes the kernel OOM-killed in this cgroup since it was made (``oom_kill``; 0 on kernels
        older than 4.13 that do not count them)."""
        return _count(self._read(self.hierarchy.events_file), "oom_kill")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside this cgroup: a shell moves itself in, then execs ``cmd`` (same pid)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *cmd]

    def kill_all(self) -> None:
        """SIGKILL every process still in the cgroup (a container's stragglers)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left in it and remove the directory (retried until the kernel lets go).

        Raises:
            OSError: still busy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.kill_all()
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def remove_tree(root: Path) -> None:
    """Remove cgroup directory ``root`` and its children, innermost first (killing what runs there)."""
    if not root.is_dir():
        return
    for child in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        MemoryCgroup(Hierarchy(0, child.parent), child).remove()
    MemoryCgroup(Hierarchy(0, root.parent), root).remove()
