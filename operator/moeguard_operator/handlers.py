"""Thin kopf handlers: each parses, decides with the pure modules, and applies.

* create/update/resume → :func:`reconcile`: :func:`~spec_checks.parse_spec`, children by
  server-side apply, the budget ConfigMap (:mod:`budget_document`), ``status`` (:mod:`report`).
* a timer per resource → :func:`control_loop`: pod readiness → Ready; every
  ``control.queryIntervalSeconds`` (or at once on an OOM kill) one look at Prometheus →
  :func:`policy.decide` → budget ConfigMap + status + Events.

:func:`register` puts them in a kopf registry with the operator's :class:`~config.OperatorConfig`.
"""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime
from typing import Any, NoReturn

import kopf
from kubernetes.client.exceptions import ApiException

from moeguard_operator import apply_errors, budget_document, kube, metrics, report
from moeguard_operator import constants as c
from moeguard_operator.builders import (
    Owner,
    build_budget_configmap,
    build_children,
    build_pod_monitor,
    dropped_volumes,
    restart_patch,
    selector_string,
    worker_name,
)
from moeguard_operator.config import MEMO_KEY, OperatorConfig, from_memo
from moeguard_operator.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus
from moeguard_operator.observe import observe_service
from moeguard_operator.podstate import pod_facts
from moeguard_operator.policy import decide, floors
from moeguard_operator.spec_checks import (
    SpecError,
    check_model_source,
    check_prometheus_url,
    parse_spec,
)
from moeguard_runtime.contract import (
    API_GROUP,
    API_VERSION,
    PLURAL,
    BudgetDocument,
    budget_configmap_name,
)

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
Logger = logging.Logger | logging.LoggerAdapter[Any]
PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"
LAST_LOOK_KEY = "last_look"
"""Key, in a resource's kopf memo, of the time (a ``datetime``) of its last look at Prometheus."""


def register(config: OperatorConfig, registry: kopf.OperatorRegistry) -> None:
    """Register moeguard's handlers in ``registry``, configured by ``config``.

    kopf fixes a timer's interval when the timer is registered, and the interval is a
    command-line option: so the handlers are registered here, after the command line is
    parsed, not at import time (where the value could only come from a global or the
    environment). The startup handler puts ``config`` in kopf's memo, which every
    resource's memo copies, so the other handlers read it from there. A fresh registry has
    none of kopf's fallback login handlers, so the kubernetes client's login is registered
    explicitly (the one kopf would pick: in-cluster credentials, else the kubeconfig).
    """
    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry)(functools.partial(configure, config=config))
    for on in (kopf.on.resume, kopf.on.create, kopf.on.update):
        on(*RESOURCE, registry=registry)(reconcile)
    kopf.timer(*RESOURCE, interval=config.timer_interval_seconds, initial_delay=1.0, registry=registry)(control_loop)


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, config: OperatorConfig, **_: Any) -> None:
    """Keep kopf's own bookkeeping under moeguard.dev, store ``config`` in memo, and load credentials."""
    memo[MEMO_KEY] = config
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # A standby replica takes over this long after the active one stops renewing.
    settings.peering.lifetime = config.peering_lifetime_seconds
    settings.watching.server_timeout = 120
    kube.load_config()


