"""Thin kopf handlers: parse, call the pure builders and policy, apply, report.

* create/update/resume → :func:`reconcile`: children by server-side apply, the
  budget ConfigMap, ``status`` (observedGeneration, budgets, conditions).
* a timer per resource → :func:`control_loop`: pod readiness → Ready; every
  ``control.queryIntervalSeconds`` one look at Prometheus → :func:`policy.decide`
  → ConfigMap + status + Event when budgets change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from moeguard_operator import constants as c
from moeguard_operator import kube, metrics
from moeguard_operator.builders import (
    Owner,
    build_budget_configmap,
    build_children,
    build_pod_monitor,
    restart_patch,
    selector_string,
    worker_name,
)
from moeguard_operator.conditions import Status, get_condition, metrics_verdict, set_condition
from moeguard_operator.models import BUDGET_FIELDS, MoEInferenceServiceSpec
from moeguard_operator.observe import observe
from moeguard_operator.podstate import PodFacts, pod_facts
from moeguard_operator.policy import (
    LoopState,
    Observation,
    ceilings,
    decide,
    floors,
    initial_budgets,
)
from moeguard_runtime.contract import (
    API_GROUP,
    API_VERSION,
    BUDGET_KEY,
    PLURAL,
    BudgetDocument,
    BudgetDocumentError,
    Budgets,
    budget_configmap_name,
    parse_budget_configmap_data,
)
from moeguard_runtime.presets import get_preset, parameter_count, shape_problems

TIMER_INTERVAL_SECONDS = float(os.environ.get("MOEGUARD_TIMER_INTERVAL_SECONDS", "5"))
"""How often each resource's timer runs (readiness; Prometheus only every queryIntervalSeconds)."""

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
WEIGHT_BYTES = 2
"""Bytes per parameter assumed when checking that the weights fit in hardLimit (bf16, the GPU default;
float32 on the CPU needs twice as much, so this check only catches shapes that can never fit)."""
Logger = logging.Logger | logging.LoggerAdapter[Any]
PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"


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
    # A standby replica takes over this long after the active one stops renewing (kopf's default: 60 s).
    settings.peering.lifetime = int(os.environ.get("MOEGUARD_PEERING_LIFETIME_SECONDS", "60"))
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
        preset = get_preset(parsed.model.preset)
    except KeyError as exc:
        raise SpecError("UnknownModelPreset", f"spec.model.preset: {exc.args[0]}") from None
    args = dataclasses.replace(preset, **parsed.model.overrides.model_dump(exclude_none=True))
    issues = [f"spec.model.overrides: {p}" for p in shape_problems(args)]
    weights = parameter_count(args) * WEIGHT_BYTES
    if weights >= parsed.resources.hard_limit_bytes:
        issues.append(f"spec.resources.hardLimit ({parsed.resources.hard_limit}) is below the model's weights alone "
                        f"({weights / 2**30:.2f} GiB at {WEIGHT_BYTES} bytes per parameter)")
    cap = parsed.overload.max_context_tokens
    if cap is not None and cap > args.max_seq_len:
        issues.append(f"spec.overload.maxContextTokens ({cap}) is above the model's context ({args.max_seq_len})")
    if issues:
        raise SpecError("InvalidSpec", "; ".join(issues))
    return parsed


def _budgets(status: Any, key: str) -> Budgets | None:
    raw = status.get(key)
    return Budgets.model_validate(dict(raw)) if raw else None


