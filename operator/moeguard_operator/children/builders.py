"""Pure builders: a MoEInferenceService → the manifests of its children.

Every function takes the parsed spec and the owner's identity and returns a plain
dict ready for server-side apply; none does I/O (dask-kubernetes' ``build_*_spec``
style). Each child carries an owner reference to the MoEInferenceService and the
``app.kubernetes.io`` labels.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from moeguard_core import contract as k
from moeguard_core.contract import BudgetDocument
from moeguard_operator import constants as c
from moeguard_operator.spec.models import ModelSource, MoEInferenceServiceSpec

Manifest = dict[str, Any]

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""Node label set by NVIDIA GPU feature discovery."""
RESTARTED_AT_ANNOTATION = "moeguard.dev/restartedAt"


@dataclass(frozen=True)
class Owner:
    """Identity of the MoEInferenceService that owns the children; ``parent``: for the children of its
    prefill role (:func:`prefill_owner`), the service's own name (``name`` is then ``<service>-prefill``)."""

    name: str
    namespace: str
    uid: str
    parent: str | None = None


PREFILL_SUFFIX = "-prefill"


def prefill_owner(owner: Owner) -> Owner:
    """The identity the prefill role's children are built for: every name and the selector from
    ``<service>-prefill`` (a Deployment ``<service>-prefill-worker``, a Service ``<service>-prefill``, a budget
    ConfigMap and RBAC of their own), the owner reference to the service."""
    return Owner(owner.name + PREFILL_SUFFIX, owner.namespace, owner.uid, parent=owner.name)


def prefill_role_spec(spec: MoEInferenceServiceSpec) -> MoEInferenceServiceSpec:
    """The spec the prefill role's children are built from: the service's, with ``spec.prefill``'s replicas and
    whichever of its resources, batching, UCX settings and template it sets; no autoscaling.

    Raises:
        ValueError: the spec has no ``prefill``.
    """
    p = spec.prefill
    if p is None:
        raise ValueError("the spec has no prefill role")
    return spec.model_copy(update={
        "replicas": p.replicas, "autoscaling": None,
        "resources": p.resources or spec.resources, "batching": p.batching or spec.batching,
        "ucx": p.ucx or spec.ucx, "template": p.template or spec.template})


def role(owner: Owner, spec: MoEInferenceServiceSpec) -> str:
    """The workers' ``contract.ENV_ROLE``: ``single`` without ``spec.prefill``, else ``prefill`` for the prefill
    role's children and ``decode`` for the service's own."""
    if spec.prefill is None:
        return "single"
    return "prefill" if owner.parent is not None else "decode"


def labels(owner: Owner) -> dict[str, str]:
    """The labels of every child object."""
    out = {
        c.LABEL_NAME: c.WORKER_NAME,
        c.LABEL_INSTANCE: owner.name,
        c.LABEL_COMPONENT: c.WORKER_COMPONENT,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_PART_OF: "moeguard",
    }
    if owner.parent is not None:
        out[c.ROLE_LABEL] = "prefill"
    return out


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
                "name": owner.parent or owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def worker_name(owner: Owner) -> str:
    return f"{owner.name}-worker"


def ucx_mode(spec: MoEInferenceServiceSpec) -> str:
    """``spec.ucx.mode``, or where unset its default: ``rcache`` on AMD GPUs (ROCm: the mmap hooks' ``none``
    breaks NIXL there; vLLM PR #32570, NIXL PR #1210), else ``none``."""
    if spec.ucx.mode is not None:
        return spec.ucx.mode
    return "rcache" if spec.resources.amd_gpu else "none"


