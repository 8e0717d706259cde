"""Issue 33 §4 with the operator in the loop: the prefill role of a MoEInferenceService is controlled as a service
of its own. Its pods' budgets come from ``spec.prefill.batching`` through their own ConfigMap, ``status.prefill``
reports them Ready with their own observations, and a leak in a prefill pod (``leakAction: Restart``, the predictive
policy) replaces that prefill pod only: the decode pod is never restarted nor replaced, and the service's own status
never suspects a leak.

Scale and leak as in test_leak_replacement_e2e (query interval 2 s, window 10 s, 30-s leak window, the short
warm-up, 8 MiB/s from ~450 MiB to a 2-GiB hard limit), with one pod per role.
"""

from __future__ import annotations

import json
import time
from typing import Any

from harness import stack
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import TEST_LEAK_WARMUP_SECONDS, get, moeis, wait, wait_cr
from tests.integration.e2e.test_control_loop import SPEC

OPERATOR_EXTRA_ARGS = ("--policy", "predictive", "--leak-warmup-seconds", str(TEST_LEAK_WARMUP_SECONDS))
LEAK_RATE_BYTES_PER_SECOND = 8 << 20


def _pods(cluster: Cluster, ns: str, instance: str) -> dict[str, dict[str, Any]]:
    items = cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={instance}")["items"]
    return {p["metadata"]["name"]: p for p in items}


def _restarts(pod: dict[str, Any]) -> int:
    return sum(cs.get("restartCount", 0) for cs in pod["status"].get("containerStatuses") or [])


def test_a_prefill_pods_leak_replaces_it_and_never_touches_the_decode_pod(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "roles"
    lock_file = cluster.run_dir / f"leak-{ns}.lock"
    leak_env = {"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND": str(LEAK_RATE_BYTES_PER_SECOND),
                "MOEGUARD_FAULT_LEAK_LOCK_FILE": str(lock_file)}
    spec = SPEC | {
        "resources": {"gpus": 0, "softLimit": "1920Mi", "hardLimit": "2Gi"},
        "control": SPEC["control"] | {"leakAction": "Restart", "leakWindowSeconds": 30, "leakHorizonSeconds": 900},
        "prefill": {"replicas": 1, "batching": {"maxPrefillTokens": 1024, "maxDecodeTokens": 16,
                                                "floors": {"maxPrefillTokens": 128}},
                    # only the prefill pods can claim the leak (the harness adds this env to their processes)
                    "template": {"annotations": {"harness.moeguard.dev/test-env": json.dumps(leak_env)}}},
    }
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **spec))

    def prefill_ready(o: dict[str, Any]) -> bool:
        role = (o.get("status") or {}).get("prefill") or {}
        return stack.condition(o, "Ready") is not None and stack.condition(o, "Ready")["status"] == "True" \
            and any(c["type"] == "Ready" and c["status"] == "True" for c in role.get("conditions") or [])

    obj = wait_cr(cluster, ns, name, prefill_ready, 180, "Ready=True and status.prefill Ready=True")
    role = obj["status"]["prefill"]
    assert role["budgets"]["maxPrefillTokens"] == 1024 and obj["status"]["budgets"]["maxPrefillTokens"] == 2048
    assert role["selector"] == f"app.kubernetes.io/name=moeguard-worker,app.kubernetes.io/instance={name}-prefill"
    (decode_pod,) = _pods(cluster, ns, name).values()
    decode_uid = decode_pod["metadata"]["uid"]
    original_prefill = set(_pods(cluster, ns, f"{name}-prefill"))

    lock_file.touch()  # the prefill worker claims it and leaks from now on
    wait(lambda: lock_file.read_text().strip() or None, 120, "the prefill worker's claim on the leak")
    lock_file.unlink()  # its replacement cannot claim it again
    started = time.monotonic()
    replaced = None
    while time.monotonic() - started < 300:
        prefill = _pods(cluster, ns, f"{name}-prefill")
        decode = _pods(cluster, ns, name)
        assert [p["metadata"]["uid"] for p in decode.values()] == [decode_uid], decode  # never replaced
        assert _restarts(next(iter(decode.values()))) == 0  # nor restarted
        if not original_prefill & set(prefill) and prefill:
            replaced = round(time.monotonic() - started, 1)
            break
        time.sleep(1)
    assert replaced is not None, "the leaking prefill pod was not replaced within 300 s"
    obj = get(cluster, ns, name)
    root_leak = stack.condition(obj, "MemoryLeakSuspected")
    assert root_leak is None or root_leak["status"] != "True", root_leak  # the decode pods never suspected
    events = cluster.kubectl_json("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")
    messages = [e.get("message", "") for e in events["items"]]
    assert any(m.startswith("prefill role:") and "leak" in m.lower() for m in messages), messages
    print(f"\nthe leaking prefill pod was replaced {replaced} s after the leak began; the decode pod untouched")
