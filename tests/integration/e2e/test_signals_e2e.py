"""Issue 18 §3–4 with the operator in the loop, real workers and the real Prometheus: a service re-created
under the same name is not tightened at birth by its predecessor's series, and an idle service climbs back
to its ceilings after a skew burst (no batches: no skew data, not the last value forever).

Scale as in test_control_loop: query interval 2 s, window 10 s, stabilization 6 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any

from harness import stack
from harness.loadgen.text import repetitive_prompt
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import (
    TEST_LEAK_WARMUP_SECONDS,
    THRESHOLD_POLICY,
    get,
    wait,
    wait_cr,
)
from tests.integration.e2e.test_control_loop import (  # noqa: F401 - restore_prometheus is a fixture
    SPEC,
    complete,
    prometheus_pid,
    restore_prometheus,
    start,
)

DEADLINE = 120
OPERATOR_EXTRA_ARGS = (*THRESHOLD_POLICY, "--leak-warmup-seconds", str(TEST_LEAK_WARMUP_SECONDS))


def prefill(obj: dict[str, Any]) -> int:
    return int(obj["status"]["budgets"]["maxPrefillTokens"])


def burst(url: str) -> None:
    for i in range(4):
        complete(url, repetitive_prompt(512, 0), max_tokens=1 + i % 2)


def test_a_service_recreated_under_the_same_name_is_not_tightened_at_birth(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "again"
    control = SPEC["control"] | {"windowSeconds": 60}  # the old pod's samples stay in the window throughout
    (url,) = start(cluster, ns, name, pod_workers, control=control)
    burst(url)
    wait_cr(cluster, ns, name, lambda o: prefill(o) < 2048, 60, "the first service tightened")
    burst(url)  # its pod keeps serving skewed batches until the very end
    old_pods = {p["metadata"]["name"] for p in cluster.kubectl_json("-n", ns, "get", "pods")["items"]}
    cluster.kubectl("-n", ns, "delete", "moeis", name, "--wait=true", timeout=120)
    wait(lambda: not cluster.kubectl_json("-n", ns, "get", "pods")["items"], 60, "the old pods gone")
    deleted = time.monotonic()
    (url,) = start(cluster, ns, name, pod_workers, control=control)
    new_pods = {p["metadata"]["name"] for p in cluster.kubectl_json("-n", ns, "get", "pods")["items"]}
    assert not new_pods & old_pods
    # Within the old pod's skew window (60 s): the new service keeps its initial budgets.
    seen = []
    while time.monotonic() - deleted < 45:
        obj = get(cluster, ns, name)
        seen.append((prefill(obj), (obj["status"].get("observed") or {}).get("skewRatio")))
        assert prefill(obj) == 2048, seen
        time.sleep(1)
    events = cluster.kubectl_json("-n", ns, "get", "events", "--field-selector",
                                  f"involvedObject.name={name},reason=BudgetTightened")["items"]
    assert all(e["metadata"]["creationTimestamp"] < obj["metadata"]["creationTimestamp"] for e in events), events


def test_an_idle_service_climbs_back_after_a_burst(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "idle"
    (url,) = start(cluster, ns, name, pod_workers)
    burst(url)
    tight = wait_cr(cluster, ns, name, lambda o: prefill(o) < 2048, 60, "tightened")
    # No traffic at all from here: the burst leaves the window, and the budgets climb back to their ceilings.
    back = wait_cr(cluster, ns, name, lambda o: prefill(o) == 2048, DEADLINE, "back at the ceilings")
    assert prefill(tight) < 2048 and back["status"]["observed"].get("skewRatio") is None
    reasons = [e["reason"] for e in cluster.kubectl_json("-n", ns, "get", "events", "--field-selector",
                                                         f"involvedObject.name={name}")["items"]]
    assert "BudgetRelaxed" in reasons
    assert SPEC["batching"]["maxPrefillTokens"] == 2048


def test_a_rollout_under_skew_is_not_tightened_by_the_old_pods_series(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    """The old ReplicaSet's pod serves skewed batches until it goes; once it is no longer Running, its series
    (still inside the 60 s window) never tighten the new pod's service again."""
    ns, name = namespace, "roll"
    # One tightening per 20 s, down to a floor of 32 (six halvings from 2,048: two minutes of cooldowns), so the
    # budget is still above its floor when the old pod goes and a tightening by its series (inside the 60 s window)
    # would show. A floor of 256 (three halvings) was reached before a slow rollout ended (CI of stop 38).
    control = SPEC["control"] | {"windowSeconds": 60, "cooldownSeconds": 20}
    floor = 32
    batching = SPEC["batching"] | {"floors": {"maxPrefillTokens": floor}}
    (url,) = start(cluster, ns, name, pod_workers, control=control, batching=batching)
    (old_pod,) = [p["metadata"]["name"] for p in cluster.kubectl_json("-n", ns, "get", "pods")["items"]]
    burst(url)
    wait_cr(cluster, ns, name, lambda o: prefill(o) < 2048, DEADLINE, "tightened under skew")
    burst(url)
    cluster.kubectl("-n", ns, "patch", "moeis", name, "--type=merge", "-p",
                    json.dumps({"spec": {"ucx": {"mode": "rcache"}}}))  # rolls the workers

    def old_gone() -> bool:
        pods = cluster.kubectl_json("-n", ns, "get", "pods")["items"]
        return all(p["metadata"]["name"] != old_pod or p["metadata"].get("deletionTimestamp") for p in pods)

    wait(old_gone, DEADLINE, f"{old_pod} leaving")
    time.sleep(3)  # one look in flight may still have counted it while it was Running
    held = prefill(get(cluster, ns, name))
    assert held > floor, held  # above the floor: a further tightening could happen
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 40:
        obj = get(cluster, ns, name)
        seen.append((prefill(obj), (obj["status"].get("observed") or {}).get("skewRatio")))
        assert prefill(obj) >= held, seen
        time.sleep(1)
    assert old_pod not in {p["metadata"]["name"] for p in cluster.kubectl_json("-n", ns, "get", "pods")["items"]
                           if not p["metadata"].get("deletionTimestamp")}


