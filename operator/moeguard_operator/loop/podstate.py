"""Pure reading of worker pods (as the API returns them, in JSON form): which are
Running, how often they restarted, which containers were OOM-killed when, which pods are
crash-looping, and why containers that are not ready failed to start.

The fields read are those the kubelet writes (``containerStatuses[]``: ``state``,
``lastState.terminated`` with ``reason`` ``OOMKilled`` / ``Error`` and ``exitCode``,
``restartCount``, ``ready``; ``state.waiting.reason: CrashLoopBackOff`` during its back-off)."""

from __future__ import annotations

from collections.abc import Mapping
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
        startup_failures: (pod, what the kubelet says) for each container that is not ready and failed:
            exited non-zero (its termination message: the worker writes why there, e.g. a bad
            checkpoint) or waits in an error state (CrashLoopBackOff, ImagePullBackOff, …).
        crash_looping: pods (not being deleted) with a container in the kubelet's crash-loop back-off:
            ``state.waiting.reason: CrashLoopBackOff``, or restarted again after one (``restartCount``
            >= 2, the kubelet backs off from the second restart on) and not ready since, with a failed
            last termination; so the name does not flicker while the container runs between back-offs.
            The outer loop must not loosen budgets while this is non-empty.
    """

    running: tuple[str, ...]
    restarts: int
    oom_kills: tuple[tuple[str, str, datetime], ...]
    started: tuple[tuple[str, datetime], ...] = ()
    startup_failures: tuple[tuple[str, str], ...] = ()
    crash_looping: tuple[str, ...] = ()

    def running_since(self, before: datetime) -> tuple[str, ...]:
        """Running pods whose worker started no later than ``before``."""
        return tuple(sorted(name for name, t in self.started if t <= before))

    def oom_kills_after(self, since: datetime | None) -> int:
        """OOM kills that finished after ``since`` (all of them when None)."""
        return sum(1 for _, _, t in self.oom_kills if since is None or t > since)

    def latest_oom(self) -> datetime | None:
        return max((t for _, _, t in self.oom_kills), default=None)


def timestamp(value: Any) -> datetime | None:
    """A time as the API returns it (RFC 3339, ``Z`` or an offset; or already a datetime), or None (absent)."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


WAITING_FAILURES = frozenset({
    "CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})
"""``state.waiting.reason`` values the kubelet sets when a container cannot start (not ``ContainerCreating``
or ``PodInitializing``, which are progress)."""
MESSAGE_CHARS = 2048
"""At most this many characters of a termination message are kept (the kubelet keeps 4096 bytes; a log
tail through ``FallbackToLogsOnError`` keeps its last lines)."""


def _clip(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MESSAGE_CHARS else "…" + message[-(MESSAGE_CHARS - 1):]


def _terminated(term: dict[str, Any]) -> str:
    code, reason, message = term.get("exitCode"), term.get("reason") or "", _clip(str(term.get("message") or ""))
    head = f"exited {code}" + (f" ({reason})" if reason else "")
    return f"{head}: {message}" if message else head


def container_failure(cs: dict[str, Any]) -> str | None:
    """Why a container (one ``containerStatuses[]`` entry) failed to start, or None when it is ready or
    starting for the first time. A crash loop names the last termination (exit code, reason, termination
    message), also while the restarted container runs again but is not ready yet (so the reason does not
    flip at every restart)."""
    if cs.get("ready"):
        return None
    state, last = cs.get("state") or {}, cs.get("lastState") or {}
    name = cs.get("name", "")
    term = state.get("terminated") or {}
    if term and term.get("exitCode") not in (None, 0):
        return f"container {name} {_terminated(term)}"
    last_term = last.get("terminated") or {}
    failed_before = bool(last_term) and last_term.get("exitCode") not in (None, 0)
    if state.get("running") and failed_before:
        return f"container {name} {_terminated(last_term)} (restarted, not ready)"
    waiting = state.get("waiting") or {}
    if waiting.get("reason") not in WAITING_FAILURES:
        return None
    if failed_before:
        return f"container {name} {_terminated(last_term)} ({waiting['reason']})"
    message = _clip(str(waiting.get("message") or ""))
    return f"container {name} {waiting['reason']}" + (f": {message}" if message else "")


def crash_looping(cs: dict[str, Any]) -> bool:
    """Whether a container (one ``containerStatuses[]`` entry) is in a crash loop (see
    :attr:`PodFacts.crash_looping`)."""
    state, last = cs.get("state") or {}, (cs.get("lastState") or {}).get("terminated") or {}
    if ((state.get("waiting") or {}).get("reason")) == "CrashLoopBackOff":
        return True
    failed = bool(last) and (last.get("exitCode") not in (None, 0) or last.get("reason") == "OOMKilled")
    return failed and not cs.get("ready") and int(cs.get("restartCount") or 0) >= 2


CRASH_LOOP = "CrashLoopBackOff"


def cannot_start(pod: dict[str, Any]) -> tuple[str, str] | None:
    """Why a pod (not being deleted) cannot start, as (reason, message): the kubelet's waiting reason of a
    container that waits in :data:`WAITING_FAILURES`, or ``CrashLoopBackOff`` for a container in a crash loop
    (:func:`crash_looping`, also while it runs between two back-offs); the message is :func:`container_failure`'s.
    None while every container starts, runs or is ready."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
        if waiting in WAITING_FAILURES or crash_looping(cs):
            reason = waiting if waiting in WAITING_FAILURES else CRASH_LOOP
            return str(reason), container_failure(cs) or f"container {cs.get('name', '')} {reason}"
    return None


def pod_facts(pods: list[dict[str, Any]]) -> PodFacts:
    """Summarize pods (``kubectl get pods -o json``'s items) into :class:`PodFacts`."""
    running, restarts, ooms, started, failures, looping = [], 0, [], [], [], set()
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {}) or {}
        name = meta.get("name", "")
        is_running = status.get("phase") == "Running" and not meta.get("deletionTimestamp")
        if is_running:
            running.append(name)
        since = [timestamp(((cs.get("state") or {}).get("running") or {}).get("startedAt"))
                 for cs in status.get("containerStatuses") or []]
        since_known = [t for t in since if t is not None] or [t for t in [timestamp(status.get("startTime"))] if t]
        if is_running and since_known:
            started.append((name, max(since_known)))
        for cs in status.get("containerStatuses") or []:
            restarts += int(cs.get("restartCount") or 0)
            if not meta.get("deletionTimestamp") and crash_looping(cs):
                looping.add(name)
            failure = None if meta.get("deletionTimestamp") else container_failure(cs)
            if failure is not None:
                failures.append((name, failure))
            for state_key in ("lastState", "state"):
                term = (cs.get(state_key) or {}).get("terminated") or {}
                finished = timestamp(term.get("finishedAt"))
                if term.get("reason") == "OOMKilled" and finished is not None:
                    ooms.append((name, cs.get("name", ""), finished))
    return PodFacts(tuple(sorted(running)), restarts, tuple(sorted(set(ooms))), tuple(sorted(started)),
                    tuple(sorted(failures)), tuple(sorted(looping)))


def is_ready(pod: Mapping[str, Any]) -> bool:
    """A pod counts as a ready worker: its ``Ready`` condition is True and it is not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
