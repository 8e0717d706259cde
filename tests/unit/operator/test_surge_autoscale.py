"""The leak replacement together with replica autoscaling (issue 30, items 4 and 5): the surge is one replica on
top of the autoscaler's count (the base, :func:`autoscale.base_replicas`), and every writer of the workload's
replica count agrees on it. The pods, looks and states are test_leak_replacement's (``spec.replicas`` 2); the
autoscaler decided 3 here."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import kopf
import pytest
from tests.unit.operator import test_autoscale as ta
from tests.unit.operator.test_leak_replacement import NOW, PODS, SPEC, obs, pod, surging

from moeguard_operator import handlers
from moeguard_operator.children import children, kube
from moeguard_operator.children.builders import Owner, build_children
from moeguard_operator.config import MEMO_KEY, OperatorConfig
from moeguard_operator.loop import autoscale, tick
from moeguard_operator.loop import leak_replacement as lr
from moeguard_operator.loop.autoscale import AutoscaleState
from moeguard_operator.loop.control_loop import ControlLoop
from moeguard_operator.loop.leak_replacement import Actions, Workload, plan
from moeguard_operator.loop.observation import ClassLatency, Observation
from moeguard_operator.loop.policy import initial_budgets
from moeguard_operator.loop.signals import DiagnosisSignals, PodSignals
from moeguard_operator.spec.models import (
    AutoscalingStatus,
    LeakReplacementStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
    Observed,
)

pytestmark = pytest.mark.unit

AUTO_SPEC = SPEC.model_copy(update={"autoscaling": MoEInferenceServiceSpec.model_validate(
    {"autoscaling": {"minReplicas": 1, "maxReplicas": 5}}).autoscaling})
"""test_leak_replacement's spec (``replicas: 2``) with ``spec.autoscaling`` (1..5)."""
DESIRED = 3
"""The autoscaler's count in status: the base."""


def status(replacement: LeakReplacementStatus | None = None, desired: int = DESIRED) -> MoEInferenceServiceStatus:
    return MoEInferenceServiceStatus(autoscaling=AutoscalingStatus(desired_replicas=desired),
                                     leak_replacement=replacement)


def draining() -> LeakReplacementStatus:
    return surging().model_copy(update={"phase": "Draining"})


# --- (1) the base count -----------------------------------------------------------------------------------------
def test_the_base_is_the_autoscalers_count_within_its_bounds_and_the_same_for_the_serving_spec() -> None:
    assert autoscale.base_replicas(AUTO_SPEC, status()) == DESIRED
    assert autoscale.base_replicas(autoscale.serving_spec(AUTO_SPEC, status()), status()) == DESIRED
    assert autoscale.base_replicas(AUTO_SPEC, status(desired=9)) == 5  # maxReplicas
    assert autoscale.base_replicas(AUTO_SPEC, MoEInferenceServiceStatus()) == 2  # before the first decision
    assert autoscale.base_replicas(SPEC, status()) == 2  # without autoscaling: spec.replicas


@pytest.mark.parametrize("spec", [AUTO_SPEC, autoscale.serving_spec(AUTO_SPEC, status())],
                         ids=["stored spec", "serving spec"])
def test_the_reconcile_and_the_reapply_keep_the_surge_on_top_of_the_autoscalers_count(
        spec: MoEInferenceServiceSpec) -> None:
    assert lr.surge_replicas(spec, status(surging())) == DESIRED + 1
    assert lr.surge_replicas(spec, status(draining())) == DESIRED
    assert lr.surge_replicas(spec, status()) == DESIRED


def test_a_surge_adds_one_replica_to_the_base_not_to_spec_replicas() -> None:
    step = plan(None, obs(100), PODS, Workload(replicas=DESIRED), AUTO_SPEC, None, NOW, base=DESIRED)
    assert step.actions == Actions(mark_pod="w-a", replicas=DESIRED + 1)
    assert f"replicas {DESIRED} -> {DESIRED + 1}, then back" in step.events[0].message


