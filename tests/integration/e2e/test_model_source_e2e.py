"""spec.model.source with the operator running against the real local control plane.

* A worker that cannot load its checkpoint: its pod status, as the kubelet writes it, becomes the
  service's Ready=False condition (reason WorkerStartupFailed) with the worker's own message, and one
  Warning Event. kwok runs no containers and the pod-workers harness cannot yet crash a worker, so the
  test writes that pod status through the API (the status subresource, which is what the kubelet
  writes): a crash loop whose last termination carries the message the worker leaves in
  /dev/termination-log (``telemetry.write_termination_message``) before it exits 3.
* A hostPath source on an operator run without ``--allow-host-path-models``: Stalled, HostPathNotAllowed.
* An image source on this API server (1.34, ImageVolume feature gate off): Stalled, VolumeDropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hack import stack
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import moeis, ready_status, wait, wait_cr

RESOURCES = {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"}
MESSAGE = ("model_load_error: /moeguard/model/tiny/model-00002-of-00002.safetensors: missing shard "
           "(named by model.safetensors.index.json)")


@pytest.fixture
def bound_claim(cluster: Cluster, namespace: str) -> Iterator[str]:
    """A PersistentVolumeClaim bound to a static PersistentVolume (no provisioner here), so that the
    scheduler places the worker pod."""
    pv = f"m10-{uuid.uuid4().hex[:8]}"
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
        "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": "/tmp/moeguard-models"},
        "claimRef": {"namespace": namespace, "name": "weights"}}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights"}, "spec": {
        "accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
        "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(volume))
    try:
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(claim))
        wait(lambda: cluster.kubectl_json("-n", namespace, "get", "pvc", "weights")["status"].get("phase") == "Bound",
             60, "the claim bound")
        yield "weights"
    finally:
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def _crash_loop_status(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod status the kubelet writes for a worker that exited 3 with ``MESSAGE`` and is backing off."""
    started = pod["status"].get("startTime", "2026-11-30T10:00:00Z")
    waiting = {"reason": "CrashLoopBackOff",
               "message": f"back-off 40s restarting failed container=worker pod={pod['metadata']['name']}"}
    return {"status": {
        "phase": "Running",
        "conditions": [{"type": t, "status": "False", "reason": "ContainersNotReady",
                        "lastTransitionTime": started} for t in ("Ready", "ContainersReady")]
                      + [{"type": "PodScheduled", "status": "True", "lastTransitionTime": started}],
        "containerStatuses": [{
            "name": "worker", "ready": False, "started": False, "restartCount": 3,
            "image": pod["spec"]["containers"][0]["image"], "imageID": "",
            "state": {"waiting": waiting},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": MESSAGE,
                                         "startedAt": started, "finishedAt": started}},
        }],
    }}


def test_a_worker_start_up_failure_is_the_ready_condition(cluster: Cluster, operator: None, namespace: str,
                                                          bound_claim: str) -> None:
    source = {"persistentVolumeClaim": {"claimName": bound_claim}, "subPath": "tiny"}
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=moeis(
        "broken", model={"source": source, "servedModelName": "tiny-moe"}, replicas=1, resources=RESOURCES))
    wait_cr(cluster, namespace, "broken", lambda o: ready_status(o) == "True", 90, "Ready while kwok runs the pod")
    deployment = cluster.kubectl_json("-n", namespace, "get", "deployment", "broken-worker")
    pod_spec = deployment["spec"]["template"]["spec"]
    assert {"name": "moeguard-model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} \
        in pod_spec["volumes"]
    env = {e["name"]: e.get("value") for e in pod_spec["containers"][0]["env"]}
    assert env["MOEGUARD_CHECKPOINT_PATH"] == "/moeguard/model/tiny"
    assert env["MOEGUARD_SERVED_MODEL_NAME"] == "tiny-moe"

    pod = cluster.kubectl_json("-n", namespace, "get", "pods", "-l", "app.kubernetes.io/instance=broken")["items"][0]
    cluster.kubectl("-n", namespace, "patch", "pod", pod["metadata"]["name"], "--subresource=status",
                    "--type=merge", "-p", json.dumps(_crash_loop_status(pod)))

    obj = wait_cr(cluster, namespace, "broken",
                  lambda o: (stack.condition(o, "Ready") or {}).get("reason") == "WorkerStartupFailed", 60,
                  "Ready=False WorkerStartupFailed")
    ready = stack.condition(obj, "Ready")
    assert ready is not None and ready["status"] == "False"
    assert ready["message"] == (f"0/1 worker pods ready; pod {pod['metadata']['name']}: container worker exited 3 "
                                f"(Error): {MESSAGE} (CrashLoopBackOff)")
    assert stack.condition(obj, "Stalled")["status"] == "False"  # type: ignore[index]

    def warned() -> bool:
        events = cluster.kubectl_json("-n", namespace, "get", "events",
                                      "--field-selector", "involvedObject.name=broken")["items"]
        return [e["message"] for e in events if e["reason"] == "WorkerStartupFailed"] == [ready["message"]]
    wait(warned, 30, "one WorkerStartupFailed Event")


@pytest.mark.parametrize(("name", "source", "reason", "needle"), [
    ("host", {"hostPath": {"path": "/srv/models/tiny"}}, "HostPathNotAllowed",
     "spec.model.source.hostPath (/srv/models/tiny): this operator serves no node directories"),
    ("image", {"image": {"reference": "registry.example.com/models/tiny:1"}}, "VolumeDropped",
     "the API server stored the worker Deployment without its volumes moeguard-model"),
])
def test_a_source_this_cluster_cannot_serve_stalls(cluster: Cluster, operator: None, namespace: str, name: str,
                                                   source: dict[str, Any], reason: str, needle: str) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-",
                    input=moeis(name, model={"source": source}, replicas=0, resources=RESOURCES))
    obj = wait_cr(cluster, namespace, name, lambda o: (stack.condition(o, "Ready") or {}).get("reason") == reason,
                  60, f"Ready=False {reason}")
    assert needle in stack.condition(obj, "Ready")["message"]  # type: ignore[index]
    assert stack.condition(obj, "Stalled")["status"] == "True"  # type: ignore[index]
