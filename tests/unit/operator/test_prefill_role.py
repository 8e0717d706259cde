"""The children of a service with ``spec.prefill`` (disaggregated prefill/decode, issue 33 §1): the prefill role's
own Deployment, Service, PDB, RBAC and budget ConfigMap, its env, and the decode pods' env; a spec without it
renders exactly as before."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from moeguard_core import contract
from moeguard_operator import constants as c
from moeguard_operator.children.builders import (
    Owner,
    build_children,
    prefill_children,
    prefill_role_spec,
)
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

OWNER = Owner(name="mixtral", namespace="serving", uid="1234-abcd")


def _env(dep: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "<from>") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def _by(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


SPEC = {"replicas": 3, "resources": {"gpus": 1, "hardLimit": "16Gi", "softLimit": "12Gi"},
        "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64},
        "prefill": {"replicas": 2, "resources": {"gpus": 1, "hardLimit": "24Gi", "softLimit": "20Gi"},
                    "batching": {"maxPrefillTokens": 8192, "maxDecodeTokens": 16},
                    "ucx": {"mode": "rcache", "rcacheMaxUnreleased": 2048},
                    "kvTransferTimeoutSeconds": 2.5, "kvLeaseSeconds": 20}}


def test_both_roles_are_rendered_with_their_own_replicas_resources_and_ucx() -> None:
    spec = MoEInferenceServiceSpec.model_validate(SPEC)
    got = _by(build_children(OWNER, spec))
    assert set(got) == {(kind, name) for name in ("mixtral-worker", "mixtral-prefill-worker")
                        for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget")
                        } | {("Service", "mixtral"), ("Service", "mixtral-prefill")}
    decode, prefill = got[("Deployment", "mixtral-worker")], got[("Deployment", "mixtral-prefill-worker")]
    assert (decode["spec"]["replicas"], prefill["spec"]["replicas"]) == (3, 2)
    limits = [d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] for d in (decode, prefill)]
    assert limits == ["16Gi", "24Gi"]
    d_env, p_env = _env(decode), _env(prefill)
    assert d_env[contract.ENV_ROLE] == "decode" and p_env[contract.ENV_ROLE] == "prefill"
    assert d_env[contract.ENV_PREFILL_URL] == "http://mixtral-prefill:8000"
    assert d_env[contract.ENV_KV_TRANSFER_TIMEOUT_SECONDS] == "2.5"
    assert contract.ENV_PREFILL_URL not in p_env and p_env[contract.ENV_KV_LEASE_SECONDS] == "20"
    # UCX per role: the decode pods keep the service's (none), the prefill pods their own (rcache)
    assert (d_env[contract.UCX_MEM_MMAP_HOOK_MODE], d_env[contract.UCX_RCACHE_MAX_UNRELEASED]) == ("none", "1024")
    assert contract.UCX_MEM_MMAP_HOOK_MODE not in p_env and p_env[contract.UCX_RCACHE_MAX_UNRELEASED] == "2048"
    assert p_env[contract.ENV_BUDGET_CONFIGMAP] == "mixtral-prefill-budget"
    assert p_env[contract.ENV_SERVICE_NAME] == "mixtral-prefill"  # its metrics: a series set of its own
    # the prefill pods' memory limits come from their own resources
    assert p_env[contract.ENV_HARD_LIMIT_BYTES] == str(24 * 2**30)


def test_the_roles_select_disjoint_pods_and_clients_reach_the_decode_pods() -> None:
    spec = MoEInferenceServiceSpec.model_validate(SPEC)
    got = _by(build_children(OWNER, spec))
    decode, prefill = got[("Deployment", "mixtral-worker")], got[("Deployment", "mixtral-prefill-worker")]
    d_sel, p_sel = decode["spec"]["selector"]["matchLabels"], prefill["spec"]["selector"]["matchLabels"]
    d_pod, p_pod = (d["spec"]["template"]["metadata"]["labels"] for d in (decode, prefill))
    assert not set(d_sel.items()) <= set(p_pod.items()) and not set(p_sel.items()) <= set(d_pod.items())
    assert got[("Service", "mixtral")]["spec"]["selector"] == d_sel  # what clients call
    assert got[("Service", "mixtral-prefill")]["spec"]["selector"] == p_sel
    assert p_pod[c.ROLE_LABEL] == "prefill"
    for m in got.values():  # every child, both roles, owned by the service itself
        assert m["metadata"]["ownerReferences"][0]["name"] == "mixtral"
    role = got[("Role", "mixtral-prefill-worker")]
    assert role["rules"][0]["resourceNames"] == ["mixtral-prefill-budget"]
    pdb = got[("PodDisruptionBudget", "mixtral-prefill-worker")]
    assert pdb["spec"]["selector"]["matchLabels"] == p_sel


def test_unset_prefill_fields_take_the_services_own() -> None:
    spec = MoEInferenceServiceSpec.model_validate({**SPEC, "autoscaling": {"maxReplicas": 6}, "prefill": {}})
    role = prefill_role_spec(spec)
    assert (role.replicas, role.resources, role.batching, role.ucx, role.autoscaling) == (
        1, spec.resources, spec.batching, spec.ucx, None)


def test_without_prefill_the_children_are_unchanged() -> None:
    spec = MoEInferenceServiceSpec.model_validate({k: v for k, v in SPEC.items() if k != "prefill"})
    got = build_children(OWNER, spec)
    assert all("prefill" not in m["metadata"]["name"] for m in got)
    env = _env(_by(got)[("Deployment", "mixtral-worker")])
    assert not {contract.ENV_ROLE, contract.ENV_PREFILL_URL} & set(env)
    deleted = prefill_children(OWNER)
    assert deleted[0] == ("apps/v1", "Deployment", "mixtral-prefill-worker")
    assert deleted[-1] == ("v1", "ServiceAccount", "mixtral-prefill-worker")  # the marker, deleted last
    assert ("v1", "ConfigMap", "mixtral-prefill-budget") in deleted


def test_a_prefill_role_needs_single_pod_replicas() -> None:
    with pytest.raises(ValidationError, match=r"prefill needs parallelism\.podsPerReplica 1"):
        MoEInferenceServiceSpec.model_validate({**SPEC, "resources": {"gpus": 2},
                                                "parallelism": {"expertParallelSize": 4, "podsPerReplica": 2}})
