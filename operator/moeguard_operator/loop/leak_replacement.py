"""The leak replacement, pure: a leaking worker pod replaced *before* it reaches ``resources.hardLimit``, with
the Deployment's surge where one is possible (issue 30, item 4).

For ``--policy predictive``, ``control.leakAction: Restart`` and Deployment workers
(``parallelism.podsPerReplica: 1``) this replaces the rolling restart of the whole Deployment (which drains pods
while their successors load); the threshold policy and LeaderWorkerSet keep the rolling restart.

**When.** Per pod, from its own RSS slope (``Observation.pod_rss_slopes``, bytes/s, over ``leakWindowSeconds``)
and its memory in use (``PodLoad.memory_bytes``, bytes): the projected seconds to ``hardLimit``
(:func:`policy.seconds_to_hard_limit`). A replacement starts when that is at most the **lead time**
(:func:`lead_seconds`)::

    lead = 3 × ready + grace + interval

* ``ready``: the seconds a replacement takes to become Ready, *measured* from the service's own pods
  (:func:`measured_ready_seconds`: ``creationTimestamp`` to the ``Ready`` condition's ``lastTransitionTime``,
  the newest pod's; ``status.observed.replacementReadySeconds``), :data:`DEFAULT_READY_SECONDS` before any.
  Tripled (:data:`READY_SAFETY_FACTOR`): the measurement is of a past pod, and a surge pod may wait for
  scheduling or a colder image cache, start beside a node busier with the leak, or the slope may steepen.
* ``grace``: the leaking pod's ``terminationGracePeriodSeconds`` (30 s where unset): once drained it may take
  that long to finish its requests and exit, still leaking.
* ``interval``: ``control.queryIntervalSeconds``: the crossing is seen up to one look late.

**How** (:func:`plan`, one replacement at a time per service, kept in ``status.leakReplacement``):

* **Surge** where one is possible: the leaking pod gets ``controller.kubernetes.io/pod-deletion-cost: -1000``
  (a ReplicaSet scaling down deletes the lowest cost first, among pods equally scheduled, running and ready)
  and the Deployment the **base** count + 1 (phase ``Surging``); once the surge pod is Ready, replicas go back
  to the base and the ReplicaSet removes the leaking pod: its graceful termination is the worker's drain (phase
  ``Draining``). The base is :func:`autoscale.base_replicas`: ``spec.replicas``, or with ``spec.autoscaling``
  the autoscaler's count (``status.autoscaling.desiredReplicas`` within its bounds; the autoscaler holds while
  a replacement is in progress, so the base does not move under a surge). The reconcile and the loop's re-apply
  of a deleted Deployment apply base + 1 while ``Surging`` (:func:`surge_replicas`), so they never fight the
  surge; the resource's spec is never written.
* **Drain** (delete the leaking pod, graceful; the ReplicaSet then creates its successor) where no surge is
  possible: the Deployment's ``maxSurge`` is 0, its ReplicaSet cannot create pods (``ReplicaFailure`` True,
  reason ``FailedCreate``: a ResourceQuota), a pod of the service is ``Unschedulable``
  (``PodScheduled`` False), or, during a surge, one of these appears or the surge pod is not Ready while
  the leaking pod is within ``grace + interval`` of the hard limit (not Ready in time).
* **No end-less replacement** (a replacement in progress holds the autoscaler): a surge whose pod is not Ready
  within twice the lead, the leaking pod far from its limit, is abandoned (replicas back to the base, a Warning;
  it is replaced again when due); a drain that overruns by :data:`STUCK_SECONDS` ends (see :func:`_draining`).

Events (:class:`report.Event`, reason ``LeakReplacement``): Normal for a surge (the projection, the lead and the
measured ready time), Warning for a drain, saying why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from moeguard_operator.children.builders import worker_replicas
from moeguard_operator.loop.autoscale import base_replicas
from moeguard_operator.loop.observation import LEAK_NOISE_BYTES_PER_SECOND, Observation
from moeguard_operator.loop.podstate import is_ready, timestamp
from moeguard_operator.loop.policy import seconds_to_hard_limit
from moeguard_operator.loop.report import Event
from moeguard_operator.spec.models import (
    LeakReplacementStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)

Pod = Mapping[str, Any]
DEFAULT_READY_SECONDS = 300.0
"""The ready time assumed before any pod of the service was measured, seconds: the safe side (replace early)."""
READY_SAFETY_FACTOR = 3.0
"""The measured ready time counts this many times in the lead (see the module docstring). Measured: in the headline
benchmark (stop 48, 2 cores) the service's pods, started idle, were Ready 5-6 s after creation, and a surge pod
started beside two busy workers 11 s after (2.2x). At 2x the first surge began with 36-43 s left to the hard limit,
its pod was not Ready at the next look and the leaking pod was drained instead (within grace + interval) in every
repetition. At 3x the first surges began with 39-53 s left and were still drained, 5-11 s later: the projection fell
faster than the clock while the leak was younger than the slope's window (``leakWindowSeconds``), so the slope
steepened from look to look. A slope that weighs the window's newest part is the fix left open."""
DEFAULT_GRACE_SECONDS = 30.0
"""A pod's ``terminationGracePeriodSeconds`` where its spec has none (the Kubernetes default), seconds."""
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
"""The pod annotation a ReplicaSet's scale-down reads (lowest first; Kubernetes ``PodDeletionCost``, beta and on
by default since 1.22)."""
LEAKING_POD_COST = "-1000"
"""The deletion cost the leaking pod gets during a surge (the other pods have none: 0)."""
REASON = "LeakReplacement"
"""The Events' reason."""
STUCK_SECONDS = 60.0
"""How long a drain may overrun before the replacement stops waiting, seconds: past the leaking pod's deletion
deadline (``deletionTimestamp``: the API server's now + grace), or after the surge pod was Ready while the
ReplicaSet, back at the base count, kept the leaking pod. Without an end a stuck replacement would hold the
autoscaler (:mod:`autoscale`) forever."""


