"""spec.parallelism: the multi-node replica (LeaderWorkerSet) the operator renders, its checks and its status."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from moeguard_core import contract
from moeguard_operator import constants as c
from moeguard_operator.children.apply_errors import spec_field
from moeguard_operator.children.builders import (
    Owner,
    build_children,
    build_service,
    restart_patch,
    stale_workload,
    workload_pod_spec,
)
from moeguard_operator.loop.tick import replica_readiness
from moeguard_operator.spec.models import MoEInferenceServiceSpec
from moeguard_operator.spec.spec_checks import SpecError, parse_spec

OWNER = Owner("big", "ns", "uid-1")
EP = {"parallelism": {"expertParallelSize": 2, "podsPerReplica": 2}, "resources": {"gpus": 1}, "replicas": 2}


def _spec(body: dict[str, Any]) -> MoEInferenceServiceSpec:
    return MoEInferenceServiceSpec.model_validate(body)


def _env(pod_spec: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod_spec["containers"][0]["env"]}


def test_one_pod_per_replica_stays_a_deployment_with_no_ep_env() -> None:
    kinds = [m["kind"] for m in build_children(OWNER, _spec({}))]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Service", "Deployment", "PodDisruptionBudget"]
    pod = next(m for m in build_children(OWNER, _spec({})) if m["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert contract.ENV_EXPERT_PARALLEL_SIZE not in _env(pod)
    assert [p["name"] for p in pod["containers"][0]["ports"]] == ["http"]
    assert stale_workload(_spec({})) == (c.LWS_API_VERSION, c.LWS_KIND)


def test_several_pods_per_replica_become_a_leader_worker_set_with_the_same_pod() -> None:
    spec = _spec(EP)
    children = build_children(OWNER, spec)
    assert [m["kind"] for m in children] == ["ServiceAccount", "Role", "RoleBinding", "Service", "LeaderWorkerSet",
                                             "PodDisruptionBudget"]
    lws = children[4]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"] == "big-worker"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert lws["spec"]["replicas"] == 2  # groups
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    pod = workload_pod_spec(lws)
    single = workload_pod_spec(next(m for m in build_children(OWNER, _spec({"resources": {"gpus": 1}}))
                                    if m["kind"] == "Deployment"))
    # the same pod as a Deployment's, plus the EP env and the rendezvous port
    env, single_env = _env(pod), _env(single)
    assert {k: v for k, v in env.items() if k not in single_env} == {
        contract.ENV_EXPERT_PARALLEL_SIZE: "2", contract.ENV_EP_PORT: str(contract.DEFAULT_EP_PORT)}
    assert [p["name"] for p in pod["containers"][0]["ports"]] == ["http", "ep"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one GPU per rank
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == "big-worker"
    assert template["workerTemplate"]["metadata"]["labels"][c.LABEL_INSTANCE] == "big"
    assert stale_workload(spec) == ("apps/v1", "Deployment")


def test_the_service_selects_the_leaders_only() -> None:
    selector = build_service(OWNER, _spec(EP))["spec"]["selector"]
    assert selector == {c.LABEL_NAME: c.WORKER_NAME, c.LABEL_INSTANCE: "big", c.LWS_WORKER_INDEX_LABEL: "0"}
    assert c.LWS_WORKER_INDEX_LABEL not in build_service(OWNER, _spec({}))["spec"]["selector"]


def test_a_rolling_restart_patches_the_template_of_the_workload_in_use() -> None:
    assert restart_patch(_spec(EP), "t") == {"spec": {"leaderWorkerTemplate": {"workerTemplate": {
        "metadata": {"annotations": {"moeguard.dev/restartedAt": "t"}}}}}}
    assert restart_patch(_spec({}), "t") == {"spec": {"template": {
        "metadata": {"annotations": {"moeguard.dev/restartedAt": "t"}}}}}


@pytest.mark.parametrize(("body", "needle"), [
    ({"parallelism": {"expertParallelSize": 4, "podsPerReplica": 3}},
     "parallelism.expertParallelSize (4) must be divisible by parallelism.podsPerReplica (3)"),
    ({"parallelism": {"expertParallelSize": 2, "podsPerReplica": 2}, "resources": {"gpus": 2}},
     "resources.gpus (2) must equal parallelism.expertParallelSize / parallelism.podsPerReplica (1)"),
    ({"parallelism": {"expertParallelSize": 3, "podsPerReplica": 3}, "resources": {"gpus": 1},
      "model": {"overrides": {"numExperts": 8}}},
     "model.overrides.numExperts (8) must be divisible by parallelism.expertParallelSize (3)"),
])
def test_inconsistent_parallelism_is_refused_naming_the_fields(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _spec(body)


def test_several_ranks_in_one_pod_are_a_deployment_with_the_env_of_a_group_of_one() -> None:
    spec = _spec({"parallelism": {"expertParallelSize": 8, "podsPerReplica": 1}, "resources": {"gpus": 8}})
    workload = next(m for m in build_children(OWNER, spec) if m["kind"] in ("Deployment", "LeaderWorkerSet"))
    assert workload["kind"] == "Deployment"
    env = _env(workload_pod_spec(workload))
    assert {name: env[name] for name in (contract.ENV_EXPERT_PARALLEL_SIZE, contract.ENV_LWS_LEADER_ADDRESS,
                                         contract.ENV_LWS_GROUP_SIZE, contract.ENV_LWS_WORKER_INDEX)} == {
        contract.ENV_EXPERT_PARALLEL_SIZE: "8", contract.ENV_LWS_LEADER_ADDRESS: "127.0.0.1",
        contract.ENV_LWS_GROUP_SIZE: "1", contract.ENV_LWS_WORKER_INDEX: "0"}
    # in a LeaderWorkerSet these come from LWS's webhook, never from the operator
    lws = next(m for m in build_children(OWNER, _spec(EP)) if m["kind"] == "LeaderWorkerSet")
    assert contract.ENV_LWS_LEADER_ADDRESS not in _env(workload_pod_spec(lws))
    assert _spec({"parallelism": {"expertParallelSize": 8, "podsPerReplica": 2},
                  "resources": {"gpus": 4}}).parallelism.ranks_per_pod == 4


def test_gpus_are_free_without_expert_parallelism_and_cpu_ranks_are_allowed() -> None:
    assert _spec({"resources": {"gpus": 4}}).parallelism.ranks_per_pod == 1
    assert _spec({"parallelism": {"expertParallelSize": 4, "podsPerReplica": 2},
                  "resources": {"gpus": 0}}).parallelism.ranks_per_pod == 2


def test_a_preset_whose_experts_do_not_split_over_the_ranks_is_refused_at_reconcile() -> None:
    # the tiny preset has 8 experts: 8 ranks split them, 16 do not
    parse_spec({"parallelism": {"expertParallelSize": 8, "podsPerReplica": 8}, "resources": {"gpus": 1}})
    with pytest.raises(SpecError) as err:
        parse_spec({"parallelism": {"expertParallelSize": 16, "podsPerReplica": 16}, "resources": {"gpus": 1}})
    assert err.value.reason == "InvalidSpec"
    assert "expertParallelSize (16) must divide the model's expert count (8, preset tiny)" in str(err.value)


def _pod(name: str, group: int, index: int, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {c.LWS_GROUP_INDEX_LABEL: str(group),
                                                     c.LWS_WORKER_INDEX_LABEL: str(index)}}
    if deleting:
        meta["deletionTimestamp"] = datetime(2026, 1, 1, tzinfo=UTC).isoformat()
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_groups_are_ready_when_every_pod_is_and_ranks_are_counted_per_group() -> None:
    spec = _spec(EP)
    pods = [_pod("big-worker-0", 0, 0, True), _pod("big-worker-0-1", 0, 1, True),
            _pod("big-worker-1", 1, 0, True), _pod("big-worker-1-1", 1, 1, False)]
    ready, groups = replica_readiness(pods, spec)
    assert ready == 1
    assert groups is not None
    assert [(g.index, g.leader, g.ready_pods, g.ready_ranks, g.ranks) for g in groups] == [
        (0, "big-worker-0", 2, 2, 2), (1, "big-worker-1", 1, 1, 2)]
    # a group being recreated (its pods deleting) is not ready; a group with no pod yet is listed empty
    pods = [_pod("big-worker-0", 0, 0, True, deleting=True), _pod("big-worker-0-1", 0, 1, True, deleting=True)]
    ready, groups = replica_readiness(pods, spec)
    assert ready == 0 and groups is not None
    assert [(g.index, g.leader, g.ready_pods) for g in groups] == [(0, None, 0), (1, None, 0)]


def test_single_pod_replicas_have_no_groups() -> None:
    assert replica_readiness([_pod("x", 0, 0, True)], _spec({})) == (1, None)


def test_a_refusal_inside_the_leader_worker_set_template_names_the_spec_field() -> None:
    message = ('LeaderWorkerSet.leaderworkerset.x-k8s.io "big-worker" is invalid: '
               "spec.leaderWorkerTemplate.workerTemplate.spec.tolerations[0].key: Invalid value")
    assert spec_field(message) == "spec.template.tolerations"


def test_the_weights_check_counts_each_pods_share_of_the_experts() -> None:
    # 400 GiB of weights: 8 ranks hold at least 50 GiB each, so a 64 GiB pod passes and a 48 GiB pod cannot
    body: dict[str, Any] = {"model": {"weightBytes": "400Gi"}, "resources": {"gpus": 1, "softLimit": "40Gi"},
                            "parallelism": {"expertParallelSize": 8, "podsPerReplica": 8}}
    parse_spec({**body, "resources": {**body["resources"], "hardLimit": "64Gi"}})
    with pytest.raises(SpecError, match=r"below the model's weights alone \(50.00 GiB, spec.model.weightBytes / 8 "
                                        "ranks"):
        parse_spec({**body, "resources": {**body["resources"], "hardLimit": "48Gi"}})
