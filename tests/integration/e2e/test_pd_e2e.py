"""Issue 33 e2e: a MoEInferenceService with ``spec.prefill`` on the local control plane.

* the roles are rendered: a Deployment per role, the prefill role's Service, UCX env per role (the prefill pods'
  own ``ucx``), the decode pods pointing at the prefill Service;
* the decode pod answers greedy completions as a single worker does, its prompts prefilled by the prefill pod and
  the KV read over UCX (``moeguard_kv_transfer_seconds`` counts the reads);
* the prefill pod's process killed: the decode pod answers 503 ``prefill_unavailable`` with ``Retry-After``
  (the kubelet stand-in restarts the container); once it runs again, answers are 200 again;
* the decode pod's process killed: it restarts and serves again, and the prefill pod holds no KV (an offer
  nobody read is dropped when its lease ends).

The pods run as processes (hack/pod_workers.py); the decode pod reaches the prefill Service through the
harness's loopback stand-in for kube-proxy (hack/service_proxy.py).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
from harness.metrics_text import samples_named
from harness.worker_process import start_worker_process
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import moeis, ready_status, wait, wait_cr

from moeguard_core import contract

NAME = "pd"
SPEC = {"model": {"preset": "tiny"}, "replicas": 1,
        "resources": {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"},
        "prefill": {"replicas": 1, "ucx": {"mode": "rcache", "rcacheMaxUnreleased": 2048},
                    "kvTransferTimeoutSeconds": 5, "kvLeaseSeconds": 10}}
PROMPTS = ["The quick brown fox", "Experts and routers", "b" * 70]


def _worker(pw: PodWorkers, ns: str, moeis_name: str) -> dict[str, Any]:
    """The harness's running worker of the pod of service ``moeis_name`` (one replica)."""
    def found() -> dict[str, Any] | None:
        for key, info in pw.state().items():
            if key.startswith(f"{ns}/") and info.get("moeis") == moeis_name:
                try:
                    if httpx.get(f"{info['url']}/readyz", timeout=2).status_code == 200:
                        return info
                except httpx.HTTPError:
                    return None
        return None
    return dict(wait(found, 120, f"a ready worker of {moeis_name}"))


def _complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 10,
                                                      "temperature": 0}, timeout=60)


def _env(cluster: Cluster, ns: str, deployment: str) -> dict[str, str]:
    dep = cluster.kubectl_json("-n", ns, "get", "deployment", deployment)
    return {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def _metric(url: str, name: str) -> float:
    return sum(v for _, v in samples_named(httpx.get(f"{url}/metrics", timeout=5).text, name))


def test_prefill_and_decode_roles_on_the_control_plane(cluster: Cluster, operator: None, pod_workers: PodWorkers,
                                                        namespace: str, tmp_path: Path) -> None:
    ns = namespace
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(NAME, **SPEC))
    wait_cr(cluster, ns, NAME, lambda o: ready_status(o) == "True", 180, "Ready=True")
    decode_env, prefill_env = _env(cluster, ns, f"{NAME}-worker"), _env(cluster, ns, f"{NAME}-prefill-worker")
    assert (decode_env[contract.ENV_ROLE], prefill_env[contract.ENV_ROLE]) == ("decode", "prefill")
    assert decode_env[contract.ENV_PREFILL_URL] == f"http://{NAME}-prefill:{contract.WORKER_PORT}"
    assert decode_env[contract.UCX_MEM_MMAP_HOOK_MODE] == "none"
    assert contract.UCX_MEM_MMAP_HOOK_MODE not in prefill_env
    assert prefill_env[contract.UCX_RCACHE_MAX_UNRELEASED] == "2048"
    svc = cluster.kubectl_json("-n", ns, "get", "service", f"{NAME}-prefill")
    assert svc["spec"]["selector"]["app.kubernetes.io/instance"] == f"{NAME}-prefill"

    decode, prefill = _worker(pod_workers, ns, NAME), _worker(pod_workers, ns, f"{NAME}-prefill")
    single = start_worker_process(tmp_path)  # the same preset and seed, one role
    try:
        for prompt in PROMPTS:
            want, got = _complete(single.base_url, prompt), _complete(decode["url"], prompt)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"], prompt
    finally:
        single.stop()
    assert _metric(decode["url"], f"{contract.METRIC_KV_TRANSFER_SECONDS}_count") == len(PROMPTS)

    # the prefill pod's process killed: 503 with Retry-After at once, then served again after its restart
    os.kill(prefill["pid"], signal.SIGKILL)
    r = _complete(decode["url"], PROMPTS[0])
    assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_unavailable", r.text
    assert int(r.headers["retry-after"]) >= 1

    def served() -> bool:
        return _complete(decode["url"], PROMPTS[0]).status_code == 200
    wait(served, 120, "the decode pod served again after the prefill pod's restart")

    # the decode pod's process killed: it restarts and serves; the prefill pod holds no KV afterwards
    os.kill(decode["pid"], signal.SIGKILL)
    decode = _worker(pod_workers, ns, NAME)
    assert _complete(decode["url"], PROMPTS[1]).status_code == 200
    prefill = _worker(pod_workers, ns, f"{NAME}-prefill")

    def no_kv_held() -> bool:
        return _metric(prefill["url"], contract.METRIC_KV_CACHE_BYTES) == 0
    wait(no_kv_held, 30, "the prefill pod holding no KV")

