"""Issue 30 with the operator in the loop (``--policy predictive``), a real worker and the real Prometheus: expert
skew with room to spare changes no budget (the threshold policy halves maxPrefillTokens on the same burst:
test_control_loop's C7), and status shows the SLO attainment and each pod's predicted memory.

Scale as in test_control_loop: query interval 2 s, window 10 s; CPU workers (``resources.gpus`` 0: the memory
model is of the CPU path).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from harness import stack
from harness.loadgen.text import prompt_of_length, repetitive_prompt
from tests.integration.conftest import Cluster, PodWorkers
from tests.integration.e2e.helpers import get, operator_looks, reasons, wait, wait_cr, wait_event
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
    rounds = iter(range(10**6))

    def burst_then_look() -> dict[str, Any] | None:
        """Two repetitive prompts (skew ratios of 100 and more on this random-weight model) and two of real text,
        then the status: the skew must still be in the window when the pod's history first spans it (SLO
        attainment needs that), which one burst right after the start missed on a fast host (stop 46)."""
        i = next(rounds)
        for j in range(2):
            complete(url, repetitive_prompt(512, 0), max_tokens=1 + j)
            complete(url, prompt_of_length(300, offset=1000 * (2 * i + j)), max_tokens=4)
        obj = get(cluster, ns, name)
        return obj if skewed_and_measured(obj) else None

    seen = wait(burst_then_look, DEADLINE,
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
    obj = wait_cr(cluster, ns, name, budgets_applied("True"), DEADLINE, "BudgetsApplied True")
    cond = stack.condition(obj, "BudgetsApplied")
    assert cond is not None and cond["reason"] == "Applied", cond
    found = re.fullmatch(r"every reporting worker \(1\) runs budget generation (\d+)", cond["message"])
    assert found is not None and 1 <= int(found[1]) <= obj["status"]["budgetGeneration"], cond
    # The predictive operator decides overload from SLO attainment: its workers' own trigger leaves the queue out.
    cm = cluster.kubectl_json("-n", ns, "get", "configmap", f"{name}-budget")
    assert json.loads(cm["data"]["budget.json"])["overloadQueueTrigger"] is False


def budgets_applied(status: str) -> Any:
    """A ``wait_cr`` predicate: the object's BudgetsApplied condition has ``status``."""
    def pred(o: dict[str, Any]) -> bool:
        cond = stack.condition(o, "BudgetsApplied")
        return cond is not None and cond["status"] == status
    return pred


def test_a_document_the_worker_refuses_turns_budgets_applied_false_and_warns(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    """A document edited by hand with a long-request cap above the batch (the contract's rule: the worker refuses
    it and keeps its budgets, budget_watch.check_consistency): once the grace (windowSeconds + queryIntervalSeconds,
    12 s here) has passed, BudgetsApplied is False naming the pod and the generation it runs, with one Warning
    Event BudgetNotApplied."""
    ns, name = namespace, "refused"
    start(cluster, ns, name, pod_workers, resources=RESOURCES)
    wait_cr(cluster, ns, name, budgets_applied("True"), DEADLINE, "BudgetsApplied True")
    cm = cluster.kubectl_json("-n", ns, "get", "configmap", f"{name}-budget")
    doc = json.loads(cm["data"]["budget.json"])
    running = doc["generation"]
    doc["generation"] = running + 1
    doc["budgets"]["maxLongRequestsPerBatch"] = doc["budgets"]["maxBatchRequests"] + 1
    doc["updatedAt"] = datetime.now(UTC).isoformat()
    doc["reason"] = "edited by hand"
    cluster.kubectl("-n", ns, "patch", "configmap", f"{name}-budget", "--type", "merge",
                    "-p", json.dumps({"data": {"budget.json": json.dumps(doc)}}))
    obj = wait_cr(cluster, ns, name, budgets_applied("False"), DEADLINE, "BudgetsApplied False")
    cond = stack.condition(obj, "BudgetsApplied")
    assert cond is not None and cond["reason"] == "WorkersBehind", cond
    (pod,) = [p["metadata"]["name"] for p in cluster.kubectl_json(
        "-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"]]
    assert cond["message"].startswith(f"{pod} (generation {running}) still run(s) older budgets than generation "
                                      f"{running + 1}"), cond
    wait_event(cluster, ns, name, "Warning", "BudgetNotApplied", pod)


def test_loosening_follows_the_tpot_attainment_up_to_the_ceiling_and_back_never_below_the_spec(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, namespace: str) -> None:
    """Room and TPOT met: maxBatchRequests climbs above the spec's 16 toward its ceiling (24). The TPOT objective
    made unreachable (``spec.slo.interactive.tpotSeconds`` patched to 0.1 ms; the budgets stay, only a
    ``batching`` change resets them): each look undoes one loosening (pressure ``SloAttainment``) back to the
    spec's 16, and not below it."""
    ns, name = namespace, "tpot"
    batching = {**SPEC["batching"], "ceilings": {"maxBatchRequests": 24}}
    (url,) = start(cluster, ns, name, pod_workers, resources=RESOURCES, batching=batching, slo={"minRequests": 3})
    rounds = iter(range(10**6))

    def traffic() -> None:
        i = next(rounds)
        for j in range(3):
            complete(url, prompt_of_length(200, offset=1000 * (3 * i + j)), max_tokens=4)

    def batch_with_traffic(pred: Any) -> Any:
        def probe() -> dict[str, Any] | None:
            traffic()
            obj = get(cluster, ns, name)
            return obj if pred(obj["status"]["budgets"]["maxBatchRequests"]) else None
        return probe

    wait(batch_with_traffic(lambda n: n > 16), DEADLINE, "maxBatchRequests loosened above the spec's 16")
    wait_event(cluster, ns, name, "Normal", "BudgetRelaxed", "maxBatchRequests 16 -> 18")
    cluster.kubectl("-n", ns, "patch", "moeis", name, "--type", "merge",
                    "-p", json.dumps({"spec": {"slo": {"interactive": {"tpotSeconds": 0.0001}}}}))
    obj = wait(batch_with_traffic(lambda n: n == 16), DEADLINE, "maxBatchRequests back at the spec's 16")
    last = obj["status"]["lastAdjustment"]
    assert "one loosening undone" in last["reason"] and last["to"]["maxBatchRequests"] == 16, last
    assert last["from"]["maxBatchRequests"] == 18, last  # one step (0.1 x the ceiling 24) at a time
    events = wait_event(cluster, ns, name, "Normal", "BudgetTightened", "one loosening undone")
    assert any("TPOT below target with budgets above the spec's" in m for _, r, m in events if r == "BudgetTightened")
    looks = operator_looks(ns, name)
    seen: list[int] = []

    def three_more_looks() -> bool:
        traffic()
        seen.append(get(cluster, ns, name)["status"]["budgets"]["maxBatchRequests"])
        return operator_looks(ns, name) >= looks + 3

    wait(three_more_looks, DEADLINE, "three more looks with traffic")
    assert set(seen) == {16}, seen  # never below the spec's budget, and no climb while TPOT is missed
