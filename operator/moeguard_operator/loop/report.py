"""The status report, pure: from what was applied, seen and decided to a typed ``MoEInferenceServiceStatus``.

Each function takes the prior status and returns the next one (and the Events to post);
:func:`status_patch` turns the difference into the merge patch kopf writes to ``status``,
with the field names of the CRD (camelCase, as ``kubectl`` shows them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from moeguard_core.contract import BudgetDocument
from moeguard_operator import constants as c
from moeguard_operator.loop.conditions import (
    Status,
    find_condition,
    leak_unknown,
    metrics_verdict,
    scaled_to_zero_verdict,
    set_condition,
)
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.podstate import CRASH_LOOP, WAITING_FAILURES, PodFacts
from moeguard_operator.loop.policy import Decision, PolicyState, ceilings, initial_budgets
from moeguard_operator.loop.slo import attainments
from moeguard_operator.spec.models import (
    Adjustment,
    ControlStatus,
    GroupStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
    Observed,
    PodMemoryPrediction,
    SloAttainment,
)


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the resource."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def read_status(raw: Mapping[str, Any] | None) -> MoEInferenceServiceStatus:
    """Parse ``status`` as the API server returns it (camelCase keys; fields unknown to the model ignored).

    Raises:
        pydantic.ValidationError: a field holds a value the status model refuses.
    """
    return MoEInferenceServiceStatus.model_validate(dict(raw or {}))


def _plain(value: Any) -> Any:
    """JSON-ready values with datetimes as ``datetime.isoformat()`` writes them (``+00:00``)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def status_patch(prior: MoEInferenceServiceStatus, new: MoEInferenceServiceStatus) -> dict[str, Any]:
    """The merge patch from ``prior`` to ``new``: each top-level field that changed, whole, by alias.

    A field's value is written in full (a null inside it deletes that key), so the stored
    status equals ``new`` in every field that changed.
    """
    dumped = new.model_dump(by_alias=True)
    return {
        field.alias or name: _plain(dumped[field.alias or name])
        for name, field in MoEInferenceServiceStatus.model_fields.items()
        if getattr(prior, name) != getattr(new, name)
    }


def stalled(prior: MoEInferenceServiceStatus, reason: str, message: str, now: datetime,
            generation: int | None) -> tuple[MoEInferenceServiceStatus, Event]:
    """A spec this generation cannot be served with: Ready=False, Stalled=True, and a Warning Event."""
    states: tuple[tuple[str, Status], ...] = (
        (c.CONDITION_READY, "False"), (c.CONDITION_STALLED, "True"), (c.CONDITION_RECONCILING, "False"))
    conditions = prior.conditions
    for type_, value in states:
        conditions = set_condition(conditions, type_, value, reason, message, now, generation)
    status = prior.model_copy(update={"conditions": conditions, "observed_generation": generation})
    return status, Event("Warning", reason, message)


def is_stalled(status: MoEInferenceServiceStatus, generation: int | None) -> bool:
    """Whether ``generation`` of the spec was stalled (``Stalled=True``) by its reconcile: nothing to control,
    nothing to re-apply (a child the API server refused would be refused again on every tick). A rollout stall
    (a pod's reason, :data:`podstate.WAITING_FAILURES` or ``CrashLoopBackOff``: :func:`readiness`) is not: the
    loop keeps reading the pods and clears it when they start."""
    cond = find_condition(status.conditions, c.CONDITION_STALLED)
    return (cond is not None and cond.status == "True" and status.observed_generation == generation
            and cond.reason not in ROLLOUT_STALLS)


