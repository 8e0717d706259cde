"""One service's step of the control loop, pure: from what the watches hold (the service's status, its
worker pods, its budget ConfigMap) and, every ``control.queryIntervalSeconds``, one look at Prometheus,
to what must be written (:class:`Writes`).

No I/O and no clock: :mod:`control_loop` passes ``now`` and the loop's own memory (the *blind floor*)
in, and writes what comes back, ConfigMap first.

* **Readiness** (:func:`readiness_step`) comes from the pod watch at once: the worker pods whose
  ``Ready`` condition is True (not the Deployment's ``readyReplicas``, which lags behind the
  controller-manager and froze at 0 after an API-server outage: issue 18, fault 7).
* **A look** (:func:`look_step`) adds OOM kills, the policy decision and the budget document.
* **The ConfigMap is the source of truth** for the budgets in effect
  (:func:`budget_document.caught_up`): a status that lags behind it is brought up to it, never the
  other way round.
* **Blind floor**: the latest moment the running process could not see the service (its own start,
  an API-server outage, a look that failed, a gap between looks): the policy's ``last_blind`` is never
  older than it, so a climb needs a full ``stabilizationWindowSeconds`` of fully visible looks made
  by this process (issue 18, fault 1).
* **No idle writes** (:func:`stable`): ``status.observed.time`` changes only when an observed value
  changes, and ``control.lastBlindTime`` only when sight returns; the time of each look lives in the
  loop's memory (and the operator's metrics), not in status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from moeguard_core.contract import (
    BudgetDocument,
    BudgetDocumentError,
    Budgets,
    parse_budget_configmap_data,
)
from moeguard_operator import constants as c
from moeguard_operator.diagnosis.diagnosis import (
    Diagnosis,
    DiagnosisLook,
    DiagnosisMemory,
    diagnose,
    unchanged_but_time,
)
from moeguard_operator.loop import (
    applied,
    autoscale,
    budget_document,
    leak_replacement,
    predictive,
    report,
    rollout,
)
from moeguard_operator.loop.conditions import set_condition
from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS, Observation
from moeguard_operator.loop.podstate import is_ready, pod_facts
from moeguard_operator.loop.policy import Decision, PolicyState, decide
from moeguard_operator.spec.models import (
    ControlStatus,
    DiagnosisStatus,
    GroupStatus,
    LeakReplacementStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)

Pod = Mapping[str, Any]
DECIDERS: dict[str, Callable[[Observation, PolicyState, MoEInferenceServiceSpec, datetime], Decision]] = {
    "threshold": decide, "predictive": predictive.decide}
"""Each policy's pure ``decide`` (``config.POLICIES``: the operator's ``--policy``)."""


@dataclass(frozen=True)
class Writes:
    """What one step asks to be written for a service, in this order.

    Attributes:
        status: the status the service should have (written as a merge patch of what differs from the
            stored one; nothing when equal).
        events: Events to post after the status (transitions only).
        document: the budget document to write to the ConfigMap first (None: none); the decision is
            durable once it is there.
        restart: roll the workers (leak action Restart) after the ConfigMap.
        replacement: the leak replacement's writes (:mod:`leak_replacement`), after the status (which holds the
            replacement first, so a restart between the two finishes it).
        decision: the policy decision of a look (None for a readiness step).
        diagnosis: the incident diagnosis of a look (None for a readiness step); its ``memory`` is the loop's next.
        scale: the replica count to set on the worker workload after the status (``spec.autoscaling``: the
            autoscaler changed it, or the workload's count differs from it); None: leave it.
        autoscale: the autoscaler's decision of a look (None without ``spec.autoscaling``, or a readiness step).
    """

    status: MoEInferenceServiceStatus
    events: tuple[report.Event, ...] = ()
    document: BudgetDocument | None = None
    restart: bool = False
    replacement: leak_replacement.Actions = field(default_factory=leak_replacement.Actions)
    decision: Decision | None = None
    diagnosis: Diagnosis | None = None
    scale: int | None = None
    autoscale: autoscale.ScaleDecision | None = None


def ready_pods(pods: Iterable[Pod]) -> int:
    """How many of ``pods`` are ready workers (:func:`is_ready`)."""
    return sum(1 for pod in pods if is_ready(pod))


def replica_readiness(pods: Iterable[Pod], spec: MoEInferenceServiceSpec) -> tuple[int, list[GroupStatus] | None]:
    """Ready replicas and, for a multi-node service, every group's readiness (indexes 0 to ``replicas - 1``
    and any other group that still has pods), from the LeaderWorkerSet labels of ``pods``.

    A group is ready when all its ``podsPerReplica`` pods are (:func:`is_ready`); pods being deleted count
    for nothing (a group being recreated is not ready). Single-pod replicas: (ready pods, None).
    """
    par = spec.parallelism
    if not par.multi_node:
        return ready_pods(pods), None
    ready: dict[int, int] = {}
    leaders: dict[int, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        index = (meta.get("labels") or {}).get(c.LWS_GROUP_INDEX_LABEL)
        if index is None or not str(index).isdigit() or meta.get("deletionTimestamp"):
            continue
        group = int(index)
        ready[group] = ready.get(group, 0) + is_ready(pod)
        if (meta.get("labels") or {}).get(c.LWS_WORKER_INDEX_LABEL) == "0":
            leaders[group] = str(meta.get("name"))
    groups = [GroupStatus(index=i, leader=leaders.get(i), ready_pods=ready.get(i, 0),
                          ready_ranks=ready.get(i, 0) * par.ranks_per_pod, ranks=par.expert_parallel_size)
              for i in sorted(set(range(spec.replicas)) | set(ready))]
    return sum(1 for g in groups if g.ready_pods >= par.pods_per_replica and g.index < spec.replicas), groups


def document_in(data: Mapping[str, str] | None) -> BudgetDocument | None:
    """The valid budget document in a ConfigMap's ``data``, or None."""
    if data is None:
        return None
    try:
        return parse_budget_configmap_data(dict(data))
    except BudgetDocumentError:
        return None