def _time(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def overload_context_cap(spec: MoEInferenceServiceSpec) -> int:
    """Prompt + max_tokens refused while overload is on: the spec's, else half the model's context."""
    if spec.overload.max_context_tokens:
        return spec.overload.max_context_tokens
    max_seq = spec.model.overrides.max_seq_len or get_preset(spec.model.preset).max_seq_len
    return max(1, max_seq // 2)


def _document(spec: MoEInferenceServiceSpec, budgets: Budgets, overload: Literal["On", "Off"], generation: int, reason: str,
              now: datetime) -> BudgetDocument:
    return BudgetDocument(generation=generation, budgets=budgets, overload_mode=overload,
                          overload_max_context_tokens=overload_context_cap(spec), reason=reason[:1024], updated_at=now)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str | None,
    uid: str,
    patch: kopf.Patch,
    logger: Logger,
    **_: Any,
) -> None:
    """Apply every child and the budget ConfigMap; record what was applied in status."""
    assert namespace is not None, "MoEInferenceService is namespaced"
    now = _now()
    generation = meta.get("generation")
    conditions = list(status.get("conditions") or [])
    try:
        parsed = parse_spec(spec)
    except SpecError as exc:
        _stall(body, patch, conditions, exc.reason, str(exc), now, generation)
        metrics.RECONCILIATIONS.labels(namespace, name, "invalid").inc()
        raise kopf.PermanentError(str(exc)) from None

    owner = Owner(name=name, namespace=namespace, uid=uid)
    try:
        apply_children(owner, parsed)
    except ApiException as exc:
        if exc.status is None or (exc.status >= 500 and "duplicate" not in str(exc.body)):
            raise kopf.TemporaryError(f"API server error {exc.status}; retrying", delay=10) from exc
        message = f"the API server refused a child object: {exc.status} {_api_message(exc)}"
        _stall(body, patch, conditions, "ApplyFailed", message, now, generation)
        metrics.RECONCILIATIONS.labels(namespace, name, "refused").inc()
        raise kopf.PermanentError(message) from None

    # Budgets: keep those in effect unless the spec's initial budgets changed.
    initial = initial_budgets(parsed.batching)
    budgets = _budgets(status, "budgets")
    cm_data = kube.read_configmap_data(owner.namespace, budget_configmap_name(owner.name))
    budget_generation = max(int(status.get("budgetGeneration") or 0), _generation_in(cm_data))
    overload: Literal["On", "Off"] = "On" if status.get("overloadMode") == "On" else "Off"
    if parsed.overload.mode != "Auto":
        overload = parsed.overload.mode
    reason = "in effect"
    if budgets is None or _budgets(status, "initialBudgets") != initial:
        reason = "initial budgets from spec" if budgets is None else "spec.batching changed"
        budgets = initial
        budget_generation += 1
    elif overload != status.get("overloadMode"):
        reason = f"overload.mode {parsed.overload.mode}"
        budget_generation += 1
    budget_generation = _ensure_budget_configmap(
        owner, cm_data, _document(parsed, budgets, overload, budget_generation, reason, now))

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
        "overloadMode": overload,
        "replicas": parsed.replicas,
        "selector": selector_string(owner),
    })
    metrics.RECONCILIATIONS.labels(namespace, name, "applied").inc()
    metrics.PREFILL_BUDGET.labels(namespace, name).set(budgets.max_prefill_tokens)
    kopf.info(body, reason="Reconciled",
              message=f"applied worker Deployment, Service, PDB, RBAC and budget ConfigMap (budget generation {budget_generation})")
    logger.info("reconciled %s/%s generation %s", namespace, name, generation)


def _stall(body: kopf.Body, patch: kopf.Patch, conditions: list[dict[str, Any]], reason: str, message: str,
           now: datetime, generation: int | None) -> None:
    """Record a spec this generation cannot be served with: Ready=False, Stalled=True, a Warning Event."""
    states: tuple[tuple[str, Status], ...] = (
        (c.CONDITION_READY, "False"), (c.CONDITION_STALLED, "True"), (c.CONDITION_RECONCILING, "False"))
    for type_, value in states:
        conditions = set_condition(conditions, type_, value, reason, message, now, generation)
    patch.status["conditions"] = conditions
    patch.status["observedGeneration"] = generation
    kopf.warn(body, reason=reason, message=message)


def apply_children(owner: Owner, spec: MoEInferenceServiceSpec) -> None:
    """Server-side apply every child (and the PodMonitor when prometheus-operator is installed)."""
    for manifest in build_children(owner, spec):
        kube.apply(manifest)
    if kube.crd_exists(PODMONITOR_CRD):
        kube.apply(build_pod_monitor(owner))


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(str(exc.body)).get("message", exc.body))[:800]
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason)[:800]