def applies(spec: MoEInferenceServiceSpec, policy: str) -> bool:
    """Whether leaks are handled by replacement (``--policy predictive``, ``leakAction: Restart``, Deployment
    workers) rather than by the rolling restart."""
    return policy == "predictive" and spec.control.leak_action == "Restart" and not spec.parallelism.multi_node


def surge_replicas(spec: MoEInferenceServiceSpec, status: MoEInferenceServiceStatus) -> int:
    """The Deployment's replicas: the base count (:func:`autoscale.base_replicas`: ``spec.replicas``, or the
    autoscaler's), + 1 while a surge waits for its pod (phase ``Surging``)."""
    replacement = status.leak_replacement
    return base_replicas(spec, status) + (1 if replacement is not None and replacement.phase == "Surging" else 0)


def lead_seconds(ready_seconds: float, grace_seconds: float, query_interval_seconds: float) -> float:
    """The lead time a replacement needs before the hard limit, seconds: ``3 × ready + grace + interval`` (see
    the module docstring for each term)."""
    return READY_SAFETY_FACTOR * ready_seconds + grace_seconds + query_interval_seconds


def grace_seconds(pod: Pod) -> float:
    """The pod's ``spec.terminationGracePeriodSeconds``, seconds (:data:`DEFAULT_GRACE_SECONDS` where unset)."""
    value = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return DEFAULT_GRACE_SECONDS if value is None else float(value)


def _ready_since(pod: Pod) -> datetime | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return timestamp(cond.get("lastTransitionTime"))
    return None


def _created(pod: Pod) -> datetime | None:
    return timestamp((pod.get("metadata") or {}).get("creationTimestamp"))