def rollout_readiness(status: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, pods: list[dict[str, Any]],
                      now: datetime, generation: int | None,
                      template_hash: str | None) -> MoEInferenceServiceStatus:
    """:func:`report.readiness` from the pods of the current template (``template_hash``, the label
    :func:`children.builders.template_hash` gives; None: every pod counts as current) and those of earlier ones
    (:func:`rollout.split`)."""
    split = rollout.split(pods, template_hash)
    current = [dict(p) for p in split.current]
    return report.readiness(status, spec, *replica_readiness(current, spec), now, generation,
                            pod_facts(current).startup_failures, len(split.earlier), split.earlier_ready,
                            split.stuck)


def readiness_step(prior: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, pods: list[dict[str, Any]],
                   data: Mapping[str, str] | None, now: datetime, generation: int | None, ours: bool = True,
                   template_hash: str | None = None) -> Writes:
    """Ready/Reconciling/Stalled from the pods (:func:`rollout_readiness`), and the budgets of a ConfigMap of the
    operator's (``ours``) ahead of ``prior``; no look."""
    status = budget_document.caught_up(prior, None if data is None else dict(data), ours)
    new = rollout_readiness(status, spec, pods, now, generation, template_hash)
    return Writes(new, tuple(report.readiness_events(status, new)))


def policy_state(status: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, data: Mapping[str, str] | None,
                 blind_floor: datetime, ours: bool = True) -> PolicyState:
    """The policy's state: what ``status`` persists (:func:`report.policy_state`), with ``last_blind`` no
    older than ``blind_floor`` (this process's memory of when it could not see) and ``last_change`` no
    older than the ConfigMap's document when that document is the newer decision (a kill between the
    ConfigMap and the status)."""
    state = report.policy_state(status, spec)
    last_blind = max(t for t in (state.last_blind, blind_floor) if t is not None)
    last_change = state.last_change
    doc = document_in(data) if ours else None
    if doc is not None and doc.generation > (status.budget_generation or 0):
        last_change = doc.updated_at if last_change is None else max(last_change, doc.updated_at)
    return replace(state, last_blind=last_blind, last_change=last_change)


