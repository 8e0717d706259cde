"""Issue 12 §7: a native leak in a worker ends in MemoryLeakSuspected naming the kind ``native``.

The leak is the worker's test fault (``MOEGUARD_TEST_FAULTS=1``, anonymous memory mapped and touched at a
steady rate). ``spec.template.extraEnv`` may not set ``MOEGUARD_*``, so the test adds the fault's variables
to the worker Deployment by hand (another field manager, as a debugging admin would): the operator rewrites
its pod template only on a spec change, so the new pod runs with the fault and the harness passes its env
to the worker process.
"""

from __future__ import annotations

import json

from harness import stack
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import moeis, ready_status, wait_cr, wait_event

LEAK_BYTES_PER_SECOND = 2_000_000
"""120 MB/min: 4Gi of hardLimit is ~30 min away, well within the default 12 h horizon."""
SPEC = {"model": {"preset": "tiny"}, "replicas": 1,
        "resources": {"gpus": 1, "softLimit": "3Gi", "hardLimit": "4Gi"},
        "control": {"queryIntervalSeconds": 2, "windowSeconds": 10, "leakWindowSeconds": 30}}
DEADLINE_SECONDS = 240
# The operator's full leak warm-up (90 s), not the short one of test_signals_e2e: in a worker's first minute
# its RSS grows as python_heap, and a judgement that early names python_heap before the native fault dominates
# (a rehearsal with a 20-s warm-up: MemoryLeakSuspected ended NativeLeak, but its Warning Event said python_heap).


def test_a_native_leak_is_named_native(cluster: Cluster, operator: None, pod_workers: PodWorkers,
                                       namespace: str) -> None:
    ns, name = namespace, "leaky"
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=moeis(name, **SPEC))
    wait_cr(cluster, ns, name, lambda o: ready_status(o) == "True", 180, "Ready=True")
    fault = [{"name": "MOEGUARD_TEST_FAULTS", "value": "1"},
             {"name": "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND", "value": str(LEAK_BYTES_PER_SECOND)}]
    cluster.kubectl("-n", ns, "patch", "deployment", f"{name}-worker", "--type", "strategic", "-p",
                    json.dumps({"spec": {"template": {"spec": {"containers": [{"name": "worker", "env": fault}]}}}}))

    def leak_named(o: dict) -> bool:  # type: ignore[type-arg]
        cond = stack.condition(o, "MemoryLeakSuspected") or {}
        return cond.get("status") == "True" and cond.get("reason") == "NativeLeak"

    obj = wait_cr(cluster, ns, name, leak_named, DEADLINE_SECONDS, "MemoryLeakSuspected=True, NativeLeak")
    cond = stack.condition(obj, "MemoryLeakSuspected")
    assert cond is not None and cond["message"].startswith("native leak suspected: RSS +"), cond
    assert "hardLimit reached in" in cond["message"]
    assert obj["status"]["observed"]["leakKinds"] == ["native"]
    print(f"\nMemoryLeakSuspected: {cond['message']}")
    wait_event(cluster, ns, name, "Warning", "MemoryLeakSuspected", "native leak suspected")
