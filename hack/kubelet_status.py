"""What a kubelet would write in a Pod's status, as pure functions (test/demo tooling, not product).

``hack/pod_workers.py`` runs each worker pod's container as a local process and reports it through
these, as the kubelet does:

* :class:`BackOff`: the kubelet's crash-loop back-off (``k8s.io/client-go/util/flowcontrol.Backoff``
  as ``kuberuntime.doBackOff`` uses it): the first restart is immediate; each exit after that waits the
  current back-off (10 s, doubled per restart, capped at 5 min) counted from the exit; an exit more than
  2 x the cap (10 min) after the last restart starts over at 10 s.
* :func:`termination`: exit code and reason of a finished container (``OOMKilled`` when its cgroup
  counted an OOM kill and it died of SIGKILL; else ``Error``, or ``Completed`` for exit 0); a signal
  ``s`` is exit code ``128 + s``.
* :func:`container_status`, :func:`ready_conditions`: ``containerStatuses[]`` and the ``Ready`` /
  ``ContainersReady`` conditions (``lastTransitionTime`` kept while the status does not change).
* :class:`Probe` / :class:`ProbeCounter`: a readiness probe read from the container spec, and its
  success/failure thresholds.

Times are ``datetime`` in UTC; durations in seconds.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

KUBELET_BACKOFF_INITIAL_S = 10.0
KUBELET_BACKOFF_MAX_S = 300.0


def rfc3339(t: datetime) -> str:
    """``2026-11-30T23:00:00Z``: the API's time format (whole seconds, as the kubelet writes it)."""
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class BackOff:
    """One container's back-off state. ``delay_s`` None: no entry yet (or expired)."""

    initial_s: float = KUBELET_BACKOFF_INITIAL_S
    max_s: float = KUBELET_BACKOFF_MAX_S
    delay_s: float | None = None
    last_update: datetime | None = None

    def _expired(self, finished: datetime) -> bool:
        return self.last_update is None or (finished - self.last_update).total_seconds() > 2 * self.max_s

    def wait_s(self, finished: datetime, now: datetime) -> float:
        """Seconds still to wait before restarting a container that exited at ``finished`` (0: now)."""
        if self.delay_s is None or self._expired(finished):
            return 0.0
        return max(0.0, self.delay_s - (now - finished).total_seconds())

    def current_s(self, finished: datetime) -> float:
        """The back-off the kubelet names in ``back-off 10s restarting failed container``."""
        return self.initial_s if self.delay_s is None or self._expired(finished) else self.delay_s

    def restarted(self, finished: datetime, now: datetime) -> BackOff:
        """The state after restarting (``Backoff.Next``): doubled (capped), or reset to the initial
        back-off when there was none or it expired."""
        if self.delay_s is None or self._expired(finished):
            return replace(self, delay_s=self.initial_s, last_update=now)
        return replace(self, delay_s=min(self.delay_s * 2, self.max_s), last_update=now)


@dataclass(frozen=True)
class Termination:
    exit_code: int
    reason: str  # OOMKilled, Error or Completed
    signal: int | None


def termination(returncode: int, oom_kills_before: int, oom_kills_after: int) -> Termination:
    """How a container process ended, from ``Popen.returncode`` (negative: killed by that signal) and
    its cgroup's OOM-kill counter before it started and after it ended."""
    sig = -returncode if returncode < 0 else None
    code = 128 + sig if sig is not None else returncode
    if sig == signal.SIGKILL and oom_kills_after > oom_kills_before:
        return Termination(code, "OOMKilled", sig)
    return Termination(code, "Completed" if code == 0 else "Error", sig)


def terminated_state(term: Termination, started: datetime, finished: datetime,
                     message: str = "") -> dict[str, Any]:
    state: dict[str, Any] = {"exitCode": term.exit_code, "reason": term.reason,
                             "startedAt": rfc3339(started), "finishedAt": rfc3339(finished)}
    if message:
        state["message"] = message
    return {"terminated": state}


def container_status(name: str, image: str, restart_count: int, state: dict[str, Any],
                     last_state: dict[str, Any] | None, ready: bool) -> dict[str, Any]:
    """One ``containerStatuses[]`` entry; ``state`` is ``{"running": ...}``, ``{"waiting": ...}`` or
    ``{"terminated": ...}``."""
    return {"name": name, "image": image, "imageID": "", "containerID": "",
            "restartCount": restart_count, "ready": ready, "started": "running" in state,
            "state": state, "lastState": last_state or {}}


def ready_conditions(previous: list[dict[str, Any]], ready: bool, unready: list[str],
                     now: datetime) -> list[dict[str, Any]]:
    """``previous`` conditions with ``Ready`` and ``ContainersReady`` set (others kept): reason
    ``ContainersNotReady`` naming the ``unready`` containers; ``lastTransitionTime`` moves only when the
    status flips."""
    status = "True" if ready else "False"
    out = [dict(c) for c in previous if c.get("type") not in ("Ready", "ContainersReady")]
    for kind in ("Ready", "ContainersReady"):
        old = next((c for c in previous if c.get("type") == kind), None)
        cond: dict[str, Any] = {"type": kind, "status": status, "lastProbeTime": None,
                                "lastTransitionTime": (old or {}).get("lastTransitionTime") if old
                                and old.get("status") == status else rfc3339(now)}
        if not ready:
            cond["reason"] = "ContainersNotReady"
            cond["message"] = f"containers with unready status: [{' '.join(unready)}]"
        out.append(cond)
    return out


@dataclass(frozen=True)
class Probe:
    """An HTTP readiness probe (``readinessProbe.httpGet``); defaults are the API's."""

    path: str = "/"
    period_s: float = 10.0
    timeout_s: float = 1.0
    initial_delay_s: float = 0.0
    failure_threshold: int = 3
    success_threshold: int = 1

    @classmethod
    def from_container(cls, container: dict[str, Any]) -> Probe | None:
        """The container's readiness probe, or None when it has none (ready once running).

        Raises:
            ValueError: a probe that is not ``httpGet`` (exec, tcpSocket, grpc are not run here).
        """
        spec = container.get("readinessProbe")
        if not spec:
            return None
        http = spec.get("httpGet")
        if not http:
            raise ValueError(f"container {container.get('name')}: readinessProbe "
                             f"{sorted(k for k in spec if k in ('exec', 'tcpSocket', 'grpc'))} is not httpGet; "
                             f"the harness runs only HTTP probes")
        return cls(path=str(http.get("path") or "/"), period_s=float(spec.get("periodSeconds") or 10),
                   timeout_s=float(spec.get("timeoutSeconds") or 1),
                   initial_delay_s=float(spec.get("initialDelaySeconds") or 0),
                   failure_threshold=int(spec.get("failureThreshold") or 3),
                   success_threshold=int(spec.get("successThreshold") or 1))


@dataclass(frozen=True)
class ProbeCounter:
    """Readiness from consecutive probe results: not ready until ``success_threshold`` successes in a
    row, not ready again after ``failure_threshold`` failures in a row (the kubelet's prober)."""

    probe: Probe
    ready: bool = False
    successes: int = 0
    failures: int = 0

    def observe(self, ok: bool) -> ProbeCounter:
        if ok:
            s = self.successes + 1
            return replace(self, successes=s, failures=0, ready=self.ready or s >= self.probe.success_threshold)
        f = self.failures + 1
        return replace(self, successes=0, failures=f, ready=self.ready and f < self.probe.failure_threshold)
