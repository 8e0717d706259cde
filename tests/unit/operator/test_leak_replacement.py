"""The leak replacement (issue 30 item 4, :mod:`leak_replacement`): a leaking pod replaced before its hard limit,
with the Deployment's surge where possible, a drain where not; its state in status, its writes and Events, and
what the policy, the reconcile and the control loop's views do for it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from moeguard_operator.children.builders import Owner, build_children, build_deployment
from moeguard_operator.loop import leak_replacement as lr
from moeguard_operator.loop import policy, predictive, report, tick
from moeguard_operator.loop.control_loop import slim_deployment, slim_pod
from moeguard_operator.loop.leak_replacement import Actions, Workload, plan
from moeguard_operator.loop.observation import Observation, PodLoad
from moeguard_operator.loop.policy import PolicyState, initial_budgets
from moeguard_operator.spec.models import (
    LeakReplacementStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
    Observed,
)

pytestmark = pytest.mark.unit

MIB = 2**20
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec.model_validate({
    "replicas": 2, "resources": {"gpus": 0, "softLimit": "1920Mi", "hardLimit": "2Gi"},
    "control": {"queryIntervalSeconds": 10, "leakAction": "Restart"},
})
HARD = SPEC.resources.hard_limit_bytes
SLOPE = 8 * MIB  # bytes/s
READY = 40.0  # the pods below took 40 s from creation to Ready
LEAD = 3 * READY + 30 + 10  # 160 s
DEPLOYMENT = Workload(replicas=2)


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).isoformat()


def pod(name: str, created: float = 3600, ready_after: float | None = READY, restarts: int = 0,
        deleting: bool = False, grace: int | None = None, cost: str | None = None,
        unschedulable: bool = False) -> dict[str, Any]:
    """A worker pod created ``created`` seconds ago, Ready ``ready_after`` seconds later (None: not Ready)."""
    conditions: list[dict[str, Any]] = []
    if ready_after is not None:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": ago(created - ready_after)})
    else:
        conditions.append({"type": "Ready", "status": "False", "lastTransitionTime": ago(created)})
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."})
    meta: dict[str, Any] = {"name": name, "creationTimestamp": ago(created)}
    if deleting:
        meta["deletionTimestamp"] = NOW.isoformat()
    if cost is not None:
        meta["annotations"] = {lr.DELETION_COST_ANNOTATION: cost}
    out: dict[str, Any] = {"metadata": meta, "status": {
        "phase": "Running" if not unschedulable else "Pending", "conditions": conditions,
        "containerStatuses": [{"name": "worker", "restartCount": restarts, "ready": ready_after is not None}]}}
    if grace is not None:
        out["spec"] = {"terminationGracePeriodSeconds": grace}
    return out


PODS = [pod("w-a"), pod("w-b", created=1800)]


def obs(eta: float, slope: float = SLOPE, name: str = "w-a", others: tuple[tuple[str, float], ...] = ()) -> Observation:
    """A look where pod ``name`` reaches the hard limit in ``eta`` seconds at ``slope`` bytes/s."""
    used = HARD - eta * slope
    loads = (PodLoad(name, memory_bytes=used), *(PodLoad(p, memory_bytes=HARD - e * SLOPE) for p, e in others))
    return Observation(time=NOW, memory_ratio=used / HARD, rss_slope_bytes_per_second=slope,
                       pod_rss_slopes=((name, slope), *((p, SLOPE) for p, _ in others)), pod_loads=loads,
                       expected_pods=("w-a", "w-b"), reporting_pods=("w-a", "w-b"))


def surging(started: float = 30, hard_in: float = 90, replacement: str | None = None) -> LeakReplacementStatus:
    return LeakReplacementStatus(pod="w-a", action="Surge", phase="Surging", started_at=NOW - timedelta(seconds=started),
                                 hard_limit_at=NOW + timedelta(seconds=hard_in), replacement_pod=replacement)


# --- the lead and the measured ready time ----------------------------------------------------------------------
def test_the_lead_is_three_times_the_ready_time_plus_grace_plus_the_query_interval() -> None:
    assert lr.lead_seconds(40, 30, 10) == 160
    assert lr.lead_seconds(0, 0, 1) == 1


def test_the_grace_is_the_pods_own_else_the_kubernetes_default() -> None:
    assert lr.grace_seconds(pod("w", grace=5)) == 5
    assert lr.grace_seconds(pod("w")) == 30


def test_the_ready_time_is_measured_from_the_newest_ready_pod_that_never_restarted() -> None:
    pods = [pod("old", created=3600, ready_after=100), pod("new", created=600, ready_after=45),
            pod("restarted", created=300, ready_after=290, restarts=1), pod("loading", created=10, ready_after=None)]
    assert lr.measured_ready_seconds(pods) == 45
    assert lr.measured_ready_seconds([pod("loading", ready_after=None)]) is None


def test_a_pod_is_replaced_only_once_its_time_to_the_hard_limit_is_within_the_lead() -> None:
    assert plan(None, obs(LEAD + 1), PODS, DEPLOYMENT, SPEC, None, NOW).state is None
    step = plan(None, obs(LEAD - 1), PODS, DEPLOYMENT, SPEC, None, NOW)
    assert step.state is not None and step.state.pod == "w-a" and step.ready_seconds == READY


def test_before_any_measurement_the_ready_time_is_300_s_the_safe_side() -> None:
    loading = [pod("w-a", ready_after=None), pod("w-b", ready_after=None)]  # nothing to measure
    eta = 3 * 300 + 30 + 10 - 1
    step = plan(None, obs(eta), loading, DEPLOYMENT, SPEC, None, NOW)
    assert step.state is not None and "ready time 300 s (not measured yet: assumed)" in step.events[0].message
    assert plan(None, obs(eta), loading, DEPLOYMENT, SPEC, 40.0, NOW).state is None  # the measurement in status


def test_growth_at_the_noise_floor_or_without_a_memory_reading_is_never_replaced() -> None:
    assert plan(None, obs(10, slope=64 * 1024), PODS, DEPLOYMENT, SPEC, None, NOW).state is None
    no_memory = Observation(time=NOW, pod_rss_slopes=(("w-a", SLOPE),), pod_loads=(PodLoad("w-a"),))
    assert plan(None, no_memory, PODS, DEPLOYMENT, SPEC, None, NOW).state is None


# --- surge or drain ---------------------------------------------------------------------------------------------
def test_a_surge_marks_the_leaking_pod_and_adds_one_replica_and_says_so() -> None:
    step = plan(None, obs(100), PODS, DEPLOYMENT, SPEC, None, NOW)
    assert step.state == LeakReplacementStatus(pod="w-a", action="Surge", phase="Surging", started_at=NOW,
                                               hard_limit_at=NOW + timedelta(seconds=100), reason=step.state.reason)
    assert step.actions == Actions(mark_pod="w-a", replicas=3)
    (event,) = step.events
    assert (event.type, event.reason) == ("Normal", "LeakReplacement")
    assert event.message.startswith("surge: pod w-a reaches hardLimit in 100 s at +480 MiB/min; lead 160 s = 3 x "
                                    "ready time 40 s (measured) + grace 30 s + query interval 10 s")


def test_the_soonest_of_two_leaking_pods_goes_first_and_only_one_at_a_time() -> None:
    step = plan(None, obs(110, others=(("w-b", 50),)), PODS, DEPLOYMENT, SPEC, None, NOW)
    assert step.state is not None and step.state.pod == "w-b"
    busy = plan(surging(), obs(50, name="w-b"), PODS, DEPLOYMENT, SPEC, None, NOW)
    assert busy.state is not None and busy.state.pod == "w-a"  # w-b waits for w-a's replacement to end


@pytest.mark.parametrize(("workload", "pods", "why"), [
    (Workload(replicas=2, max_surge_zero=True), PODS, "the Deployment's maxSurge is 0"),
    (Workload(replicas=2, failed_create='FailedCreate: pods "w-c" is forbidden: exceeded quota'), PODS,
     "the ReplicaSet cannot create pods (quota?)"),
    (DEPLOYMENT, [*PODS, pod("w-c", created=5, ready_after=None, unschedulable=True)], "pod w-c is Unschedulable"),
])
def test_where_no_surge_is_possible_the_leaking_pod_is_drained_with_a_warning(
        workload: Workload, pods: list[dict[str, Any]], why: str) -> None:
    step = plan(None, obs(100), pods, workload, SPEC, None, NOW)
    assert step.state is not None and (step.state.action, step.state.phase) == ("Drain", "Draining")
    assert step.actions == Actions(delete_pod="w-a")
    (event,) = step.events
    assert event.type == "Warning" and event.message.startswith(f"drain (no surge: {why}")


def test_the_deployments_max_surge_and_replica_failure_are_read_from_it() -> None:
    def deployment(surge: Any, failure: bool = False) -> dict[str, Any]:
        conditions = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                       "message": "exceeded quota"}] if failure else []
        return {"spec": {"replicas": 3, "strategy": {"rollingUpdate": {"maxSurge": surge}}},
                "status": {"conditions": conditions}}
    assert lr.workload_of(deployment(0)).max_surge_zero and lr.workload_of(deployment("0%")).max_surge_zero
    assert not lr.workload_of(deployment("25%")).max_surge_zero and not lr.workload_of(deployment(1)).max_surge_zero
    assert lr.workload_of(deployment(1)).replicas == 3 and lr.workload_of(deployment(1)).failed_create is None
    assert lr.workload_of(deployment(1, failure=True)).failed_create == "FailedCreate: exceeded quota"
    assert lr.workload_of(None) == Workload()


# --- during the surge -------------------------------------------------------------------------------------------
def test_once_the_surge_pod_is_ready_replicas_go_back_and_the_replicaset_drains_the_leaking_pod() -> None:
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=15)]
    step = plan(surging(started=30), obs(80), pods, Workload(replicas=3), SPEC, None, NOW)
    assert step.state is not None and (step.state.phase, step.state.replacement_pod) == ("Draining", "w-c")
    assert step.actions == Actions(replicas=2)
    assert step.events[0].type == "Normal" and "surge pod w-c Ready 30 s after the surge started" in (
        step.events[0].message)
    assert step.ready_seconds == 15  # the surge pod is the newest measurement


def test_a_surge_pod_still_loading_is_waited_for_and_nothing_is_rewritten() -> None:
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=None)]
    step = plan(surging(), obs(80), pods, Workload(replicas=3), SPEC, None, NOW)
    assert step.state is not None and (step.state.phase, step.state.replacement_pod) == ("Surging", "w-c")
    assert step.state.hard_limit_at == NOW + timedelta(seconds=80)  # the newest projection
    assert not step.actions and not step.events


def test_a_surge_resumed_after_a_restart_writes_again_what_the_objects_do_not_show() -> None:
    step = plan(surging(), obs(80), PODS, Workload(replicas=2), SPEC, None, NOW)
    assert step.actions == Actions(mark_pod="w-a", replicas=3)


def test_a_surge_pod_not_ready_in_time_turns_into_a_drain() -> None:
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=None)]
    held = plan(surging(hard_in=41), obs(41), pods, Workload(replicas=3), SPEC, None, NOW)
    assert held.state is not None and held.state.phase == "Surging"  # grace 30 + interval 10 = 40 s still left
    step = plan(surging(hard_in=40), obs(40), pods, Workload(replicas=3), SPEC, None, NOW)
    assert step.state is not None and (step.state.action, step.state.phase) == ("Drain", "Draining")
    assert step.actions == Actions(delete_pod="w-a", replicas=2)
    assert step.events[0].type == "Warning" and "not Ready in time" in step.events[0].message


def test_a_blind_look_keeps_the_projected_deadline() -> None:
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=None)]
    blind = Observation(time=NOW, error="unreachable")
    step = plan(surging(hard_in=39), blind, pods, Workload(replicas=3), SPEC, None, NOW)
    assert step.state is not None and step.state.action == "Drain"


@pytest.mark.parametrize(("workload", "surge", "why"), [
    (Workload(replicas=3, failed_create="FailedCreate: exceeded quota"), None, "cannot create the surge pod (quota?)"),
    (Workload(replicas=3), pod("w-c", created=20, ready_after=None, unschedulable=True),
     "surge pod w-c is Unschedulable"),
])
def test_a_surge_that_cannot_get_its_pod_turns_into_a_drain(workload: Workload, surge: dict[str, Any] | None,
                                                            why: str) -> None:
    pods = [pod("w-a", cost="-1000"), pod("w-b"), *([surge] if surge else [])]
    step = plan(surging(), obs(80), pods, workload, SPEC, None, NOW)
    assert step.state is not None and step.state.action == "Drain"
    assert step.actions == Actions(delete_pod="w-a", replicas=2)
    assert step.events[0].type == "Warning" and why in step.events[0].message


def test_a_leaking_pod_gone_before_its_surge_pod_was_ready_undoes_the_surge() -> None:
    step = plan(surging(), obs(80), [pod("w-b"), pod("w-c", created=20, ready_after=None)], Workload(replicas=3), SPEC,
                None, NOW)
    assert step.state is None and step.actions == Actions(replicas=2) and "surge undone" in step.events[0].message
    evicted = [pod("w-a", deleting=True), pod("w-b"), pod("w-c", created=20, ready_after=None)]
    assert plan(surging(), obs(80), evicted, Workload(replicas=3), SPEC, None, NOW).state is None


def test_the_surge_pod_is_one_created_since_the_surge_started() -> None:
    prior = surging(started=30)
    assert lr.surge_pod(prior, [pod("w-a"), pod("w-b")]) is None
    assert lr.surge_pod(prior, [pod("w-a", created=5), pod("w-b"), pod("w-c", created=29)])["metadata"][
        "name"] == "w-c"  # type: ignore[index]
    named = prior.model_copy(update={"replacement_pod": "w-b"})
    assert lr.surge_pod(named, [pod("w-b")]) is not None and lr.surge_pod(named, [pod("w-c", created=1)]) is None


# --- draining ---------------------------------------------------------------------------------------------------
def test_draining_ends_when_the_leaking_pod_is_gone_and_writes_again_what_is_missing() -> None:
    drain = LeakReplacementStatus(pod="w-a", action="Drain", phase="Draining", started_at=NOW)
    assert plan(drain, obs(80), PODS, DEPLOYMENT, SPEC, None, NOW).actions == Actions(delete_pod="w-a")
    deleting = [pod("w-a", deleting=True), pod("w-b")]
    assert not plan(drain, obs(80), deleting, DEPLOYMENT, SPEC, None, NOW).actions
    done = plan(drain, obs(80), [pod("w-b"), pod("w-c", created=20)], DEPLOYMENT, SPEC, None, NOW)
    assert done.state is None and "done" in done.events[0].message
    surged = drain.model_copy(update={"action": "Surge"})
    assert plan(surged, obs(80), PODS, Workload(replicas=3), SPEC, None, NOW).actions == Actions(replicas=2)
    assert not plan(surged, obs(80), PODS, Workload(replicas=2), SPEC, None, NOW).actions


def test_a_surge_pod_never_ready_is_abandoned_after_twice_the_lead_when_the_limit_is_far() -> None:
    """A surge pod that never gets Ready (a crash loop, an image it cannot pull) must not hold the autoscaler (and
    an extra replica) forever; the leaking pod, far from its limit, serves on and is replaced again when due."""
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=None)]
    waiting = plan(surging(started=2 * LEAD, hard_in=200), obs(200), pods, Workload(replicas=3), SPEC, None, NOW)
    assert waiting.state is not None and waiting.state.phase == "Surging" and not waiting.events
    step = plan(surging(started=2 * LEAD + 1, hard_in=200), obs(200), pods, Workload(replicas=3), SPEC, None, NOW)
    assert step.state is None and step.actions == Actions(replicas=2)
    assert step.events[0].type == "Warning" and step.events[0].message.startswith(
        f"surge abandoned: surge pod w-c not Ready {2 * LEAD + 1:.0f} s after the surge started (twice the lead: "
        f"{2 * LEAD:.0f} s), and w-a reaches hardLimit in 200 s: replicas back to 2")


def test_a_drain_stuck_past_the_pods_deletion_deadline_ends_with_a_warning() -> None:
    drain = LeakReplacementStatus(pod="w-a", action="Drain", phase="Draining", started_at=NOW - timedelta(seconds=300))

    def stuck(for_seconds: float) -> list[dict[str, Any]]:
        leaking = pod("w-a", deleting=True)
        leaking["metadata"]["deletionTimestamp"] = ago(for_seconds)
        return [leaking, pod("w-b")]

    assert plan(drain, obs(80), stuck(lr.STUCK_SECONDS), DEPLOYMENT, SPEC, None, NOW).state == drain
    step = plan(drain, obs(80), stuck(lr.STUCK_SECONDS + 1), DEPLOYMENT, SPEC, None, NOW)
    assert step.state is None and not step.actions
    assert step.events[0].type == "Warning" and "w-a still terminating 61 s past its deletion deadline" in (
        step.events[0].message) and "the autoscaler resumes" in step.events[0].message


def test_a_leaking_pod_the_replicaset_kept_after_the_surge_is_deleted() -> None:
    """Replicas back at the base, the surge pod Ready for a minute, the leaking pod still there (its deletion cost
    lost, or another pod went): it is deleted (graceful) instead of waited for."""
    surged = LeakReplacementStatus(pod="w-a", action="Surge", phase="Draining", started_at=NOW - timedelta(seconds=200),
                                   replacement_pod="w-c")

    def pods(ready_for: float) -> list[dict[str, Any]]:
        return [pod("w-a"), pod("w-b"), pod("w-c", created=ready_for + 20, ready_after=20)]

    assert not plan(surged, obs(80), pods(lr.STUCK_SECONDS), DEPLOYMENT, SPEC, None, NOW).actions
    step = plan(surged, obs(80), pods(lr.STUCK_SECONDS + 1), DEPLOYMENT, SPEC, None, NOW)
    assert step.state is not None and (step.state.action, step.state.phase) == ("Drain", "Draining")
    assert step.actions == Actions(delete_pod="w-a")
    assert step.events[0].type == "Warning" and "the ReplicaSet kept w-a 61 s after the surge pod was Ready" in (
        step.events[0].message)


# --- where it applies, the reconcile, the policy, the look ------------------------------------------------------
def test_it_applies_to_the_predictive_policy_with_leak_action_restart_on_deployments_only() -> None:
    assert lr.applies(SPEC, "predictive") and not lr.applies(SPEC, "threshold")
    warn = SPEC.model_copy(update={"control": SPEC.control.model_copy(update={"leak_action": "Warn"})})
    assert not lr.applies(warn, "predictive")
    lws = MoEInferenceServiceSpec.model_validate({
        "parallelism": {"expertParallelSize": 2, "podsPerReplica": 2}, "resources": {"gpus": 1}, "replicas": 2,
        "control": {"leakAction": "Restart"}})
    assert not lr.applies(lws, "predictive")


def test_the_reconcile_keeps_the_surge_replica_while_surging_only() -> None:
    owner = Owner("svc", "ns", "uid")
    status = MoEInferenceServiceStatus(leak_replacement=surging())
    assert lr.surge_replicas(SPEC, status) == 3
    draining = MoEInferenceServiceStatus(leak_replacement=surging().model_copy(update={"phase": "Draining"}))
    assert lr.surge_replicas(SPEC, draining) == 2 and lr.surge_replicas(SPEC, MoEInferenceServiceStatus()) == 2
    assert build_deployment(owner, SPEC, 3)["spec"]["replicas"] == 3
    assert build_deployment(owner, SPEC)["spec"]["replicas"] == 2
    (workload,) = [m for m in build_children(owner, SPEC, 3) if m["kind"] == "Deployment"]
    assert workload["spec"]["replicas"] == 3


def leaking_look(eta: float = 100) -> Observation:
    """A look where w-a's leak is suspected (policy) and due for replacement (leak_replacement)."""
    base = obs(eta)
    return Observation(time=NOW, skew_ratio=1.5, skew_steps=10, memory_ratio=base.memory_ratio,
                       rss_slope_bytes_per_second=SLOPE, pod_rss_slopes=base.pod_rss_slopes, pod_loads=base.pod_loads,
                       expected_pods=("w-a", "w-b"), reporting_pods=("w-a", "w-b"))


