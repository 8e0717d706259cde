"""The operator's Kubernetes I/O: server-side apply and a few reads.

Every write is a server-side apply under one field manager
(:data:`~moeguard_operator.constants.FIELD_MANAGER`), with ``force`` so that the
operator owns the fields it sets; the spec of a MoEInferenceService is never written.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from moeguard_operator.constants import FIELD_MANAGER


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
    )
    return result.to_dict()


def read_deployment_status(namespace: str, name: str) -> dict[str, Any] | None:
    """The Deployment's ``status`` as a dict, or None when it does not exist."""
    try:
        # A plain GET carries the status too, and needs only `get deployments` (not deployments/status).
        dep = client.AppsV1Api().read_namespaced_deployment(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return client.ApiClient().sanitize_for_serialization(dep.status) or {}


def read_configmap_data(namespace: str, name: str) -> dict[str, str] | None:
    """A ConfigMap's ``data``, or None when it does not exist."""
    try:
        cm = client.CoreV1Api().read_namespaced_config_map(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(cm.data or {})


def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching ``selector`` in ``namespace``, as JSON-style dicts (camelCase keys)."""
    pods = client.CoreV1Api().list_namespaced_pod(namespace, label_selector=selector)
    return [client.ApiClient().sanitize_for_serialization(p) for p in pods.items]


def patch_deployment(namespace: str, name: str, body: dict[str, Any]) -> None:
    """Strategic-merge patch a Deployment (used for the rolling restart annotation only)."""
    client.AppsV1Api().patch_namespaced_deployment(name, namespace, body)


def crd_exists(name: str) -> bool:
    """Whether the CustomResourceDefinition ``name`` (e.g. ``podmonitors.monitoring.coreos.com``) is installed."""
    try:
        client.ApiextensionsV1Api().read_custom_resource_definition(name)
    except ApiException as exc:
        if exc.status in (403, 404):
            return False
        raise
    return True


def api_message(exc: ApiException) -> str:
    """The API server's message in a refusal (its Status ``message``), at most 800 characters."""
    try:
        return str(json.loads(str(exc.body)).get("message", exc.body))[:800]
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason)[:800]
