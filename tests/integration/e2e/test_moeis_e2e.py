"""End to end on the real local control plane, Prometheus and worker processes.

The operator runs as a process (``python -m moeguard_operator``), the harness backs
kwok's pods with real workers, and the closed loop is seen from three sides: the
CR's status, the budget ConfigMap, and the worker's own ``/metrics``.
"""

from __future__ import annotations

import json

import httpx
from harness import stack
from harness.loadgen.text import prompt_of_length, repetitive_prompt
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import (
    OPERATOR_METRICS_PORT,
    THRESHOLD_POLICY,
    moeis,
    ready_status,
    wait,
    wait_cr,
    wait_event,
)

OPERATOR_EXTRA_ARGS = THRESHOLD_POLICY
"""This module's story is the threshold policy's: a skew burst past skewThreshold tightens (helpers.THRESHOLD_POLICY)."""
SPEC = {
    "model": {"preset": "tiny"},
    "replicas": 1,
    "resources": {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"},
    "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64, "maxBatchRequests": 16,
                 "maxConcurrentBatches": 2, "floors": {"maxPrefillTokens": 256}},
    "control": {"queryIntervalSeconds": 2, "windowSeconds": 10, "skewThreshold": 8, "cooldownSeconds": 5},
}


def test_closed_loop_end_to_end(cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "e2e"
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **SPEC))
    obj = wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True", 180, "Ready=True")
    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    # kopf's bookkeeping lives under moeguard.dev, not kopf.zalando.org
    annotations = obj["metadata"].get("annotations", {})
    assert "moeguard.dev/last-handled-configuration" in annotations
    assert not [k for k in annotations if k.startswith("kopf.zalando.org")]
    assert status["readyReplicas"] == 1
    assert status["budgets"]["maxPrefillTokens"] == 2048

    # Children: GPU and memory limits, UCX env, owner references.
    dep = cluster.kubectl_json("-n", ns, "get", "deployment", f"{name}-worker")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"memory": "4Gi", "cpu": "2", "nvidia.com/gpu": "1"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["UCX_MEM_MMAP_HOOK_MODE"] == "none"
    assert env["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
    assert env["MOEGUARD_SOFT_LIMIT_BYTES"] == str(3 * 2**30)
    assert dep["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    svc = cluster.kubectl_json("-n", ns, "get", "service", name)
    assert svc["spec"]["ports"][0]["port"] == 8000
    cm = cluster.kubectl_json("-n", ns, "get", "configmap", f"{name}-budget")
    assert json.loads(cm["data"]["budget.json"])["budgets"]["maxPrefillTokens"] == 2048
    table = cluster.kubectl("-n", ns, "get", "moeis", name).stdout
    assert table.split("\n")[0].split() == ["NAME", "READY", "REPLICAS", "PREFILL", "SKEW", "RSS", "%", "OVERLOAD", "AGE"]
    assert table.split("\n")[1].split()[:4] == [name, "True", "1", "2048"]
    assert status["overloadMode"] == "Off"

    # The worker behind the kwok pod serves real prompts.
    pod = cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"][0]
    url = pod_workers.wait_for(f"{ns}/{pod['metadata']['name']}", 60)["url"]
    wait(lambda: stack.healthy(url), 120, "worker /healthz")
    prompt = prompt_of_length(200, offset=1000)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["prompt_tokens"] >= 200
    assert stack.scrape_one(url, "moeguard_budget_max_prefill_tokens") == 2048

    # Skew: repetitive prompts route most tokens to a few experts.
    with httpx.Client(timeout=120) as client:
        for i in range(6):
            resp = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": repetitive_prompt(512, i), "max_tokens": 2})
            assert resp.status_code == 200, resp.text
    obj = wait_cr(cluster, ns, name, lambda o: o["status"]["budgets"]["maxPrefillTokens"] < 2048, 90,
                  "the operator to tighten maxPrefillTokens")
    tightened = obj["status"]["budgets"]["maxPrefillTokens"]
    assert tightened == 1024
    adj = obj["status"]["lastAdjustment"]
    assert adj["from"]["maxPrefillTokens"] == 2048 and adj["to"]["maxPrefillTokens"] == 1024
    assert "expert skew ratio" in adj["reason"] and "> threshold 8" in adj["reason"]
    assert obj["status"]["observed"]["skewRatio"] > 8
    assert stack.condition(obj, "MetricsAvailable")["status"] == "True"  # type: ignore[index]
    # How fast the worker takes it is measured by the benchmarks; here only that it does.
    wait(lambda: stack.scrape_one(url, "moeguard_budget_max_prefill_tokens") == 1024, 120,
         "the worker to apply the new budget")
    cm = cluster.kubectl_json("-n", ns, "get", "configmap", f"{name}-budget")
    assert json.loads(cm["data"]["budget.json"])["generation"] == stack.scrape_one(url, "moeguard_budget_generation")
    wait_event(cluster, ns, name, "Normal", "BudgetTightened")
    # The operator's own metrics say the same.
    text = httpx.get(f"http://127.0.0.1:{OPERATOR_METRICS_PORT}/metrics", timeout=5).text
    assert f'moeguard_operator_budget_changes_total{{direction="down",moeis="{name}",namespace="{ns}"}} 1.0' in text
    assert f'moeguard_operator_budget_max_prefill_tokens{{moeis="{name}",namespace="{ns}"}} 1024.0' in text
    assert f'moeguard_operator_budget_at_floor{{budget="maxPrefillTokens",moeis="{name}",namespace="{ns}"}} 0.0' in text


def test_api_server_rejects_invalid_specs(cluster: Cluster, operator: None, namespace: str) -> None:
    bad_limits = moeis("bad-limits", resources={"softLimit": "8Gi", "hardLimit": "8Gi"})
    res = cluster.kubectl("-n", namespace, "apply", "-f", "-", input=bad_limits, check=False)
    assert res.returncode != 0
    assert "spec.resources.softLimit: Invalid value" in res.stderr
    assert "resources.softLimit must be less than resources.hardLimit" in res.stderr

    negative = moeis("negative", batching={"maxPrefillTokens": -5})
    res = cluster.kubectl("-n", namespace, "apply", "-f", "-", input=negative, check=False)
    assert res.returncode != 0
    assert "spec.batching.maxPrefillTokens: Invalid value: -5" in res.stderr
    assert "should be greater than or equal to 1" in res.stderr

    floor = moeis("floor", batching={"maxPrefillTokens": 128, "floors": {"maxPrefillTokens": 512}})
    res = cluster.kubectl("-n", namespace, "apply", "-f", "-", input=floor, check=False)
    assert "batching.floors.maxPrefillTokens must be <= batching.maxPrefillTokens" in res.stderr


def test_unknown_preset_is_reported_and_others_still_served(cluster: Cluster, operator: None, namespace: str) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=moeis("nope", model={"preset": "gpt-17"}, replicas=0))
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=moeis("fine", replicas=0))
    obj = wait_cr(cluster, namespace, "nope", lambda o: ready_status(o) == "False", 60, "Ready=False")
    ready = stack.condition(obj, "Ready")
    assert ready is not None and ready["reason"] == "UnknownModelPreset"
    assert "unknown model preset 'gpt-17'" in ready["message"]
    assert stack.condition(obj, "Stalled")["status"] == "True"  # type: ignore[index]
    events = cluster.kubectl_json("-n", namespace, "get", "events", "--field-selector", "involvedObject.name=nope")["items"]
    assert any(e["type"] == "Warning" and e["reason"] == "UnknownModelPreset" for e in events), events
    fine = wait_cr(cluster, namespace, "fine", lambda o: ready_status(o) == "True", 60, "fine Ready")
    assert fine["status"]["budgets"]["maxPrefillTokens"] == 4096
    assert cluster.kubectl("-n", namespace, "get", "deployment", "nope-worker", check=False).returncode != 0


def test_a_pod_marked_not_ready_by_the_node_controller_is_made_ready_again_by_its_harness(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    """As a kubelet's status manager does, the pod harness writes its container's readiness again when someone else
    changed it: after an API server outage the node controller marks the pods of a node whose lease expired
    NotReady (``NodeNotReady``), and the worker, still ready, would otherwise stay NotReady (stop 39's clean-clone
    run: "0/1 worker pods ready" for 90 s after the outage)."""
    ns, name = namespace, "resync"
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **SPEC))
    wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True", 180, "Ready=True")
    (pod,) = cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"]
    conditions = [c | {"status": "False", "reason": "NodeNotReady"} if c["type"] == "Ready" else c
                  for c in pod["status"]["conditions"]]
    cluster.kubectl("-n", ns, "patch", "pod", pod["metadata"]["name"], "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"conditions": conditions}}))

    def pod_ready() -> bool:
        got = cluster.kubectl_json("-n", ns, "get", "pod", pod["metadata"]["name"])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in got["status"]["conditions"])
    wait(pod_ready, 30, "the harness writing Ready=True again")
    wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True", 60, "the service Ready again")