def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str | None,
    uid: str,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    logger: Logger,
    **_: Any,
) -> None:
    """Apply every child and the budget ConfigMap; record what was applied in status.

    A child the API server refuses is retried only while retrying may help, and a bounded number of
    times (:func:`apply_errors.judge`); then the resource is stalled with the spec field named.
    """
    assert namespace is not None, "MoEInferenceService is namespaced"
    now, generation = datetime.now(UTC), meta.get("generation")
    prior, owner = report.read_status(status), Owner(name=name, namespace=namespace, uid=uid)
    try:
        config = from_memo(memo)
        parsed = parse_spec(spec, allow_secrets=config.allow_secrets)
        check_model_source(parsed, config.allow_host_path_models)
        check_prometheus_url(parsed, config.prometheus_urls)
        apply_children(owner, parsed)
    except SpecError as exc:
        _stall(body, patch, prior, exc.reason, str(exc), now, generation, "invalid")
    except apply_errors.ChildRefused as exc:
        verdict = apply_errors.judge(exc.child, exc.status, exc.message, exc.body, retry)
        metrics.CHILD_APPLY_REFUSALS.labels(namespace, name, "retry" if verdict.retry else "stall").inc()
        if verdict.retry:
            logger.warning("%s", verdict.message)
            raise kopf.TemporaryError(verdict.message, delay=apply_errors.RETRY_DELAY_SECONDS) from exc
        _stall(body, patch, prior, verdict.reason, verdict.message, now, generation, "refused")

    data = kube.read_configmap_data(namespace, budget_configmap_name(name))
    document = apply_budget_document(owner, data, budget_document.for_spec(parsed, prior, data, now))
    patch.status.update(report.status_patch(
        prior, report.reconciled(prior, parsed, document, selector_string(owner), now, generation)))

    metrics.RECONCILIATIONS.labels(namespace, name, "applied").inc()
    metrics.PREFILL_BUDGET.labels(namespace, name).set(document.budgets.max_prefill_tokens)
    kopf.info(body, reason="Reconciled", message="applied worker Deployment, Service, PDB, RBAC and budget "
                                                 f"ConfigMap (budget generation {document.generation})")
    logger.info("reconciled %s/%s generation %s", namespace, name, generation)


def _stall(body: kopf.Body, patch: kopf.Patch, prior: MoEInferenceServiceStatus, reason: str, message: str,
           now: datetime, generation: int | None, result: str) -> NoReturn:
    """Report a spec this generation cannot be served with, and stop handling it.

    Raises:
        kopf.PermanentError: always (kopf retries nothing until the spec changes).
    """
    status, event = report.stalled(prior, reason, message, now, generation)
    patch.status.update(report.status_patch(prior, status))
    _post(body, [event])
    assert body.metadata.namespace is not None
    metrics.RECONCILIATIONS.labels(body.metadata.namespace, body.metadata.name, result).inc()
    raise kopf.PermanentError(message)


def apply_children(owner: Owner, spec: MoEInferenceServiceSpec) -> None:
    """Server-side apply every child (and the PodMonitor when prometheus-operator is installed).

    Raises:
        apply_errors.ChildRefused: the API server refused one (which, and its answer).
        SpecError: reason ``VolumeDropped``: the API server stored the Deployment without some of its
            volumes (a disabled feature, e.g. image volumes without the ImageVolume feature gate).
    """
    manifests = build_children(owner, spec)
    if kube.crd_exists(PODMONITOR_CRD):
        manifests.append(build_pod_monitor(owner))
    for manifest in manifests:
        try:
            stored = kube.apply(manifest)
        except ApiException as exc:
            child = f"{manifest['kind']} {manifest['metadata']['name']}"
            raise apply_errors.ChildRefused(child, exc.status, kube.api_message(exc), str(exc.body or "")) from exc
        dropped = dropped_volumes(manifest, stored) if manifest["kind"] == "Deployment" else []
        if dropped:
            raise SpecError("VolumeDropped", f"the API server stored the worker Deployment without its volumes "
                                             f"{', '.join(dropped)}: a volume type this cluster has not enabled "
                                             "(image volumes need Kubernetes 1.33+ with the ImageVolume feature "
                                             "gate)")


def apply_budget_document(owner: Owner, data: dict[str, str] | None, document: BudgetDocument) -> BudgetDocument:
    """Write ``document`` to the budget ConfigMap whose current ``data`` was read this pass, unless it is
    there already (:func:`budget_document.to_apply`); returns the document in effect.

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused it.
    """
    written = budget_document.to_apply(data, document)
    if written is not None:
        kube.apply(build_budget_configmap(owner, written))
    return written or document