def ucx_env(spec: MoEInferenceServiceSpec) -> dict[str, str]:
    """UCX variables for :func:`ucx_mode` (see :class:`~moeguard_operator.spec.models.UcxSpec`), then extraEnv."""
    env: dict[str, str] = {}
    mode = ucx_mode(spec)
    if mode == "none":
        env[k.UCX_MEM_MMAP_HOOK_MODE] = k.UCX_SAFE_MMAP_HOOK_MODE
    if mode in ("none", "rcache"):
        env[k.UCX_RCACHE_MAX_UNRELEASED] = str(spec.ucx.rcache_max_unreleased)
    env.update(spec.ucx.extra_env)
    return env


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def worker_env(owner: Owner, spec: MoEInferenceServiceSpec) -> list[dict[str, Any]]:
    """The worker container's environment (the contract's ``ENV_*`` names).

    No budget is here: budgets reach the workers through the budget ConfigMap alone
    (``ENV_BUDGET_CONFIGMAP`` names it; the worker is not ready before its first valid
    document), so that a change of ``spec.batching``'s budgets never rolls the pods.
    """
    b = spec.batching
    plain = {
        k.ENV_SERVICE_NAME: owner.name,
        k.ENV_MODEL_PRESET: spec.model.preset,
        k.ENV_SOFT_LIMIT_BYTES: str(spec.resources.soft_limit_bytes),
        k.ENV_HARD_LIMIT_BYTES: str(spec.resources.hard_limit_bytes),
        k.ENV_GPU_SOFT_FRACTION: _number(spec.resources.gpu_soft_fraction),
        k.ENV_GPU_HARD_FRACTION: _number(spec.resources.gpu_hard_fraction),
        k.ENV_BUDGET_CONFIGMAP: k.budget_configmap_name(owner.name),
        k.ENV_LONG_REQUEST_THRESHOLD_TOKENS: str(b.long_request_threshold_tokens),
        k.ENV_MAX_CONCURRENT_REQUESTS: str(b.max_concurrent_requests),
        k.ENV_OVERLOAD_MODE: spec.overload.mode,
        k.ENV_PORT: str(k.WORKER_PORT),
        k.ENV_KERNEL_CACHE_DIR: k.POD_KERNEL_CACHE_DIR,  # on the /tmp emptyDir: kept across container restarts
    }
    if spec.model.source is not None:
        plain[k.ENV_CHECKPOINT_PATH] = spec.model.source.checkpoint_path
    elif spec.model.checkpoint_path:
        plain[k.ENV_CHECKPOINT_PATH] = spec.model.checkpoint_path
    if spec.model.served_model_name:
        plain[k.ENV_SERVED_MODEL_NAME] = spec.model.served_model_name
    overrides = spec.model.overrides.model_dump(exclude_none=True)
    if overrides:
        plain[k.ENV_MODEL_OVERRIDES] = json.dumps(overrides, sort_keys=True)
    par = spec.parallelism
    if par.expert_parallel_size > 1:
        plain[k.ENV_EXPERT_PARALLEL_SIZE] = str(par.expert_parallel_size)
        plain[k.ENV_EP_PORT] = str(k.DEFAULT_EP_PORT)
        if not par.multi_node:  # one pod holds the group: what LeaderWorkerSet would inject for a group of 1
            plain.update({k.ENV_LWS_LEADER_ADDRESS: "127.0.0.1", k.ENV_LWS_GROUP_SIZE: "1", k.ENV_LWS_WORKER_INDEX: "0"})
    plain.update(ucx_env(spec))  # every rank's process: the UCX settings hold for the whole group
    if spec.prefill is not None:  # disaggregated prefill/decode (issue 33)
        plain[k.ENV_ROLE] = role(owner, spec)
        plain[k.ENV_KV_LEASE_SECONDS] = _number(spec.prefill.kv_lease_seconds)
        if owner.parent is None:  # the decode pods call the prefill role's Service
            plain[k.ENV_PREFILL_URL] = f"http://{owner.name}{PREFILL_SUFFIX}:{k.WORKER_PORT}"
            plain[k.ENV_KV_TRANSFER_TIMEOUT_SECONDS] = _number(spec.prefill.kv_transfer_timeout_seconds)
    env: list[dict[str, Any]] = [
        {"name": k.ENV_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": k.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    env += [{"name": name, "value": value} for name, value in plain.items()]
    env += [dict(e) for e in spec.template.extra_env]
    return env


def model_volume(source: ModelSource) -> Manifest:
    """The pod volume (``contract.MODEL_VOLUME``) of ``spec.model.source``: read-only wherever the volume
    type can say so (an image volume always is)."""
    volume: Manifest = {"name": k.MODEL_VOLUME}
    if source.persistent_volume_claim is not None:
        volume["persistentVolumeClaim"] = {"claimName": source.persistent_volume_claim.claim_name, "readOnly": True}
    elif source.host_path is not None:
        volume["hostPath"] = {"path": source.host_path.path, "type": "Directory"}
    elif source.image is not None:
        volume["image"] = {"reference": source.image.reference, "pullPolicy": source.image.pull_policy}
    return volume


def pod_template(owner: Owner, spec: MoEInferenceServiceSpec) -> Manifest:
    """The worker pod template (of the Deployment, or of every pod of a LeaderWorkerSet group): GPU limit,
    memory limit = ``hardLimit``, restricted pod security, probes, the budget ConfigMap's ServiceAccount."""
    res = spec.resources
    limits: dict[str, str] = {"memory": res.hard_limit, "cpu": res.cpu}
    if res.gpus:
        limits[res.gpu_resource_name] = str(res.gpus)
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    if spec.model.source is not None:  # the whole volume: the worker reads MODEL_MOUNT_PATH/<subPath>
        mounts.append({"name": k.MODEL_VOLUME, "mountPath": k.MODEL_MOUNT_PATH, "readOnly": True})
        volumes.append(model_volume(spec.model.source))
    mounts += [{"readOnly": True, **m} for m in spec.template.volume_mounts]  # read-only unless asked
    container = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python", "-m", "moeguard_runtime"],
        "ports": [{"name": "http", "containerPort": k.WORKER_PORT, "protocol": "TCP"}]
        + ([{"name": "ep", "containerPort": k.DEFAULT_EP_PORT, "protocol": "TCP"}]
           if spec.parallelism.expert_parallel_size > 1 else []),
        "env": worker_env(owner, spec),
        "resources": {"limits": limits, "requests": {"memory": res.hard_limit, "cpu": res.cpu}},
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
        "volumeMounts": mounts,
        # the worker writes why it could not start there (contract.TERMINATION_MESSAGE_PATH); where it
        # could not write it, the kubelet takes the log's tail
        "terminationMessagePath": k.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    node_selector = dict(spec.template.node_selector)
    if res.gpu_product:
        node_selector[GPU_PRODUCT_LABEL] = res.gpu_product
    pod_spec: dict[str, Any] = {
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
        "volumes": [*volumes, *spec.template.volumes],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if spec.template.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.template.tolerations]
    if spec.template.affinity:
        pod_spec["affinity"] = spec.template.affinity
    if spec.template.priority_class_name:
        pod_spec["priorityClassName"] = spec.template.priority_class_name
    template_meta: dict[str, Any] = {"labels": labels(owner)}
    if spec.template.annotations:
        template_meta["annotations"] = dict(spec.template.annotations)
    template = {"metadata": template_meta, "spec": pod_spec}
    template_meta["labels"][c.TEMPLATE_HASH_LABEL] = _hash(template)
    return template


TEMPLATE_HASH_CHARS = 16
"""Hex digits of the template hash (64 bits: a label value holds at most 63 characters)."""


def _hash(template: Manifest) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[
        :TEMPLATE_HASH_CHARS]


def template_hash(owner: Owner, spec: MoEInferenceServiceSpec) -> str:
    """The :data:`constants.TEMPLATE_HASH_LABEL` of the worker pods ``spec`` asks for: the first
    :data:`TEMPLATE_HASH_CHARS` hex digits of the SHA-256 of the pod template without that label (its JSON with
    sorted keys). The same spec gives the same hash in every operator process; the restart annotation
    (:func:`restart_patch`) is added to the stored template only, so a restarted pod keeps its hash."""
    return str(pod_template(owner, spec)["metadata"]["labels"][c.TEMPLATE_HASH_LABEL])


def worker_replicas(spec: MoEInferenceServiceSpec, desired: int | None = None) -> int:
    """The worker workload's replica count: ``spec.replicas`` without ``spec.autoscaling``; with it, the
    autoscaler's ``desired`` count (``status.autoscaling.desiredReplicas``; None before its first decision:
    ``spec.replicas``), clamped to ``minReplicas``..``maxReplicas``. The one place the count is decided, for
    every builder and for the control loop's readiness (:func:`moeguard_operator.loop.autoscale.serving_spec`)."""
    auto = spec.autoscaling
    if auto is None:
        return spec.replicas
    return max(auto.min_replicas, min(auto.max_replicas, spec.replicas if desired is None else desired))


def build_deployment(owner: Owner, spec: MoEInferenceServiceSpec, replicas: int | None = None) -> Manifest:
    """The worker Deployment (``parallelism.podsPerReplica: 1``), one pod per replica: :func:`worker_replicas`,
    or ``replicas`` where given (a leak replacement's surge on top of it: ``leak_replacement.surge_replicas``).

    A change of the spec changes the pod template and so rolls the workers; budget
    changes do not (they travel through the ConfigMap).
    """
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, worker_name(owner)),
        "spec": {
            "replicas": worker_replicas(spec) if replicas is None else replicas,
            "selector": {"matchLabels": selector_labels(owner)},
            "template": pod_template(owner, spec),
        },
    }


