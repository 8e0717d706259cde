"""Issue 15, e2e on the local control plane: a MoEInferenceService with ``podsPerReplica: 2`` becomes a
LeaderWorkerSet (the real LWS controller and its webhooks), its pods get workers (the pod harness, with the
env LWS injects), completions are served by the group's leader through the Service's endpoints, skew on
the group tightens the budget, and killing the member pod recreates the group with no accepted request
left hanging.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
from harness.loadgen.text import repetitive_prompt
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import THRESHOLD_POLICY, moeis, ready_status, wait, wait_cr

from moeguard_core import contract

OPERATOR_EXTRA_ARGS = THRESHOLD_POLICY
"""This module's story is the threshold policy's: a skew burst past skewThreshold tightens (helpers.THRESHOLD_POLICY)."""
SPEC: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "replicas": 1,
    "parallelism": {"expertParallelSize": 2, "podsPerReplica": 2},
    "resources": {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"},
    "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64, "floors": {"maxPrefillTokens": 256}},
    "control": {"queryIntervalSeconds": 2, "windowSeconds": 10, "skewThreshold": 8, "cooldownSeconds": 2,
                "stabilizationWindowSeconds": 600},
}
LWS_GROUP_RECREATE_SECONDS = 120
"""Bound on a group's recreation after a member's death (both workers load the model again)."""


def _pods(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    items = cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"]
    return sorted((p for p in items if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


def _complete(url: str, prompt: str, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_a_two_pod_replica_is_a_leader_worker_set_served_by_its_leader_and_recreated_whole(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "ep"
    t0 = time.monotonic()
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **SPEC))
    obj = wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True", 240, "Ready=True")
    ready_s = time.monotonic() - t0
    lws = cluster.kubectl_json("-n", ns, "get", "leaderworkersets", f"{name}-worker")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert cluster.kubectl("-n", ns, "get", "deployment", f"{name}-worker", check=False).returncode != 0
    pods = _pods(cluster, ns, name)
    leader, member = pods
    assert leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert obj["status"]["groups"] == [{"index": 0, "leader": leader["metadata"]["name"], "readyPods": 2,
                                        "readyRanks": 2, "ranks": 2}]
    assert obj["status"]["readyReplicas"] == 1

    # The Service's endpoints are the leader's only; the leader serves, the member refuses.
    slices = cluster.kubectl_json("-n", ns, "get", "endpointslices", "-l", f"kubernetes.io/service-name={name}")
    targets = {ep["targetRef"]["name"] for s in slices["items"] for ep in s.get("endpoints") or []}
    assert targets == {leader["metadata"]["name"]}
    lead = pod_workers.wait_for(f"{ns}/{leader['metadata']['name']}", 60)
    mem = pod_workers.wait_for(f"{ns}/{member['metadata']['name']}", 60)
    ok = _complete(lead["url"], "The capital of France is")
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8, ok.text
    refused = _complete(mem["url"], "The capital of France is")
    assert refused.status_code == 503 and contract.EP_NOT_LEADER in refused.text, refused.text
    print(f"\nmulti-node e2e: Ready (LWS group of 2 pods, 2 ranks) {ready_s:.1f} s after apply")

    # Skew: repetitive prompts send the group's tokens to a few experts; the operator tightens the budget.
    t1 = time.monotonic()
    stop = threading.Event()

    def skewed() -> None:
        i = 0
        while not stop.is_set():
            _complete(lead["url"], repetitive_prompt(256, i), max_tokens=4)
            i += 1

    sender = threading.Thread(target=skewed, daemon=True)
    sender.start()
    try:
        tight = wait_cr(cluster, ns, name, lambda o: ((o["status"].get("budgets") or {}).get("maxPrefillTokens")
                                                       or 2048) < 2048, 120, "the prefill budget to drop")
    finally:
        stop.set()
        sender.join(timeout=90)
    assert (tight["status"].get("observed") or {}).get("skewRatio", 0) > 8, tight["status"].get("observed")
    print(f"multi-node e2e: skew tightened maxPrefillTokens 2048 -> {tight['status']['budgets']['maxPrefillTokens']} "
          f"in {time.monotonic() - t1:.1f} s")

    # Kill the member while a request streams: the request ends (an error, not a hang), the group is recreated.
    uids = {p["metadata"]["uid"] for p in pods}
    answer: dict[str, Any] = {}

    def long_request() -> None:
        t = time.monotonic()
        try:
            r = _complete(lead["url"], "Tell me a long story about experts.", max_tokens=400, timeout=120)
            answer["status"] = r.status_code
        except httpx.HTTPError as exc:  # the leader exits after answering: a cut connection is an answer too
            answer["status"] = type(exc).__name__
        answer["seconds"] = time.monotonic() - t

    req = threading.Thread(target=long_request)
    req.start()
    time.sleep(1.0)
    t2 = time.monotonic()
    os.kill(int(mem["pid"]), signal.SIGKILL)
    req.join(timeout=float(contract.DEFAULT_EP_TIMEOUT_SECONDS) + 60)
    assert not req.is_alive(), "an accepted request hung after a member pod died"
    assert answer.get("status") in (200, 503) or isinstance(answer.get("status"), str), answer

    def recreated() -> bool:
        now = _pods(cluster, ns, name)
        return len(now) == 2 and not ({p["metadata"]["uid"] for p in now} & uids)

    wait(recreated, LWS_GROUP_RECREATE_SECONDS, "LeaderWorkerSet to recreate the group")
    obj = wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True" and (o["status"].get("groups") or [{}])[0]
                  .get("readyRanks") == 2, LWS_GROUP_RECREATE_SECONDS, "the recreated group to be Ready")
    recreate_s = time.monotonic() - t2
    new_leader = _pods(cluster, ns, name)[0]
    url = pod_workers.wait_for(f"{ns}/{new_leader['metadata']['name']}", 60)["url"]
    wait(lambda: _complete(url, "Hello").status_code == 200, 60, "the new group to serve")
    print(f"multi-node e2e: member SIGKILLed -> in-flight request answered {answer} ; group recreated and Ready "
          f"in {recreate_s:.1f} s")
    assert obj["status"]["groups"][0]["leader"] == new_leader["metadata"]["name"]


def test_one_pod_groups_of_two_replicas_each_rendezvous_on_their_own_port(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    """``podsPerReplica: 1`` with 2 ranks: a Deployment whose pods each start their second rank as a child
    process. The operator gives every pod port 29500 (each pod has its own network namespace on a node);
    the harness, where all pods share loopback, gives each its own: both replicas become Ready and serve."""
    ns, name = namespace, "ep-one-pod"
    spec = {**SPEC, "replicas": 2, "parallelism": {"expertParallelSize": 2, "podsPerReplica": 1},
            "resources": {**SPEC["resources"], "gpus": 0}}
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **spec))
    obj = wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True" and o["status"].get("readyReplicas") == 2,
                  300, "Ready=True with 2 ready replicas")
    deploy = cluster.kubectl_json("-n", ns, "get", "deployment", f"{name}-worker")
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env[contract.ENV_EXPERT_PARALLEL_SIZE], env[contract.ENV_EP_PORT]) == ("2", "29500")
    pods = _pods(cluster, ns, name)
    assert len(pods) == 2 and obj["status"]["readyReplicas"] == 2
    workers = [pod_workers.wait_for(f"{ns}/{p['metadata']['name']}", 60) for p in pods]
    ports = {w["epPort"] for w in workers}
    assert len(ports) == 2 and 29500 not in ports, workers
    for w in workers:
        ok = _complete(w["url"], "The capital of France is")
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8, ok.text