def test_after_prometheus_restarts_with_wiped_data_nothing_is_concluded_or_loosened_until_the_windows_fill(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str,
        restore_prometheus: None) -> None:  # noqa: F811 - the fixture imported above
    """Issue 18 §5: with its data wiped, Prometheus holds seconds of history; the leak is Unknown
    (InsufficientHistory), never RSSFlat from a few samples, and budgets hold until the leak window (30 s)
    has filled again."""
    ns, name = namespace, "wiped"
    lw = 30
    control = SPEC["control"] | {"leakWindowSeconds": lw, "leakHorizonSeconds": 60}
    (url,) = start(cluster, ns, name, pod_workers, control=control)
    # the first judged leak window starts after the worker's warm-up (the operator's --leak-warmup-seconds)
    wait_cr(cluster, ns, name, lambda o: (stack.condition(o, "MemoryLeakSuspected") or {}).get("reason") == "RSSFlat",
            DEADLINE + TEST_LEAK_WARMUP_SECONDS + lw, "a judged leak window (RSSFlat)")
    burst(url)
    tight = prefill(wait_cr(cluster, ns, name, lambda o: prefill(o) < 2048, 60, "tightened"))
    pid = prometheus_pid(cluster)
    os.kill(pid, signal.SIGTERM)
    wait(lambda: not os.path.exists(f"/proc/{pid}"), 120, "Prometheus to exit")  # slow to shut down on a loaded machine
    data = cluster.run_dir / "prometheus" / "data"
    shutil.rmtree(data)
    data.mkdir()
    # Prometheus scrapes nothing before cluster-up.sh starts it, so no pod can have a full leak window before
    # `launched` + lw; cluster-up.sh returns only once Prometheus is ready, which under load can be seconds
    # after its first scrape (CI, stop 42: judged 23.8 s after `back`, about 30 s after the first scrape).
    launched = time.monotonic()
    subprocess.run([str(stack.ROOT / "hack" / "cluster-up.sh")], env={**os.environ, "MOEGUARD_RUN_DIR": str(cluster.run_dir)},
                   check=True, capture_output=True, timeout=300)
    back = time.monotonic()
    print(f"\ncluster-up.sh took {back - launched:.1f} s")
    # (s since cluster-up.sh returned, s since it was launched, MemoryLeakSuspected, reason, maxPrefillTokens)
    seen: list[tuple[float, float, str, str, int]] = []
    while time.monotonic() - back < lw + 30:
        obj = get(cluster, ns, name)
        leak = stack.condition(obj, "MemoryLeakSuspected") or {}
        now = time.monotonic()
        seen.append((round(now - back, 1), round(now - launched, 1), leak.get("status", ""), leak.get("reason", ""),
                     prefill(obj)))
        if prefill(obj) > tight:
            break
        time.sleep(1)
    print(f"after the wiped restart (s, s since launch, MemoryLeakSuspected, reason, maxPrefillTokens): {seen}")
    assert any(reason == "InsufficientHistory" for *_, reason, _ in seen), seen
    # Until the operator's first look at the new Prometheus (one query interval, 2 s here), status still
    # shows the last judgement made before the wipe; from that look on, nothing is concluded.
    first = next(i for i, (*_, reason, _) in enumerate(seen) if reason == "InsufficientHistory")
    assert seen[first][0] <= 5, seen
    early = [s for s in seen if s[1] < lw - 2]  # 2 s for the operator's query interval
    assert all(budget == tight for *_, budget in early), seen
    assert all(status == "Unknown" for _, _, status, _, _ in early[first:]), seen
    rose = next((t for _, t, _, _, budget in seen if budget > tight), None)
    assert rose is not None and rose >= lw - 2, seen  # and then control resumes