def build_leader_worker_set(owner: Owner, spec: MoEInferenceServiceSpec) -> Manifest:
    """The worker LeaderWorkerSet (``parallelism.podsPerReplica`` above 1): one group of ``podsPerReplica``
    pods per replica, every pod from :func:`pod_template`; LWS adds the group's labels and the env
    ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``.

    ``RecreateGroupOnPodRestart``: a restart of any pod (an OOM kill, a crash) recreates the whole group, as
    the ranks' process group cannot take a new member (LWS API, ``leaderWorkerTemplate.restartPolicy``).
    ``rolloutStrategy`` RollingUpdate with maxUnavailable 1, LWS's default, made explicit.
    """
    return {
        "apiVersion": c.LWS_API_VERSION,
        "kind": c.LWS_KIND,
        "metadata": _metadata(owner, worker_name(owner)),
        "spec": {
            "replicas": worker_replicas(spec),
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxUnavailable": 1,
                                                                                          "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": spec.parallelism.pods_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod_template(owner, spec),
            },
        },
    }


def build_workload(owner: Owner, spec: MoEInferenceServiceSpec, replicas: int | None = None) -> Manifest:
    """The workers' workload: a LeaderWorkerSet when a replica spans several pods, else a Deployment (of
    ``replicas`` where given: :func:`build_deployment`)."""
    return (build_leader_worker_set(owner, spec) if spec.parallelism.multi_node
            else build_deployment(owner, spec, replicas))


