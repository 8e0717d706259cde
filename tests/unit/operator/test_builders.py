from __future__ import annotations

import pytest
from pydantic import ValidationError

from moeguard_core.contract import BudgetDocument, Budgets, parse_budget_configmap_data
from moeguard_operator.children.builders import (
    Owner,
    build_budget_configmap,
    build_children,
    build_deployment,
    build_role,
    ucx_env,
)
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

OWNER = Owner(name="mixtral", namespace="serving", uid="1234-abcd")


def _env(dep: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "<from>") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_deployment_limits_and_env() -> None:
    spec = MoEInferenceServiceSpec.model_validate(
        {"replicas": 3, "resources": {"gpus": 2, "softLimit": "12Gi", "hardLimit": "16Gi"},
         "batching": {"maxPrefillTokens": 2048}}
    )
    dep = build_deployment(OWNER, spec)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 3
    assert container["resources"]["limits"] == {"memory": "16Gi", "cpu": "2", "nvidia.com/gpu": "2"}
    env = _env(dep)
    assert env["MOEGUARD_SOFT_LIMIT_BYTES"] == str(12 * 2**30)
    assert env["MOEGUARD_HARD_LIMIT_BYTES"] == str(16 * 2**30)
    assert "MOEGUARD_MAX_PREFILL_TOKENS" not in env  # budgets travel in the ConfigMap alone
    assert env["UCX_MEM_MMAP_HOOK_MODE"] == "none"
    assert env["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
    assert env["MOEGUARD_BUDGET_CONFIGMAP"] == "mixtral-budget"
    assert env["MOEGUARD_POD_NAME"] == "<from>"


@pytest.mark.parametrize(("ucx", "expected"), [
    ({}, {"UCX_MEM_MMAP_HOOK_MODE": "none", "UCX_RCACHE_MAX_UNRELEASED": "1024"}),
    ({"mode": "rcache", "rcacheMaxUnreleased": 4096}, {"UCX_RCACHE_MAX_UNRELEASED": "4096"}),
    ({"mode": "passthrough", "extraEnv": {"UCX_CUDA_IPC_CACHE": "n"}}, {"UCX_CUDA_IPC_CACHE": "n"}),
])
def test_ucx_modes(ucx: dict, expected: dict) -> None:
    env = _env(build_deployment(OWNER, MoEInferenceServiceSpec.model_validate({"ucx": ucx})))
    assert {k: v for k, v in env.items() if k.startswith("UCX_")} == expected


def test_pod_template_extras_and_gpu_type() -> None:
    spec = MoEInferenceServiceSpec.model_validate({
        "image": "registry.local/worker:1", "imagePullPolicy": "Always",
        "resources": {"gpus": 1, "gpuResourceName": "nvidia.com/mig-1g.10gb", "gpuProduct": "NVIDIA-H100-80GB-HBM3", "cpu": "4"},
        "model": {"checkpointPath": "/models/mixtral", "overrides": {"nLayer": 4, "topK": 1}},
        "template": {"nodeSelector": {"pool": "gpu"}, "priorityClassName": "inference",
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "affinity": {"nodeAffinity": {"x": 1}}, "extraEnv": [{"name": "HF_HOME", "value": "/cache"}],
                     "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                     "volumeMounts": [{"name": "models", "mountPath": "/models"}], "annotations": {"a": "b"}},
    })
    dep = build_deployment(OWNER, spec)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.local/worker:1" and c["imagePullPolicy"] == "Always"
    assert c["resources"]["limits"] == {"memory": "8Gi", "cpu": "4", "nvidia.com/mig-1g.10gb": "1"}
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}} and pod["priorityClassName"] == "inference"
    assert pod["volumes"][1] == {"name": "models", "persistentVolumeClaim": {"claimName": "models"}}
    assert c["volumeMounts"][1] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert dep["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}
    env = _env(dep)
    assert env["HF_HOME"] == "/cache" and env["MOEGUARD_CHECKPOINT_PATH"] == "/models/mixtral"
    assert env["MOEGUARD_MODEL_OVERRIDES"] == '{"n_layer": 4, "top_k": 1}'
    assert env["MOEGUARD_OVERLOAD_MODE"] == "Auto" and "MOEGUARD_QUEUE_TIMEOUT_SECONDS" not in env


def test_restricted_pod_security() -> None:
    pod = build_deployment(OWNER, MoEInferenceServiceSpec())["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_every_child_is_owned_and_labelled() -> None:
    children = build_children(OWNER, MoEInferenceServiceSpec())
    assert [m["kind"] for m in children] == ["ServiceAccount", "Role", "RoleBinding", "Service", "Deployment",
                                             "PodDisruptionBudget"]
    for m in children:
        ref = m["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "1234-abcd" and ref["kind"] == "MoEInferenceService" and ref["controller"] is True
        assert m["metadata"]["labels"]["app.kubernetes.io/instance"] == "mixtral"
        assert m["metadata"]["namespace"] == "serving"


def test_role_reads_only_its_configmap() -> None:
    (rule,) = build_role(OWNER)["rules"]
    assert rule == {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["mixtral-budget"],
                    "verbs": ["get", "list", "watch"]}


def test_budget_configmap_round_trips_through_the_contract() -> None:
    budgets = Budgets(max_prefill_tokens=1024, max_decode_tokens=64, max_batch_requests=8, max_concurrent_batches=1)
    cm = build_budget_configmap(OWNER, BudgetDocument(generation=7, budgets=budgets, reason="test"))
    parsed = parse_budget_configmap_data(cm["data"])
    assert parsed.generation == 7 and parsed.budgets == budgets and parsed.reason == "test"


def test_ucx_mode_defaults_to_rcache_only_on_amd_gpus() -> None:
    """ROCm: UCX_MEM_MMAP_HOOK_MODE=none breaks NIXL there (vLLM PR #32570, NIXL PR #1210)."""
    nvidia = MoEInferenceServiceSpec.model_validate({})
    amd = MoEInferenceServiceSpec.model_validate({"resources": {"gpuResourceName": "amd.com/gpu"}})
    forced = MoEInferenceServiceSpec.model_validate({"resources": {"gpuResourceName": "amd.com/gpu"},
                                                     "ucx": {"mode": "none"}})
    assert ucx_env(nvidia) == {"UCX_MEM_MMAP_HOOK_MODE": "none", "UCX_RCACHE_MAX_UNRELEASED": "1024"}
    assert ucx_env(amd) == {"UCX_RCACHE_MAX_UNRELEASED": "1024"}
    assert ucx_env(forced) == {"UCX_MEM_MMAP_HOOK_MODE": "none", "UCX_RCACHE_MAX_UNRELEASED": "1024"}


def test_gpu_resource_name_cannot_be_a_core_resource() -> None:
    for name in ("memory", "cpu", "ephemeral-storage", "hugepages-1Gi"):
        with pytest.raises(ValidationError, match="must be an extended resource"):
            MoEInferenceServiceSpec.model_validate({"resources": {"gpuResourceName": name}})


LIVE_CHANGES = {  # spec changes that reach the workers through the budget ConfigMap, or not at all
    "budgets": {"batching": {"maxPrefillTokens": 1024, "maxDecodeTokens": 32, "maxBatchRequests": 8,
                             "maxLongRequestsPerBatch": 2, "maxConcurrentBatches": 1, "maxQueueRequests": 10,
                             "queueTimeoutSeconds": 5}},
    "floors and ceilings": {"batching": {"floors": {"maxPrefillTokens": 128},
                                         "ceilings": {"maxPrefillTokens": 8192}}},
    "overload context cap": {"overload": {"maxContextTokens": 512}},
    "overload thresholds": {"overload": {"rejectionRatePerSecond": 9, "p99LatencySeconds": 99}},
    "control": {"control": {"skewThreshold": 9, "queryIntervalSeconds": 3, "cooldownSeconds": 1,
                            "leakHorizonSeconds": 600, "leakAction": "Restart", "prometheusUrl": "http://p:9090"}},
}


@pytest.mark.parametrize("change", list(LIVE_CHANGES.values()), ids=list(LIVE_CHANGES))
def test_changes_that_apply_live_leave_the_pod_template_alone(change: dict) -> None:
    """Only image, resources, model, parallelism (and the pod-template extras, UCX, and the static
    knobs a worker reads at start) may change the pod template: anything else would roll every worker."""
    base = build_deployment(OWNER, MoEInferenceServiceSpec())["spec"]["template"]
    changed = build_deployment(OWNER, MoEInferenceServiceSpec.model_validate(change))["spec"]["template"]
    assert changed == base
