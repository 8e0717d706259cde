"""Issue 30 with the operator in the loop (``--policy predictive``), a real worker and the real Prometheus: expert
skew with room to spare changes no budget (the threshold policy halves maxPrefillTokens on the same burst:
test_control_loop's C7), and status shows the SLO attainment and each pod's predicted memory.

Scale as in test_control_loop: query interval 2 s, window 10 s; CPU workers (``resources.gpus`` 0: the memory
model is of the CPU path).
"""

from __future__ import annotations

import re
from typing import Any

from harness import stack
from harness.loadgen.text import prompt_of_length, repetitive_prompt
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import get, operator_looks, reasons, wait, wait_cr
from tests.integration.e2e.test_control_loop import DEADLINE, SPEC, complete, start

OPERATOR_EXTRA_ARGS = ("--policy", "predictive")
RESOURCES = {"gpus": 0, "softLimit": "3Gi", "hardLimit": "4Gi"}


def observed(obj: dict[str, Any]) -> dict[str, Any]:
    return dict((obj.get("status") or {}).get("observed") or {})


def skewed_and_measured(obj: dict[str, Any]) -> bool:
    seen = observed(obj)
    interactive = [c for c in seen.get("slo") or [] if c["priority"] == "interactive"]
    return ((seen.get("skewRatio") or 0) > SPEC["control"]["skewThreshold"] and bool(seen.get("predictedMemory"))
            and bool(interactive) and (interactive[0].get("requests") or 0) > 0)


def test_skew_with_room_changes_no_budget_and_status_shows_slo_attainment(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    ns, name = namespace, "room"
    (url,) = start(cluster, ns, name, pod_workers, resources=RESOURCES)
    initial = get(cluster, ns, name)["status"]["budgets"]
    for i in range(6):  # repetitive prompts: skew ratios of 100 and more on this random-weight model
        complete(url, repetitive_prompt(512, 0), max_tokens=1 + i % 2)
    for i in range(6):
        complete(url, prompt_of_length(300, offset=1000 * i), max_tokens=4)
    seen = wait_cr(cluster, ns, name, skewed_and_measured, DEADLINE,
                   f"skew above {SPEC['control']['skewThreshold']}, SLO attainment and predicted memory in status")
    looks = operator_looks(ns, name)
    wait(lambda: operator_looks(ns, name) >= looks + 3, DEADLINE, "three more looks")
    obj = get(cluster, ns, name)

    assert obj["status"]["budgets"] == initial  # the skew had room: nothing tightened
    assert "BudgetTightened" not in [r for _, r, _ in reasons(cluster, ns, name)]
    tightened = stack.condition(obj, "BudgetTightened")
    assert tightened is not None and (tightened["status"], tightened["reason"]) == ("False", "AtCeilings")

    (interactive,) = [c for c in observed(seen)["slo"] if c["priority"] == "interactive"]
    assert 0.0 <= interactive["ttftAttainment"] <= 1.0 and 0.0 <= interactive["tpotAttainment"] <= 1.0
    assert interactive["target"] == 0.9 and interactive["finished"] > 0
    (pod,) = observed(seen)["predictedMemory"]
    hard = 4 * 2**30
    assert 0 < pod["idleFootprintBytes"] < pod["predictedPeakBytes"] < 3 * 2**30 < hard
    assert pod["headroomBytes"] == 3 * 2**30 - pod["predictedPeakBytes"] > 0
    # The worker runs the ConfigMap's document, read back through Prometheus (moeguard_budget_generation).
    def applied(o: dict[str, Any]) -> bool:
        cond = stack.condition(o, "BudgetsApplied")
        return cond is not None and cond["status"] == "True"

    obj = wait_cr(cluster, ns, name, applied, DEADLINE, "BudgetsApplied True")
    cond = stack.condition(obj, "BudgetsApplied")
    assert cond is not None and cond["reason"] == "Applied", cond
    found = re.fullmatch(r"every reporting worker \(1\) runs budget generation (\d+)", cond["message"])
    assert found is not None and 1 <= int(found[1]) <= obj["status"]["budgetGeneration"], cond