def test_the_predictive_policy_rolls_no_deployment_for_a_leak_but_lws_and_the_threshold_policy_still_do() -> None:
    state = PolicyState(initial_budgets(SPEC.batching))
    replaced = predictive.decide(leaking_look(), state, SPEC, NOW)
    assert replaced.leak_suspected is True and not replaced.restart and replaced.state.last_restart is None
    assert "leaking pods replaced before hardLimit" in replaced.reason
    assert policy.decide(leaking_look(), state, SPEC, NOW).restart
    lws = MoEInferenceServiceSpec.model_validate({
        "parallelism": {"expertParallelSize": 2, "podsPerReplica": 2}, "replicas": 2,
        "resources": {"gpus": 1, "softLimit": "1920Mi", "hardLimit": "2Gi"}, "control": {"leakAction": "Restart"}})
    assert predictive.decide(leaking_look(), state, lws, NOW).restart


def test_a_look_of_the_predictive_policy_writes_the_replacement_after_its_status() -> None:
    prior = MoEInferenceServiceStatus(budgets=initial_budgets(SPEC.batching),
                                      observed=Observed(time=NOW - timedelta(minutes=1)))
    deployment = {"spec": {"replicas": 2}, "status": {}}
    writes = tick.look_step(prior, SPEC, PODS, None, leaking_look(), NOW - timedelta(hours=1), NOW, 1,
                            policy="predictive", workload=deployment)
    assert writes.replacement == Actions(mark_pod="w-a", replicas=3) and not writes.restart
    assert writes.status.leak_replacement is not None and writes.status.leak_replacement.phase == "Surging"
    assert writes.status.observed is not None and writes.status.observed.replacement_ready_seconds == READY
    assert ("Normal", "LeakReplacement") in [(e.type, e.reason) for e in writes.events]
    threshold = tick.look_step(prior, SPEC, PODS, None, leaking_look(), NOW - timedelta(hours=1), NOW, 1,
                               policy="threshold", workload=deployment)
    assert threshold.restart and not threshold.replacement and threshold.status.leak_replacement is None


