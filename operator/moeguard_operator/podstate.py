"""Pure reading of worker pods (as the API returns them, in JSON form): which are
Running, how often they restarted, and which containers were OOM-killed when."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class PodFacts:
    """What the pods say.

    Attributes:
        running: names of pods in phase Running that are not being deleted.
        restarts: container restarts summed over the pods.
        started: when each running pod's worker container last started (its RSS history begins there).
        oom_kills: (pod, container, finishedAt) of every last termination with reason OOMKilled.
    """

    running: tuple[str, ...]
    restarts: int
    oom_kills: tuple[tuple[str, str, datetime], ...]
    started: tuple[tuple[str, datetime], ...] = ()

    def running_since(self, before: datetime) -> tuple[str, ...]:
        """Running pods whose worker started no later than ``before``."""
        return tuple(sorted(name for name, t in self.started if t <= before))

    def oom_kills_after(self, since: datetime | None) -> int:
        """OOM kills that finished after ``since`` (all of them when None)."""
        return sum(1 for _, _, t in self.oom_kills if since is None or t > since)

    def latest_oom(self) -> datetime | None:
        return max((t for _, _, t in self.oom_kills), default=None)


def _time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


def pod_facts(pods: list[dict[str, Any]]) -> PodFacts:
    """Summarize pods (``kubectl get pods -o json``'s items) into :class:`PodFacts`."""
    running, restarts, ooms, started = [], 0, [], []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {}) or {}
        name = meta.get("name", "")
        is_running = status.get("phase") == "Running" and not meta.get("deletionTimestamp")
        if is_running:
            running.append(name)
        since = [_time(((cs.get("state") or {}).get("running") or {}).get("startedAt"))
                 for cs in status.get("containerStatuses") or []]
        since_known = [t for t in since if t is not None] or [t for t in [_time(status.get("startTime"))] if t]
        if is_running and since_known:
            started.append((name, max(since_known)))
        for cs in status.get("containerStatuses") or []:
            restarts += int(cs.get("restartCount") or 0)
            for state_key in ("lastState", "state"):
                term = (cs.get(state_key) or {}).get("terminated") or {}
                finished = _time(term.get("finishedAt"))
                if term.get("reason") == "OOMKilled" and finished is not None:
                    ooms.append((name, cs.get("name", ""), finished))
    return PodFacts(tuple(sorted(running)), restarts, tuple(sorted(set(ooms))), tuple(sorted(started)))
