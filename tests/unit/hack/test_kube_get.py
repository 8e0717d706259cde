"""harness.kube_get: which kubectl reads are answered without kubectl, and in kubectl's shape (pure parts; the
answers themselves are compared with kubectl's in tests/integration/cluster/test_kube_get_live.py)."""

from __future__ import annotations

import pytest
from harness import kube_get


@pytest.mark.parametrize(("args", "path", "labels", "fields"), [
    (("-n", "ns1", "get", "moeis", "svc"), "/apis/moeguard.dev/v1alpha1/namespaces/ns1/moeinferenceservices/svc",
     None, None),
    (("get", "moeis", "svc", "-n", "ns1"), "/apis/moeguard.dev/v1alpha1/namespaces/ns1/moeinferenceservices/svc",
     None, None),
    (("-n", "ns1", "get", "pods", "-l", "app=x"), "/api/v1/namespaces/ns1/pods", "app=x", None),
    (("-n", "ns1", "get", "events", "--field-selector", "involvedObject.name=svc"), "/api/v1/namespaces/ns1/events",
     None, "involvedObject.name=svc"),
    (("get", "pods"), "/api/v1/namespaces/default/pods", None, None),
    (("get", "nodes"), "/api/v1/nodes", None, None),
    (("get", "crd", "moeinferenceservices.moeguard.dev"),
     "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/moeinferenceservices.moeguard.dev", None, None),
    (("-n", "ns1", "get", "deploy", "svc-worker"), "/apis/apps/v1/namespaces/ns1/deployments/svc-worker", None, None),
    (("-n", "ns1", "get", "lws", "svc-worker"),
     "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns1/leaderworkersets/svc-worker", None, None),
])
def test_plain_reads_are_served_at_their_api_path(args: tuple[str, ...], path: str, labels: str | None,
                                                  fields: str | None) -> None:
    get = kube_get.parse(args)
    assert get is not None
    assert (get.path(), get.label_selector, get.field_selector) == (path, labels, fields)


@pytest.mark.parametrize("args", [
    ("-n", "ns1", "get", "moeis", "svc", "--show-managed-fields"),  # kubectl's own flag
    ("get", "--raw", "/readyz"),
    ("-n", "ns1", "get", "kopfpeering", "moeguard"),  # not in the table
    ("-A", "get", "pods"),
    ("-n", "ns1", "get", "pods", "-o", "name"),
    ("-n", "ns1", "get", "pods", "a", "b"),  # two names
    ("-n", "ns1", "get", "pod", "a", "-l", "app=x"),  # a name and a selector: kubectl refuses it
    ("-n", "ns1", "get", "pod/a"),
    ("-n", "ns1", "-n", "ns2", "get", "pods"),
    ("-n",),
    ("version",),
    ("apply", "-f", "-"),
])
def test_anything_else_is_left_to_kubectl(args: tuple[str, ...]) -> None:
    assert kube_get.parse(args) is None


def test_a_list_reads_as_kubectls_list_and_managed_fields_go() -> None:
    get = kube_get.parse(("-n", "ns1", "get", "pods"))
    assert get is not None
    body = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "42"},
            "items": [{"metadata": {"name": "a", "managedFields": [{"manager": "kwok"}]}, "spec": {}}]}
    assert kube_get.kubectl_shape(get, body) == {
        "apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
        "items": [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}, "spec": {}}]}


def test_one_object_keeps_its_own_kind_and_loses_managed_fields() -> None:
    get = kube_get.parse(("-n", "ns1", "get", "deployment", "svc-worker"))
    assert get is not None
    obj = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "svc-worker", "managedFields": [{"manager": "moeguard"}], "generation": 3}}
    assert kube_get.kubectl_shape(get, obj) == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "metadata": {"name": "svc-worker", "generation": 3}}


def test_list_items_get_the_group_version_of_their_resource() -> None:
    get = kube_get.parse(("-n", "ns1", "get", "moeis"))
    assert get is not None
    shaped = kube_get.kubectl_shape(get, {"items": [{"metadata": {"name": "x"}}]})
    assert shaped["items"][0]["apiVersion"] == "moeguard.dev/v1alpha1"
    assert shaped["items"][0]["kind"] == "MoEInferenceService"