def test_once_the_surge_pod_is_ready_replicas_go_back_to_the_base_not_to_spec_replicas() -> None:
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=15)]
    step = plan(surging(), obs(80), pods, Workload(replicas=DESIRED + 1), AUTO_SPEC, None, NOW, base=DESIRED)
    assert step.state is not None and step.state.phase == "Draining"
    assert step.actions == Actions(replicas=DESIRED)
    assert f"replicas {DESIRED + 1} -> {DESIRED}" in step.events[0].message


@pytest.mark.parametrize(("prior", "pods", "replicas", "expected"), [
    # the leaking pod went before its surge pod was Ready: the surge is undone, to the base
    (surging(), [pod("w-b"), pod("w-c", created=20, ready_after=None)], DESIRED + 1, Actions(replicas=DESIRED)),
    # the surge pod cannot be scheduled: drained instead, replicas back to the base
    (surging(), [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=None, unschedulable=True)],
     DESIRED + 1, Actions(delete_pod="w-a", replicas=DESIRED)),
    # resumed after a restart: the surge written again is base + 1; a Deployment at base + 1 is left alone
    (surging(), [pod("w-a", cost="-1000"), pod("w-b")], DESIRED, Actions(replicas=DESIRED + 1)),
    (surging(), [pod("w-a", cost="-1000"), pod("w-b")], DESIRED + 1, Actions()),
    # draining after a surge: the base written again where the Deployment does not show it yet
    (draining(), PODS, DESIRED + 1, Actions(replicas=DESIRED)),
    (draining(), PODS, DESIRED, Actions()),
])
def test_every_replica_write_of_the_replacement_is_the_base_or_base_plus_one(
        prior: LeakReplacementStatus, pods: list[dict[str, Any]], replicas: int, expected: Actions) -> None:
    step = plan(prior, obs(80), pods, Workload(replicas=replicas), AUTO_SPEC, None, NOW, base=DESIRED)
    assert step.actions == expected


def test_the_look_passes_the_autoscalers_count_to_the_replacement() -> None:
    started, actions, _ = tick.replaced(status(), AUTO_SPEC, PODS, obs(100), {"spec": {"replicas": DESIRED}},
                                        "predictive", NOW)
    assert started.leak_replacement is not None and actions == Actions(mark_pod="w-a", replicas=DESIRED + 1)
    ready = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=20, ready_after=15)]
    _, back, _ = tick.replaced(status(surging()), AUTO_SPEC, ready, obs(80), {"spec": {"replicas": DESIRED + 1}},
                               "predictive", NOW + timedelta(seconds=1))
    assert back == Actions(replicas=DESIRED)


# --- (2) the autoscaler holds while a leak replacement is in progress -------------------------------------------
@pytest.mark.parametrize("replacement", [surging(), draining(),
                                         LeakReplacementStatus(pod="w-a", action="Drain", phase="Draining",
                                                               started_at=NOW)])
def test_the_autoscaler_takes_no_step_during_a_leak_replacement_and_restarts_its_windows(
        replacement: LeakReplacementStatus) -> None:
    up = ta.obs(2, queue=10.0, ttft=ta.MISSED)
    state = AutoscaleState(2, up_since=ta.ago(60))
    assert ta.run(up, state).direction == "up"  # without a replacement: one replica added
    held = autoscale.decide(up, state, ta.SPEC, ta.BUDGETS, 2, NOW, None, replacement)
    assert (held.direction, held.recommendation, held.state) == ("hold", "Hold", AutoscaleState(2))
    assert held.reason.startswith(f"leak replacement of pod w-a in progress ({replacement.action}, "
                                  f"{replacement.phase}): holding 2 replicas")
    bounded = autoscale.decide(ta.obs(), AutoscaleState(9), ta.SPEC, ta.BUDGETS, 9, NOW, None, replacement)
    assert bounded.direction == "hold" and bounded.state.desired == 9  # not even the bounds' step


