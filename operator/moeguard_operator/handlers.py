"""Thin kopf handlers: each parses, decides with the pure modules, and applies.

* create/update/resume → :func:`reconcile`: :func:`~spec_checks.parse_spec`, children by
  server-side apply (:mod:`children`), the budget ConfigMap (:mod:`budget_document`: the budgets in
  effect are the ConfigMap's when it is ahead of status), ``status`` (:mod:`report`).
* ``on.event`` watches of the services, their worker pods, budget ConfigMaps and Deployments feed the
  one operator-level :class:`~control_loop.ControlLoop`, started by :func:`start_loop` and stopped by
  :func:`stop_loop`: readiness, OOM kills, the looks at Prometheus, the policy, budgets, status and
  Events for every service (see :mod:`control_loop`).

No handler needs a finalizer (no timer, no daemon, no deletion handler), so kopf adds none and
removes the one older versions put on the resources (``moeguard.dev/finalizer``): deleting a service,
or the CRD at ``helm uninstall``, never waits for the operator.

:func:`register` puts them in a kopf registry with the operator's :class:`~config.OperatorConfig`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from datetime import UTC, datetime
from typing import Any, NoReturn

import kopf

from moeguard_core.contract import (
    API_GROUP,
    API_VERSION,
    PLURAL,
    BudgetDocument,
    budget_configmap_name,
)
from moeguard_operator import constants as c
from moeguard_operator.children import apply_errors, children, kube
from moeguard_operator.children.builders import (
    Owner,
    prefill_owner,
    prefill_role_spec,
    selector_string,
)
from moeguard_operator.config import MEMO_KEY, OperatorConfig, from_memo
from moeguard_operator.loop import autoscale, budget_document, leak_replacement, metrics, report
from moeguard_operator.loop.control_loop import ControlLoop
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus
from moeguard_operator.spec.spec_checks import (
    SpecError,
    check_model_source,
    check_prometheus_url,
    memory_warnings,
    parse_spec,
)

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
Logger = logging.Logger | logging.LoggerAdapter[Any]


def register(config: OperatorConfig, registry: kopf.OperatorRegistry) -> ControlLoop:
    """Register moeguard's handlers in ``registry``, configured by ``config``; returns the control loop
    they feed (started at kopf's startup, stopped at its cleanup).

    The startup handler puts ``config`` in kopf's memo, which every resource's memo copies, so
    :func:`reconcile` reads it from there. A fresh registry has none of kopf's fallback login handlers, so
    the kubernetes client's login is registered explicitly (the one kopf would pick: in-cluster
    credentials, else the kubeconfig). The watches of pods, ConfigMaps and Deployments select moeguard's
    children by their ``app.kubernetes.io/managed-by`` label.
    """
    loop = ControlLoop(config)
    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry, id="configure")(functools.partial(configure, config=config))
    kopf.on.startup(registry=registry, id="start-loop")(functools.partial(start_loop, loop=loop))
    kopf.on.cleanup(registry=registry, id="stop-loop")(functools.partial(stop_loop, loop=loop))
    for on in (kopf.on.resume, kopf.on.create, kopf.on.update):
        on(*RESOURCE, registry=registry)(reconcile)
    children_only = {c.LABEL_MANAGED_BY: c.MANAGED_BY}
    feeds: list[tuple[tuple[str, str, str], dict[str, str] | None, Any]] = [
        (RESOURCE, None, loop.on_service),
        (("", "v1", "pods"), children_only, loop.on_pod),
        (("", "v1", "configmaps"), children_only, loop.on_configmap),
        (("apps", "v1", "deployments"), children_only, loop.on_workload),
        # Served once LeaderWorkerSet's CRD is installed (kopf waits for unresolved resources).
        (("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"), children_only, loop.on_workload),
    ]
    for resource, labels, feed in feeds:
        kopf.on.event(*resource, labels=labels, registry=registry, id=f"{WATCH_PREFIX}{resource[2]}")(
            functools.partial(watch, feed=feed))
    return loop


WATCH_PREFIX = "watch-"
"""Prefix of the ids of the watch handlers (their routine success lines are not logged)."""


async def watch(event: kopf.RawEvent, feed: Any, **_: Any) -> None:
    """Hand one watch event (its ``type`` and raw ``object``) to the control loop."""
    feed(event.get("type"), dict(event["object"]))


async def start_loop(loop: ControlLoop, logger: Logger, **_: Any) -> None:
    """Start the control loop (an asyncio task of the operator's own event loop)."""
    loop.task = asyncio.create_task(loop.run(), name="moeguard-control-loop")
    logger.info("control loop started (tick %ss)", loop.config.timer_interval_seconds)


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, config: OperatorConfig, **_: Any) -> None:
    """Keep kopf's own bookkeeping under moeguard.dev, store ``config`` in memo, and load credentials.

    ``settings.persistence.finalizer`` stays moeguard's: kopf removes that finalizer from every resource
    it meets, since no handler needs one any more.
    """
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
    settings.execution.max_workers = 16  # reconciles of many services created at once
    kube.load_config()


