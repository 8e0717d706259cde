"""The breakdown of the largest predicted step peak of a sliding window (``moeguard_memory_peak_breakdown_bytes``).

Pure: the step loop gives each step's :class:`memory_model.Estimate` (the memory model's prediction of
the step, :mod:`moeguard_core.memory_model`), the KV cache the worker held before it and the model's
parameter bytes; :class:`PeakWindow` keeps the largest of the last
``contract.PEAK_BREAKDOWN_WINDOW_SECONDS`` (a monotonic deque: O(1) amortised per step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moeguard_core import contract
from moeguard_core.memory_model import Estimate


@dataclass(frozen=True)
class Breakdown:
    """One step's predicted memory by stage (``contract.MEMORY_STAGES``), bytes.

    Attributes:
        kv_cache: KV cache held by every request in the worker before the step plus the caches the
            step allocates (``Estimate.kv_bytes``).
        attention, expert_buffers, dense_mlp: the step's transient phases (``Estimate.attention_bytes``,
            ``moe_bytes``, ``dense_bytes``); only the largest is live at the peak.
        weights: the loaded model's parameters.
        constant: the memory model's per-step constant (``Estimate.constant_bytes``; not a stage).
    """

    kv_cache: int
    attention: int
    expert_buffers: int
    dense_mlp: int
    weights: int
    constant: int = 0

    @property
    def peak_bytes(self) -> int:
        """The step's predicted resident peak: ``weights + kv_cache + constant + max(phases)``, bytes."""
        return self.weights + self.kv_cache + self.constant + max(self.attention, self.expert_buffers,
                                                                  self.dense_mlp)

    def stages(self) -> dict[str, int]:
        """Bytes per stage, keyed and ordered as ``contract.MEMORY_STAGES``."""
        return {"kv_cache": self.kv_cache, "attention": self.attention, "expert_buffers": self.expert_buffers,
                "dense_mlp": self.dense_mlp, "weights": self.weights}


def breakdown(estimate: Estimate, kv_held_bytes: int, weight_bytes: int) -> Breakdown:
    """The :class:`Breakdown` of a step predicted as ``estimate``, with ``kv_held_bytes`` of KV cache held
    by the worker's requests before it and ``weight_bytes`` of parameters."""
    return Breakdown(kv_held_bytes + estimate.kv_bytes, estimate.attention_bytes, estimate.moe_bytes,
                     estimate.dense_bytes, weight_bytes, estimate.constant_bytes)


class PeakWindow:
    """The largest :attr:`Breakdown.peak_bytes` among the steps of the last ``window_s`` seconds.

    ``now`` is any monotonic clock in seconds, non-decreasing between calls. A later step of an equal
    peak replaces an earlier one (it expires later).
    """

    def __init__(self, window_s: float = contract.PEAK_BREAKDOWN_WINDOW_SECONDS) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s {window_s} must be > 0")
        self.window_s = window_s
        self._steps: deque[tuple[float, Breakdown]] = deque()  # peaks strictly decreasing front to back

    def add(self, now: float, step: Breakdown) -> None:
        """Record a step planned at ``now``."""
        while self._steps and self._steps[-1][1].peak_bytes <= step.peak_bytes:
            self._steps.pop()
        self._steps.append((now, step))
        self._expire(now)

    def largest(self, now: float) -> Breakdown | None:
        """The breakdown of the largest step within ``(now - window_s, now]``, None when there is none."""
        self._expire(now)
        return self._steps[0][1] if self._steps else None

    def _expire(self, now: float) -> None:
        while self._steps and now - self._steps[0][0] >= self.window_s:
            self._steps.popleft()