def control_loop(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str | None,
    uid: str,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: Logger,
    **_: Any,
) -> None:
    """Every tick: readiness and OOM kills. Every query interval (or at once on an OOM kill): one look
    at Prometheus, one policy decision, and the actions it asks for."""
    try:
        config = from_memo(memo)
        parsed = parse_spec(spec, allow_secrets=config.allow_secrets)
        check_model_source(parsed, config.allow_host_path_models)
        check_prometheus_url(parsed, config.prometheus_urls)
    except SpecError:
        return  # reported by reconcile; nothing to control
    prior = report.read_status(status)
    if prior.budgets is None or prior.observed_generation != meta.get("generation"):
        return  # reconcile has not finished this generation yet
    if report.is_stalled(prior, meta.get("generation")):
        return  # reported by reconcile; re-applying a refused child every tick would retry it forever
    assert namespace is not None, "MoEInferenceService is namespaced"
    now, generation, owner = datetime.now(UTC), meta.get("generation"), Owner(name=name, namespace=namespace, uid=uid)

    deployment = kube.read_deployment_status(namespace, worker_name(owner))
    data = kube.read_configmap_data(namespace, budget_configmap_name(name))
    if deployment is None or data is None:
        _recreate(body, owner, parsed, prior, {"Deployment": deployment is None, "budget ConfigMap": data is None}, now)
    facts = pod_facts(kube.list_pods(namespace, selector_string(owner)))
    new = report.readiness(prior, parsed, int((deployment or {}).get("readyReplicas") or 0), now, generation,
                           facts.startup_failures)
    _post(body, report.readiness_events(prior, new))
    new, new_ooms = report.oom_check(new, facts, now)
    last_look: datetime | None = memo.get(LAST_LOOK_KEY)
    if new_ooms or last_look is None or (now - last_look).total_seconds() >= parsed.control.query_interval_seconds:
        memo[LAST_LOOK_KEY] = now
        obs = observe_service(config.prometheus_url, namespace, name, parsed, facts, new_ooms, now,
                              ca_file=config.prometheus_ca_file)
        decision = decide(obs, report.policy_state(new, parsed), parsed, now)
        document = budget_document.for_decision(parsed, new, data, decision, now)
        if document is not None:
            document = apply_budget_document(owner, data, document)
        if decision.restart:
            kube.patch_deployment(namespace, worker_name(owner), restart_patch(now.isoformat()))
        new, events = report.looked(new, parsed, obs, decision, document, facts.restarts, now, generation,
                                    facts.crash_looping)
        _post(body, events)
        metrics.record_look(namespace, name, obs, decision, floors(parsed.batching))
        if decision.changed:
            logger.info("budget %s: %s", decision.direction, decision.reason)
    patch.status.update(report.status_patch(prior, new))


def _recreate(body: kopf.Body, owner: Owner, spec: MoEInferenceServiceSpec, prior: MoEInferenceServiceStatus,
              missing: dict[str, bool], now: datetime) -> None:
    """Children deleted by hand (or by a tool) come back, as with any controller: ``missing`` names
    them (``Deployment``, ``budget ConfigMap``); the ConfigMap with the budgets in effect in ``prior``."""
    apply_children(owner, spec)
    document = budget_document.in_effect(spec, prior, "recreated: the ConfigMap was deleted", now)
    if missing["budget ConfigMap"] and document is not None:
        apply_budget_document(owner, None, document)
    gone = " and ".join(what for what, is_gone in missing.items() if is_gone)
    kopf.warn(body, reason="ChildRecreated", message=f"{gone} missing; applied again")


def _post(body: kopf.Body, events: list[report.Event]) -> None:
    """Post ``events`` on the resource."""
    for event in events:
        (kopf.warn if event.type == "Warning" else kopf.info)(body, reason=event.reason, message=event.message)