def look_step(prior: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, pods: list[dict[str, Any]],
              data: Mapping[str, str] | None, obs: Observation, blind_floor: datetime, now: datetime,
              generation: int | None, ours: bool = True, diagnosis: DiagnosisMemory | None = None,
              leak_warmup_seconds: float = LEAK_WARMUP_SECONDS, template_hash: str | None = None,
              policy: str = "threshold", workload: Mapping[str, Any] | None = None,
              workload_replicas: int | None = None) -> Writes:
    """Readiness, OOM kills (counted from the pods now: ``obs.new_oom_kills`` is replaced), the decision on
    ``obs``, the incident diagnosis (after the decision, from the same look: it never feeds it) and what they
    ask to write; ``ours``: the ConfigMap's document is the operator's (not a hand edit); ``diagnosis``: the
    loop's diagnosis memory (None: a fresh one, blind until ``blind_floor``); ``leak_warmup_seconds``: the
    operator's ``--leak-warmup-seconds`` (a younger pod's leak window still holds its warm-up); ``template_hash``:
    the current pod template's (:func:`rollout_readiness`); ``policy``: the
    operator's ``--policy`` (:data:`DECIDERS`); ``workload``: the worker Deployment as the watch holds it (the
    leak replacement reads its replicas, ``maxSurge`` and ``ReplicaFailure``: :func:`replaced`);
    ``workload_replicas``: the worker workload's replica count as the watch last saw it (None: not seen). With
    ``spec.autoscaling`` the autoscaler decides from the same look, after the budget policy and the leak
    replacement (:func:`autoscale.decide`, at the budgets just decided; it holds, and writes no count, while a
    replacement is in progress, starts or ends in this look: :func:`scaled`); ``spec`` is then the serving spec
    (:func:`autoscale.serving_spec`).

    Raises:
        KeyError: ``policy`` is not one of :data:`DECIDERS`.
    """
    raw = None if data is None else dict(data)
    status = budget_document.caught_up(prior, raw, ours)
    facts = pod_facts(pods)
    new = rollout_readiness(status, spec, pods, now, generation, template_hash)
    events = report.readiness_events(status, new)
    new, new_ooms = report.oom_check(new, facts, now)
    obs = replace(obs, new_oom_kills=new_ooms, crash_looping_pods=facts.crash_looping)
    state = policy_state(prior, spec, data, blind_floor, ours)
    state = replace(state, budgets=new.budgets or state.budgets,
                    overload="On" if new.overload_mode == "On" else "Off")
    decision = DECIDERS[policy](obs, state, spec, now)
    document = budget_document.for_decision(spec, new, raw, decision, now, policy=policy)
    looked, look_events = report.looked(new, spec, obs, decision, document, facts.restarts, now, generation,
                                               facts.crash_looping)
    found = diagnose(diagnosis or DiagnosisMemory(blind_at=blind_floor), DiagnosisLook.of(obs, leak_warmup_seconds),
                     prior.diagnosis,
                     spec, now)
    looked, found_events = diagnosed(looked, found, now, generation)
    looked, applied_events = applied.applied(
        looked, document_in(raw), obs.budget_generations, now, generation,
        applied.grace_seconds(spec.control.window_seconds, spec.control.query_interval_seconds))
    looked, actions, replace_events = replaced(looked, spec, pods, obs, workload, policy, now)
    looked, scale_decision, scale, scale_events = scaled(
        looked, autoscale.state_of(prior, spec), spec, obs, decision.state.budgets, new.ready_replicas or 0, now,
        blind_floor, prior.leak_replacement or looked.leak_replacement, workload_replicas)
    return Writes(stable(new, looked, obs), (*events, *look_events, *found_events, *applied_events, *replace_events, *scale_events),
                  document, decision.restart, actions, decision, found, scale, scale_decision)


