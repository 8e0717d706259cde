"""The outer loop's decision, as a pure function.

``decide(observation, budgets, control, floors, last_change, now)`` never does
I/O and never reads the clock: the handler passes ``now`` in. The rules:

* No data is never read as healthy: a missing skew ratio holds the budgets
  (nothing loosens, nothing tightens on a guess) and says why.
* Skew above ``control.skewThreshold`` halves ``maxPrefillTokens``, never below
  ``floors.maxPrefillTokens``. Halving is the multiplicative decrease of AIMD
  (Chiu & Jain 1989), the rule TCP congestion control uses.
* At most one change per ``control.cooldownSeconds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from moeguard_operator.models import BatchingSpec, BudgetFloors, ControlSpec
from moeguard_runtime.contract import Budgets


@dataclass(frozen=True)
class Observation:
    """What the operator saw in one look. ``None`` means *no data*, never 0.

    Attributes:
        time: when the look was made.
        skew_ratio: the highest expert skew ratio among the service's pods over
            the skew window (top expert tokens / median expert tokens), or None.
        error: why a value is missing (unreachable Prometheus, no series), or None.
    """

    time: datetime
    skew_ratio: float | None
    error: str | None = None

    @property
    def available(self) -> bool:
        return self.skew_ratio is not None


@dataclass(frozen=True)
class Decision:
    """The budgets to put in effect, and why. ``changed`` is False when holding."""

    budgets: Budgets
    changed: bool
    reason: str


def decide(
    observation: Observation,
    budgets: Budgets,
    control: ControlSpec,
    floors: BudgetFloors,
    last_change: datetime | None,
    now: datetime,
) -> Decision:
    """Decide the next budgets from one observation (see the module docstring)."""
    skew = observation.skew_ratio
    if skew is None:
        return Decision(budgets, False, f"holding budgets: metrics unavailable ({observation.error or 'no data'})")
    if skew <= control.skew_threshold:
        return Decision(budgets, False, f"skew ratio {skew:.2f} <= threshold {control.skew_threshold:g}")
    floor = floors.max_prefill_tokens
    if budgets.max_prefill_tokens <= floor:
        return Decision(budgets, False, f"skew ratio {skew:.2f} > {control.skew_threshold:g}, but maxPrefillTokens is at its floor {floor}")
    if last_change is not None and (now - last_change).total_seconds() < control.cooldown_seconds:
        return Decision(budgets, False, f"skew ratio {skew:.2f} > {control.skew_threshold:g}, in cooldown")
    new_prefill = max(floor, budgets.max_prefill_tokens // 2)
    new = budgets.model_copy(update={"max_prefill_tokens": new_prefill})
    return Decision(
        new,
        True,
        f"expert skew ratio {skew:.2f} > threshold {control.skew_threshold:g}: "
        f"maxPrefillTokens {budgets.max_prefill_tokens} -> {new_prefill}",
    )


def initial_budgets(batching: BatchingSpec) -> Budgets:
    """The budgets a spec starts with: its ``batching`` values."""
    return Budgets(
        max_prefill_tokens=batching.max_prefill_tokens,
        max_decode_tokens=batching.max_decode_tokens,
        max_batch_requests=batching.max_batch_requests,
        max_concurrent_batches=batching.max_concurrent_batches,
    )
