"""Pure builders: a MoEInferenceService → the manifests of its children.

Every function takes the parsed spec and the owner's identity and returns a plain
dict ready for server-side apply; none does I/O (dask-kubernetes' ``build_*_spec``
style). Each child carries an owner reference to the MoEInferenceService and the
``app.kubernetes.io`` labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeguard_operator import constants as c
from moeguard_operator.models import MoEInferenceServiceSpec
from moeguard_runtime import contract as k
from moeguard_runtime.contract import BudgetDocument

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """Identity of the MoEInferenceService that owns the children."""

    name: str
    namespace: str
    uid: str


def labels(owner: Owner) -> dict[str, str]:
    """The labels of every child object."""
    return {
        c.LABEL_NAME: c.WORKER_NAME,
        c.LABEL_INSTANCE: owner.name,
        c.LABEL_COMPONENT: c.WORKER_COMPONENT,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_PART_OF: "moeguard",
    }


def selector_labels(owner: Owner) -> dict[str, str]:
    """The stable subset of labels used by selectors (never changes after creation)."""
    return {c.LABEL_NAME: c.WORKER_NAME, c.LABEL_INSTANCE: owner.name}


def selector_string(owner: Owner) -> str:
    """``selector_labels`` as a label-selector string (``status.selector``)."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(owner).items())


def _metadata(owner: Owner, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner),
        "ownerReferences": [
            {
                "apiVersion": f"{k.API_GROUP}/{k.API_VERSION}",
                "kind": k.KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def worker_name(owner: Owner) -> str:
    return f"{owner.name}-worker"


def worker_env(owner: Owner, spec: MoEInferenceServiceSpec) -> list[dict[str, Any]]:
    """The worker container's environment (the contract's ``ENV_*`` names).

    The budgets here are the spec's *initial* ones: budgets changed at run time
    travel through the budget ConfigMap, so that they never roll the pods.
    """
    b = spec.batching
    plain = {
        k.ENV_SERVICE_NAME: owner.name,
        k.ENV_MODEL_PRESET: spec.model.preset,
        k.ENV_SOFT_LIMIT_BYTES: str(spec.resources.soft_limit_bytes),
        k.ENV_HARD_LIMIT_BYTES: str(spec.resources.hard_limit_bytes),
        k.ENV_BUDGET_CONFIGMAP: k.budget_configmap_name(owner.name),
        k.ENV_MAX_PREFILL_TOKENS: str(b.max_prefill_tokens),
        k.ENV_MAX_DECODE_TOKENS: str(b.max_decode_tokens),
        k.ENV_MAX_BATCH_REQUESTS: str(b.max_batch_requests),
        k.ENV_MAX_CONCURRENT_BATCHES: str(b.max_concurrent_batches),
        k.ENV_PORT: str(k.WORKER_PORT),
        k.UCX_MEM_MMAP_HOOK_MODE: spec.ucx.mmap_hook_mode,
        k.UCX_RCACHE_MAX_UNRELEASED: spec.ucx.rcache_max_unreleased,
    }
    env: list[dict[str, Any]] = [
        {"name": k.ENV_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": k.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    env += [{"name": name, "value": value} for name, value in plain.items()]
    return env


def build_deployment(owner: Owner, spec: MoEInferenceServiceSpec) -> Manifest:
    """The worker Deployment: GPU limit, memory limit = ``hardLimit``, restricted pod security."""
    memory = spec.resources.hard_limit
    limits: dict[str, str] = {"memory": memory}
    if spec.resources.gpus:
        limits["nvidia.com/gpu"] = str(spec.resources.gpus)
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    container = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "moeguard_runtime"],
        "ports": [{"name": "http", "containerPort": k.WORKER_PORT, "protocol": "TCP"}],
        "env": worker_env(owner, spec),
        "resources": {"limits": limits, "requests": {"memory": memory, "cpu": "1"}},
        "livenessProbe": probe,
        "readinessProbe": {**probe, "httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "startupProbe": {**probe, "failureThreshold": 60, "periodSeconds": 5},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, worker_name(owner)),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner)},
            "template": {
                "metadata": {"labels": labels(owner)},
                "spec": {
                    "serviceAccountName": worker_name(owner),
                    "automountServiceAccountToken": True,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "fsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
                },
            },
        },
    }


def build_service(owner: Owner) -> Manifest:
    """A ClusterIP Service in front of the workers' HTTP port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner),
            "ports": [{"name": "http", "port": k.WORKER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_budget_configmap(owner: Owner, document: BudgetDocument) -> Manifest:
    """The budget ConfigMap that the workers watch (``contract.BUDGET_KEY``)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, k.budget_configmap_name(owner.name)),
        "data": document.to_configmap_data(),
    }


def build_service_account(owner: Owner) -> Manifest:
    """The workers' ServiceAccount."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, worker_name(owner))}


def build_role(owner: Owner) -> Manifest:
    """A Role that lets the workers read and watch their own budget ConfigMap, and nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(owner, worker_name(owner)),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [k.budget_configmap_name(owner.name)],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def build_role_binding(owner: Owner) -> Manifest:
    """Binds the workers' Role to their ServiceAccount."""
    name = worker_name(owner)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(owner, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def build_children(owner: Owner, spec: MoEInferenceServiceSpec) -> list[Manifest]:
    """Every child except the budget ConfigMap, in apply order (RBAC before the pods that use it)."""
    return [
        build_service_account(owner),
        build_role(owner),
        build_role_binding(owner),
        build_service(owner),
        build_deployment(owner, spec),
    ]
