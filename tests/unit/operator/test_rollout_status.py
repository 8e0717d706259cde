"""Ready, Reconciling and Stalled as kstatus reads a rollout (issue 29, item 1; the kind of ai-dynamo/dynamo#3567),
and ``replicas: 0`` as a calm state (item 3), pure: :func:`tick.readiness_step` and :func:`tick.look_step` on pods
of the current and of an earlier template (:mod:`rollout`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from moeguard_core.contract import BudgetDocument
from moeguard_operator.children.builders import (
    Owner,
    build_deployment,
    build_leader_worker_set,
    template_hash,
)
from moeguard_operator.constants import (
    LWS_GROUP_INDEX_LABEL,
    LWS_WORKER_INDEX_LABEL,
    TEMPLATE_HASH_LABEL,
)
from moeguard_operator.loop import report, rollout, tick
from moeguard_operator.loop.conditions import find_condition
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.policy import initial_budgets
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
OWNER = Owner("moe", "ns", "uid-1")
V1 = MoEInferenceServiceSpec.model_validate({"replicas": 1, "image": "registry.example/worker:1"})
V2 = V1.model_copy(update={"image": "registry.example/worker:2"})
OLD, NEW = template_hash(OWNER, V1), template_hash(OWNER, V2)


def pod(name: str, template: str | None, ready: bool = True, containers: list[dict[str, Any]] | None = None,
        **labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {**({TEMPLATE_HASH_LABEL: template} if template else {}),
                                                     **labels}}
    return {"metadata": meta, "status": {
        "phase": "Running", "startTime": (NOW - timedelta(minutes=5)).isoformat(),
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": containers or [{"name": "worker", "ready": ready, "restartCount": 0,
                                             "state": {"running": {"startedAt": NOW.isoformat()}}}]}}


CRASH_LOOP = [{"name": "worker", "ready": False, "restartCount": 3,
               "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
               "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": "model_load_error: no shard",
                                            "finishedAt": NOW.isoformat()}}}]


def ready_status(spec: MoEInferenceServiceSpec, generation: int) -> MoEInferenceServiceStatus:
    """A service Ready at generation 1, then reconciled for ``generation``."""
    doc = BudgetDocument(generation=1, budgets=initial_budgets(spec.batching))
    base = report.reconciled(MoEInferenceServiceStatus(), V1, doc, "a=b", NOW - timedelta(hours=1), 1)
    ready = tick.readiness_step(base, V1, [pod("moe-a", OLD)], None, NOW - timedelta(hours=1), 1,
                                template_hash=OLD).status
    return report.reconciled(ready, spec, doc, "a=b", NOW - timedelta(seconds=30), generation)


def conditions(status: MoEInferenceServiceStatus) -> dict[str, tuple[str, str, str]]:
    return {t: (c.status, c.reason, c.message) for t in ("Ready", "Reconciling", "Stalled")
            if (c := find_condition(status.conditions, t)) is not None}


def test_the_template_hash_is_on_the_pods_of_both_workloads_and_follows_the_template() -> None:
    deployment = build_deployment(OWNER, V1)["spec"]["template"]["metadata"]["labels"]
    assert deployment[TEMPLATE_HASH_LABEL] == OLD and len(OLD) == 16 and OLD != NEW
    multi = MoEInferenceServiceSpec.model_validate({"parallelism": {"expertParallelSize": 2, "podsPerReplica": 2}})
    lws = build_leader_worker_set(OWNER, multi)["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert lws["metadata"]["labels"][TEMPLATE_HASH_LABEL] == template_hash(OWNER, multi)
    # live changes (budgets, control) leave the hash alone: the pods stay current
    live = V1.model_copy(update={"batching": V1.batching.model_copy(update={"max_prefill_tokens": 512})})
    assert template_hash(OWNER, live) == OLD


def test_a_new_generation_of_a_ready_service_is_reconciling_until_its_pods_are_read() -> None:
    status = ready_status(V2, 2)
    assert conditions(status)["Ready"][0] == "True"
    assert conditions(status)["Reconciling"] == ("True", "ChildrenApplied",
                                                 "children applied for generation 2; reading the worker pods")
    assert status.observed_generation == 2


def test_a_crash_looping_new_template_with_the_old_pod_ready_is_stalled_not_ready() -> None:
    """The dynamo#3567 shape: replicas 1, the old pod Ready, the new one in CrashLoopBackOff."""
    pods = [pod("moe-a", OLD), pod("moe-b", NEW, ready=False, containers=CRASH_LOOP)]
    writes = tick.readiness_step(ready_status(V2, 2), V2, pods, None, NOW, 2, template_hash=NEW)
    got = conditions(writes.status)
    failure = "container worker exited 3 (Error): model_load_error: no shard (CrashLoopBackOff)"
    assert got["Ready"] == ("False", "WorkerStartupFailed",
                            f"0/1 worker pods of the current template ready; pod moe-b: {failure}; 1 pods of an "
                            "earlier template still there (1 ready, serving)")
    stall = f"pod moe-b of the current template cannot start: {failure}; 1 pods of an earlier template still serve"
    assert got["Stalled"] == ("True", "CrashLoopBackOff", stall)
    assert got["Reconciling"] == ("False", "CrashLoopBackOff", stall)  # kstatus: Failed, not InProgress
    assert writes.status.ready_replicas == 0
    assert [(e.type, e.reason) for e in writes.events] == [("Warning", "WorkerStartupFailed")]
    # a rollout stall does not stop the loop: it keeps reading the pods and clears it
    assert not report.is_stalled(writes.status, 2)