def _generation_in(data: dict[str, str] | None) -> int:
    """The generation in a budget ConfigMap's ``data`` (0 when missing or unreadable).

    The operator's next document must be newer than anything found there: a
    worker ignores a generation that is not newer than the one it applied, so a
    hand-edited document with a high generation would otherwise pin it.
    """
    if data is None:
        return 0
    try:
        return parse_budget_configmap_data(data).generation
    except BudgetDocumentError:
        try:
            raw = json.loads(data.get(BUDGET_KEY, "{}"))
            return int(raw.get("generation", 0)) if isinstance(raw, dict) else 0
        except (TypeError, ValueError):
            return 0


def _ensure_budget_configmap(owner: Owner, data: dict[str, str] | None, document: BudgetDocument) -> int:
    """Apply the budget ConfigMap unless ``data`` (read this pass) already holds this generation,
    budgets and overload mode; returns the generation in effect.

    A ConfigMap that differs but already carries this generation (edited by hand) gets the
    next one, so that the workers, which ignore a generation they have seen, take it.
    """
    if data is not None:
        try:
            current = parse_budget_configmap_data(data)
            if (current.generation, current.budgets, current.overload_mode) == (
                    document.generation, document.budgets, document.overload_mode):
                return document.generation
        except BudgetDocumentError:
            pass  # replaced below by a valid document
    found = _generation_in(data)
    if data is not None and document.generation <= found:
        document = document.model_copy(update={"generation": found + 1})
    kube.apply(build_budget_configmap(owner, document))
    return document.generation


@kopf.timer(*RESOURCE, interval=TIMER_INTERVAL_SECONDS, initial_delay=1.0)
def control_loop(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str | None,
    uid: str,
    patch: kopf.Patch,
    memo: Any,
    logger: Logger,
    **_: Any,
) -> None:
    """Every tick: readiness and OOM kills. Every query interval (or at once on an OOM kill): one look
    at Prometheus, one policy decision, and the actions it asks for."""
    try:
        parsed = parse_spec(spec)
    except SpecError:
        return  # reported by reconcile; nothing to control
    budgets = _budgets(status, "budgets")
    if budgets is None or status.get("observedGeneration") != meta.get("generation"):
        return  # reconcile has not finished this generation yet
    assert namespace is not None, "MoEInferenceService is namespaced"
    now = _now()
    generation = meta.get("generation")
    conditions = list(status.get("conditions") or [])
    owner = Owner(name=name, namespace=namespace, uid=uid)

    dep_status = kube.read_deployment_status(namespace, worker_name(owner))
    cm = kube.read_configmap_data(namespace, budget_configmap_name(name))
    if dep_status is None or cm is None:
        # A child deleted by hand (or by a tool) comes back, as with any controller.
        missing = [what for what, gone in (("Deployment", dep_status is None), ("budget ConfigMap", cm is None)) if gone]
        apply_children(owner, parsed)
        generation_now = max(int(status.get("budgetGeneration") or 0), _generation_in(cm))
        if cm is None:
            overload_now: Literal["On", "Off"] = "On" if status.get("overloadMode") == "On" else "Off"
            kube.apply(build_budget_configmap(owner, _document(parsed, budgets, overload_now, generation_now,
                                                               "recreated: the ConfigMap was deleted", now)))
        kopf.warn(body, reason="ChildRecreated", message=f"{' and '.join(missing)} missing; applied again")
    dep = dep_status or {}
    ready = int(dep.get("readyReplicas") or 0)
    state: Status = "True" if ready >= parsed.replicas else "False"
    why = "AllReplicasReady" if state == "True" else "WaitingForReplicas"
    conditions = set_condition(conditions, c.CONDITION_READY, state, why,
                               f"{ready}/{parsed.replicas} worker pods ready", now, generation)
    conditions = set_condition(conditions, c.CONDITION_RECONCILING, "False" if state == "True" else "True", why,
                               f"{ready}/{parsed.replicas} worker pods ready", now, generation)
    patch.status["readyReplicas"] = ready
    patch.status["replicas"] = parsed.replicas

    loop = dict(status.get("control") or {})
    facts = pod_facts(kube.list_pods(namespace, selector_string(owner)))
    oom_since = _time(loop.get("oomCheckedTime"))
    new_ooms = facts.oom_kills_after(oom_since) if oom_since is not None else 0
    if oom_since is None or new_ooms:
        loop["oomCheckedTime"] = _iso(max(t for t in (now, facts.latest_oom()) if t is not None))
    last_look: datetime | None = getattr(memo, "last_look", None)
    due = last_look is None or (now - last_look).total_seconds() >= parsed.control.query_interval_seconds
    if due or new_ooms:
        memo.last_look = now
        conditions = _outer_loop(body, parsed, status, owner, cm, conditions, loop, facts, new_ooms, patch, now,
                                 generation, logger)
    patch.status["conditions"] = conditions
    patch.status["control"] = loop


