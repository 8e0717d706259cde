"""Writing a service's children: every child by server-side apply, and the budget ConfigMap.

Shared by the reconcile handler (:mod:`handlers`) and the control loop (:mod:`control_loop`, which
applies them again when one is deleted by hand).
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from moeguard_core.contract import BudgetDocument
from moeguard_operator import constants as c
from moeguard_operator.children import apply_errors, kube
from moeguard_operator.children.builders import (
    Owner,
    build_budget_configmap,
    build_children,
    build_pod_monitor,
    dropped_volumes,
    prefill_children,
    prefill_owner,
    stale_workload,
    worker_name,
)
from moeguard_operator.loop import budget_document
from moeguard_operator.spec.models import MoEInferenceServiceSpec
from moeguard_operator.spec.spec_checks import SpecError

PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"


def apply_children(owner: Owner, spec: MoEInferenceServiceSpec, replicas: int | None = None) -> None:
    """Server-side apply every child (and the PodMonitor when prometheus-operator is installed), then delete
    the workload of the kind the spec no longer uses (:func:`~moeguard_operator.children.builders.stale_workload`);
    ``replicas``: the Deployment's where not ``spec.replicas`` (a leak replacement's surge).

    Raises:
        apply_errors.ChildRefused: the API server refused one (which, and its answer).
        SpecError: reason ``VolumeDropped``: the API server stored the workload without some of its
            volumes (a disabled feature, e.g. image volumes without the ImageVolume feature gate);
            reason ``LeaderWorkerSetNotInstalled``: ``parallelism.podsPerReplica`` is above 1 and the
            cluster has no LeaderWorkerSet API.
    """
    if spec.parallelism.multi_node and not kube.crd_exists(c.LWS_CRD):
        raise SpecError("LeaderWorkerSetNotInstalled",
                        f"parallelism.podsPerReplica {spec.parallelism.pods_per_replica} needs the LeaderWorkerSet "
                        f"API ({c.LWS_CRD}), which this cluster does not serve: install LeaderWorkerSet "
                        "(https://lws.sigs.k8s.io) or set podsPerReplica to 1")
    manifests = build_children(owner, spec, replicas)
    if kube.crd_exists(PODMONITOR_CRD):
        manifests.append(build_pod_monitor(owner))
        if spec.prefill is not None and owner.parent is None:
            manifests.append(build_pod_monitor(prefill_owner(owner)))
    for manifest in manifests:
        try:
            stored = kube.apply(manifest)
        except ApiException as exc:
            child = f"{manifest['kind']} {manifest['metadata']['name']}"
            raise apply_errors.ChildRefused(child, exc.status, kube.api_message(exc), str(exc.body or "")) from exc
        dropped = dropped_volumes(manifest, stored) if manifest["kind"] in ("Deployment", c.LWS_KIND) else []
        if dropped:
            raise SpecError("VolumeDropped", f"the API server stored the worker {manifest['kind']} without its volumes "
                                             f"{', '.join(dropped)}: a volume type this cluster has not enabled "
                                             "(image volumes need Kubernetes 1.33+ with the ImageVolume feature "
                                             "gate)")
    stale = [(*stale_workload(spec), worker_name(owner))]
    if spec.prefill is None:  # a prefill role removed from the spec: its children go
        role_children = prefill_children(owner)
        if kube.exists(*role_children[-1][:2], owner.namespace, role_children[-1][2]):  # one GET when there are none
            stale += role_children
    for api_version, kind, name in stale:
        try:
            kube.delete_if_exists(api_version, kind, owner.namespace, name)
        except ApiException as exc:
            raise apply_errors.ChildRefused(f"{kind} {name} (deleting it)", exc.status,
                                            kube.api_message(exc), str(exc.body or "")) from exc


def apply_budget_document(owner: Owner, data: dict[str, str] | None, document: BudgetDocument) -> BudgetDocument:
    """Write ``document`` to the budget ConfigMap whose current ``data`` is known (None: it does not exist),
    unless it is there already (:func:`budget_document.to_apply`); returns the document in effect.

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused it.
    """
    written = budget_document.to_apply(data, document)
    if written is not None:
        kube.apply(build_budget_configmap(owner, written))
    return written or document