def test_the_old_pod_serving_while_the_new_one_starts_is_reconciling_rolling_out() -> None:
    pods = [pod("moe-a", OLD), pod("moe-b", NEW, ready=False)]
    got = conditions(tick.readiness_step(ready_status(V2, 2), V2, pods, None, NOW, 2, template_hash=NEW).status)
    message = "0/1 worker pods of the current template ready; 1 pods of an earlier template still there (1 ready, serving)"
    assert got == {"Ready": ("False", "WaitingForReplicas", message),
                   "Reconciling": ("True", "WaitingForReplicas", message), "Stalled": ("False", "Reconciled", "")}
    # the new pod ready, the old one not yet gone (surge): Ready, still Reconciling (RollingOut)
    pods = [pod("moe-a", OLD), pod("moe-b", NEW)]
    got = conditions(tick.readiness_step(ready_status(V2, 2), V2, pods, None, NOW, 2, template_hash=NEW).status)
    assert got["Ready"][:2] == ("True", "AllReplicasReady") and got["Reconciling"][:2] == ("True", "RollingOut")
    # the old pod being deleted: done
    gone = pod("moe-a", OLD)
    gone["metadata"]["deletionTimestamp"] = NOW.isoformat()
    got = conditions(tick.readiness_step(ready_status(V2, 2), V2, [gone, pod("moe-b", NEW)], None, NOW, 2,
                                         template_hash=NEW).status)
    assert got == {"Ready": ("True", "AllReplicasReady", "1/1 worker pods ready"),
                   "Reconciling": ("False", "AllReplicasReady", "1/1 worker pods ready"),
                   "Stalled": ("False", "Reconciled", "")}


def test_a_stall_clears_when_the_new_pod_starts_and_a_pod_without_the_label_is_of_an_earlier_template() -> None:
    stuck = tick.readiness_step(ready_status(V2, 2), V2, [pod("moe-b", NEW, ready=False, containers=CRASH_LOOP)],
                                None, NOW, 2, template_hash=NEW).status
    assert conditions(stuck)["Stalled"][:2] == ("True", "CrashLoopBackOff")
    # a resumed operator's reconcile of the same generation keeps the rollout stall
    doc = BudgetDocument(generation=1, budgets=initial_budgets(V2.batching))
    assert conditions(report.reconciled(stuck, V2, doc, "a=b", NOW, 2))["Stalled"][:2] == ("True", "CrashLoopBackOff")
    fixed = tick.readiness_step(stuck, V2, [pod("moe-b", NEW), pod("moe-z", None, ready=False)], None, NOW, 2,
                                template_hash=NEW).status
    got = conditions(fixed)
    assert got["Stalled"] == ("False", "Reconciled", "")
    assert got["Ready"][0] == "True" and got["Reconciling"][:2] == ("True", "RollingOut")


@pytest.mark.parametrize(("waiting", "reason"), [("ImagePullBackOff", "ImagePullBackOff"),
                                                 ("InvalidImageName", "InvalidImageName")])
