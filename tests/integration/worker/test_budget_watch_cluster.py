"""The budget watch against the local control plane's real kube-apiserver."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.conftest import Cluster
from tests.integration.worker.conftest import WorkerProcess

from moeguard_core.contract import BudgetDocument, Budgets

pytestmark = pytest.mark.integration


def configmap(namespace: str, data: dict[str, str]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "demo-budget", "namespace": namespace}, "data": data})


def doc(generation: int, prefill: int) -> dict[str, str]:
    b = Budgets(max_prefill_tokens=prefill, max_decode_tokens=8, max_batch_requests=4,
                max_concurrent_batches=1)
    return BudgetDocument(generation=generation, budgets=b, reason="test").to_configmap_data()


def sample(w: WorkerProcess, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(httpx.get(f"{w.base_url}/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def wait_for(w: WorkerProcess, name: str, value: float, timeout: float = 60, **labels: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if sample(w, name, **labels) == value:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{name} != {value} after {timeout}s: {sample(w, name, **labels)}\n{w.logs()}")


def test_budget_configmap_is_watched_applied_and_bad_documents_refused(
        cluster: Cluster, namespace: str, start_worker: Callable[..., WorkerProcess]) -> None:
    cluster.kubectl("apply", "-f", "-", input=configmap(namespace, doc(1, 300)))
    w = start_worker(KUBECONFIG=str(cluster.kubeconfig), MOEGUARD_BUDGET_CONFIGMAP="demo-budget",
                     MOEGUARD_NAMESPACE=namespace, MOEGUARD_SERVICE_NAME="demo")
    wait_for(w, "moeguard_budget_max_prefill_tokens", 300)  # the initial GET
    assert sample(w, "moeguard_budget_generation") == 1

    cluster.kubectl("apply", "-f", "-", input=configmap(namespace, doc(2, 77)))
    elapsed = wait_for(w, "moeguard_budget_max_prefill_tokens", 77)
    print(f"\nbudget change visible in /metrics after {elapsed:.2f} s")  # the target: bench
    assert sample(w, "moeguard_budget_generation") == 2

    cluster.kubectl("apply", "-f", "-", input=configmap(namespace, {"budget.json": '{"generation": 3}'}))
    wait_for(w, "moeguard_budget_updates_total", 1, result="rejected")
    assert sample(w, "moeguard_budget_max_prefill_tokens") == 77
    assert sample(w, "moeguard_budget_generation") == 2
    assert "event=budget_rejected" in w.logs()
    r = httpx.post(f"{w.base_url}/v1/completions", json={"prompt": "x" * 200, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200  # 201 prompt tokens prefilled in chunks of 77
    assert sample(w, "moeguard_batch_tokens_count", phase="prefill") == 3


def test_with_a_budget_configmap_named_the_worker_is_not_ready_before_its_first_document(
        cluster: Cluster, namespace: str, start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(KUBECONFIG=str(cluster.kubeconfig), MOEGUARD_BUDGET_CONFIGMAP="demo-budget",
                     MOEGUARD_NAMESPACE=namespace, MOEGUARD_SERVICE_NAME="demo")
    r = httpx.get(f"{w.base_url}/readyz", timeout=5)
    assert r.status_code == 503 and "waiting for the first valid budget document" in r.text, r.text
    cluster.kubectl("apply", "-f", "-", input=configmap(namespace, {"budget.json": '{"generation": 1}'}))
    wait_for(w, "moeguard_budget_updates_total", 1, result="rejected")
    assert httpx.get(f"{w.base_url}/readyz", timeout=5).status_code == 503  # an invalid one does not count
    cluster.kubectl("apply", "-f", "-", input=configmap(namespace, doc(2, 300)))
    wait_for(w, "moeguard_budget_generation", 2)
    assert httpx.get(f"{w.base_url}/readyz", timeout=5).text == "ready"