def reconciled(prior: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, document: BudgetDocument,
               selector: str, now: datetime, generation: int | None) -> MoEInferenceServiceStatus:
    """Children and ``document`` applied for ``generation`` (``spec``: the serving spec, its ``replicas`` the
    autoscaler's where ``spec.autoscaling`` is set; without it ``status.autoscaling`` is cleared): Stalled=False
    (a rollout stall of this generation stays: a resumed operator re-applies the same children, and the pods
    still cannot start), budgets, and,
    until the worker pods are ready, Ready=False and Reconciling=True; a new generation of a Ready service is
    Reconciling=True (``ChildrenApplied``) until the loop reads its pods (:func:`readiness`)."""
    conditions = prior.conditions
    stall = find_condition(conditions, c.CONDITION_STALLED)
    if stall is None or stall.reason not in ROLLOUT_STALLS or prior.observed_generation != generation:
        conditions = set_condition(conditions, c.CONDITION_STALLED, "False", "Reconciled", "", now, generation)
    ready = find_condition(conditions, c.CONDITION_READY)
    if ready is None or ready.status != "True":
        conditions = set_condition(conditions, c.CONDITION_READY, "False", "WaitingForReplicas",
                                   f"0/{spec.replicas} worker pods ready", now, generation)
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "True", "WaitingForReplicas",
                                   "children applied; waiting for worker pods", now, generation)
    elif prior.observed_generation != generation:
        # kstatus reads Reconciling first: a new generation is in progress until its pods are read
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "True", CHILDREN_APPLIED,
                                   f"children applied for generation {generation}; reading the worker pods", now,
                                   generation)
    return prior.model_copy(update={
        "observed_generation": generation,
        "conditions": conditions,
        "budgets": document.budgets,
        "initial_budgets": initial_budgets(spec.batching),
        "budget_generation": document.generation,
        "overload_mode": document.overload_mode,
        "replicas": spec.replicas,
        "selector": selector,
        "autoscaling": prior.autoscaling if spec.autoscaling is not None else None,
    })


ROLLOUT_STALLS = WAITING_FAILURES | {CRASH_LOOP}
"""Reasons of a Stalled=True that :func:`readiness` sets from the pods (not from a reconcile)."""
STARTUP_FAILED = "WorkerStartupFailed"
"""Reason of Ready=False while worker containers fail to start (:attr:`PodFacts.startup_failures`)."""


ROLLING_OUT = "RollingOut"
"""Reason of Reconciling=True while pods of an earlier template are still there (:mod:`rollout`)."""
CHILDREN_APPLIED = "ChildrenApplied"
"""Reason of Reconciling=True from a new generation's reconcile until the pods are read (:func:`reconciled`)."""


def readiness(prior: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, ready: int,
              groups: list[GroupStatus] | None, now: datetime, generation: int | None,
              startup_failures: Sequence[tuple[str, str]] = (), earlier: int = 0, earlier_ready: int = 0,
              stuck: tuple[str, str, str] | None = None) -> MoEInferenceServiceStatus:
    """Ready, Reconciling and Stalled as kstatus reads a rollout (issue 29, item 1), from the ``ready`` replicas
    *of the current template* (worker pods, or LeaderWorkerSet ``groups`` whose every pod is ready:
    ``tick.replica_readiness``), the ``earlier`` pods of earlier templates still there (``earlier_ready`` of them
    ready) and the current pod that cannot start (``stuck``: pod, reason, message; :mod:`rollout`).

    * **Ready** is True only when ``spec.replicas`` current replicas are ready and no current pod is ``stuck``.
      While some are missing and ``startup_failures`` (pod, why) is not empty, the reason is
      ``WorkerStartupFailed`` and the message carries the first pod's failure (the worker's own words: its
      termination message) and how many other pods fail.
    * **Stalled** is True, with the pod's reason (``CrashLoopBackOff``, ``ImagePullBackOff``, …), while a pod of
      the current template cannot start: the rollout makes no progress without a change. Reconciling is then
      False: kstatus (sigs.k8s.io/cli-utils, as Flux and Argo CD read it) checks Reconciling before Stalled, so
      both True would read "in progress" and hide the failure.
    * **Reconciling** is True while not Ready, or Ready with pods of an earlier template still there (reason
      ``RollingOut``); False once only current pods are left and Ready.
    """
    done = ready >= spec.replicas and stuck is None
    state: Status = "True" if done else "False"
    why = "AllReplicasReady" if done else "WaitingForReplicas"
    of = " of the current template" if earlier else ""
    message = f"{ready}/{spec.replicas} worker pods{of} ready" if groups is None else (
        f"{ready}/{spec.replicas} groups{of} ready ({spec.parallelism.pods_per_replica} pods, "
        f"{spec.parallelism.expert_parallel_size} ranks each)")
    if state == "False" and startup_failures:
        why = STARTUP_FAILED
        pod, failure = startup_failures[0]
        others = len({p for p, _ in startup_failures} - {pod})
        message += f"; pod {pod}: {failure}" + (f" (and {others} more pods failing)" if others else "")
    if earlier:
        message += f"; {earlier} pods of an earlier template still there ({earlier_ready} ready, serving)"
    conditions = set_condition(prior.conditions, c.CONDITION_READY, state, why, message, now, generation)
    if stuck is not None:
        pod, reason, failure = stuck
        stall = f"pod {pod} of the current template cannot start: {failure}" + (
            f"; {earlier_ready} pods of an earlier template still serve" if earlier_ready else "")
        conditions = set_condition(conditions, c.CONDITION_STALLED, "True", reason, stall, now, generation)
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "False", reason, stall, now, generation)
    else:
        conditions = set_condition(conditions, c.CONDITION_STALLED, "False", "Reconciled", "", now, generation)
        reconciling: Status = "True" if not done or earlier else "False"
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, reconciling,
                                   ROLLING_OUT if done and earlier else why, message, now, generation)
    if spec.replicas == 0:
        verdict = scaled_to_zero_verdict()
        conditions = set_condition(conditions, c.CONDITION_METRICS_AVAILABLE, verdict.status, verdict.reason,
                                   verdict.message, now, generation)
    return prior.model_copy(update={"conditions": conditions, "ready_replicas": ready, "replicas": spec.replicas,
                                    "groups": groups})