def test_a_new_template_whose_image_cannot_start_is_stalled_with_the_kubelets_reason(waiting: str, reason: str) -> None:
    containers = [{"name": "worker", "ready": False, "restartCount": 0,
                   "state": {"waiting": {"reason": waiting, "message": "pull failed"}}}]
    split = rollout.split([pod("moe-a", OLD), pod("moe-b", NEW, ready=False, containers=containers)], NEW)
    assert split.stuck == ("moe-b", reason, f"container worker {waiting}: pull failed")
    assert split.earlier == ("moe-a",) and split.earlier_ready == 1


def test_lws_groups_count_only_pods_of_the_current_template() -> None:
    multi = MoEInferenceServiceSpec.model_validate({"replicas": 1, "resources": {"gpus": 1},
                                                   "parallelism": {"expertParallelSize": 2, "podsPerReplica": 2}})
    new = template_hash(OWNER, multi)

    def member(name: str, template: str, worker: str) -> dict[str, Any]:
        return pod(name, template, **{LWS_GROUP_INDEX_LABEL: "0", LWS_WORKER_INDEX_LABEL: worker})

    doc = BudgetDocument(generation=1, budgets=initial_budgets(multi.batching))
    base = report.reconciled(MoEInferenceServiceStatus(), multi, doc, "a=b", NOW, 2)
    half = [member("moe-0", new, "0"), member("moe-0-1", "0ld", "1")]
    status = tick.readiness_step(base, multi, half, None, NOW, 2, template_hash=new).status
    assert conditions(status)["Ready"][0] == "False" and status.groups is not None
    assert status.groups[0].ready_pods == 1
    whole = [member("moe-0", new, "0"), member("moe-0-1", new, "1")]
    status = tick.readiness_step(base, multi, whole, None, NOW, 2, template_hash=new).status
    assert conditions(status)["Ready"] == ("True", "AllReplicasReady", "1/1 groups ready (2 pods, 2 ranks each)")


# --- replicas: 0 (issue 29, item 3) --------------------------------------------------------------------------

ZERO = V1.model_copy(update={"replicas": 0})


def metrics_available(status: MoEInferenceServiceStatus) -> tuple[str, str] | None:
    cond = find_condition(status.conditions, "MetricsAvailable")
    return None if cond is None else (cond.status, cond.reason)


def test_scaled_to_zero_is_ready_and_metrics_unknown_with_no_event() -> None:
    writes = tick.readiness_step(ready_status(ZERO, 2), ZERO, [], None, NOW, 2, template_hash=OLD)
    assert conditions(writes.status)["Ready"] == ("True", "AllReplicasReady", "0/0 worker pods ready")
    assert conditions(writes.status)["Reconciling"][0] == "False"
    assert metrics_available(writes.status) == ("Unknown", "ScaledToZero")
    assert writes.events == ()


def test_a_look_at_a_service_scaled_to_zero_long_past_the_grace_raises_nothing() -> None:
    """Even a blind look (one in flight when the spec changed) says ScaledToZero, with no Warning."""
    prior = tick.readiness_step(ready_status(ZERO, 2), ZERO, [], None, NOW, 2, template_hash=OLD).status
    blind = Observation(time=NOW, error="Prometheus at http://p:9090: no series matched")
    for minutes in (1, 5, 30):
        writes = tick.look_step(prior, ZERO, [], None, blind, NOW, NOW + timedelta(minutes=minutes), 2,
                                template_hash=OLD)
        prior = writes.status
        assert metrics_available(prior) == ("Unknown", "ScaledToZero")
        assert not [e for e in writes.events if e.type == "Warning"], writes.events


def test_scaling_up_from_zero_waits_for_metrics_before_it_warns() -> None:
    prior = tick.readiness_step(ready_status(ZERO, 2), ZERO, [], None, NOW, 2, template_hash=OLD).status
    blind = Observation(time=NOW, expected_pods=("moe-a",), error="Prometheus at http://p:9090: no series matched")
    writes = tick.look_step(prior, V1, [pod("moe-a", OLD)], None, blind, NOW, NOW + timedelta(hours=1), 3,
                            template_hash=OLD)
    assert metrics_available(writes.status) == ("False", "WaitingForMetrics")
    assert not [e for e in writes.events if e.reason == "MetricsUnavailable"]
