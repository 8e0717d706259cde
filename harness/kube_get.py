"""``kubectl get ... -o json`` answered by one kept-alive API client instead of a kubectl process, for the reads
that the tests and the demo poll (every 0.5 s while they wait on the operator).

Why: each kubectl process costs ~0.09 s of CPU (a Go binary's start, the kubeconfig, a TLS handshake; measured
on the 2-core AMD EPYC, 2026-12-06) and the suite started ~160 of them a minute, about a tenth of the machine
while its CPUs were saturated. A GET over the kubernetes client's connection pool costs a few milliseconds.

Only the plain forms are served here: ``[-n NS] get RESOURCE [NAME] [-l SELECTOR] [--field-selector SELECTOR]``
for the resources in :data:`RESOURCES`. Anything else (another flag, another resource) returns None and the
caller runs kubectl. The answer has kubectl's shape: ``metadata.managedFields`` dropped (kubectl shows them only
with ``--show-managed-fields``), a list as ``{"apiVersion": "v1", "kind": "List", "items": [...]}`` with each
item's ``apiVersion`` and ``kind`` filled in (the API server leaves them out of a list's items).
"""

from __future__ import annotations

import json
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config


@dataclass(frozen=True)
class Resource:
    """Where a resource lives in the API: ``prefix`` (``/api/v1`` or ``/apis/GROUP/VERSION``), its plural,
    its list's item kind and whether it is namespaced."""

    prefix: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return self.prefix.removeprefix("/apis/").removeprefix("/api/")

    @property
    def qualified(self) -> str:
        """``plural.group`` as kubectl names it in a NotFound error (``pods`` for the core group)."""
        group = self.api_version.split("/")[0] if "/" in self.api_version else ""
        return f"{self.plural}.{group}" if group else self.plural


def _table(*entries: tuple[tuple[str, ...], Resource]) -> dict[str, Resource]:
    return {alias: res for aliases, res in entries for alias in aliases}


RESOURCES = _table(
    (("moeis", "moeinferenceservice", "moeinferenceservices", "moeinferenceservices.moeguard.dev"),
     Resource("/apis/moeguard.dev/v1alpha1", "moeinferenceservices", "MoEInferenceService")),
    (("pod", "pods", "po"), Resource("/api/v1", "pods", "Pod")),
    (("configmap", "configmaps", "cm"), Resource("/api/v1", "configmaps", "ConfigMap")),
    (("event", "events", "ev"), Resource("/api/v1", "events", "Event")),
    (("service", "services", "svc"), Resource("/api/v1", "services", "Service")),
    (("pvc", "persistentvolumeclaim", "persistentvolumeclaims"),
     Resource("/api/v1", "persistentvolumeclaims", "PersistentVolumeClaim")),
    (("node", "nodes", "no"), Resource("/api/v1", "nodes", "Node", namespaced=False)),
    (("deployment", "deployments", "deploy"), Resource("/apis/apps/v1", "deployments", "Deployment")),
    (("replicaset", "replicasets", "rs"), Resource("/apis/apps/v1", "replicasets", "ReplicaSet")),
    (("endpointslice", "endpointslices"), Resource("/apis/discovery.k8s.io/v1", "endpointslices", "EndpointSlice")),
    (("leaderworkerset", "leaderworkersets", "lws"),
     Resource("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets", "LeaderWorkerSet")),
    (("crd", "crds", "customresourcedefinition", "customresourcedefinitions"),
     Resource("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition",
              namespaced=False)),
)
"""The resources served without kubectl, by every name the tests give them (kubectl's short names included)."""


@dataclass(frozen=True)
class Get:
    """A parsed ``kubectl get``: the resource, the namespace (None: kubectl's default, ``default``), the name
    (None: a list) and the list's selectors."""

    resource: Resource
    namespace: str | None
    name: str | None
    label_selector: str | None
    field_selector: str | None

    def path(self) -> str:
        ns = f"/namespaces/{self.namespace or 'default'}" if self.resource.namespaced else ""
        return f"{self.resource.prefix}{ns}/{self.resource.plural}" + (f"/{self.name}" if self.name else "")


