"""The leak replacement together with replica autoscaling (issue 30, items 4 and 5): the surge is one replica on
top of the autoscaler's count (the base, :func:`autoscale.base_replicas`), and every writer of the workload's
replica count agrees on it. The pods, looks and states are test_leak_replacement's (``spec.replicas`` 2); the
autoscaler decided 3 here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from tests.unit.operator.test_leak_replacement import NOW, PODS, SPEC, obs, pod, surging

from moeguard_operator.loop import autoscale, tick
from moeguard_operator.loop import leak_replacement as lr
from moeguard_operator.loop.leak_replacement import Actions, Workload, plan
from moeguard_operator.spec.models import (
    AutoscalingStatus,
    LeakReplacementStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
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