async def stop_loop(loop: ControlLoop, **_: Any) -> None:
    """Stop the control loop."""
    task = loop.task
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    loop.shutdown()


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
        for warning in memory_warnings(parsed):
            kopf.warn(body, reason="MemoryPredicted", message=warning)
        check_model_source(parsed, config.allow_host_path_models)
        check_prometheus_url(parsed, config.prometheus_urls)
        parsed = autoscale.serving_spec(parsed, prior)  # spec.autoscaling: the replicas the autoscaler decided
        # on top of them, a leak replacement's surge pod is kept (status.leakReplacement): never scaled away here
        children.apply_children(owner, parsed, leak_replacement.surge_replicas(parsed, prior))
    except SpecError as exc:
        _stall(body, patch, prior, exc.reason, str(exc), now, generation, "invalid")
    except apply_errors.ChildRefused as exc:
        verdict = apply_errors.judge(exc.child, exc.status, exc.message, exc.body, retry)
        metrics.CHILD_APPLY_REFUSALS.labels(namespace, name, "retry" if verdict.retry else "stall").inc()
        if verdict.retry:
            logger.warning("%s", verdict.message)
            raise kopf.TemporaryError(verdict.message, delay=apply_errors.RETRY_DELAY_SECONDS) from exc
        _stall(body, patch, prior, verdict.reason, verdict.message, now, generation, "refused")

    document, own_patch = _reconcile_budgets(owner, parsed, prior, now, generation, config.policy)
    patch.status.update(own_patch)
    if parsed.prefill is not None:  # the prefill role: its own budget document and status.prefill
        role_prior = report.read_status(None if prior.prefill is None else prior.prefill.model_dump(by_alias=True))
        role_patch = _reconcile_budgets(prefill_owner(owner), prefill_role_spec(parsed), role_prior, now,
                                        generation, config.policy)[1]
        if role_patch:
            patch.status["prefill"] = role_patch
    elif prior.prefill is not None:
        patch.status["prefill"] = None

    metrics.RECONCILIATIONS.labels(namespace, name, "applied").inc()
    metrics.PREFILL_BUDGET.labels(namespace, name).set(document.budgets.max_prefill_tokens)
    kopf.info(body, reason="Reconciled", message="applied worker Deployment, Service, PDB, RBAC and budget "
                                                 f"ConfigMap (budget generation {document.generation})")
    logger.info("reconciled %s/%s generation %s", namespace, name, generation)


def _reconcile_budgets(owner: Owner, spec: MoEInferenceServiceSpec, prior: MoEInferenceServiceStatus,
                       now: datetime, generation: int | None, policy: str) -> tuple[BudgetDocument, dict[str, Any]]:
    """The budget ConfigMap of ``owner``'s pods (the service's, or its prefill role's: :func:`prefill_owner`) after
    :func:`budget_document.for_spec` on ``spec`` and ``prior``, and the merge patch of their status (empty: nothing
    changed).

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused the ConfigMap.
    """
    cm = kube.read_configmap(owner.namespace, budget_configmap_name(owner.name))
    data = None if cm is None else dict(cm.get("data") or {})
    ours = cm is not None and budget_document.written_by((cm.get("metadata") or {}).get("managedFields"),
                                                         c.FIELD_MANAGER)
    document = children.apply_budget_document(
        owner, data, budget_document.for_spec(spec, prior, data, now, ours, policy=policy))
    return document, report.status_patch(prior, report.reconciled(prior, spec, document, selector_string(owner),
                                                                  now, generation))


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


def _post(body: kopf.Body, events: list[report.Event]) -> None:
    """Post ``events`` on the resource."""
    for event in events:
        (kopf.warn if event.type == "Warning" else kopf.info)(body, reason=event.reason, message=event.message)