def parse(args: tuple[str, ...]) -> Get | None:
    """``args`` of ``kubectl ARGS -o json`` (without the ``-o json``) as a :class:`Get`, or None when they are
    anything but the plain forms this module serves."""
    flags = {"-n": "namespace", "--namespace": "namespace", "-l": "labels", "--selector": "labels",
             "--field-selector": "fields"}
    values: dict[str, str] = {}
    words: list[str] = []
    it = iter(args)
    for arg in it:
        if arg in flags:
            value = next(it, None)
            if value is None or flags[arg] in values:
                return None
            values[flags[arg]] = value
        elif arg.startswith("-"):
            return None  # -o, -A, --show-managed-fields, --raw, ...: kubectl's own business
        else:
            words.append(arg)
    if len(words) not in (2, 3) or words[0] != "get" or words[1] not in RESOURCES:
        return None
    name = words[2] if len(words) == 3 else None
    if name is not None and ("labels" in values or "fields" in values or "/" in name):
        return None
    return Get(RESOURCES[words[1]], values.get("namespace"), name, values.get("labels"), values.get("fields"))


def kubectl_shape(get: Get, body: dict[str, Any]) -> dict[str, Any]:
    """The API server's answer as ``kubectl get -o json`` prints it (see the module's docstring)."""
    def strip(obj: dict[str, Any]) -> dict[str, Any]:
        (obj.get("metadata") or {}).pop("managedFields", None)
        return obj
    if get.name is not None:
        return strip(body)
    items = [strip({"apiVersion": get.resource.api_version, "kind": get.resource.kind} | item)
             for item in body.get("items") or []]
    return {"apiVersion": "v1", "items": items, "kind": "List", "metadata": {"resourceVersion": ""}}


class KubeGetError(RuntimeError):
    """The API server refused the read, or could not be reached; the message reads as kubectl's would."""


_clients: dict[tuple[str, int], k8s_client.ApiClient] = {}
_lock = threading.Lock()


def _client(kubeconfig: Path) -> k8s_client.ApiClient:
    """One API client per kubeconfig (a cluster brought up again writes a new one: a new client)."""
    key = (str(kubeconfig), kubeconfig.stat().st_mtime_ns)
    with _lock:
        api = _clients.get(key)
        if api is None:
            api = k8s_config.new_client_from_config(config_file=str(kubeconfig))
            _clients[key] = api
        return api


def get_json(get: Get, kubeconfig: Path, timeout: float = 30.0) -> dict[str, Any]:
    """GET ``get`` from the cluster of ``kubeconfig``, shaped as kubectl prints it.

    Raises:
        KubeGetError: an error status (its message as kubectl gives it: ``Error from server (NotFound): ...``),
            or the API server unreachable within ``timeout`` seconds.
    """
    query = [(k, v) for k, v in (("labelSelector", get.label_selector), ("fieldSelector", get.field_selector)) if v]
    try:
        api = _client(kubeconfig)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # urllib3's InsecureRequestWarning: the local cluster skips TLS checks
            method, url, headers, body, post = api.param_serialize(
                "GET", get.path(), query_params=query, header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"])
            resp = api.call_api(method, url, header_params=headers, body=body, post_params=post,
                                _request_timeout=timeout)
            data = resp.read()
    except Exception as exc:  # urllib3's MaxRetryError, a timeout, a closed connection: kubectl fails the same way
        raise KubeGetError(f"the API server did not answer GET {get.path()}: {exc}") from None
    if not 200 <= resp.status < 300:
        raise KubeGetError(_server_error(get, resp.status, resp.reason, data))
    return kubectl_shape(get, json.loads(data))


def _server_error(get: Get, status: int, reason: str | None, data: bytes | None) -> str:
    try:
        body = json.loads(data or b"{}")
    except ValueError:
        body = {}
    if not isinstance(body, dict) or "message" not in body:  # no Status: the API itself is missing (a CRD not there)
        return f"the server could not find the requested resource (get {get.resource.qualified}): HTTP {status} {reason}"
    why, message = body.get("reason") or reason, body["message"]
    return f"Error from server ({why}): {message}"
