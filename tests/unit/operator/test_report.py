"""The status report: prior status + what was applied, seen and decided -> the next status, its
merge patch (camelCase, as the CRD's status schema names the fields) and the Events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from moeguard_core.contract import BudgetDocument
from moeguard_operator.loop import report
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.podstate import PodFacts
from moeguard_operator.loop.policy import decide, initial_budgets
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec.model_validate({
    "replicas": 2,
    "batching": {"maxPrefillTokens": 2048, "maxDecodeTokens": 64, "maxBatchRequests": 16, "maxConcurrentBatches": 2},
    "control": {"skewThreshold": 8, "cooldownSeconds": 2, "windowSeconds": 10, "queryIntervalSeconds": 2},
})
START = initial_budgets(SPEC.batching)
PODS = ("w-0", "w-1")


def _types(status: MoEInferenceServiceStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def _reconciled(generation: int = 1) -> MoEInferenceServiceStatus:
    doc = BudgetDocument(generation=generation, budgets=START)
    return report.reconciled(MoEInferenceServiceStatus(), SPEC, doc, "a=b", NOW, 1)


def _obs(**kw: Any) -> Observation:
    base: dict[str, Any] = {"time": NOW, "skew_ratio": 2.0, "memory_ratio": 0.5, "expected_pods": PODS,
                            "reporting_pods": PODS}
    return Observation(**(base | kw))


def test_read_status_takes_the_camel_case_fields_and_ignores_unknown_ones() -> None:
    status = report.read_status({"observedGeneration": 3, "budgetGeneration": 7, "overloadMode": "On",
                                 "somethingNew": 1, "observed": {"skewRatio": 9.5, "silentPods": ["w-1"]}})
    assert (status.observed_generation, status.budget_generation, status.overload_mode) == (3, 7, "On")
    assert status.observed is not None and status.observed.skew_ratio == 9.5 and status.observed.silent_pods == ["w-1"]
    assert report.read_status(None) == MoEInferenceServiceStatus()


def test_first_reconcile_patch_has_the_crd_field_names_and_iso_times() -> None:
    new = _reconciled()
    patch = report.status_patch(MoEInferenceServiceStatus(), new)
    assert sorted(patch) == sorted(["observedGeneration", "conditions", "budgets", "initialBudgets",
                                    "budgetGeneration", "overloadMode", "replicas", "selector"])
    assert patch["budgets"]["maxPrefillTokens"] == 2048 and patch["budgetGeneration"] == 1
    assert patch["conditions"] == [
        {"type": "Stalled", "status": "False", "reason": "Reconciled", "message": "",
         "lastTransitionTime": "2026-11-30T12:00:00+00:00", "observedGeneration": 1},
        {"type": "Ready", "status": "False", "reason": "WaitingForReplicas", "message": "0/2 worker pods ready",
         "lastTransitionTime": "2026-11-30T12:00:00+00:00", "observedGeneration": 1},
        {"type": "Reconciling", "status": "True", "reason": "WaitingForReplicas",
         "message": "children applied; waiting for worker pods",
         "lastTransitionTime": "2026-11-30T12:00:00+00:00", "observedGeneration": 1},
    ]
    # What was written reads back as the same status: nothing to write the second time.
    assert report.status_patch(report.read_status(patch), new) == {}


def test_a_null_in_a_changed_field_is_written_so_the_merge_patch_deletes_it() -> None:
    before = report.read_status({"observed": {"skewRatio": 9.5, "oomKills": 2}})
    after, _ = report.looked(before, SPEC, _obs(skew_ratio=None), decide(_obs(skew_ratio=None), report.policy_state(
        before, SPEC), SPEC, NOW), None, 0, NOW, 1)
    observed = report.status_patch(before, after)["observed"]
    assert observed["skewRatio"] is None and observed["oomKills"] == 2 and observed["time"] == NOW.isoformat()


def test_stalled() -> None:
    status, event = report.stalled(_reconciled(), "UnknownModelPreset", "spec.model.preset: unknown", NOW, 2)
    assert _types(status)["Ready"] == ("False", "UnknownModelPreset")
    assert _types(status)["Stalled"] == ("True", "UnknownModelPreset")
    assert _types(status)["Reconciling"] == ("False", "UnknownModelPreset")
    assert status.observed_generation == 2 and status.budgets == START  # the budgets in effect stay
    assert event == report.Event("Warning", "UnknownModelPreset", "spec.model.preset: unknown")


def test_readiness() -> None:
    waiting = report.readiness(_reconciled(), SPEC, 1, None, NOW, 1)
    assert _types(waiting)["Ready"] == ("False", "WaitingForReplicas") and waiting.ready_replicas == 1
    ready = report.readiness(waiting, SPEC, 2, None, NOW + timedelta(seconds=5), 1)
    assert _types(ready)["Ready"] == ("True", "AllReplicasReady")
    assert _types(ready)["Reconciling"] == ("False", "AllReplicasReady")
    assert [c.last_transition_time for c in ready.conditions if c.type == "Ready"] == [NOW + timedelta(seconds=5)]
    # A reconcile of a ready service leaves Ready alone.
    again = report.reconciled(ready, SPEC, BudgetDocument(generation=1, budgets=START), "a=b", NOW, 1)
    assert _types(again)["Ready"] == ("True", "AllReplicasReady")


def test_oom_check_counts_only_kills_after_the_last_check() -> None:
    kill = NOW - timedelta(seconds=30)
    facts = PodFacts(running=PODS, restarts=1, oom_kills=(("w-0", "worker", kill),))
    first, new = report.oom_check(_reconciled(), facts, NOW)
    assert new == 0 and first.control is not None and first.control.oom_checked_time == NOW  # history
    later = PodFacts(running=PODS, restarts=2, oom_kills=(("w-0", "worker", kill), ("w-1", "worker", NOW + timedelta(seconds=3))))
    second, new = report.oom_check(first, later, NOW + timedelta(seconds=5))
    assert new == 1 and second.control is not None and second.control.oom_checked_time == NOW + timedelta(seconds=5)
    third, new = report.oom_check(second, later, NOW + timedelta(seconds=10))
    assert new == 0 and third.control == second.control


def test_a_skew_look_tightens_and_says_why() -> None:
    prior = report.readiness(_reconciled(), SPEC, 2, None, NOW, 1)
    seen = _obs(skew_ratio=9.5)
    decision = decide(seen, report.policy_state(prior, SPEC), SPEC, NOW)
    doc = BudgetDocument(generation=2, budgets=decision.state.budgets)
    status, events = report.looked(prior, SPEC, seen, decision, doc, 3, NOW, 1)
    assert status.budgets is not None and status.budgets.max_prefill_tokens == 1024 and status.budget_generation == 2
    assert status.last_adjustment is not None and status.last_adjustment.from_.max_prefill_tokens == 2048
    assert "expert skew ratio 9.50 > threshold 8" in status.last_adjustment.reason
    assert status.observed is not None and (status.observed.skew_ratio, status.observed.restarts) == (9.5, 3)
    assert status.observed.memory_percent == 50
    assert _types(status)["BudgetTightened"] == ("True", "ExpertSkew")
    assert _types(status)["MetricsAvailable"] == ("True", "AllPodsReporting")
    assert _types(status)["Overloaded"] == ("False", "ModeAuto")
    assert _types(status)["MemoryLeakSuspected"] == ("Unknown", "NoSlope")
    assert [(e.type, e.reason) for e in events] == [("Normal", "BudgetTightened")]
    assert status.control is not None and status.control.last_change_time == NOW
    patch = report.status_patch(prior, status)
    assert patch["lastAdjustment"]["from"]["maxPrefillTokens"] == 2048 and patch["lastAdjustment"]["to"]["maxPrefillTokens"] == 1024
    assert patch["control"]["lastChangeTime"] == NOW.isoformat()


def test_an_oom_kill_look_warns_and_turns_overload_on() -> None:
    prior = report.readiness(_reconciled(), SPEC, 2, None, NOW, 1)
    seen = _obs(new_oom_kills=1)
    decision = decide(seen, report.policy_state(prior, SPEC), SPEC, NOW)
    doc = BudgetDocument(generation=2, budgets=decision.state.budgets, overload_mode="On")
    status, events = report.looked(prior, SPEC, seen, decision, doc, 1, NOW, 1)
    assert status.overload_mode == "On" and status.observed is not None and status.observed.oom_kills == 1
    assert [(e.type, e.reason) for e in events] == [
        ("Warning", "OOMKilled"), ("Warning", "BudgetTightened"), ("Normal", "OverloadOn")]
    assert _types(status)["Overloaded"] == ("True", "ModeAuto")


def test_blind_first_look_waits_without_an_event_and_holds_the_budgets() -> None:
    prior = _reconciled()
    seen = _obs(skew_ratio=None, memory_ratio=None, error="memory: no series matched")
    decision = decide(seen, report.policy_state(prior, SPEC), SPEC, NOW)
    status, events = report.looked(prior, SPEC, seen, decision, None, 0, NOW, 1)
    assert events == [] and status.budgets == START and status.last_adjustment is None
    assert _types(status)["MetricsAvailable"] == ("False", "WaitingForMetrics")
    assert _types(status)["BudgetTightened"] == ("False", "AtCeilings")


def test_a_leak_warns_once() -> None:
    prior = _reconciled()
    seen = _obs(rss_slope_bytes_per_second=10 * 2**20)
    status, events = report.looked(prior, SPEC, seen, decide(seen, report.policy_state(prior, SPEC), SPEC, NOW),
                                   None, 0, NOW, 1)
    assert ("Warning", "MemoryLeakSuspected") in [(e.type, e.reason) for e in events]
    assert _types(status)["MemoryLeakSuspected"] == ("True", "RSSGrowing")  # the workers flag no kind
    native = _obs(rss_slope_bytes_per_second=10 * 2**20, leak_kinds=("native",))
    named, events = report.looked(status, SPEC, native, decide(native, report.policy_state(status, SPEC), SPEC, NOW),
                                  None, 0, NOW, 1)
    assert _types(named)["MemoryLeakSuspected"] == ("True", "NativeLeak")
    assert [e.message.split(":")[0] for e in events if e.reason == "MemoryLeakSuspected"] == ["native leak suspected"]
    assert named.observed is not None and named.observed.leak_kinds == ["native"]
    assert named.observed.seconds_to_hard_limit is not None
    _, again = report.looked(status, SPEC, seen, decide(seen, report.policy_state(status, SPEC), SPEC, NOW),
                             None, 0, NOW, 1)
    assert "MemoryLeakSuspected" not in [e.reason for e in again]


def test_policy_state_round_trips_through_status() -> None:
    prior = _reconciled()
    seen = _obs(skew_ratio=9.5)
    decision = decide(seen, report.policy_state(prior, SPEC), SPEC, NOW)
    status, _ = report.looked(prior, SPEC, seen, decision, BudgetDocument(generation=2, budgets=decision.state.budgets),
                              0, NOW, 1)
    assert report.policy_state(report.read_status(report.status_patch(MoEInferenceServiceStatus(), status)), SPEC) \
        == decision.state


def test_a_stalled_generation_is_stalled_until_a_new_one_reconciles() -> None:
    prior = _reconciled()
    assert not report.is_stalled(prior, 1)
    stalled, _ = report.stalled(prior, "ApplyRefused", "the API server refused Deployment x-worker", NOW, 2)
    assert report.is_stalled(stalled, 2) and not report.is_stalled(stalled, 3)


def test_a_start_up_failure_is_the_ready_conditions_message_and_warns_once() -> None:
    failures = (("w-0", "container worker exited 3 (Error): model_load_error: missing shard "
                        "model-00002-of-00002.safetensors (CrashLoopBackOff)"),
                ("w-1", "container worker exited 3 (Error): model_load_error: missing shard"))
    prior = _reconciled()
    failing = report.readiness(prior, SPEC, 0, None, NOW, 1, failures)
    ready = next(c for c in failing.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "WorkerStartupFailed")
    assert ready.message == ("0/2 worker pods ready; pod w-0: container worker exited 3 (Error): model_load_error: "
                             "missing shard model-00002-of-00002.safetensors (CrashLoopBackOff) "
                             "(and 1 more pods failing)")
    assert _types(failing)["Reconciling"] == ("True", "WorkerStartupFailed")
    assert report.readiness_events(prior, failing) == [report.Event("Warning", "WorkerStartupFailed", ready.message)]
    later = report.readiness(failing, SPEC, 0, None, NOW + timedelta(seconds=5), 1, failures)
    assert report.readiness_events(failing, later) == []  # once, not every tick
    # all replicas ready: an old crash in lastState says nothing any more
    healed = report.readiness(later, SPEC, 2, None, NOW + timedelta(seconds=10), 1, failures)
    assert _types(healed)["Ready"] == ("True", "AllReplicasReady")
    assert report.readiness_events(later, healed) == []
