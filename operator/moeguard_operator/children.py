"""Writing a service's children: every child by server-side apply, and the budget ConfigMap.

Shared by the reconcile handler (:mod:`handlers`) and the control loop (:mod:`control_loop`, which
applies them again when one is deleted by hand).
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from moeguard_operator import apply_errors, budget_document, kube
from moeguard_operator.builders import (
    Owner,
    build_budget_configmap,
    build_children,
    build_pod_monitor,
    dropped_volumes,
)
from moeguard_operator.models import MoEInferenceServiceSpec
from moeguard_operator.spec_checks import SpecError
from moeguard_runtime.contract import BudgetDocument

PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"


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
    """Write ``document`` to the budget ConfigMap whose current ``data`` is known (None: it does not exist),
    unless it is there already (:func:`budget_document.to_apply`); returns the document in effect.

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused it.
    """
    written = budget_document.to_apply(data, document)
    if written is not None:
        kube.apply(build_budget_configmap(owner, written))
    return written or document
