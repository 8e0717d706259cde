"""Thin kopf handlers: parse, call the pure builders and policy, apply, report.

* create/update/resume → :func:`reconcile`: children by server-side apply, the
  budget ConfigMap, ``status`` (observedGeneration, budgets, conditions).
* a timer per resource → :func:`control_loop`: pod readiness → Ready; every
  ``control.queryIntervalSeconds`` one look at Prometheus → :func:`policy.decide`
  → ConfigMap + status + Event when budgets change.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from moeguard_operator import constants as c
from moeguard_operator import kube
from moeguard_operator.builders import Owner, build_budget_configmap, build_children, selector_string
from moeguard_operator.conditions import get_condition, set_condition
from moeguard_operator.models import MoEInferenceServiceSpec
from moeguard_operator.observe import observe
from moeguard_operator.policy import Observation, decide, initial_budgets
from moeguard_runtime.contract import (
    API_GROUP,
    API_VERSION,
    PLURAL,
    BudgetDocument,
    BudgetDocumentError,
    Budgets,
    budget_configmap_name,
    parse_budget_configmap_data,
)
from moeguard_runtime.presets import get_preset

TIMER_INTERVAL_SECONDS = float(os.environ.get("MOEGUARD_TIMER_INTERVAL_SECONDS", "5"))
"""How often each resource's timer runs (readiness; Prometheus only every queryIntervalSeconds)."""

RESOURCE = (API_GROUP, API_VERSION, PLURAL)


def _now() -> datetime:
    return datetime.now(UTC)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's own bookkeeping under moeguard.dev, and load credentials."""
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 120
    kube.load_config()


class SpecError(Exception):
    """A spec that passed the API server's schema but cannot be served (e.g. unknown preset)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_spec(spec: Any) -> MoEInferenceServiceSpec:
    """Validate ``spec`` with the same models that generated the CRD.

    Raises:
        SpecError: reason ``InvalidSpec`` or ``UnknownModelPreset``, with a message naming the field.
    """
    try:
        parsed = MoEInferenceServiceSpec.model_validate(dict(spec))
    except ValidationError as exc:
        problems = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise SpecError("InvalidSpec", problems) from None
    try:
        get_preset(parsed.model.preset)
    except KeyError as exc:
        raise SpecError("UnknownModelPreset", f"spec.model.preset: {exc.args[0]}") from None
    return parsed


def _budgets(status: Any, key: str) -> Budgets | None:
    raw = status.get(key)
    return Budgets.model_validate(dict(raw)) if raw else None


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str,
    uid: str,
    patch: kopf.Patch,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Apply every child and the budget ConfigMap; record what was applied in status."""
    now = _now()
    generation = meta.get("generation")
    conditions = list(status.get("conditions") or [])
    try:
        parsed = parse_spec(spec)
    except SpecError as exc:
        message = str(exc)
        conditions = set_condition(conditions, c.CONDITION_READY, "False", exc.reason, message, now, generation)
        conditions = set_condition(conditions, c.CONDITION_STALLED, "True", exc.reason, message, now, generation)
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "False", exc.reason, message, now, generation)
        patch.status["conditions"] = conditions
        patch.status["observedGeneration"] = generation
        kopf.warn(body, reason=exc.reason, message=message)
        raise kopf.PermanentError(message) from None

    owner = Owner(name=name, namespace=namespace, uid=uid)
    for manifest in build_children(owner, parsed):
        kube.apply(manifest)

    # Budgets: keep those in effect unless the spec's initial budgets changed.
    initial = initial_budgets(parsed.batching)
    budgets = _budgets(status, "budgets")
    budget_generation = int(status.get("budgetGeneration") or 0)
    reason = "in effect"
    if budgets is None or _budgets(status, "initialBudgets") != initial:
        reason = "initial budgets from spec" if budgets is None else "spec.batching changed"
        budgets = initial
        budget_generation += 1
    _ensure_budget_configmap(owner, budgets, budget_generation, reason, now)

    conditions = set_condition(conditions, c.CONDITION_STALLED, "False", "Reconciled", "", now, generation)
    ready = get_condition(conditions, c.CONDITION_READY)
    if ready is None or ready.get("status") != "True":
        conditions = set_condition(conditions, c.CONDITION_READY, "False", "WaitingForReplicas",
                                   f"0/{parsed.replicas} worker pods ready", now, generation)
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "True", "WaitingForReplicas",
                                   "children applied; waiting for worker pods", now, generation)
    patch.status.update({
        "observedGeneration": generation,
        "conditions": conditions,
        "budgets": budgets.model_dump(by_alias=True),
        "initialBudgets": initial.model_dump(by_alias=True),
        "budgetGeneration": budget_generation,
        "replicas": parsed.replicas,
        "selector": selector_string(owner),
    })
    kopf.info(body, reason="Reconciled", message=f"applied worker Deployment, Service, RBAC and budget ConfigMap (budget generation {budget_generation})")
    logger.info("reconciled %s/%s generation %s", namespace, name, generation)