def _outer_loop(
    body: kopf.Body,
    parsed: MoEInferenceServiceSpec,
    status: kopf.Status,
    owner: Owner,
    cm_data: dict[str, str] | None,
    conditions: list[dict[str, Any]],
    loop: dict[str, Any],
    facts: PodFacts,
    new_ooms: int,
    patch: kopf.Patch,
    now: datetime,
    generation: int | None,
    logger: Logger,
) -> list[dict[str, Any]]:
    """One look, one decision, its actions; returns the updated conditions (``loop`` is updated in place)."""
    ns, name = owner.namespace, owner.name
    url = parsed.control.prometheus_url or os.environ.get(c.PROMETHEUS_URL_ENV)
    if url:
        obs = observe(url, ns, name, hard_limit_bytes=parsed.resources.hard_limit_bytes,
                      window_seconds=parsed.control.window_seconds,
                      leak_window_seconds=parsed.control.leak_window_seconds,
                      expected_pods=facts.running, new_oom_kills=new_ooms, now=now,
                      slope_pods=facts.running_since(now - timedelta(seconds=parsed.control.leak_window_seconds)))
    else:
        obs = Observation(time=now, expected_pods=facts.running, new_oom_kills=new_ooms,
                          error="no Prometheus URL configured (spec.control.prometheusUrl or --prometheus-url)")
    previous = dict(status.get("observed") or {})
    state = LoopState(
        budgets=_budgets(status, "budgets") or initial_budgets(parsed.batching),
        overload="On" if status.get("overloadMode") == "On" else "Off",
        last_change=_time(loop.get("lastChangeTime")),
        last_pressure=_time(loop.get("lastPressureTime")),
        last_overload_trigger=_time(loop.get("lastOverloadTriggerTime")),
        last_restart=_time(loop.get("lastRestartTime")),
        last_blind=_time(loop.get("lastBlindTime")),
    )
    decision = decide(obs, state, parsed, now)
    nxt = decision.state

    # What was seen: status.observed (missing values stay null), MetricsAvailable, silent pods.
    mem = obs.memory_ratio
    patch.status["observed"] = {
        "time": now.isoformat(),
        "skewRatio": None if obs.skew_ratio is None else round(obs.skew_ratio, 2),
        "memoryRatio": None if mem is None else round(mem, 4),
        "memoryPercent": None if mem is None else round(mem * 100),
        "rssSlopeBytesPerSecond": None if obs.rss_slope_bytes_per_second is None else round(obs.rss_slope_bytes_per_second, 1),
        "rejectionRatePerSecond": None if obs.rejection_rate_per_second is None else round(obs.rejection_rate_per_second, 3),
        "p99LatencySeconds": None if obs.p99_latency_seconds is None else round(obs.p99_latency_seconds, 3),
        "oomKills": int(previous.get("oomKills") or 0) + new_ooms,
        "restarts": facts.restarts,
        "silentPods": list(obs.silent_pods),
    }
    prior = get_condition(conditions, c.CONDITION_METRICS_AVAILABLE)
    verdict = metrics_verdict(obs, prior, list(previous.get("silentPods") or []), now,
                              grace_seconds=max(60, 3 * parsed.control.window_seconds))
    conditions = set_condition(conditions, c.CONDITION_METRICS_AVAILABLE, verdict.status, verdict.reason,
                               verdict.message, now, generation)
    if verdict.event is not None:
        event_type, event_reason = verdict.event
        (kopf.warn if event_type == "Warning" else kopf.info)(body, reason=event_reason, message=verdict.message)
    metrics.PROMETHEUS_QUERIES.labels(ns, name, "ok" if obs.fully_visible else "blind").inc()
    metrics.METRICS_AVAILABLE.labels(ns, name).set(1 if obs.fully_visible else 0)
    if new_ooms:
        metrics.OOM_KILLS.labels(ns, name).inc(new_ooms)
        kopf.warn(body, reason="OOMKilled", message=f"{new_ooms} worker container(s) OOM-killed; tightening at once")

    # Budgets and overload: one new budget document for both.
    if decision.changed or decision.overload_changed:
        budget_generation = max(int(status.get("budgetGeneration") or 0), _generation_in(cm_data)) + 1
        kube.apply(build_budget_configmap(owner, _document(parsed, nxt.budgets, nxt.overload, budget_generation,
                                                           decision.reason, now)))
        patch.status["budgetGeneration"] = budget_generation
        patch.status["budgets"] = nxt.budgets.model_dump(by_alias=True)
        patch.status["overloadMode"] = nxt.overload
    if decision.changed:
        patch.status["lastAdjustment"] = {
            "time": now.isoformat(), "reason": decision.reason,
            "from": state.budgets.model_dump(by_alias=True), "to": nxt.budgets.model_dump(by_alias=True),
        }
        event = "BudgetTightened" if decision.direction == "down" else "BudgetRelaxed"
        (kopf.warn if "OOMKilled" in decision.pressure else kopf.info)(body, reason=event, message=decision.reason)
        metrics.BUDGET_CHANGES.labels(ns, name, decision.direction).inc()
        logger.info("budget %s: %s", decision.direction, decision.reason)
    below = nxt.budgets != ceilings(parsed.batching)
    conditions = set_condition(
        conditions, c.CONDITION_BUDGET_TIGHTENED, "True" if below else "False",
        ",".join(decision.pressure) or ("Tightened" if below else "AtCeilings"),
        (status.get("lastAdjustment") or {}).get("reason", "") if below and not decision.changed else
        (decision.reason if below else "budgets at their ceilings"), now, generation)
    metrics.PREFILL_BUDGET.labels(ns, name).set(nxt.budgets.max_prefill_tokens)
    lowest = floors(parsed.batching)
    for field in BUDGET_FIELDS:
        at_floor = getattr(nxt.budgets, field) <= getattr(lowest, field)
        metrics.BUDGET_AT_FLOOR.labels(ns, name, to_camel(field)).set(1 if at_floor else 0)

    if decision.overload_changed:
        kopf.info(body, reason=f"Overload{nxt.overload}", message=decision.reason)
    conditions = set_condition(conditions, c.CONDITION_OVERLOADED, "True" if nxt.overload == "On" else "False",
                               f"Mode{parsed.overload.mode}", f"overload mode {nxt.overload}", now, generation)
    metrics.OVERLOAD.labels(ns, name).set(1 if nxt.overload == "On" else 0)

    if decision.leak_suspected is None:
        conditions = set_condition(conditions, c.CONDITION_MEMORY_LEAK_SUSPECTED, "Unknown", "NoSlope",
                                   "RSS slope not yet measurable", now, generation)
    else:
        leak_was = (get_condition(conditions, c.CONDITION_MEMORY_LEAK_SUSPECTED) or {}).get("status")
        slope = obs.rss_slope_bytes_per_second or 0.0
        message = f"RSS slope {slope / 2**20 * 60:.1f} MiB/min over {parsed.control.leak_window_seconds}s"
        conditions = set_condition(conditions, c.CONDITION_MEMORY_LEAK_SUSPECTED,
                                   "True" if decision.leak_suspected else "False",
                                   "RSSGrowing" if decision.leak_suspected else "RSSFlat", message, now, generation)
        if decision.leak_suspected and leak_was != "True":
            kopf.warn(body, reason="MemoryLeakSuspected",
                      message=f"{message}; see docs/runbook.md (native leak vs heap leak)")
    if decision.restart:
        kube.patch_deployment(ns, worker_name(owner), restart_patch(now.isoformat()))
        kopf.warn(body, reason="RestartingWorkers", message=f"leakAction Restart: {decision.reason}")

    loop.update({
        "lastChangeTime": _iso(nxt.last_change),
        "lastPressureTime": _iso(nxt.last_pressure),
        "lastOverloadTriggerTime": _iso(nxt.last_overload_trigger),
        "lastRestartTime": _iso(nxt.last_restart),
        "lastBlindTime": _iso(nxt.last_blind),
    })
    return conditions
