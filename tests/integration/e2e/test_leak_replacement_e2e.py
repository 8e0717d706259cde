"""Issue 30 item 4 with the operator in the loop (``--policy predictive``, ``leakAction: Restart``), real workers, the
real Prometheus and the real API server's Deployment and ReplicaSet controllers: one of two workers leaks, and the
operator replaces it before its hard limit with a surge (a third pod, Ready before the leaking pod is drained), not
with a rolling restart; no OOM kill.

Scale as in test_control_loop (query interval 2 s, window 10 s), a 30-s leak window and the short warm-up
(``--leak-warmup-seconds``): the leak (8 MiB/s from ~450 MiB, hardLimit 2 GiB) would reach the limit about 200 s
after it starts, and the lead (3 x the measured ready time + 30 s grace + 2 s) is reached well before that.
"""

from __future__ import annotations

import json
import time
from typing import Any

from harness import stack
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import TEST_LEAK_WARMUP_SECONDS, get, wait, wait_cr, wait_event
from tests.integration.e2e.test_control_loop import DEADLINE, SPEC, start

OPERATOR_EXTRA_ARGS = ("--policy", "predictive", "--leak-warmup-seconds", str(TEST_LEAK_WARMUP_SECONDS))
LEAK_RATE_BYTES_PER_SECOND = 8 << 20
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def pods_of(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    return list(cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"])


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def test_a_leaking_pod_is_replaced_by_a_surge_pod_ready_before_it_drains(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "surge"
    lock_file = cluster.run_dir / f"leak-{ns}.lock"
    spec = {
        "replicas": 2,
        "resources": {"gpus": 0, "softLimit": "1920Mi", "hardLimit": "2Gi"},
        "control": SPEC["control"] | {"leakAction": "Restart", "leakWindowSeconds": 30, "leakHorizonSeconds": 900},
        # the harness adds this env to the worker processes; the leak starts once the test creates the lock file
        "template": {"annotations": {"harness.moeguard.dev/test-env": json.dumps({
            "MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND": str(LEAK_RATE_BYTES_PER_SECOND),
            "MOEGUARD_FAULT_LEAK_LOCK_FILE": str(lock_file)})}},
    }
    start(cluster, ns, name, pod_workers, **spec)
    original = {p["metadata"]["name"] for p in pods_of(cluster, ns, name)}
    lock_file.touch()  # one of the two workers claims it and leaks from now on
    pid = int(wait(lambda: lock_file.read_text().strip() or None, DEADLINE, "a worker's claim on the leak"))
    lock_file.unlink()  # no other worker (the surge pod's included) can claim it
    leak_started = time.monotonic()
    (leaking,) = [key.split("/", 1)[1] for key, w in pod_workers.state().items()
                  if key.startswith(f"{ns}/") and w["pid"] == pid]
    assert leaking in original

    # Watch the pods until the leaking one is gone: the surge pod must be Ready before it is drained.
    seen: list[tuple[float, int, bool, bool, str | None]] = []  # (s, pods, surge pod ready, leaking deleting, cost)
    surge_pod, surge_ready_at, drained_at = None, None, None
    while time.monotonic() - leak_started < 300:
        pods = {p["metadata"]["name"]: p for p in pods_of(cluster, ns, name)}
        t = round(time.monotonic() - leak_started, 1)
        new = [p for n, p in pods.items() if n not in original and not p["metadata"].get("deletionTimestamp")]
        if new and surge_pod is None:
            surge_pod = new[0]["metadata"]["name"]
        surge_is_ready = surge_pod in pods and ready(pods[surge_pod])
        if surge_is_ready and surge_ready_at is None:
            surge_ready_at = t
        old = pods.get(leaking)
        deleting = old is None or bool(old["metadata"].get("deletionTimestamp"))
        if old is not None:
            restarts = sum(cs.get("restartCount", 0) for cs in old["status"].get("containerStatuses") or [])
            assert restarts == 0, (old["status"], seen[-5:])  # no OOM kill (nor any restart) of the leaking worker
        seen.append((t, len(pods), surge_is_ready, deleting,
                     None if old is None else (old["metadata"].get("annotations") or {}).get(DELETION_COST)))
        if deleting and drained_at is None:
            drained_at = t
        if old is None:
            break
        time.sleep(0.5)
    print(f"\nleak replacement (s since the leak started, pods, surge pod ready, leaking pod deleting, its deletion "
          f"cost): {seen[::4]}\nsurge pod {surge_pod} Ready at {surge_ready_at} s, {leaking} drained from "
          f"{drained_at} s")
    assert drained_at is not None and seen[-1][4] is None, seen[-5:]  # gone
    assert surge_pod is not None and surge_ready_at is not None, seen[-5:]
    assert surge_ready_at <= drained_at, seen  # Ready before the leaking pod was drained
    assert max(n for _, n, *_ in seen) == 3  # the surge: a third pod
    assert "-1000" in {cost for *_, cost in seen}  # the leaking pod went first by its deletion cost

    obj = wait_cr(cluster, ns, name, lambda o: not o["status"].get("leakReplacement")
                  and o["status"].get("readyReplicas") == 2, DEADLINE, "the replacement done, 2 ready replicas")
    assert cluster.kubectl_json("-n", ns, "get", "deployment", f"{name}-worker")["spec"]["replicas"] == 2
    assert obj["status"]["observed"]["oomKills"] == 0
    assert 0 < obj["status"]["observed"]["replacementReadySeconds"] < 300
    events = wait_event(cluster, ns, name, "Normal", "LeakReplacement", "surge:")
    assert not [e for e in events if e[1] in ("OOMKilled", "RestartingWorkers")], events
    surges = [m for t, r, m in events if r == "LeakReplacement" and t == "Normal" and m.startswith("surge:")]
    assert surges and f"pod {leaking} reaches hardLimit in" in surges[0], events
    assert "lead" in surges[0] and "ready time" in surges[0] and "(measured)" in surges[0], surges
    assert not [e for e in events if e[1] == "LeakReplacement" and e[0] == "Warning"], events
    assert (stack.condition(get(cluster, ns, name), "Ready") or {}).get("status") == "True"
