"""Pure helpers for Kubernetes conditions (metav1.Condition semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from moeguard_operator.spec.models import Condition

if TYPE_CHECKING:
    from moeguard_operator.loop.observation import Observation

Status = Literal["True", "False", "Unknown"]


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: Status,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """Return ``conditions`` with condition ``type_`` set (appended when it is new).

    ``lastTransitionTime`` changes only when ``status`` changes, as the API
    conventions require. The input is not modified; order is kept.
    """
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        found = True
        since = now if cond.status != status else cond.last_transition_time
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             last_transition_time=since, observed_generation=generation))
    if not found:
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             last_transition_time=now, observed_generation=generation))
    return out


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of type ``type_`` in a typed status, or None."""
    return next((cond for cond in conditions if cond.type == type_), None)


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of type ``type_`` in an object as the API returns it (JSON form), or None."""
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None


@dataclass(frozen=True)
class Verdict:
    """The MetricsAvailable condition to set, and the Event to post (type, reason), if any."""

    status: Status
    reason: str
    message: str
    event: tuple[str, str] | None = None


SCALED_TO_ZERO = "ScaledToZero"
"""Reason of ``MetricsAvailable=Unknown`` while ``spec.replicas`` is 0 (issue 29, item 3; the kind of
kserve/kserve#6079): a deliberate scale to zero is a calm, known state, not a blind operator."""


def scaled_to_zero_verdict() -> Verdict:
    """MetricsAvailable while ``spec.replicas`` is 0: Unknown, reason ``ScaledToZero``, no Event (no pod has
    series to see, and Prometheus is not asked)."""
    return Verdict("Unknown", SCALED_TO_ZERO, "replicas: 0: no worker pods, so no metrics to look at; Prometheus is "
                                              "not asked until the service scales up")


def metrics_verdict(obs: Observation, prior: Condition | None, prior_silent: Sequence[str], now: datetime,
                    grace_seconds: float) -> Verdict:
    """The MetricsAvailable condition after one look.

    * blind and never yet seeing, or just scaled up from zero (``ScaledToZero``), or waiting less than
      ``grace_seconds``: ``WaitingForMetrics``, no Event — a new pod has no series until its first scrapes and
      batches;
    * blind otherwise: ``MetricsUnavailable`` and one Warning Event when it starts;
    * some pods silent: ``SilentPods`` naming them, a Warning Event when the set changes;
    * all visible: ``AllPodsReporting``, and a Normal Event when sight comes back.
    """
    was = None if prior is None else prior.status
    if not obs.available:
        message = f"{obs.error}; budgets held, nothing loosens"
        waiting = prior is not None and prior.reason == "WaitingForMetrics"
        young = (waiting and prior is not None
                 and (now - prior.last_transition_time).total_seconds() < grace_seconds)
        if prior is None or prior.reason == SCALED_TO_ZERO or young:
            return Verdict("False", "WaitingForMetrics", message)
        started = prior.reason != "MetricsUnavailable"
        return Verdict("False", "MetricsUnavailable", message, ("Warning", "MetricsUnavailable") if started else None)
    if obs.silent_pods:
        message = f"pods report no metrics: {', '.join(obs.silent_pods)}; nothing loosens"
        changed = list(obs.silent_pods) != list(prior_silent)
        return Verdict("False", "SilentPods", message, ("Warning", "SilentPods") if changed else None)
    message = f"{len(obs.reporting_pods)} pods reporting"
    if was == "False":
        return Verdict("True", "AllPodsReporting", message + "; normal control resumes", ("Normal", "MetricsAvailable"))
    return Verdict("True", "AllPodsReporting", message)


def leak_unknown(obs: Observation) -> tuple[str, str]:
    """The reason and message of ``MemoryLeakSuspected=Unknown`` after a look without a leak verdict:
    ``InsufficientHistory`` when some pods' leak window cannot be judged yet (Prometheus restarted or lost
    samples: never read as a flat slope), else ``NoSlope`` (no pod has run for the leak window yet)."""
    if obs.slope_unknown is not None:
        return "InsufficientHistory", f"{obs.slope_unknown}; judged once the leak window fills"
    return "NoSlope", "RSS slope not yet measurable"
