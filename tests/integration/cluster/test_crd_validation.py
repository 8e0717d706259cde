"""Hostile and edge specs against the real API server: a spec it accepts must deploy, so what the
worker pods' Deployment would refuse is refused at ``kubectl apply`` (core/v1 schemas + CEL)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from harness import stack
from harness.stack import ROOT
from tests.integration.conftest import Cluster

from moeguard_operator.children.builders import Owner, build_children, dropped_volumes
from moeguard_operator.spec.models import MoEInferenceServiceSpec


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    stack.wait_established("moeinferenceservices.moeguard.dev", run_dir=cluster.run_dir)


def _apply(cluster: Cluster, namespace: str, name: str, spec: dict[str, Any]) -> tuple[bool, str]:
    obj = {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
           "metadata": {"name": name, "namespace": namespace}, "spec": {"resources": {"gpus": 0}, **spec}}
    res = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)
    return res.returncode == 0, res.stderr


PVC = {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}

REFUSED = [
    ("autoscaling-min-above-max", {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    ("autoscaling-without-max", {"autoscaling": {"minReplicas": 1}}, "spec.autoscaling.maxReplicas: Required value"),
    ("affinity-not-an-object", {"template": {"affinity": {"nodeAffinity": "everywhere"}}},
     "spec.template.affinity.nodeAffinity: Invalid value: \"string\""),
    ("toleration-exists-with-value", {"template": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
     "a toleration with operator Exists must not have a value"),
    ("toleration-seconds-without-noexecute",
     {"template": {"tolerations": [{"key": "k", "value": "v", "effect": "NoSchedule", "tolerationSeconds": 5}]}},
     "tolerationSeconds is only for effect NoExecute"),
    ("toleration-bad-key", {"template": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}},
     "a toleration key must be a qualified name"),
    ("node-selector-bad-key", {"template": {"nodeSelector": {"bad key!": "x"}}},
     "template.nodeSelector keys must be label keys"),
    ("node-selector-bad-value", {"template": {"nodeSelector": {"gpu": "a b"}}},
     "template.nodeSelector values must be label values"),
    ("volume-named-like-the-operators", {"template": {"volumes": [{"name": "tmp", "emptyDir": {}}]}},
     "the names tmp, moeguard-model are the operator's"),
    ("mount-at-the-operators-path", {"template": {"volumes": [PVC], "volumeMounts": [{"name": "models", "mountPath": "/tmp/x"}]}},
     "/tmp and /moeguard/model are where the operator mounts its own volumes"),
    ("mount-of-an-undefined-volume", {"template": {"volumeMounts": [{"name": "nope", "mountPath": "/m"}]}},
     "template.volumeMounts must name a volume of template.volumes"),
    ("host-path-volume", {"template": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}},
     "template.volumes: volume host is of a type that is not allowed"),
    ("nfs-volume", {"template": {"volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}},
     "volume n is of a type that is not allowed"),
    ("gpu-resource-memory", {"resources": {"gpus": 1, "gpuResourceName": "memory"}},
     "resources.gpuResourceName must be an extended resource"),
    ("gpu-resource-hugepages", {"resources": {"gpus": 1, "gpuResourceName": "hugepages-2Mi"}},
     "resources.gpuResourceName must be an extended resource"),
    ("env-value-and-value-from",
     {"template": {"extraEnv": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}},
     "set value or valueFrom, not both"),
    ("env-reserved", {"template": {"extraEnv": [{"name": "MOEGUARD_SEED", "value": "1"}]}},
     "must not set MOEGUARD_* or UCX_*"),
    ("annotation-bad-key", {"template": {"annotations": {"a b": "x"}}},
     "template.annotations keys must be qualified names"),
    ("leak-horizon-below-a-minute", {"control": {"leakHorizonSeconds": 30}},
     "spec.control.leakHorizonSeconds: Invalid value: 30"),
    ("leak-horizon-above-a-week", {"control": {"leakHorizonSeconds": 604_801}},
     "spec.control.leakHorizonSeconds: Invalid value: 604801"),
    ("model-source-two-kinds", {"model": {"source": {"persistentVolumeClaim": {"claimName": "m"},
                                                     "image": {"reference": "r/m:1"}}}},
     "model.source must set exactly one of persistentVolumeClaim, hostPath, image"),
    ("model-source-no-kind", {"model": {"source": {"subPath": "m"}}}, "model.source must set exactly one of"),
    ("model-source-and-checkpoint-path",
     {"model": {"source": {"persistentVolumeClaim": {"claimName": "m"}}, "checkpointPath": "/m"}},
     "model.source and model.checkpointPath are exclusive"),
    ("model-source-sub-path-up", {"model": {"source": {"persistentVolumeClaim": {"claimName": "m"},
                                                       "subPath": "a/../.."}}},
     "spec.model.source.subPath: Invalid value"),
    ("model-source-host-root", {"model": {"source": {"hostPath": {"path": "/"}}}},
     "spec.model.source.hostPath.path: Invalid value"),
    ("served-model-name-with-space", {"model": {"servedModelName": "my model"}},
     "spec.model.servedModelName: Invalid value"),
    ("volume-named-like-the-model-volume", {"template": {"volumes": [{"name": "moeguard-model", "emptyDir": {}}]}},
     "the names tmp, moeguard-model are the operator's"),
    ("mount-at-the-model-path", {"template": {"volumes": [PVC], "volumeMounts": [{"name": "models",
                                                                                   "mountPath": "/moeguard/model"}]}},
     "/tmp and /moeguard/model are where the operator mounts its own volumes"),
    ("mount-of-the-model-volume", {"template": {"volumeMounts": [{"name": "moeguard-model", "mountPath": "/m"}]}},
     "template.volumeMounts must name a volume of template.volumes"),
    ("ranks-not-divisible-by-pods", {"parallelism": {"expertParallelSize": 4, "podsPerReplica": 3}},
     "parallelism.expertParallelSize must be divisible by parallelism.podsPerReplica"),
    ("experts-not-divisible-by-ranks", {"parallelism": {"expertParallelSize": 3, "podsPerReplica": 3},
                                        "model": {"overrides": {"numExperts": 8}}},
     "model.overrides.numExperts must be divisible by parallelism.expertParallelSize"),
    ("gpus-not-one-per-rank", {"parallelism": {"expertParallelSize": 2, "podsPerReplica": 2},
                               "resources": {"gpus": 2}},
     "resources.gpus must equal parallelism.expertParallelSize / parallelism.podsPerReplica"),
    ("gpus-not-the-ranks-per-pod", {"parallelism": {"expertParallelSize": 8, "podsPerReplica": 2},
                                    "resources": {"gpus": 2}},
     "resources.gpus must equal parallelism.expertParallelSize / parallelism.podsPerReplica"),
    ("pods-per-replica-zero", {"parallelism": {"podsPerReplica": 0}}, "spec.parallelism.podsPerReplica: Invalid value"),
    # Issue 33: the prefill role
    ("prefill-on-multi-node-replicas", {"prefill": {}, "parallelism": {"expertParallelSize": 2, "podsPerReplica": 2},
                                        "resources": {"gpus": 1}},
     "prefill needs parallelism.podsPerReplica 1"),
    ("prefill-replicas-zero", {"prefill": {"replicas": 0}}, "spec.prefill.replicas: Invalid value"),
    ("prefill-read-timeout-zero", {"prefill": {"kvTransferTimeoutSeconds": 0}},
     "spec.prefill.kvTransferTimeoutSeconds: Invalid value"),
    # Issue 29, item 5: refused at apply, naming the field, not stored and refused later by the operator or the pod.
    ("image-with-whitespace", {"image": "repo/img: tag"},
     "spec.image: Invalid value: \"string\": image: repo/img: tag is not an image reference"),
    ("image-upper-case-path", {"image": "registry.example/Team/worker:1"},
     "image: registry.example/Team/worker:1 is not an image reference"),
    ("ucx-env-key-with-equals", {"ucx": {"extraEnv": {"UCX_TLS": "rc", "UCX_A=B": "1"}}},
     "spec.ucx.extraEnv: Invalid value: \"object\": ucx.extraEnv keys must be letters, digits, -, . and _"),
    ("env-name-with-equals", {"template": {"extraEnv": [{"name": "HF_HOME", "value": "/c"}, {"name": "A=B", "value": "1"}]}},
     "spec.template.extraEnv[1].name: Invalid value: \"object\": template.extraEnv: A=B is not a variable name"),
    ("second-mount-of-an-undefined-volume", {"template": {"volumes": [PVC], "volumeMounts": [
        {"name": "models", "mountPath": "/models"}, {"name": "nope", "mountPath": "/m"}]}},
     "spec.template.volumeMounts: Invalid value: \"object\": template.volumeMounts must name a volume of template.volumes"),
    ("slo-batch-ttft-tighter", {"slo": {"interactive": {"ttftSeconds": 5}, "batch": {"ttftSeconds": 2}}},
     "slo.batch.ttftSeconds must be >= slo.interactive.ttftSeconds"),
    ("slo-batch-tpot-tighter-than-the-interactive-default", {"slo": {"batch": {"tpotSeconds": 0.1}}},
     "slo.batch.tpotSeconds must be >= slo.interactive.tpotSeconds"),
    ("slo-ttft-zero", {"slo": {"interactive": {"ttftSeconds": 0}}}, "spec.slo.interactive.ttftSeconds: Invalid value"),
    ("slo-attainment-above-one", {"slo": {"interactive": {"attainment": 1.5}}},
     "spec.slo.interactive.attainment: Invalid value"),
    ("slo-min-requests-zero", {"slo": {"minRequests": 0}}, "spec.slo.minRequests: Invalid value"),
]


@pytest.mark.parametrize(("case", "spec", "needle"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_at_apply_naming_the_field(cluster: Cluster, namespace: str, crd: None, case: str,
                                           spec: dict[str, Any], needle: str) -> None:
    ok, err = _apply(cluster, namespace, case, spec)
    assert not ok, f"{case} was accepted"
    assert needle in err, err


@pytest.mark.parametrize("name", ["9-moe", "x08.moe", "Upper", "a" * 64])
def test_names_that_cannot_name_a_service_are_refused(cluster: Cluster, namespace: str, crd: None,
                                                      name: str) -> None:
    ok, err = _apply(cluster, namespace, name, {})
    assert not ok and "metadata.name must be a DNS-1035 label" in err, err


ACCEPTED: dict[str, Any] = {
    "template": {
        "nodeSelector": {"node.kubernetes.io/instance-type": "gpu-1", "pool": "a_b.c-d"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "maintenance", "value": "x", "effect": "NoExecute", "tolerationSeconds": 30},
                        {"operator": "Exists"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]}]}}},
        "volumes": [PVC, {"name": "cfg", "configMap": {"name": "c"}}, {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                    {"name": "weights", "image": {"reference": "registry.example/weights:1", "pullPolicy": "IfNotPresent"}},
                    {"name": "token", "secret": {"secretName": "hf"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}, {"name": "weights", "mountPath": "/weights"},
                         {"name": "scratch", "mountPath": "/scratch", "readOnly": False}],
        "extraEnv": [{"name": "HF_HOME", "value": "/scratch"},
                     {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                     {"name": "spring.profiles-active", "value": "gpu"}],
        "annotations": {"example.com/team": "ml 😀"},
    },
    "image": "registry.example:5000/team/moe_worker:1.2-cpu@sha256:" + "0a" * 32,
    "ucx": {"extraEnv": {"UCX_CUDA_IPC_CACHE": "n", "UCX_TLS": "rc,cuda_copy"}},
}


def test_a_full_valid_template_is_accepted_and_its_deployment_too(cluster: Cluster, namespace: str,
                                                                   crd: None) -> None:
    ok, err = _apply(cluster, namespace, "full", ACCEPTED)
    assert ok, err
    spec = MoEInferenceServiceSpec.model_validate({"resources": {"gpus": 0}, **ACCEPTED})
    deployment = next(m for m in build_children(Owner("full", namespace, "uid-1"), spec) if m["kind"] == "Deployment")
    res = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(deployment, ensure_ascii=False),
                          check=False)
    assert res.returncode == 0, res.stderr
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
    # the user's mounts are read-only unless they say otherwise; the operator's /tmp is writable
    assert mounts == {"/tmp": False, "/models": True, "/weights": True, "/scratch": False}


MODEL_SOURCES = {
    "pvc": {"persistentVolumeClaim": {"claimName": "qwen3"}, "subPath": "hub/Qwen3-30B-A3B"},
    "host-path": {"hostPath": {"path": "/srv/models/qwen3"}},
    "image": {"image": {"reference": "registry.example.com/models/qwen3:1", "pullPolicy": "IfNotPresent"}},
}


@pytest.mark.parametrize("kind", sorted(MODEL_SOURCES))
def test_each_model_source_is_accepted_and_its_deployment_too(cluster: Cluster, namespace: str, crd: None,
                                                              kind: str) -> None:
    spec = {"model": {"source": MODEL_SOURCES[kind], "servedModelName": "Qwen/Qwen3-30B-A3B",
                      "weightBytes": "1Gi"},
            "resources": {"gpus": 0, "softLimit": "2Gi", "hardLimit": "4Gi"}}
    ok, err = _apply(cluster, namespace, f"source-{kind}", spec)
    assert ok, err
    parsed = MoEInferenceServiceSpec.model_validate(spec)
    deployment = next(m for m in build_children(Owner("m", namespace, "uid-1"), parsed) if m["kind"] == "Deployment")
    res = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(deployment),
                          check=False)
    assert res.returncode == 0, res.stderr
    stored = json.loads(res.stdout)
    pod = stored["spec"]["template"]["spec"]
    if kind == "image":
        # This API server (1.34, ImageVolume feature gate off as by default) accepts the Deployment and
        # silently drops the image volume and its mount: the operator compares what it sent with what was
        # stored and reports VolumeDropped (handlers.apply_children) instead of starting workers without
        # their weights.
        assert dropped_volumes(deployment, stored) == ["moeguard-model"]
        assert [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]] == ["/tmp"]
        return
    assert dropped_volumes(deployment, stored) == []
    model = next(v for v in pod["volumes"] if v["name"] == "moeguard-model")
    # what the API server kept (a disabled feature's field would be dropped here)
    assert {k: v for k, v in model.items() if k != "name"} == {
        "pvc": {"persistentVolumeClaim": {"claimName": "qwen3", "readOnly": True}},
        "host-path": {"hostPath": {"path": "/srv/models/qwen3", "type": "Directory"}},
        "image": {"image": {"reference": "registry.example.com/models/qwen3:1", "pullPolicy": "IfNotPresent"}},
    }[kind]
    container = pod["containers"][0]
    assert {"name": "moeguard-model", "mountPath": "/moeguard/model", "readOnly": True} in container["volumeMounts"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MOEGUARD_CHECKPOINT_PATH"] == ("/moeguard/model/hub/Qwen3-30B-A3B" if kind == "pvc"
                                               else "/moeguard/model")
    assert env["MOEGUARD_SERVED_MODEL_NAME"] == "Qwen/Qwen3-30B-A3B"


def test_slo_defaults_are_filled_by_the_api_server_per_class(cluster: Cluster, namespace: str, crd: None) -> None:
    """Issue 30: an unset ``spec.slo`` and a class given in part both come back whole, each class with its own
    defaults (interactive TTFT 3 s / TPOT 0.25 s, batch 30 s / 1 s), as the operator's models default them."""
    for name, given in (("slo-unset", {}), ("slo-part", {"slo": {"interactive": {"ttftSeconds": 2.0}}})):
        obj = {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
               "metadata": {"name": name, "namespace": namespace}, "spec": {"resources": {"gpus": 0}, **given}}
        res = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj))
        stored = json.loads(res.stdout)["spec"]["slo"]
        expected = MoEInferenceServiceSpec.model_validate(given).slo.model_dump(by_alias=True)
        assert stored == expected, stored
    assert stored["interactive"] == {"ttftSeconds": 2.0, "tpotSeconds": 0.25, "attainment": 0.9}
    assert stored["batch"] == {"ttftSeconds": 30.0, "tpotSeconds": 1.0, "attainment": 0.9}