def _looked(replacement: LeakReplacementStatus | None, **autoscaling: Any) -> MoEInferenceServiceStatus:
    return MoEInferenceServiceStatus(budgets=initial_budgets(SPEC.batching), observed=Observed(time=NOW - timedelta(
        minutes=1)), autoscaling=AutoscalingStatus(desired_replicas=DESIRED, **autoscaling),
        leak_replacement=replacement)


def test_during_a_surge_the_autoscaler_never_sets_the_surged_deployment_back_to_its_count() -> None:
    prior = _looked(surging())
    pods = [pod("w-a", cost="-1000"), pod("w-b"), pod("w-c", created=1200), pod("w-d", created=20, ready_after=None)]
    writes = tick.look_step(prior, autoscale.serving_spec(AUTO_SPEC, prior), pods, None, obs(80), NOW - timedelta(
        hours=1), NOW, 1, policy="predictive", workload={"spec": {"replicas": DESIRED + 1}, "status": {}},
        workload_replicas=DESIRED + 1)
    assert writes.status.leak_replacement is not None and writes.status.leak_replacement.phase == "Surging"
    assert writes.scale is None  # base + 1 differs from the autoscaler's 3: left alone, the surge is not undone
    assert not writes.replacement  # the Deployment already shows the surge
    assert writes.status.autoscaling is not None and writes.status.autoscaling.desired_replicas == DESIRED
    assert "leak replacement of pod w-a in progress (Surge, Surging)" in writes.status.autoscaling.reason


def _leaking_and_loaded() -> Observation:
    """A look where w-a's replacement is due and the interactive SLO is missed with long queues (up)."""
    leak = obs(100)
    names = ("w-a", "w-b", "w-c")
    return Observation(time=NOW, memory_ratio=leak.memory_ratio, rss_slope_bytes_per_second=leak.
                       rss_slope_bytes_per_second, pod_rss_slopes=leak.pod_rss_slopes, pod_loads=leak.pod_loads,
                       expected_pods=names, reporting_pods=names,
                       latency=(ClassLatency("interactive", ta.MISSED, ta.MET_TPOT),),
                       signals=DiagnosisSignals(pods=tuple(PodSignals(p, queue_requests=10.0) for p in names)))


GPU_SPEC = AUTO_SPEC.model_copy(update={"resources": AUTO_SPEC.resources.model_copy(update={"gpus": 1})})
"""GPU workers: the memory model does not apply, so a scale-up is allowed (:func:`autoscale.new_replica_fit`)."""


def test_a_look_that_starts_a_replacement_takes_no_scale_step_and_the_surge_is_on_the_autoscalers_count() -> None:
    pods = [pod("w-a"), pod("w-b"), pod("w-c", created=1200)]
    prior = _looked(None, scale_up_since=NOW - timedelta(minutes=10))
    scaling = tick.look_step(prior, autoscale.serving_spec(GPU_SPEC, prior), pods, None, _leaking_and_loaded(),
                             NOW - timedelta(hours=1), NOW, 1, workload={"spec": {"replicas": DESIRED}, "status": {}},
                             workload_replicas=DESIRED)
    assert scaling.scale == DESIRED + 1  # the threshold policy does no replacement: the autoscaler steps up
    writes = tick.look_step(prior, autoscale.serving_spec(GPU_SPEC, prior), pods, None, _leaking_and_loaded(),
                            NOW - timedelta(hours=1), NOW, 1, policy="predictive",
                            workload={"spec": {"replicas": DESIRED}, "status": {}}, workload_replicas=DESIRED)
    assert writes.status.leak_replacement is not None and writes.status.leak_replacement.phase == "Surging"
    assert writes.replacement == Actions(mark_pod="w-a", replicas=DESIRED + 1)
    assert writes.scale is None and writes.autoscale is not None and writes.autoscale.direction == "hold"
    assert writes.status.autoscaling is not None and writes.status.autoscaling.desired_replicas == DESIRED