def replaced(status: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, pods: list[dict[str, Any]],
             obs: Observation, workload: Mapping[str, Any] | None, policy: str,
             now: datetime) -> tuple[MoEInferenceServiceStatus, leak_replacement.Actions, list[report.Event]]:
    """``status`` with the leak replacement's step (:func:`leak_replacement.plan`: ``leakReplacement`` and the
    measured ready time in ``observed.replacementReadySeconds``), its writes and Events; unchanged where the
    replacement does not apply (:func:`leak_replacement.applies`) and none is in progress. The surge is one
    replica on top of the base count, the autoscaler's where ``spec.autoscaling`` is set
    (:func:`autoscale.base_replicas`)."""
    prior = status.leak_replacement
    if not leak_replacement.applies(spec, policy) and prior is None:
        return status, leak_replacement.Actions(), []
    known = None if status.observed is None else status.observed.replacement_ready_seconds
    step = leak_replacement.plan(prior, obs, pods, leak_replacement.workload_of(workload), spec, known, now,
                                 base=autoscale.base_replicas(spec, status))
    update: dict[str, Any] = {"leak_replacement": step.state}
    if status.observed is not None and step.ready_seconds != known:
        update["observed"] = status.observed.model_copy(update={"replacement_ready_seconds": step.ready_seconds})
    return status.model_copy(update=update), step.actions, list(step.events)


def scaled(status: MoEInferenceServiceStatus, state: autoscale.AutoscaleState, spec: MoEInferenceServiceSpec,
           obs: Observation, budgets: Budgets, ready: int, now: datetime, blind_floor: datetime,
           replacement: LeakReplacementStatus | None,
           workload_replicas: int | None) -> tuple[MoEInferenceServiceStatus, autoscale.ScaleDecision | None,
                                                   int | None, list[report.Event]]:
    """``status`` with the autoscaler's decision from ``state`` (the prior status's: :func:`autoscale.state_of`;
    ``spec.autoscaling`` only: else unchanged and None), the replica count to write on the workload and its
    Events. ``replacement``: a leak replacement in progress, or starting or ending in this look: the autoscaler
    holds (:func:`autoscale.decide`) and no count is written, the leak replacement owns the workload's replicas
    until the look after it ends (its surge is never undone). Otherwise the count is written when the autoscaler
    changed it or the workload's (``workload_replicas``) differs."""
    if spec.autoscaling is None:
        return status, None, None, []
    decision = autoscale.decide(obs, state, spec, budgets, ready, now, blind_floor, replacement)
    status, events = autoscale.autoscaled(status, decision)
    desired = decision.state.desired
    drifted = workload_replicas is not None and workload_replicas != desired
    scale = None if replacement is not None else desired if decision.changed or drifted else None
    return status, decision, scale, events


CLEARED = "Cleared"
"""The reason of a finding's condition once it cleared (status False)."""


def diagnosed(status: MoEInferenceServiceStatus, found: Diagnosis, now: datetime,
              generation: int | None) -> tuple[MoEInferenceServiceStatus, list[report.Event]]:
    """``status`` with ``status.diagnosis``, a condition per active finding (type and reason: the kind, status
    True, message: the finding's) and per finding cleared now (status False, reason ``Cleared``), and the
    diagnosis's Events."""
    conditions = status.conditions
    for finding in found.status.findings:
        conditions = set_condition(conditions, finding.kind, "True", finding.kind, finding.message, now, generation)
    for kind in found.cleared:
        conditions = set_condition(conditions, kind, "False", CLEARED, f"{kind} cleared", now, generation)
    return status.model_copy(update={"diagnosis": found.status, "conditions": conditions}), list(found.events)


def stable(prior: MoEInferenceServiceStatus, new: MoEInferenceServiceStatus,
           obs: Observation) -> MoEInferenceServiceStatus:
    """``new`` without the changes that only say "a look happened": ``observed.time`` stays when no observed
    value changed, ``diagnosis`` stays when only its times moved (``time``, ``lastSeen``: the loop keeps them in
    memory), and ``control.lastBlindTime`` stays while the look was not fully visible (the loop keeps
    the blind time in memory; status records the start of the current visible stretch once)."""
    observed = new.observed
    if observed is not None and prior.observed is not None and prior.observed.time is not None:
        same = observed.model_copy(update={"time": prior.observed.time})
        if same == prior.observed:
            observed = prior.observed
    control = new.control
    if control is not None and not obs.fully_visible:
        control = control.model_copy(update={"last_blind_time": (prior.control or ControlStatus()).last_blind_time})
    diagnosis = prior.diagnosis if unchanged_but_time(prior.diagnosis, new.diagnosis or DiagnosisStatus()) else (
        new.diagnosis)
    return new.model_copy(update={"observed": observed, "control": control, "diagnosis": diagnosis})