def _ensure_budget_configmap(owner: Owner, budgets: Budgets, generation: int, reason: str, now: datetime) -> None:
    """Apply the budget ConfigMap unless it already holds this generation and these budgets."""
    data = kube.read_configmap_data(owner.namespace, budget_configmap_name(owner.name))
    if data is not None:
        try:
            current = parse_budget_configmap_data(data)
            if current.generation == generation and current.budgets == budgets:
                return
        except BudgetDocumentError:
            pass  # replaced below by a valid document
    document = BudgetDocument(generation=generation, budgets=budgets, reason=reason, updated_at=now)
    kube.apply(build_budget_configmap(owner, document))


@kopf.timer(*RESOURCE, interval=TIMER_INTERVAL_SECONDS, initial_delay=1.0)
def control_loop(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str,
    uid: str,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Readiness every tick; one look at Prometheus and one policy decision per query interval."""
    try:
        parsed = parse_spec(spec)
    except SpecError:
        return  # reported by reconcile; nothing to control
    budgets = _budgets(status, "budgets")
    if budgets is None or status.get("observedGeneration") != meta.get("generation"):
        return  # reconcile has not finished this generation yet
    now = _now()
    generation = meta.get("generation")
    conditions = list(status.get("conditions") or [])
    owner = Owner(name=name, namespace=namespace, uid=uid)

    dep = kube.read_deployment_status(namespace, f"{name}-worker") or {}
    ready = int(dep.get("readyReplicas") or 0)
    if ready >= parsed.replicas:
        conditions = set_condition(conditions, c.CONDITION_READY, "True", "AllReplicasReady",
                                   f"{ready}/{parsed.replicas} worker pods ready", now, generation)
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "False", "AllReplicasReady", "", now, generation)
    else:
        conditions = set_condition(conditions, c.CONDITION_READY, "False", "WaitingForReplicas",
                                   f"{ready}/{parsed.replicas} worker pods ready", now, generation)
        conditions = set_condition(conditions, c.CONDITION_RECONCILING, "True", "WaitingForReplicas",
                                   f"{ready}/{parsed.replicas} worker pods ready", now, generation)
    patch.status["readyReplicas"] = ready
    patch.status["replicas"] = parsed.replicas

    last_query: datetime | None = getattr(memo, "last_query", None)
    if last_query is None or (now - last_query).total_seconds() >= parsed.control.query_interval_seconds:
        memo.last_query = now
        conditions = _outer_loop(body, parsed, status, owner, conditions, patch, now, generation, logger)
    patch.status["conditions"] = conditions


def _outer_loop(
    body: kopf.Body,
    parsed: MoEInferenceServiceSpec,
    status: kopf.Status,
    owner: Owner,
    conditions: list[dict[str, Any]],
    patch: kopf.Patch,
    now: datetime,
    generation: int | None,
    logger: logging.Logger,
) -> list[dict[str, Any]]:
    url = parsed.control.prometheus_url or os.environ.get(c.PROMETHEUS_URL_ENV)
    if not url:
        observation = Observation(time=now, skew_ratio=None, error="no Prometheus URL configured")
    else:
        observation = observe(url, owner.namespace, owner.name, parsed.control.skew_window_seconds, now)
    was_available = (get_condition(conditions, c.CONDITION_METRICS_AVAILABLE) or {}).get("status")
    if observation.available:
        conditions = set_condition(conditions, c.CONDITION_METRICS_AVAILABLE, "True", "QuerySucceeded", "", now, generation)
    else:
        conditions = set_condition(conditions, c.CONDITION_METRICS_AVAILABLE, "False", "MetricsUnavailable",
                                   f"{observation.error}; budgets held", now, generation)
        if was_available == "True":
            kopf.warn(body, reason="MetricsUnavailable", message=f"{observation.error}; budgets held")
    skew = None if observation.skew_ratio is None else round(observation.skew_ratio, 2)
    patch.status["observed"] = {"time": now.isoformat(), "skewRatio": skew}

    budgets = _budgets(status, "budgets")
    assert budgets is not None
    last = (status.get("lastAdjustment") or {}).get("time")
    last_change = datetime.fromisoformat(last) if last else None
    decision = decide(observation, budgets, parsed.control, parsed.batching.floors, last_change, now)
    logger.debug("decision: %s", decision.reason)
    if not decision.changed:
        return conditions
    budget_generation = int(status.get("budgetGeneration") or 0) + 1
    document = BudgetDocument(generation=budget_generation, budgets=decision.budgets, reason=decision.reason, updated_at=now)
    kube.apply(build_budget_configmap(owner, document))
    patch.status.update({
        "budgets": decision.budgets.model_dump(by_alias=True),
        "budgetGeneration": budget_generation,
        "lastAdjustment": {
            "time": now.isoformat(),
            "reason": decision.reason,
            "from": budgets.model_dump(by_alias=True),
            "to": decision.budgets.model_dump(by_alias=True),
        },
    })
    conditions = set_condition(conditions, c.CONDITION_BUDGET_TIGHTENED, "True", "ExpertSkew", decision.reason, now, generation)
    kopf.info(body, reason="BudgetTightened", message=decision.reason)
    logger.info("budget generation %d: %s", budget_generation, decision.reason)
    return conditions