def test_the_look_that_ends_a_replacement_still_holds() -> None:
    prior = _looked(surging(), scale_up_since=NOW - timedelta(minutes=10))
    gone = [pod("w-b"), pod("w-c", created=1200), pod("w-d", created=20, ready_after=None)]  # w-a went first
    writes = tick.look_step(prior, autoscale.serving_spec(GPU_SPEC, prior), gone, None, _leaking_and_loaded(),
                            NOW - timedelta(hours=1), NOW, 1, policy="predictive",
                            workload={"spec": {"replicas": DESIRED + 1}, "status": {}},
                            workload_replicas=DESIRED + 1)
    assert writes.status.leak_replacement is None and writes.replacement == Actions(replicas=DESIRED)  # undone
    assert writes.scale is None and writes.autoscale is not None and writes.autoscale.direction == "hold"


# --- (3) the reconcile and the loop's re-apply of a deleted Deployment -------------------------------------------
def _applied_replicas(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the worker Deployment's replicas each ``children.apply_children`` call would apply."""
    seen: list[int] = []

    def apply_children(owner: Owner, spec: MoEInferenceServiceSpec, replicas: int | None = None) -> None:
        (deployment,) = [m for m in build_children(owner, spec, replicas) if m["kind"] == "Deployment"]
        seen.append(deployment["spec"]["replicas"])

    monkeypatch.setattr(children, "apply_children", apply_children)
    return seen


@pytest.mark.parametrize(("replacement", "expected"), [(surging(), DESIRED + 1), (draining(), DESIRED),
                                                       (None, DESIRED)])
def test_the_reconcile_applies_the_autoscalers_count_plus_the_surge(
        monkeypatch: pytest.MonkeyPatch, replacement: LeakReplacementStatus | None, expected: int) -> None:
    seen = _applied_replicas(monkeypatch)
    monkeypatch.setattr(kube, "read_configmap", lambda namespace, name: None)
    monkeypatch.setattr(children, "apply_budget_document", lambda owner, data, document: document)
    monkeypatch.setattr(handlers.kopf, "info", lambda *a, **k: None)
    monkeypatch.setattr(handlers.kopf, "warn", lambda *a, **k: None)
    body = kopf.Body({"metadata": {"name": "svc", "namespace": "ns", "uid": "uid", "generation": 1},
                      "spec": AUTO_SPEC.model_dump(mode="json", by_alias=True, exclude_none=True),
                      "status": status(replacement).model_dump(mode="json", by_alias=True, exclude_none=True)})
    patch = kopf.Patch()
    handlers.reconcile(body=body, spec=body.spec, status=body.status, meta=body.meta, name="svc", namespace="ns",
                       uid="uid", patch=patch, memo=kopf.Memo({MEMO_KEY: OperatorConfig()}), retry=0,
                       logger=logging.getLogger("test"))
    assert seen == [expected]
    assert patch.status["replicas"] == DESIRED  # the status counts the base, not the surge pod


def test_the_loop_applies_a_deleted_deployment_again_at_the_autoscalers_count_plus_the_surge(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _applied_replicas(monkeypatch)
    posted: list[str] = []
    monkeypatch.setattr(kube, "post_event", lambda involved, type_, reason, message, now: posted.append(reason))
    prior = status(surging())
    loop = ControlLoop(OperatorConfig())
    try:
        svc = {"metadata": {"name": "svc", "namespace": "ns", "uid": "uid", "resourceVersion": "1"}}
        loop._write(svc, autoscale.serving_spec(AUTO_SPEC, prior), prior, tick.Writes(status=prior),
                    frozenset({"Deployment"}), None)
    finally:
        loop.shutdown()
    assert seen == [DESIRED + 1] and posted == ["ChildRecreated"]
