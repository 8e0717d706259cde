"""One service's step of the control loop (tick.py), pure: readiness from the pods, the ConfigMap as the source
of truth, the blind floor (downtime, outages and gaps are blind), and no write when nothing changed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tests.unit.operator.test_diagnosis import DRILLS

from moeguard_core.contract import BudgetDocument
from moeguard_operator.diagnosis.diagnosis import DiagnosisMemory
from moeguard_operator.loop import budget_document, report, tick
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.policy import initial_budgets
from moeguard_operator.loop.signals import DiagnosisSignals
from moeguard_operator.spec.models import (
    ControlStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec.model_validate({
    "replicas": 1,
    "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64, "maxBatchRequests": 16, "maxConcurrentBatches": 2},
    "control": {"skewThreshold": 8, "cooldownSeconds": 2, "windowSeconds": 10, "queryIntervalSeconds": 2,
                "stabilizationWindowSeconds": 30},
})
START = initial_budgets(SPEC.batching)
TIGHT = START.model_copy(update={"max_prefill_tokens": 1024})


def pod(name: str, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = NOW.isoformat()
    return {"metadata": meta, "status": {"phase": "Running", "startTime": (NOW - timedelta(hours=1)).isoformat(),
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def status(budgets: Any = TIGHT, generation: int = 3, last_pressure: datetime | None = None,
           last_blind: datetime | None = None) -> MoEInferenceServiceStatus:
    doc = BudgetDocument(generation=generation, budgets=budgets)
    base = report.reconciled(MoEInferenceServiceStatus(), SPEC, doc, "a=b", NOW - timedelta(hours=1), 1)
    ready = report.readiness(base, SPEC, 1, None, NOW - timedelta(hours=1), 1)
    return ready.model_copy(update={"control": ControlStatus(
        last_change_time=NOW - timedelta(hours=1), last_pressure_time=last_pressure, last_blind_time=last_blind,
        oom_checked_time=NOW - timedelta(hours=1))})


def data(budgets: Any, generation: int) -> dict[str, str]:
    return budget_document.for_budgets(SPEC, budgets, "Off", generation, "test", NOW - timedelta(seconds=5),
                                       policy="threshold").to_configmap_data()


def calm(when: datetime = NOW) -> Observation:
    return Observation(time=when, skew_ratio=1.5, memory_ratio=0.3, expected_pods=("w-0",), reporting_pods=("w-0",))


def test_ready_pods_count_the_ready_condition_of_pods_not_being_deleted() -> None:
    pods = [pod("a"), pod("b", ready=False), pod("c", deleting=True), {"metadata": {"name": "d"}}]
    assert tick.ready_pods(pods) == 1


def test_readiness_comes_from_the_pods_not_a_deployment() -> None:
    prior = status()
    lost = tick.readiness_step(prior, SPEC, [pod("w-0", ready=False)], data(TIGHT, 3), NOW, 1)
    ready = report.find_condition(lost.status.conditions, "Ready")
    assert ready is not None and (ready.status, ready.message) == ("False", "0/1 worker pods ready")
    back = tick.readiness_step(lost.status, SPEC, [pod("w-0")], data(TIGHT, 3), NOW, 1)
    assert back.status == prior.model_copy(update={"conditions": back.status.conditions})
    assert report.status_patch(prior, tick.readiness_step(prior, SPEC, [pod("w-0")], data(TIGHT, 3), NOW, 1).status) == {}


def test_a_configmap_ahead_of_status_is_the_truth_and_status_catches_up() -> None:
    # Killed between the ConfigMap (generation 4, tighter) and the status (still generation 3).
    prior = status(TIGHT, 3)
    tighter = TIGHT.model_copy(update={"max_prefill_tokens": 512})
    step = tick.readiness_step(prior, SPEC, [pod("w-0")], data(tighter, 4), NOW, 1)
    assert (step.status.budgets, step.status.budget_generation) == (tighter, 4)
    assert report.status_patch(prior, step.status)["budgetGeneration"] == 4
    # A ConfigMap behind status (an old document) changes nothing.
    assert tick.readiness_step(prior, SPEC, [pod("w-0")], data(START, 2), NOW, 1).status == prior


def test_a_reconcile_never_writes_back_the_budgets_of_a_lagging_status() -> None:
    prior, tighter = status(TIGHT, 3), TIGHT.model_copy(update={"max_prefill_tokens": 512})
    doc = budget_document.for_spec(SPEC, prior, data(tighter, 4), NOW, policy="threshold")
    assert (doc.budgets, doc.generation) == (tighter, 4)
    assert budget_document.to_apply(data(tighter, 4), doc) is None  # nothing to write: the ConfigMap holds it


@pytest.mark.parametrize("blind_floor_age, climbs", [(5, False), (29, False), (31, True)])
def test_a_climb_needs_a_full_window_since_the_blind_floor(blind_floor_age: int, climbs: bool) -> None:
    # Pressure ended an hour ago (persisted); the process started, or the API came back, blind_floor_age s ago.
    prior = status(TIGHT, 3, last_pressure=NOW - timedelta(hours=1), last_blind=NOW - timedelta(hours=1))
    floor = NOW - timedelta(seconds=blind_floor_age)
    step = tick.look_step(prior, SPEC, [pod("w-0")], data(TIGHT, 3), calm(), floor, NOW, 1)
    assert step.decision is not None and (step.decision.direction == "up") is climbs
    assert (step.document is not None) is climbs
    if not climbs:
        assert step.status.budgets == TIGHT and "waiting for the stabilization window" in step.decision.reason


def test_a_crash_looping_pod_is_named_in_status_and_holds_the_budgets() -> None:
    # Calm for an hour, but w-1 is in the kubelet's back-off (as the harness writes it): no climb, named.
    prior = status(TIGHT, 3, last_pressure=NOW - timedelta(hours=1), last_blind=NOW - timedelta(hours=1))
    looping = pod("w-1", ready=False)
    looping["status"]["containerStatuses"] = [{
        "name": "worker", "ready": False, "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"reason": "Error", "exitCode": 3}}}]
    step = tick.look_step(prior, SPEC, [pod("w-0"), looping], data(TIGHT, 3), calm(), NOW - timedelta(hours=1),
                          NOW, 1)
    assert step.decision is not None and step.decision.direction == "hold"
    assert "crash-looping pods w-1: not loosening" in step.decision.reason
    assert step.status.budgets == TIGHT and step.document is None
    assert step.status.observed is not None and step.status.observed.crash_looping_pods == ["w-1"]


def test_the_last_change_of_a_configmap_ahead_of_status_counts_for_the_cooldown() -> None:
    # A tightening reached the ConfigMap 5 s ago, its status did not: the loop must not move again in cooldown.
    spec = SPEC.model_copy(update={"control": SPEC.control.model_copy(update={"cooldown_seconds": 30})})
    prior = status(TIGHT, 3)
    tighter = TIGHT.model_copy(update={"max_prefill_tokens": 512})
    skewed = Observation(time=NOW, skew_ratio=20.0, memory_ratio=0.3, expected_pods=("w-0",), reporting_pods=("w-0",))
    step = tick.look_step(prior, spec, [pod("w-0")], data(tighter, 4), skewed, NOW - timedelta(hours=1), NOW, 1)
    assert step.decision is not None and step.decision.direction == "hold" and step.document is None
    assert step.status.budgets == tighter and step.status.budget_generation == 4


def test_an_unchanged_look_writes_nothing() -> None:
    prior = status(TIGHT, 3, last_pressure=NOW - timedelta(hours=1), last_blind=NOW - timedelta(hours=1))
    floor = NOW - timedelta(seconds=5)
    first = tick.look_step(prior, SPEC, [pod("w-0")], data(TIGHT, 3), calm(), floor, NOW, 1).status
    later = NOW + timedelta(seconds=2)
    second = tick.look_step(first, SPEC, [pod("w-0")], data(TIGHT, 3), calm(later), floor, later, 1).status
    assert report.status_patch(first, second) == {}
    assert second.observed is not None and second.observed.time == NOW
    moved = Observation(time=later, skew_ratio=2.5, memory_ratio=0.3, expected_pods=("w-0",), reporting_pods=("w-0",))
    third = tick.look_step(first, SPEC, [pod("w-0")], data(TIGHT, 3), moved, floor, later, 1).status
    assert sorted(report.status_patch(first, third)) == ["observed"]
    assert third.observed is not None and third.observed.time == later


def test_blind_looks_do_not_rewrite_the_blind_time() -> None:
    prior = status(TIGHT, 3, last_blind=NOW - timedelta(hours=1))
    blind = Observation(time=NOW, error="Prometheus at http://p: PrometheusTimeout", expected_pods=("w-0",))
    first = tick.look_step(prior, SPEC, [pod("w-0")], data(TIGHT, 3), blind, NOW, NOW, 1).status
    assert first.control is not None and first.control.last_blind_time == NOW - timedelta(hours=1)
    later = NOW + timedelta(seconds=2)
    second = tick.look_step(first, SPEC, [pod("w-0")], data(TIGHT, 3), blind, later, later, 1).status
    assert report.status_patch(first, second) == {}


def test_a_hand_edited_configmap_is_not_adopted_but_its_generation_is_respected() -> None:
    prior = status(TIGHT, 3)
    edited = START.model_copy(update={"max_prefill_tokens": 700})
    step = tick.readiness_step(prior, SPEC, [pod("w-0")], data(edited, 50), NOW, 1, ours=False)
    assert (step.status.budgets, step.status.budget_generation) == (TIGHT, 3)
    skewed = Observation(time=NOW, skew_ratio=20.0, memory_ratio=0.3, expected_pods=("w-0",), reporting_pods=("w-0",))
    look = tick.look_step(prior, SPEC, [pod("w-0")], data(edited, 50), skewed, NOW - timedelta(hours=1), NOW, 1,
                          ours=False)
    assert look.document is not None and look.document.generation == 51
    assert look.document.budgets.max_prefill_tokens == TIGHT.max_prefill_tokens // 2


@pytest.mark.parametrize("managed, ours", [
    ([{"manager": "moeguard", "operation": "Apply", "fieldsV1": {"f:data": {"f:budget.json": {}}}}], True),
    ([{"manager": "moeguard", "operation": "Apply", "fieldsV1": {"f:metadata": {}}},
      {"manager": "kubectl-patch", "operation": "Update", "fieldsV1": {"f:data": {"f:budget.json": {}}}}], False),
    (None, False),
])
def test_whose_document_a_configmap_holds_comes_from_its_managed_fields(managed: Any, ours: bool) -> None:
    assert budget_document.written_by(managed, "moeguard") is ours


def test_a_finding_writes_diagnosis_a_condition_and_one_event_then_clears_with_one_more() -> None:
    burst_pod, _ = DRILLS["BurstOverlap"]
    calm_pod, _ = DRILLS["calm"]
    spec = SPEC.model_copy(update={"resources": SPEC.resources.model_copy(update={"hard_limit": 4 * 2**30})})

    def obs(pod_signals: Any, when: datetime) -> Observation:
        return Observation(time=when, skew_ratio=1.5, memory_ratio=0.3, skew_steps=5, expected_pods=("w-0",),
                           reporting_pods=("w-0",), signals=DiagnosisSignals(pods=(pod_signals,)))

    prior = status(START, 3, last_pressure=NOW - timedelta(hours=1), last_blind=NOW - timedelta(hours=1))
    floor = NOW - timedelta(hours=1)
    first = tick.look_step(prior, spec, [pod("w-0")], data(START, 3), obs(burst_pod, NOW), floor, NOW, 1,
                           diagnosis=DiagnosisMemory(blind_at=floor))
    assert first.diagnosis is not None and first.status.diagnosis is not None
    assert [f.kind for f in first.status.diagnosis.findings] == ["BurstOverlap"]
    cond = report.find_condition(first.status.conditions, "BurstOverlap")
    assert cond is not None and (cond.status, cond.reason, cond.observed_generation) == ("True", "BurstOverlap", 1)
    assert cond.message == first.status.diagnosis.findings[0].message
    started = [e for e in first.events if e.reason == "BurstOverlap"]
    assert len(started) == 1 and started[0].type == "Warning" and "Remedy: " in started[0].message
    assert first.decision is not None  # the budgets are the policy's: the same with or without the finding
    plain = tick.look_step(prior, spec, [pod("w-0")], data(START, 3), obs(calm_pod, NOW), floor, NOW, 1)
    assert plain.decision == first.decision and plain.document == first.document

    # The same look again: only times move, nothing to write, no Event.
    later = NOW + timedelta(seconds=2)
    again = tick.look_step(first.status, spec, [pod("w-0")], data(START, 3), obs(burst_pod, later), floor, later, 1,
                           diagnosis=first.diagnosis.memory)
    assert report.status_patch(first.status, again.status) == {}
    assert not [e for e in again.events if e.reason.startswith("BurstOverlap")]
    assert again.diagnosis is not None

    # After an operator restart: restored from status, no second start Event.
    restarted = tick.look_step(first.status, spec, [pod("w-0")], data(START, 3), obs(burst_pod, later), later,
                               later, 1)
    assert not [e for e in restarted.events if e.reason.startswith("BurstOverlap")]

    # Calm for the hold (max(2 × 10 s, 60 s)): cleared, condition False/Cleared, one Normal Event.
    memory, current = again.diagnosis.memory, again.status
    events: list[report.Event] = []
    for t in range(4, 64, 2):
        when = NOW + timedelta(seconds=t)
        step = tick.look_step(current, spec, [pod("w-0")], data(START, 3), obs(calm_pod, when), floor, when, 1,
                              diagnosis=memory)
        assert step.diagnosis is not None
        memory, current = step.diagnosis.memory, step.status
        events += [e for e in step.events if "BurstOverlap" in e.reason]
    assert [(e.type, e.reason) for e in events] == [("Normal", "BurstOverlapCleared")]
    cond = report.find_condition(current.conditions, "BurstOverlap")
    assert cond is not None and (cond.status, cond.reason) == ("False", "Cleared")
    assert current.diagnosis is not None and current.diagnosis.findings == []


def test_the_policy_flag_picks_the_decide_and_status_shows_slo_and_predicted_memory() -> None:
    """``--policy predictive`` (issue 30): the same step, the predictive decide; status carries the SLO
    attainment (both policies) and each pod's predicted peak (predictive only)."""
    from tests.unit.operator.test_predictive import MET, MET_TPOT, loads
    from tests.unit.operator.test_predictive import SPEC as PREDICTIVE

    from moeguard_operator.loop.observation import ClassLatency

    prior = report.reconciled(MoEInferenceServiceStatus(), PREDICTIVE,
                              BudgetDocument(generation=1, budgets=initial_budgets(PREDICTIVE.batching)), "a=b",
                              NOW - timedelta(hours=1), 1)
    skewed = Observation(time=NOW, skew_ratio=384.0, skew_steps=40, memory_ratio=0.74, expected_pods=("w-0", "w-1"),
                         reporting_pods=("w-0", "w-1"), pod_loads=loads(skew=384.0),
                         latency=(ClassLatency("interactive", MET, MET_TPOT),))
    pods = [pod("w-0"), pod("w-1")]
    floor = NOW - timedelta(seconds=5)  # just started: blind until now, so nothing may climb
    old = tick.look_step(prior, PREDICTIVE, pods, None, skewed, floor, NOW, 1)
    new = tick.look_step(prior, PREDICTIVE, pods, None, skewed, floor, NOW, 1, policy="predictive")
    assert old.decision is not None and old.decision.direction == "down"  # threshold: skew 384 > 32 halves
    assert new.decision is not None and new.decision.direction == "hold" and new.document is None
    for step in (old, new):
        assert step.status.observed is not None
        (interactive,) = step.status.observed.slo
        assert (interactive.priority, interactive.ttft_attainment, interactive.tpot_attainment, interactive.met) == (
            "interactive", 0.95, 0.95, True)
    assert old.status.observed is not None and old.status.observed.predicted_memory == []
    assert new.status.observed is not None
    assert [(m.pod, round(m.headroom_bytes / 2**20)) for m in new.status.observed.predicted_memory] == [
        ("w-0", 132), ("w-1", 132)]
    patch = report.status_patch(prior, new.status)
    assert patch["observed"]["slo"][0]["ttftAttainment"] == 0.95
    assert patch["observed"]["predictedMemory"][0]["idleFootprintBytes"] == 799 * 2**20
    with pytest.raises(KeyError):
        tick.look_step(prior, PREDICTIVE, pods, None, skewed, floor, NOW, 1, policy="nope")
