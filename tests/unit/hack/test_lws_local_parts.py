"""The pure parts of the local LeaderWorkerSet setup: hack/lws_webhooks.py (LWS's webhook manifests
pointed at loopback) and the harness's LWS group key (hack/pod_workers.py)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from hack.lws_webhooks import apply_patch, render
from hack.pod_workers import lws_group, own_rendezvous_env

pytestmark = pytest.mark.unit

# The shape of sigs.k8s.io/lws v0.7.0's config/webhook/{manifests,mutating-patch,validating-patch}.yaml.
MANIFESTS = """
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- admissionReviewVersions: [v1]
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset}}
  failurePolicy: Fail
  name: mleaderworkerset.kb.io
  rules: [{apiGroups: [leaderworkerset.x-k8s.io], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [leaderworkersets]}]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
  failurePolicy: Fail
  name: mpod.kb.io
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validating-webhook-configuration}
webhooks:
- admissionReviewVersions: [v1]
  clientConfig: {service: {name: webhook-service, namespace: system, path: /validate-leaderworkerset-x-k8s-io-v1-leaderworkerset}}
  failurePolicy: Fail
  name: vleaderworkerset.kb.io
  rules: [{apiGroups: [leaderworkerset.x-k8s.io], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [leaderworkersets]}]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig: {service: {name: webhook-service, namespace: system, path: /validate--v1-pod}}
  failurePolicy: Fail
  name: vpod.kb.io
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [pods]}]
  sideEffects: None
"""
PATCH = """
- op: replace
  path: /webhooks/1
  value:
    admissionReviewVersions: [v1]
    clientConfig: {{service: {{name: webhook-service, namespace: system, path: {path}}}}}
    failurePolicy: Fail
    name: {name}
    objectSelector:
      matchExpressions: [{{key: leaderworkerset.sigs.k8s.io/name, operator: Exists}}]
    rules: [{{apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [pods]}}]
    sideEffects: None
"""


def test_webhooks_point_at_loopback_with_the_ca_and_only_at_lws_pods(tmp_path: Path) -> None:
    (tmp_path / "manifests.yaml").write_text(MANIFESTS)
    (tmp_path / "mutating-patch.yaml").write_text(PATCH.format(path="/mutate--v1-pod", name="mpod.kb.io"))
    (tmp_path / "validating-patch.yaml").write_text(PATCH.format(path="/validate--v1-pod", name="vpod.kb.io"))
    ca = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    out = render(tmp_path, 19473, ca)
    assert out["kind"] == "List"
    by_name = {d["metadata"]["name"]: d for d in out["items"]}
    assert set(by_name) == {"lws-mutating-webhook-configuration", "lws-validating-webhook-configuration"}
    hooks = {h["name"]: h for d in out["items"] for h in d["webhooks"]}
    assert {name: h["clientConfig"]["url"] for name, h in hooks.items()} == {
        "mleaderworkerset.kb.io": "https://127.0.0.1:19473/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
        "mpod.kb.io": "https://127.0.0.1:19473/mutate--v1-pod",
        "vleaderworkerset.kb.io": "https://127.0.0.1:19473/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
        "vpod.kb.io": "https://127.0.0.1:19473/validate--v1-pod",
    }
    assert all(base64.b64decode(h["clientConfig"]["caBundle"]) == ca and "service" not in h["clientConfig"]
               for h in hooks.values())
    # kustomize's patches: the pod webhooks see LWS's pods only (others are created while LWS is down)
    for name in ("mpod.kb.io", "vpod.kb.io"):
        assert hooks[name]["objectSelector"]["matchExpressions"][0]["key"] == "leaderworkerset.sigs.k8s.io/name"
        assert hooks[name]["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert "objectSelector" not in hooks["mleaderworkerset.kb.io"]
    assert all(h["failurePolicy"] == "Fail" for h in hooks.values())


def test_an_unknown_patch_op_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported patch op"):
        apply_patch({"webhooks": [{}]}, [{"op": "add", "path": "/webhooks/0/objectSelector", "value": {}}])


def test_lws_group_is_the_group_key_in_the_namespace() -> None:
    labels = {"leaderworkerset.sigs.k8s.io/name": "svc-worker", "leaderworkerset.sigs.k8s.io/group-index": "1",
              "leaderworkerset.sigs.k8s.io/group-key": "b0952f9f"}
    assert lws_group("ns", labels) == "ns/b0952f9f"
    del labels["leaderworkerset.sigs.k8s.io/group-key"]  # no webhook ran: the set and the group index
    assert lws_group("ns", labels) == "ns/svc-worker-1"
    assert lws_group("ns", {"app.kubernetes.io/component": "worker"}) is None
    assert lws_group("ns", None) is None


def test_a_one_pod_group_gets_a_rendezvous_port_of_its_own() -> None:
    ports = iter([41001, 41002])
    env = {"MOEGUARD_EXPERT_PARALLEL_SIZE": "2", "MOEGUARD_EP_PORT": "29500", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    assert own_rendezvous_env(env, lambda: next(ports)) == ({"MOEGUARD_EP_PORT": "41001"}, {"epPort": 41001})
    assert own_rendezvous_env(env, lambda: next(ports)) == ({"MOEGUARD_EP_PORT": "41002"}, {"epPort": 41002})
    assert own_rendezvous_env({"MOEGUARD_PORT": "8000"}, lambda: next(ports)) == ({}, {})  # no ranks: nothing