def test_the_measured_ready_time_stays_in_status_between_looks() -> None:
    kept = report.observed(Observed(replacement_ready_seconds=42.0), Observation(time=NOW), 0, NOW)
    assert kept.replacement_ready_seconds == 42.0


def test_the_views_keep_what_the_replacement_reads_of_a_pod() -> None:
    raw = pod("w-a", grace=5, cost="-1000")
    raw["metadata"]["annotations"]["kopf.zalando.org/last-handled"] = "x" * 1000
    raw["metadata"]["managedFields"] = [{"manager": "kube-controller-manager"}]
    raw["spec"]["containers"] = [{"name": "worker"}]
    kept = slim_pod(raw)
    assert kept["metadata"]["annotations"] == {lr.DELETION_COST_ANNOTATION: "-1000"}
    assert kept["metadata"]["creationTimestamp"] == raw["metadata"]["creationTimestamp"]
    assert kept["spec"] == {"terminationGracePeriodSeconds": 5} and "managedFields" not in kept["metadata"]
    assert "annotations" not in slim_pod(pod("w-b"))["metadata"] and "spec" not in slim_pod(pod("w-b"))


def test_the_views_keep_what_the_replacement_reads_of_a_deployment() -> None:
    raw = {"metadata": {"name": "svc-worker", "managedFields": [{}]},
           "spec": {"replicas": 3, "strategy": {"rollingUpdate": {"maxSurge": 0}}, "template": {"spec": {}}},
           "status": {"replicas": 3, "conditions": [{"type": "ReplicaFailure", "status": "True"}]}}
    kept = slim_deployment(raw)
    assert kept == {"metadata": {"name": "svc-worker"}, "spec": {"replicas": 3, "strategy": raw["spec"]["strategy"]},
                    "status": {"conditions": raw["status"]["conditions"]}}
    assert lr.workload_of(kept) == Workload(replicas=3, max_surge_zero=True, failed_create="FailedCreate")
