"""The local control plane from hack/cluster-up.sh is a real, RBAC-enforcing Kubernetes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

FAKE_NODES = ("moeguard-gpu-0", "moeguard-gpu-1")


def test_server_version_is_pinned_1_34(cluster: Cluster) -> None:
    version = cluster.kubectl_json("version")
    assert version["serverVersion"]["gitVersion"].startswith("v1.34.")
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == ("1", "34")
    assert version["clientVersion"]["gitVersion"].startswith("v1.34.")


def test_rbac_is_enforced(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("-n", namespace, "create", "serviceaccount", "nobody")
    who = f"--as=system:serviceaccount:{namespace}:nobody"
    denied = cluster.kubectl("auth", "can-i", "list", "pods", "-n", namespace, who, check=False)
    assert (denied.returncode, denied.stdout.strip()) == (1, "no")
    cluster.kubectl("-n", namespace, "create", "role", "pod-reader", "--verb=list", "--resource=pods")
    cluster.kubectl("-n", namespace, "create", "rolebinding", "nobody-reads",
                    "--role=pod-reader", f"--serviceaccount={namespace}:nobody")
    allowed = cluster.kubectl("auth", "can-i", "list", "pods", "-n", namespace, who, check=False)
    assert (allowed.returncode, allowed.stdout.strip()) == (0, "yes")
    assert cluster.kubectl("auth", "can-i", "list", "pods", "-A", who, check=False).returncode == 1


def test_two_fake_gpu_nodes_are_ready(cluster: Cluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in cluster.kubectl_json("get", "nodes")["items"]}
    assert set(FAKE_NODES) <= set(nodes)
    for name in FAKE_NODES:
        node = nodes[name]
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        alloc = node["status"]["allocatable"]
        assert (alloc["nvidia.com/gpu"], alloc["memory"], alloc["cpu"], alloc["pods"]) == ("8", "512Gi", "64", "110")
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        assert not node["spec"].get("taints"), "fake nodes carry no taints"


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-user}
spec:
  replicas: 1
  selector: {matchLabels: {app: gpu-user}}
  template:
    metadata: {labels: {app: gpu-user}}
    spec:
      containers:
      - name: main
        image: registry.invalid/none:0
        resources:
          limits: {nvidia.com/gpu: "1", memory: 1Gi}
"""


def test_gpu_deployment_is_scheduled_and_ready(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=DEPLOYMENT)
    cluster.kubectl("-n", namespace, "rollout", "status", "deployment/gpu-user", "--timeout=60s", timeout=90)
    pods = cluster.kubectl_json("-n", namespace, "get", "pods", "-l", "app=gpu-user")["items"]
    assert len(pods) == 1
    pod = pods[0]
    assert pod["spec"]["nodeName"] in FAKE_NODES
    assert pod["status"]["phase"] == "Running"
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    assert pod["status"]["podIP"].startswith("10.244.")


def test_gpu_requests_beyond_capacity_stay_pending(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-",
                    input=DEPLOYMENT.replace('nvidia.com/gpu: "1"', 'nvidia.com/gpu: "9"'))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pods = cluster.kubectl_json("-n", namespace, "get", "pods", "-l", "app=gpu-user")["items"]
        conds = {c["type"]: c for c in (pods[0]["status"].get("conditions") or [])} if pods else {}
        if "PodScheduled" in conds:
            break
        time.sleep(0.5)
    assert conds["PodScheduled"]["status"] == "False"
    assert "nvidia.com/gpu" in conds["PodScheduled"]["message"]


def test_prometheus_is_ready_with_the_worker_job(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.prometheus_url}/-/ready", timeout=5).status_code == 200
    config = httpx.get(f"{cluster.prometheus_url}/api/v1/status/config", timeout=5).json()["data"]["yaml"]
    assert "job_name: moeguard-workers" in config
    assert f"{cluster.run_dir}/prometheus/targets/*.json" in config