def readiness_events(prior: MoEInferenceServiceStatus, new: MoEInferenceServiceStatus) -> list[Event]:
    """A Warning Event when Ready turns to ``WorkerStartupFailed`` (once, not every tick)."""
    was, now = find_condition(prior.conditions, c.CONDITION_READY), find_condition(new.conditions, c.CONDITION_READY)
    if now is None or now.reason != STARTUP_FAILED or (was is not None and was.reason == STARTUP_FAILED):
        return []
    return [Event("Warning", STARTUP_FAILED, now.message)]


def oom_check(prior: MoEInferenceServiceStatus, facts: PodFacts, now: datetime) -> tuple[MoEInferenceServiceStatus, int]:
    """The OOM kills new since ``control.oomCheckedTime``, and the status with that time moved on.

    The first check counts none (kills before the operator looked are history) and starts the clock.
    """
    control = prior.control or ControlStatus()
    since = control.oom_checked_time
    new_ooms = facts.oom_kills_after(since) if since is not None else 0
    if since is None or new_ooms:
        checked = max(t for t in (now, facts.latest_oom()) if t is not None)
        control = control.model_copy(update={"oom_checked_time": checked})
    return prior.model_copy(update={"control": control}), new_ooms


def policy_state(status: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec) -> PolicyState:
    """The policy's state as persisted in ``status`` (budgets, overload mode, ``control``)."""
    control = status.control or ControlStatus()
    return PolicyState(
        budgets=status.budgets or initial_budgets(spec.batching),
        overload="On" if status.overload_mode == "On" else "Off",
        last_change=control.last_change_time,
        last_pressure=control.last_pressure_time,
        last_overload_trigger=control.last_overload_trigger_time,
        last_restart=control.last_restart_time,
        last_blind=control.last_blind_time,
    )


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def observed(prior: Observed | None, obs: Observation, restarts: int, now: datetime,
             eta: float | None = None, crash_looping: tuple[str, ...] = (),
             slo: Sequence[SloAttainment] = (), predicted_memory: Sequence[PodMemoryPrediction] = ()) -> Observed:
    """``status.observed`` after one look: missing values stay null; OOM kills add up; ``eta``: the
    projected seconds to the hard limit (:attr:`policy.LeakVerdict.seconds_to_limit`; inf or None: null);
    ``crash_looping``: :attr:`podstate.PodFacts.crash_looping`; the measured ``replacementReadySeconds`` is kept
    (the leak replacement updates it: ``tick.replaced``)."""
    mem = obs.memory_ratio
    return Observed(
        time=now,
        skew_ratio=_round(obs.skew_ratio, 2),
        memory_ratio=_round(mem, 4),
        memory_percent=None if mem is None else round(mem * 100),
        rss_slope_bytes_per_second=_round(obs.rss_slope_bytes_per_second, 1),
        leak_kinds=list(obs.leak_kinds),
        seconds_to_hard_limit=None if eta is None or math.isinf(eta) else round(eta),
        rejection_rate_per_second=_round(obs.rejection_rate_per_second, 3),
        p99_latency_seconds=_round(obs.p99_latency_seconds, 3),
        oom_kills=(prior.oom_kills if prior else 0) + obs.new_oom_kills,
        restarts=restarts,
        silent_pods=list(obs.silent_pods),
        crash_looping_pods=list(crash_looping),
        slo=list(slo),
        predicted_memory=list(predicted_memory),
        replacement_ready_seconds=prior.replacement_ready_seconds if prior else None,
    )


