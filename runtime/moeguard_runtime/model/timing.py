"""Clock readings that mean what they say on an asynchronous device.

CUDA kernels run asynchronously: ``time.perf_counter()`` read right after a
launch measures the launch, not the work. Two tools, one per use:

* :func:`clock` synchronises the device, then reads ``time.perf_counter()``
  (seconds). For stage boundaries outside the step's forward pass (a handful
  per step). On the CPU the synchronisation is a no-op.
* :func:`mark` / :func:`seconds_between` time spans *inside* the forward pass
  without a host synchronisation: on CUDA a mark is a recorded
  ``torch.cuda.Event(enable_timing=True)`` (read with ``Event.elapsed_time``,
  milliseconds, once the step has synchronised anyway), on other devices a
  ``time.perf_counter()`` reading.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any
"""A point in a device's timeline: a ``float`` (seconds, ``perf_counter``) or a CUDA event."""


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (``torch.cuda.synchronize``); no-op off CUDA."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """``time.perf_counter()`` seconds, read after :func:`synchronize`."""
    synchronize(device)
    return time.perf_counter()


def mark(device: torch.device | str) -> Mark:
    """A point in the device's timeline, with no host synchronisation (see the module doc)."""
    if is_cuda(device):
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end`` (two :func:`mark` results of one device).

    CUDA events must have completed (read after the step's synchronisation);
    ``Event.elapsed_time`` raises otherwise.
    """
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    return float(start.elapsed_time(end)) / 1000.0