def stale_workload(spec: MoEInferenceServiceSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the workload kind the spec does not use: deleted after a change of
    ``parallelism.podsPerReplica`` across 1 (a Deployment cannot become a LeaderWorkerSet in place)."""
    return ("apps/v1", "Deployment") if spec.parallelism.multi_node else (c.LWS_API_VERSION, c.LWS_KIND)


def workload_pod_spec(manifest: Manifest) -> Manifest:
    """The pod spec inside a Deployment's or a LeaderWorkerSet's manifest (``{}`` where there is none)."""
    spec = manifest.get("spec") or {}
    template = spec.get("template") or ((spec.get("leaderWorkerTemplate") or {}).get("workerTemplate")) or {}
    return dict(template.get("spec") or {})


def dropped_volumes(sent: Manifest, stored: Manifest) -> list[str]:
    """Names of the pod volumes of workload ``sent`` that the API server did not store in ``stored``.

    The API server silently drops a field of a disabled feature: on Kubernetes 1.33-1.34 without the
    ``ImageVolume`` feature gate, an ``image`` volume (and its mounts) vanish from an accepted Deployment.
    """
    def names(manifest: Manifest) -> set[str]:
        return {str(v.get("name")) for v in workload_pod_spec(manifest).get("volumes") or []}

    return sorted(names(sent) - names(stored))


def build_pod_disruption_budget(owner: Owner) -> Manifest:
    """At most one worker pod down at a time through voluntary disruptions (drains)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, worker_name(owner)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}},
    }


def build_pod_monitor(owner: Owner) -> Manifest:
    """A prometheus-operator PodMonitor for the workers' ``/metrics`` (apply only when its CRD exists)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(owner, worker_name(owner)),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner)},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "5s", "honorLabels": True}],
        },
    }


def restart_patch(spec: MoEInferenceServiceSpec, now_iso: str) -> Manifest:
    """The pod-template annotation that makes the workload roll its pods (as ``kubectl rollout restart``): the
    Deployment's template, or the LeaderWorkerSet's worker template (every group is recreated in turn)."""
    template = {"metadata": {"annotations": {RESTARTED_AT_ANNOTATION: now_iso}}}
    if spec.parallelism.multi_node:
        return {"spec": {"leaderWorkerTemplate": {"workerTemplate": template}}}
    return {"spec": {"template": template}}


def build_service(owner: Owner, spec: MoEInferenceServiceSpec) -> Manifest:
    """A ClusterIP Service in front of the workers' HTTP port: every worker pod, or with a LeaderWorkerSet
    only the groups' leaders (LWS worker index 0), the pods that serve HTTP."""
    selector = selector_labels(owner)
    if spec.parallelism.multi_node:
        selector[c.LWS_WORKER_INDEX_LABEL] = "0"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
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


def build_children(owner: Owner, spec: MoEInferenceServiceSpec, replicas: int | None = None) -> list[Manifest]:
    """Every child except the budget ConfigMaps and the optional PodMonitor, in apply order
    (RBAC before the pods that use it); ``replicas``: the Deployment's, where not ``spec.replicas``. With
    ``spec.prefill``, the prefill role's own children first (:func:`prefill_owner`, :func:`prefill_role_spec`):
    the decode pods find its Service when they start."""
    role_children = []
    if spec.prefill is not None and owner.parent is None:
        role_children = build_children(prefill_owner(owner), prefill_role_spec(spec))
    return [
        *role_children,
        build_service_account(owner),
        build_role(owner),
        build_role_binding(owner),
        build_service(owner, spec),
        build_workload(owner, spec, replicas),
        build_pod_disruption_budget(owner),
    ]


def prefill_children(owner: Owner) -> list[tuple[str, str, str]]:
    """``(apiVersion, kind, name)`` of every child of the prefill role of ``owner``'s service: what a spec
    without ``prefill`` deletes, in that order; the ServiceAccount, applied first, is deleted last (while it is
    there, a deletion is due)."""
    p = prefill_owner(owner)
    name = worker_name(p)
    return [("apps/v1", "Deployment", name), ("v1", "Service", p.name), ("policy/v1", "PodDisruptionBudget", name),
            ("v1", "ConfigMap", k.budget_configmap_name(p.name)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", name), ("rbac.authorization.k8s.io/v1", "Role", name),
            ("v1", "ServiceAccount", name)]
