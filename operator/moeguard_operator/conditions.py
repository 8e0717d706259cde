"""Pure helpers for Kubernetes conditions (metav1.Condition semantics)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

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