def looked(prior: MoEInferenceServiceStatus, spec: MoEInferenceServiceSpec, obs: Observation, decision: Decision,
           document: BudgetDocument | None, restarts: int, now: datetime,
           generation: int | None, crash_looping: tuple[str, ...] = ()) -> tuple[MoEInferenceServiceStatus, list[Event]]:
    """The status and Events after one look and its decision; ``document``: the budget document
    written for it (None when budgets and overload mode stayed)."""
    control, nxt, events = spec.control, decision.state, []
    before = policy_state(prior, spec)
    last_seen = prior.observed or Observed()

    verdict = scaled_to_zero_verdict() if spec.replicas == 0 else metrics_verdict(
        obs, find_condition(prior.conditions, c.CONDITION_METRICS_AVAILABLE), last_seen.silent_pods, now,
        grace_seconds=max(60, 3 * control.window_seconds))
    conditions = set_condition(prior.conditions, c.CONDITION_METRICS_AVAILABLE, verdict.status, verdict.reason,
                               verdict.message, now, generation)
    if verdict.event is not None:
        events.append(Event("Warning" if verdict.event[0] == "Warning" else "Normal", verdict.event[1], verdict.message))
    if obs.new_oom_kills:
        events.append(Event("Warning", "OOMKilled",
                            f"{obs.new_oom_kills} worker container(s) OOM-killed; tightening at once"))

    update: dict[str, Any] = {}
    if document is not None:
        update.update(budget_generation=document.generation, budgets=nxt.budgets, overload_mode=nxt.overload)
    if decision.changed:
        update["last_adjustment"] = Adjustment(time=now, reason=decision.reason, from_=before.budgets, to=nxt.budgets)
        events.append(Event("Warning" if "OOMKilled" in decision.pressure else "Normal",
                            "BudgetTightened" if decision.direction == "down" else "BudgetRelaxed", decision.reason))
    below = nxt.budgets != ceilings(spec.batching)
    if not below:
        message = "budgets at their ceilings"
    elif decision.changed:
        message = decision.reason
    else:
        message = prior.last_adjustment.reason if prior.last_adjustment else ""
    conditions = set_condition(conditions, c.CONDITION_BUDGET_TIGHTENED, "True" if below else "False",
                               ",".join(decision.pressure) or ("Tightened" if below else "AtCeilings"),
                               message, now, generation)

    if decision.overload_changed:
        events.append(Event("Normal", f"Overload{nxt.overload}", decision.reason))
    conditions = set_condition(conditions, c.CONDITION_OVERLOADED, "True" if nxt.overload == "On" else "False",
                               f"Mode{spec.overload.mode}", f"overload mode {nxt.overload}", now, generation)

    leak = decision.leak
    if leak is None:
        conditions = set_condition(conditions, c.CONDITION_MEMORY_LEAK_SUSPECTED, "Unknown", *leak_unknown(obs),
                                   now, generation)
    else:
        leak_was = find_condition(conditions, c.CONDITION_MEMORY_LEAK_SUSPECTED)
        conditions = set_condition(conditions, c.CONDITION_MEMORY_LEAK_SUSPECTED,
                                   "True" if leak.suspected else "False", leak.reason, leak.message, now, generation)
        if leak.suspected and (leak_was is None or leak_was.status != "True" or leak_was.reason != leak.reason):
            events.append(Event("Warning", "MemoryLeakSuspected",
                                f"{leak.message}; see docs/runbook.md (native leak vs heap leak)"))
    if decision.restart:
        events.append(Event("Warning", "RestartingWorkers", f"leakAction Restart: {decision.reason}"))

    loop = (prior.control or ControlStatus()).model_copy(update={
        "last_change_time": nxt.last_change,
        "last_pressure_time": nxt.last_pressure,
        "last_overload_trigger_time": nxt.last_overload_trigger,
        "last_restart_time": nxt.last_restart,
        "last_blind_time": nxt.last_blind,
    })
    status = prior.model_copy(update={**update, "observed": observed(prior.observed, obs, restarts, now,
                                                            None if decision.leak is None else decision.leak.seconds_to_limit,
                                                            crash_looping,
                                                            [a.status() for a in attainments(obs.latency, spec.slo)],
                                                            decision.memory),
                                      "conditions": conditions, "control": loop})
    return status, events