def _restarted(pod: Pod) -> bool:
    return any(int(cs.get("restartCount") or 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def measured_ready_seconds(pods: Sequence[Pod]) -> float | None:
    """Seconds from ``creationTimestamp`` to the ``Ready`` condition's ``lastTransitionTime`` of the newest Ready
    pod whose containers never restarted (a restart moves the transition: it would measure the restart, not a
    start), or None when there is none. Both times are the API server's, whole seconds."""
    measured = [(created, (ready - created).total_seconds()) for pod in pods if is_ready(pod) and not _restarted(pod)
                for created, ready in [(_created(pod), _ready_since(pod))] if created is not None and ready is not None]
    return max(measured)[1] if measured else None


@dataclass(frozen=True)
class Workload:
    """What the Deployment says about a surge (its object as the watch delivers it).

    Attributes:
        replicas: its ``spec.replicas`` (None: not seen yet).
        max_surge_zero: its ``spec.strategy.rollingUpdate.maxSurge`` is 0 (or ``0%``): the owner asks for no
            extra pod.
        failed_create: its ``ReplicaFailure`` condition's message while True (the ReplicaSet's ``FailedCreate``,
            e.g. a ResourceQuota), else None.
    """

    replicas: int | None = None
    max_surge_zero: bool = False
    failed_create: str | None = None


def workload_of(deployment: Mapping[str, Any] | None) -> Workload:
    """:class:`Workload` from a Deployment object (None: not seen yet)."""
    if deployment is None:
        return Workload()
    spec = deployment.get("spec") or {}
    surge = ((spec.get("strategy") or {}).get("rollingUpdate") or {}).get("maxSurge")
    failure = next((cond for cond in (deployment.get("status") or {}).get("conditions") or []
                    if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True"), None)
    return Workload(replicas=spec.get("replicas"), max_surge_zero=str(surge).strip() in ("0", "0%"),
                    failed_create=None if failure is None else
                    f"{failure.get('reason') or 'FailedCreate'}: {failure.get('message') or ''}".rstrip(": "))


def unschedulable(pod: Pod) -> str | None:
    """The scheduler's message while the pod's ``PodScheduled`` condition is False with reason ``Unschedulable``."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return str(cond.get("message") or "Unschedulable")
    return None


def no_surge(workload: Workload, pods: Sequence[Pod]) -> str | None:
    """Why no surge is possible now (in words, for the Warning), or None."""
    if workload.max_surge_zero:
        return "the Deployment's maxSurge is 0"
    if workload.failed_create is not None:
        return f"the ReplicaSet cannot create pods (quota?): {workload.failed_create}"
    for pod in pods:
        why = unschedulable(pod)
        if why is not None:
            return f"pod {_name(pod)} is Unschedulable: {why}"
    return None


@dataclass(frozen=True)
class Actions:
    """The writes of one step, in this order (each idempotent: a step re-issues what the objects do not show
    yet, e.g. after an operator restart).

    Attributes:
        mark_pod: annotate this pod with :data:`LEAKING_POD_COST`.
        delete_pod: delete this pod (graceful: its ``terminationGracePeriodSeconds``).
        replicas: set the Deployment's ``spec.replicas`` to this.
    """

    mark_pod: str | None = None
    delete_pod: str | None = None
    replicas: int | None = None

    def __bool__(self) -> bool:
        return self.mark_pod is not None or self.delete_pod is not None or self.replicas is not None


@dataclass(frozen=True)
class Step:
    """One look's leak replacement: the next ``status.leakReplacement``, the writes, the Events and the ready time
    to keep in ``status.observed.replacementReadySeconds``."""

    state: LeakReplacementStatus | None
    actions: Actions = Actions()
    events: tuple[Event, ...] = ()
    ready_seconds: float | None = None


def _name(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


def _deleting(pod: Pod) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _marked(pod: Pod) -> bool:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(DELETION_COST_ANNOTATION) == LEAKING_POD_COST


def _mib_min(slope: float) -> str:
    return f"{slope / 2**20 * 60:+.0f} MiB/min"


@dataclass(frozen=True)
class _Leak:
    pod: Pod
    eta: float
    lead: float
    slope: float


def _leaks(obs: Observation, pods: Mapping[str, Pod], spec: MoEInferenceServiceSpec, ready: float) -> list[_Leak]:
    """The pods whose projected time to the hard limit is known (a slope above the noise floor and a memory
    reading), soonest first."""
    memory = {load.pod: load.memory_bytes for load in obs.pod_loads}
    hard = spec.resources.hard_limit_bytes
    found = []
    for name, slope in obs.pod_rss_slopes:
        pod, used = pods.get(name), memory.get(name)
        if pod is None or _deleting(pod) or used is None or slope <= LEAK_NOISE_BYTES_PER_SECOND:
            continue
        eta = seconds_to_hard_limit(slope, used / hard, hard)
        found.append(_Leak(pod, eta, lead_seconds(ready, grace_seconds(pod), spec.control.query_interval_seconds),
                           slope))
    return sorted(found, key=lambda leak: leak.eta)


def plan(prior: LeakReplacementStatus | None, obs: Observation, pods: Sequence[Pod], workload: Workload,
         spec: MoEInferenceServiceSpec, known_ready_seconds: float | None, now: datetime, *,
         base: int | None = None) -> Step:
    """The leak replacement's step after one look (see the module docstring), from the replacement in progress
    (``prior``), the look, the service's worker pods (API objects), its Deployment (:func:`workload_of`), the
    ready time kept in status (``known_ready_seconds``; a newer measurement from ``pods`` wins) and ``now``;
    ``base``: the Deployment's count without the surge (:func:`autoscale.base_replicas` of the status; None:
    :func:`worker_replicas` of ``spec``, right for a spec without autoscaling or a serving spec)."""
    base = worker_replicas(spec) if base is None else base
    ready = measured_ready_seconds(pods)
    ready = known_ready_seconds if ready is None else ready
    by_name = {_name(p): p for p in pods}
    if prior is None:
        return _start(obs, by_name, pods, workload, spec, base, ready, now)
    leaking = by_name.get(prior.pod)
    if prior.phase == "Draining":
        return _draining(prior, leaking, pods, workload, spec, base, ready, now)
    return _surging(prior, obs, leaking, pods, workload, spec, base, ready, now)


def _draining(prior: LeakReplacementStatus, leaking: Pod | None, pods: Sequence[Pod], workload: Workload,
              spec: MoEInferenceServiceSpec, base: int, ready: float | None, now: datetime) -> Step:
    """Waiting for the leaking pod to be gone; two ways it could wait forever end instead (:data:`STUCK_SECONDS`):
    the ReplicaSet scaled back without removing it (it is then deleted, graceful), or it is still there that long
    after its deletion deadline (a finalizer, a lost node): the replacement ends with a Warning, the autoscaler
    resumes."""
    if leaking is None:
        return Step(None, events=(Event("Normal", REASON, f"pod {prior.pod} is gone: leak replacement done"),),
                    ready_seconds=ready)
    if _deleting(leaking):
        deadline = timestamp((leaking.get("metadata") or {}).get("deletionTimestamp"))
        if deadline is not None and (now - deadline).total_seconds() > STUCK_SECONDS:
            return Step(None, events=(Event("Warning", REASON, (
                f"pod {prior.pod} still terminating {(now - deadline).total_seconds():.0f} s past its deletion "
                f"deadline {deadline.isoformat()} (a finalizer or a lost node?): leak replacement ended; the "
                f"autoscaler resumes")),), ready_seconds=ready)
        return Step(prior, ready_seconds=ready)
    if prior.action == "Drain":
        return Step(prior, Actions(delete_pod=prior.pod), ready_seconds=ready)
    if workload.replicas != base:
        return Step(prior, Actions(replicas=base), ready_seconds=ready)
    surge = surge_pod(prior, pods)
    since = None if surge is None else _ready_since(surge)
    if since is not None and (now - since).total_seconds() > STUCK_SECONDS:
        return Step(prior.model_copy(update={"action": "Drain"}), Actions(delete_pod=prior.pod), (Event(
            "Warning", REASON, f"replicas are back at {base} but the ReplicaSet kept {prior.pod} "
                               f"{(now - since).total_seconds():.0f} s after the surge pod was Ready (its "
                               f"pod-deletion-cost lost?): deleting {prior.pod} (graceful)"),), ready)
    return Step(prior, ready_seconds=ready)


def _start(obs: Observation, by_name: Mapping[str, Pod], pods: Sequence[Pod], workload: Workload,
           spec: MoEInferenceServiceSpec, base: int, ready: float | None, now: datetime) -> Step:
    assumed = DEFAULT_READY_SECONDS if ready is None else ready
    due = [leak for leak in _leaks(obs, by_name, spec, assumed) if leak.eta <= leak.lead]
    if not due:
        return Step(None, ready_seconds=ready)
    leak = due[0]
    name = _name(leak.pod)
    measured = "not measured yet: assumed" if ready is None else "measured"
    why = (f"pod {name} reaches hardLimit in {leak.eta:.0f} s at {_mib_min(leak.slope)}; lead {leak.lead:.0f} s = "
           f"{READY_SAFETY_FACTOR:g} x ready time {assumed:.0f} s ({measured}) + grace {grace_seconds(leak.pod):g} s "
           f"+ query interval {spec.control.query_interval_seconds} s")
    hard_at = now + timedelta(seconds=leak.eta)
    blocked = no_surge(workload, pods)
    if blocked is not None:
        state = LeakReplacementStatus(pod=name, action="Drain", phase="Draining", started_at=now,
                                      hard_limit_at=hard_at, reason=f"{why}; no surge: {blocked}")
        return Step(state, Actions(delete_pod=name), (Event("Warning", REASON, f"drain (no surge: {blocked}): {why}; "
                                                                              f"deleting {name} (graceful)"),),
                    ready)
    state = LeakReplacementStatus(pod=name, action="Surge", phase="Surging", started_at=now, hard_limit_at=hard_at,
                                  reason=why)
    return Step(state, Actions(mark_pod=name, replicas=base + 1),
                (Event("Normal", REASON, f"surge: {why}; replicas {base} -> {base + 1}, then back "
                                         f"once the new pod is Ready ({name} goes first: pod-deletion-cost "
                                         f"{LEAKING_POD_COST})"),), ready)


def surge_pod(prior: LeakReplacementStatus, pods: Sequence[Pod]) -> Pod | None:
    """The surge pod: ``prior.replacement_pod`` while it exists, else the newest pod other than the leaking one
    created since the surge started (``creationTimestamp`` is in whole seconds), not being deleted."""
    if prior.replacement_pod is not None:
        return next((p for p in pods if _name(p) == prior.replacement_pod and not _deleting(p)), None)
    since = prior.started_at.replace(microsecond=0)
    new = [(created, _name(p), p) for p in pods if _name(p) != prior.pod and not _deleting(p)
           for created in [_created(p)] if created is not None and created >= since]
    return max(new, key=lambda t: (t[0], t[1]))[2] if new else None


def _surging(prior: LeakReplacementStatus, obs: Observation, leaking: Pod | None, pods: Sequence[Pod],
             workload: Workload, spec: MoEInferenceServiceSpec, base: int, ready: float | None,
             now: datetime) -> Step:
    if leaking is None or _deleting(leaking):
        return Step(None, Actions(replicas=base),
                    (Event("Normal", REASON, f"pod {prior.pod} went before its surge pod was Ready: replicas back to "
                                             f"{base}, surge undone"),), ready)
    hard_at = prior.hard_limit_at
    for leak in _leaks(obs, {prior.pod: leaking}, spec, DEFAULT_READY_SECONDS if ready is None else ready):
        hard_at = now + timedelta(seconds=leak.eta) if not math.isinf(leak.eta) else None
    surge = surge_pod(prior, pods)
    state = prior.model_copy(update={"hard_limit_at": hard_at,
                                     "replacement_pod": None if surge is None else _name(surge)})
    if surge is not None and is_ready(surge):
        took = (now - prior.started_at).total_seconds()
        return Step(state.model_copy(update={"phase": "Draining"}), Actions(replicas=base),
                    (Event("Normal", REASON, f"surge pod {_name(surge)} Ready {took:.0f} s after the surge started; "
                                             f"replicas {base + 1} -> {base}: the ReplicaSet "
                                             f"removes {prior.pod} (graceful)"),), ready)
    left = math.inf if hard_at is None else (hard_at - now).total_seconds()
    blocked = (f"the ReplicaSet cannot create the surge pod (quota?): {workload.failed_create}"
               if workload.failed_create is not None else None)
    if blocked is None and surge is not None and unschedulable(surge) is not None:
        blocked = f"surge pod {_name(surge)} is Unschedulable: {unschedulable(surge)}"
    if blocked is None and left <= grace_seconds(leaking) + spec.control.query_interval_seconds:
        blocked = (f"surge pod {'not created yet' if surge is None else _name(surge) + ' not Ready'} "
                   f"{(now - prior.started_at).total_seconds():.0f} s after the surge started, and {prior.pod} "
                   f"reaches hardLimit in {left:.0f} s: not Ready in time")
    if blocked is not None:
        drained = state.model_copy(update={"action": "Drain", "phase": "Draining",
                                           "reason": f"{prior.reason}; drained instead: {blocked}"})
        return Step(drained, Actions(delete_pod=prior.pod, replicas=base),
                    (Event("Warning", REASON, f"drain instead of surge ({blocked}): deleting {prior.pod} (graceful), "
                                              f"replicas back to {base}"),), ready)
    took = (now - prior.started_at).total_seconds()
    patience = 2 * lead_seconds(DEFAULT_READY_SECONDS if ready is None else ready, grace_seconds(leaking),
                                spec.control.query_interval_seconds)
    if took > patience:
        return Step(None, Actions(replicas=base), (Event("Warning", REASON, (
            f"surge abandoned: surge pod {'not created' if surge is None else _name(surge) + ' not Ready'} "
            f"{took:.0f} s after the surge started (twice the lead: {patience:.0f} s), and {prior.pod} reaches "
            f"hardLimit in "
            f"{'no projected time' if math.isinf(left) else f'{left:.0f} s'}: replicas back to {base}; "
            f"{prior.pod} serves on and is replaced again when due")),), ready)
    redo = Actions(mark_pod=None if _marked(leaking) else prior.pod,
                   replicas=None if workload.replicas == base + 1 else base + 1)
    return Step(state, redo, ready_seconds=ready)
