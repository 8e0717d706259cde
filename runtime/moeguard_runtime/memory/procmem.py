"""Process and device memory figures, read cheaply enough to sample every second.

Sources (Linux; each reader returns None where its source is missing, and the
metric is then absent rather than 0):

* RSS split: ``/proc/self/status`` ``RssAnon`` (anonymous: heap, mmaps, torch
  CPU tensors) and ``RssFile`` (file-backed: shared libraries, mmapped weights).
* Memory mappings: lines of ``/proc/self/maps`` (a native leak that maps
  regions, e.g. UCX's unreleased registration cache, changes it steadily).
* Python heap: ``sys.getallocatedblocks()``, the number of memory blocks the
  interpreter's object allocator has handed out and not freed (every live
  Python object, whatever its size). It is a count, not bytes: pymalloc does
  not report bytes in use without tracemalloc, whose per-allocation cost is too
  high for serving. A Python-heap leak grows it; an mmap leak does not.
* malloc in use: glibc ``mallinfo2()`` ``uordblks + hblkhd`` (bytes handed out
  by malloc, including torch's CPU tensors and large Python objects).
* GPU: ``torch.cuda.memory_allocated`` / ``memory_reserved`` (torch's caching
  allocator only), ``mem_get_info`` (the whole device: context and other
  processes included), pinned host memory from ``torch.cuda.host_memory_stats``
  (torch >= 2.5), all of the worker's own device (``MOEGUARD_DEVICE``). A worker
  on the CPU, or no CUDA: all None.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class ProcessMemory:
    """One sample; bytes unless named otherwise."""

    rss: int
    rss_anonymous: int | None
    rss_file: int | None
    mappings: int | None
    python_allocated_blocks: int
    malloc_in_use: int | None


@dataclass(frozen=True)
class DeviceMemory:
    """GPU figures in bytes, of the worker's device."""

    allocated: int
    reserved: int
    used: int
    """Device memory in use by everything (total - free, from mem_get_info)."""
    total: int
    pinned: int | None

    @property
    def fragmentation(self) -> int:
        """Reserved minus allocated: the caching allocator's cache, fragmentation included."""
        return self.reserved - self.allocated


def _status_kib(field: str, text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return None


def read_process_memory() -> ProcessMemory:
    """Sample this process's memory (about 0.1 ms plus one line per mapping)."""
    status = _read_status()
    rss = _status_kib("VmRSS:", status)
    if rss is None:
        import psutil

        rss = psutil.Process().memory_info().rss
    try:
        with open("/proc/self/maps", "rb") as f:
            mappings: int | None = f.read().count(b"\n")
    except OSError:
        mappings = None
    return ProcessMemory(rss, _status_kib("RssAnon:", status), _status_kib("RssFile:", status),
                         mappings, sys.getallocatedblocks(), malloc_in_use())


def _read_status() -> str:
    try:
        with open("/proc/self/status") as f:
            return f.read()
    except OSError:
        return ""


def reset_peak_rss() -> int | None:
    """Reset this process's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``,
    Linux >= 4.0, proc(5)) and return the resident set (``VmRSS``) just after, bytes; None when the
    reset is not possible here (then :func:`read_peak_rss` would not measure what follows)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kib("VmRSS:", _read_status())


def read_peak_rss() -> int | None:
    """The resident-set high-water mark since the last :func:`reset_peak_rss` (``VmHWM``), bytes;
    None off Linux. The kernel updates it before unmapping, so a large tensor freed (unmapped) by
    the time it is read still counts."""
    return _status_kib("VmHWM:", _read_status())


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@cache
def _mallinfo2() -> Any:
    # dlopen(NULL): the symbols already loaded, libc among them. (ctypes.util.find_library
    # would run ``ldconfig -p`` in a child process.)
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _MallInfo2
    return fn


def malloc_in_use() -> int | None:
    """glibc malloc bytes in use (``uordblks + hblkhd``), None off glibc >= 2.33."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


def trim_malloc() -> bool:
    """glibc ``malloc_trim(0)``: give the heap's free memory back to the kernel. Returns whether
    memory was released; False off glibc."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(fn(0))


def read_device_memory(device: str | Any = "cuda") -> DeviceMemory | None:
    """GPU figures of ``device`` (the worker's ``MOEGUARD_DEVICE``), or None when it is
    not a CUDA device or CUDA is unavailable. ``cuda`` means the current device."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    pinned = None
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is not None:
        try:
            pinned = int(stats_fn().get("allocated_bytes.current", 0))
        except RuntimeError:
            pinned = None
    return DeviceMemory(int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev)),
                        int(total - free), int(total), pinned)
