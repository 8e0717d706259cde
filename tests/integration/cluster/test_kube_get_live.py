"""harness.kube_get against kubectl itself (the reference): every plain read the tests poll gives the same JSON
through the kept-alive API client as through a kubectl process, NotFound included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from harness import stack
from tests.integration.conftest import Cluster


def by_kubectl(cluster: Cluster, *args: str) -> Any:
    """``kubectl ARGS -o json`` run as a process, as stack.kubectl_json did before harness.kube_get."""
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


SPEC = {"replicas": 1, "model": {"preset": "tiny"}, "resources": {"gpus": 0}}


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(stack.ROOT / "crds"))
    stack.wait_established(stack.CRD_NAME, run_dir=cluster.run_dir)


@pytest.fixture
def objects(cluster: Cluster, crd: None, namespace: str) -> str:
    """A namespace holding a MoEInferenceService (no operator: no children), a ConfigMap with an Event about it,
    and a kwok Pod."""
    cr = {"apiVersion": "moeguard.dev/v1alpha1", "kind": "MoEInferenceService",
          "metadata": {"name": "svc", "namespace": namespace}, "spec": SPEC}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "svc-budget", "namespace": namespace,
                                                                "labels": {"app.kubernetes.io/instance": "svc"}},
          "data": {"budget.json": "{}"}}
    ev = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "svc.1", "namespace": namespace},
          "involvedObject": {"kind": "ConfigMap", "name": "svc-budget", "namespace": namespace},
          "reason": "Tested", "message": "a message", "type": "Normal"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": namespace,
                                                           "labels": {"app.kubernetes.io/instance": "svc"}},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    for obj in (cr, cm, ev, pod):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    return namespace


def test_plain_reads_equal_kubectls_output(cluster: Cluster, objects: str) -> None:
    ns = objects
    reads = [
        ("-n", ns, "get", "moeis", "svc"), ("-n", ns, "get", "moeis"),
        ("-n", ns, "get", "configmap", "svc-budget"), ("-n", ns, "get", "cm", "-l", "app.kubernetes.io/instance=svc"),
        ("-n", ns, "get", "events", "--field-selector", "involvedObject.name=svc-budget"),
        ("-n", ns, "get", "pods", "-l", "app.kubernetes.io/instance=svc"), ("-n", ns, "get", "pod", "p"),
        ("-n", ns, "get", "deployment"), ("get", "nodes"), ("get", "crd", stack.CRD_NAME),
    ]
    for args in reads:
        assert stable(cluster.kubectl_json(*args)) == stable(by_kubectl(cluster, *args)), args
    assert [e["reason"] for e in cluster.kubectl_json(*reads[4])["items"]] == ["Tested"]
    assert [p["metadata"]["name"] for p in cluster.kubectl_json(*reads[5])["items"]] == ["p"]
    assert "managedFields" not in cluster.kubectl_json(*reads[0])["metadata"]


def stable(obj: Any) -> Any:
    """``obj`` without what moves between two reads a moment apart: resourceVersions, and the status of the kwok
    node and pod (heartbeats)."""
    if isinstance(obj, list):
        return [stable(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    drop = {"resourceVersion"} | ({"status"} if obj.get("kind") in ("Node", "Pod") else set())
    return {k: stable(v) for k, v in obj.items() if k not in drop}


def test_a_missing_object_fails_as_kubectl_does(cluster: Cluster, crd: None, namespace: str) -> None:
    with pytest.raises(stack.ToolError, match=r'Error from server \(NotFound\): moeinferenceservices.moeguard.dev '
                                              r'"absent" not found'):
        cluster.kubectl_json("-n", namespace, "get", "moeis", "absent")
    proc = cluster.kubectl("-n", namespace, "get", "moeis", "absent", "-o", "json", check=False)
    assert proc.returncode == 1
    assert 'Error from server (NotFound): moeinferenceservices.moeguard.dev "absent" not found' in proc.stderr


def test_a_read_kubectl_keeps_still_goes_to_kubectl(cluster: Cluster, objects: str) -> None:
    obj = cluster.kubectl_json("-n", objects, "get", "moeis", "svc", "--show-managed-fields")
    assert obj["metadata"].get("managedFields")  # only kubectl shows them, and only with the flag
    assert "managedFields" not in cluster.kubectl_json("-n", objects, "get", "moeis", "svc")["metadata"]


def test_an_api_server_that_does_not_answer_is_a_tool_error(tmp_path: Any) -> None:
    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:9', "
        "insecure-skip-tls-verify: true}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\n"
        "current-context: c\nusers:\n- name: u\n  user: {token: t}\n")
    with pytest.raises(stack.ToolError, match="did not answer GET /api/v1/nodes"):
        stack.kubectl_json("get", "nodes", run_dir=tmp_path)
