"""Pure helpers for Kubernetes conditions (metav1.Condition semantics)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from moeguard_operator.policy import Observation

Status = Literal["True", "False", "Unknown"]


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: Status,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[dict[str, Any]]:
    """Return ``conditions`` with condition ``type_`` set.

    ``lastTransitionTime`` changes only when ``status`` changes, as the API
    conventions require. The input list is not modified; order is kept.
    """
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions or []:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != status
        out.append({
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now.isoformat() if changed else cond.get("lastTransitionTime", now.isoformat()),
            "observedGeneration": generation,
        })
    if not found:
        out.append({
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now.isoformat(),
            "observedGeneration": generation,
        })
    return out


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of type ``type_``, or None."""
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


def metrics_verdict(obs: Observation, prior: dict[str, Any] | None, prior_silent: list[str], now: datetime,
                    grace_seconds: float) -> Verdict:
    """The MetricsAvailable condition after one look.

    * blind and never yet seeing (or waiting less than ``grace_seconds``): ``WaitingForMetrics``, no Event —
      a new service has no series until its first scrapes and batches;
    * blind otherwise: ``MetricsUnavailable`` and one Warning Event when it starts;
    * some pods silent: ``SilentPods`` naming them, a Warning Event when the set changes;
    * all visible: ``AllPodsReporting``, and a Normal Event when sight comes back.
    """
    was = None if prior is None else prior.get("status")
    if not obs.available:
        message = f"{obs.error}; budgets held, nothing loosens"
        waiting = prior is not None and prior.get("reason") == "WaitingForMetrics"
        since = prior.get("lastTransitionTime") if waiting and prior is not None else None
        young = since is not None and (now - datetime.fromisoformat(since)).total_seconds() < grace_seconds
        if prior is None or young:
            return Verdict("False", "WaitingForMetrics", message)
        started = prior.get("reason") != "MetricsUnavailable"
        return Verdict("False", "MetricsUnavailable", message, ("Warning", "MetricsUnavailable") if started else None)
    if obs.silent_pods:
        message = f"pods report no metrics: {', '.join(obs.silent_pods)}; nothing loosens"
        changed = list(obs.silent_pods) != prior_silent
        return Verdict("False", "SilentPods", message, ("Warning", "SilentPods") if changed else None)
    message = f"{len(obs.reporting_pods)} pods reporting"
    if was == "False":
        return Verdict("True", "AllPodsReporting", message + "; normal control resumes", ("Normal", "MetricsAvailable"))
    return Verdict("True", "AllPodsReporting", message)
