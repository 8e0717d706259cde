"""The operator's Kubernetes I/O: server-side apply, the control loop's status patch and Events, a few reads.

Every child is written by server-side apply under one field manager
(:data:`~moeguard_operator.constants.FIELD_MANAGER`), with ``force`` so that the
operator owns the fields it sets; the spec of a MoEInferenceService is never written.
The control loop's status writes are merge patches guarded by the ``resourceVersion`` it
computed them from (:func:`patch_status`). Every call here is under :data:`REQUEST_TIMEOUT`,
so that a hung API server costs a bounded time, and none is retried here: the control loop
retries at its own pace.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from datetime import datetime
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from moeguard_core.contract import API_GROUP, API_VERSION, PLURAL
from moeguard_operator.constants import FIELD_MANAGER

REQUEST_TIMEOUT = (3.0, 10.0)
"""(connect, read) timeout of every request, seconds."""


def load_config() -> None:
    """Load in-cluster credentials inside a pod, else the kubeconfig (``KUBECONFIG``)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    if not client.Configuration.get_default_copy().verify_ssl:
        # The kubeconfig asked for insecure-skip-tls-verify (local clusters): say it once, not per request.
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        logging.getLogger(__name__).warning("TLS verification of the API server is off (insecure-skip-tls-verify)")


@functools.cache
def _dynamic() -> DynamicClient:
    return DynamicClient(client.ApiClient())


def apply(manifest: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply ``manifest``; returns the object as the API server stored it.

    The body is sent as UTF-8 JSON text (JSON is YAML, which the apply content type asks for)
    with every character as itself: the client's own ``json.dumps`` escapes characters outside
    the Basic Multilingual Plane as UTF-16 surrogate pairs (``\\ud83d\\ude00``), which the API
    server's YAML decoder refuses ("invalid Unicode character escape code"), so an emoji in a
    user's annotation would never deploy.

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused it.
    """
    meta = manifest["metadata"]
    resource = _dynamic().resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
    result = resource.server_side_apply(
        body=json.dumps(manifest, ensure_ascii=False),
        name=meta["name"],
        namespace=meta.get("namespace"),
        field_manager=FIELD_MANAGER,
        force_conflicts=True,
        _request_timeout=REQUEST_TIMEOUT,
    )
    return result.to_dict()


def read_configmap(namespace: str, name: str) -> dict[str, Any] | None:
    """A ConfigMap as a JSON-style dict (camelCase keys, ``metadata.managedFields`` included), or None when it
    does not exist."""
    try:
        cm = client.CoreV1Api().read_namespaced_config_map(name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(client.ApiClient().sanitize_for_serialization(cm))


def patch_workload(api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any]) -> None:
    """Merge-patch the workers' Deployment or LeaderWorkerSet: the rolling restart annotation, and
    ``spec.replicas`` (the autoscaler's count, a leak replacement's surge)."""
    resource = _dynamic().resources.get(api_version=api_version, kind=kind)
    resource.patch(body=body, name=name, namespace=namespace, content_type="application/merge-patch+json",
                   _request_timeout=REQUEST_TIMEOUT)


def annotate_pod(namespace: str, name: str, annotations: dict[str, str]) -> None:
    """Merge-patch a worker pod's annotations (a leak replacement's ``pod-deletion-cost``).

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused (404: the pod is gone).
    """
    client.CoreV1Api().patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}},
                                            field_manager=FIELD_MANAGER, _content_type="application/merge-patch+json",
                                            _request_timeout=REQUEST_TIMEOUT)


def delete_pod(namespace: str, name: str) -> None:
    """Delete a worker pod gracefully (its own ``terminationGracePeriodSeconds``); a pod already gone is fine.

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused (other than 404).
    """
    try:
        client.CoreV1Api().delete_namespaced_pod(name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status != 404:
            raise


def delete_if_exists(api_version: str, kind: str, namespace: str, name: str) -> bool:
    """Delete an object (foreground propagation: its pods go with it); whether there was one to delete. A kind
    whose API is not installed (no LeaderWorkerSet CRD) has none.

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused (other than 404).
    """
    resource = _resource(api_version, kind)
    if resource is None:
        return False
    return _found(lambda: resource.delete(name=name, namespace=namespace, propagation_policy="Foreground",
                                          _request_timeout=REQUEST_TIMEOUT))


def exists(api_version: str, kind: str, namespace: str, name: str) -> bool:
    """Whether the object is there (a kind whose API is not installed: False).

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused (other than 404).
    """
    resource = _resource(api_version, kind)
    if resource is None:
        return False
    return _found(lambda: resource.get(name=name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT))


def _resource(api_version: str, kind: str) -> Any:
    """The dynamic client's resource of a kind, None where its API is not installed."""
    try:
        return _dynamic().resources.get(api_version=api_version, kind=kind)
    except ResourceNotFoundError:
        return None


def _found(call: Callable[[], object]) -> bool:
    """Run a request on one object: True, or False where the API server answers 404."""
    try:
        call()
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def crd_exists(name: str) -> bool:
    """Whether the CustomResourceDefinition ``name`` (e.g. ``podmonitors.monitoring.coreos.com``) is installed."""
    try:
        client.ApiextensionsV1Api().read_custom_resource_definition(name, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status in (403, 404):
            return False
        raise
    return True


def patch_status(namespace: str, name: str, status: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
    """Merge-patch the ``status`` of MoEInferenceService ``name`` with ``status`` (camelCase keys); returns the
    object as stored. With ``resource_version``, the patch applies only to that version of the object
    (optimistic concurrency: a status computed from an older view is refused with 409, never written).

    Raises:
        kubernetes.client.exceptions.ApiException: refused (409: the object changed since that version;
            404: it is gone).
    """
    body: dict[str, Any] = {"status": status}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    stored = client.CustomObjectsApi().patch_namespaced_custom_object_status(
        API_GROUP, API_VERSION, namespace, PLURAL, name, body,
        _content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT)
    return dict(stored) if isinstance(stored, dict) else {}


def post_event(involved: dict[str, Any], type_: str, reason: str, message: str, now: datetime) -> None:
    """Create a core/v1 Event about the object ``involved`` (its ``apiVersion``, ``kind`` and ``metadata``),
    from component ``moeguard`` (``message`` cut to 1024 characters).

    Raises:
        kubernetes.client.exceptions.ApiException: the API server refused it.
    """
    meta = involved["metadata"]
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
        involved_object=client.V1ObjectReference(
            api_version=involved.get("apiVersion"), kind=involved.get("kind"), name=meta["name"],
            namespace=meta["namespace"], uid=meta.get("uid"), resource_version=meta.get("resourceVersion")),
        type=type_, reason=reason, message=message[:1024], first_timestamp=now, last_timestamp=now, count=1,
        source=client.V1EventSource(component=FIELD_MANAGER), reporting_component=FIELD_MANAGER)
    client.CoreV1Api().create_namespaced_event(meta["namespace"], event, _request_timeout=REQUEST_TIMEOUT)


def api_reachable(timeout_seconds: float = 2.0) -> bool:
    """Whether the API server answers ``GET /version`` within ``timeout_seconds`` (any error: False)."""
    try:
        client.VersionApi().get_code(_request_timeout=timeout_seconds)
    except Exception:
        return False
    return True


def api_message(exc: ApiException) -> str:
    """The API server's message in a refusal (its Status ``message``), at most 800 characters."""
    try:
        return str(json.loads(str(exc.body)).get("message", exc.body))[:800]
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason)[:800]
