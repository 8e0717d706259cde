"""Replica autoscaling (issue 30, item 5): ``autoscale.decide`` and what carries its decision (status, the
workload's replica count, Events). The memory figures are test_memory_fit's: preset ``small`` (float32), an
idle footprint of 799 MiB, whose worst step at these budgets is predicted at about 848 MiB."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from moeguard_core.contract import BudgetDocument
from moeguard_operator.children.builders import (
    Owner,
    build_deployment,
    build_leader_worker_set,
    worker_replicas,
)
from moeguard_operator.loop import autoscale, report, tick
from moeguard_operator.loop.autoscale import (
    AutoscaleState,
    decide,
    new_replica_fit,
    serving_spec,
    state_of,
)
from moeguard_operator.loop.observation import ClassLatency, Observation, PodLoad
from moeguard_operator.loop.policy import initial_budgets
from moeguard_operator.loop.signals import DiagnosisSignals, PodSignals
from moeguard_operator.spec import crdgen
from moeguard_operator.spec.models import (
    AutoscalingStatus,
    ControlStatus,
    MoEInferenceServiceSpec,
    MoEInferenceServiceStatus,
)

pytestmark = pytest.mark.unit

MIB = 2**20
INF = math.inf
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
AUTO = {"minReplicas": 1, "maxReplicas": 3, "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300, "queueRequestsPerReplica": 4}
BASE: dict[str, Any] = {
    "model": {"preset": "small"}, "replicas": 1,
    "resources": {"gpus": 0, "softLimit": "980Mi", "hardLimit": "1152Mi"},
    "batching": {"maxPrefillTokens": 256, "maxDecodeTokens": 8, "maxBatchRequests": 8, "maxConcurrentBatches": 1,
                 "maxLongRequestsPerBatch": 1, "maxQueueRequests": 8, "queueTimeoutSeconds": 2.0,
                 "floors": {"maxPrefillTokens": 64, "maxDecodeTokens": 1, "maxBatchRequests": 1,
                            "maxLongRequestsPerBatch": 1, "maxConcurrentBatches": 1, "maxQueueRequests": 1,
                            "queueTimeoutSeconds": 1.0}},
    "slo": {"minRequests": 10},
}


def make_spec(**over: Any) -> MoEInferenceServiceSpec:
    return MoEInferenceServiceSpec.model_validate(BASE | {"autoscaling": AUTO} | over)


SPEC = make_spec()
BUDGETS = initial_budgets(SPEC.batching)
MET = ((3.0, 95.0), (INF, 100.0))  # TTFT: 95 of 100 within 3 s (target 90 %)
MET_TPOT = ((0.25, 95.0), (INF, 100.0))
MISSED = ((3.0, 50.0), (INF, 100.0))  # 50 %
FEW = ((3.0, 1.0), (INF, 3.0))  # 3 requests: below minRequests, not judged


def pods(n: int) -> tuple[str, ...]:
    return tuple(f"w-{i}" for i in range(n))


def obs(n: int = 1, queue: float | None = 0.0, ttft: Any = MET, tpot: Any = MET_TPOT, idle_mib: float | None = 799,
        **kw: Any) -> Observation:
    """A fully visible look of ``n`` pods, each with ``queue`` requests waiting."""
    names = pods(n)
    base: dict[str, Any] = {
        "time": NOW, "skew_ratio": 2.0, "skew_steps": 40, "memory_ratio": 0.74, "expected_pods": names,
        "reporting_pods": names,
        "pod_loads": tuple(PodLoad(p, memory_bytes=850 * MIB, skew_ratio=2.0, context_mean_tokens=300,
                                   context_max_tokens=2048,
                                   idle_footprint_bytes=None if idle_mib is None else idle_mib * MIB) for p in names),
        "latency": (ClassLatency("interactive", ttft, tpot),) if ttft is not None else (),
        "signals": DiagnosisSignals(pods=tuple(PodSignals(p, queue_requests=queue) for p in names)),
    }
    return Observation(**(base | kw))


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def run(o: Observation, state: AutoscaleState, spec: MoEInferenceServiceSpec = SPEC, ready: int | None = None,
        blind_floor: datetime | None = None) -> autoscale.ScaleDecision:
    return decide(o, state, spec, BUDGETS, state.desired if ready is None else ready, NOW, blind_floor)


# --- the spec -----------------------------------------------------------------------------------------------


def test_autoscaling_is_absent_by_default_and_max_replicas_is_required() -> None:
    assert MoEInferenceServiceSpec().autoscaling is None
    with pytest.raises(ValidationError, match="maxReplicas"):
        MoEInferenceServiceSpec.model_validate({"autoscaling": {"minReplicas": 1}})
    auto = make_spec(autoscaling={"maxReplicas": 4}).autoscaling
    assert auto is not None
    assert (auto.min_replicas, auto.scale_up_stabilization_seconds, auto.scale_down_stabilization_seconds,
            auto.queue_requests_per_replica) == (1, 30, 300, 8.0)


@pytest.mark.parametrize("bad", [{"minReplicas": 3, "maxReplicas": 2}, {"minReplicas": 0, "maxReplicas": 2},
                                 {"maxReplicas": 1025}, {"maxReplicas": 2, "queueRequestsPerReplica": 0}])
def test_bounds_are_refused_by_the_model(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        make_spec(autoscaling=bad)


def test_the_crd_carries_the_min_below_max_rule_and_no_default_object() -> None:
    spec = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    auto = spec["properties"]["autoscaling"]
    assert auto["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"
    assert auto["required"] == ["maxReplicas"] and auto.get("nullable") is True and "default" not in auto
    assert auto["properties"]["scaleDownStabilizationSeconds"]["default"] == 300


# --- the replica count the workload gets ----------------------------------------------------------------------


def test_without_autoscaling_the_workload_has_spec_replicas_whatever_status_says() -> None:
    plain = MoEInferenceServiceSpec.model_validate(BASE | {"replicas": 0})
    assert worker_replicas(plain, 5) == 0
    stale = MoEInferenceServiceStatus(autoscaling=AutoscalingStatus(desired_replicas=5))
    assert serving_spec(plain, stale) is plain
    assert build_deployment(Owner("s", "ns", "u"), serving_spec(plain, stale))["spec"]["replicas"] == 0


def test_with_autoscaling_the_workload_follows_status_within_the_bounds() -> None:
    owner = Owner("s", "ns", "u")
    assert worker_replicas(SPEC) == 1 and worker_replicas(make_spec(replicas=9)) == 3  # the start, clamped
    assert worker_replicas(make_spec(replicas=0)) == 1
    assert worker_replicas(SPEC, 2) == 2 and worker_replicas(SPEC, 7) == 3
    status = MoEInferenceServiceStatus(autoscaling=AutoscalingStatus(desired_replicas=2))
    served = serving_spec(SPEC, status)
    assert served.replicas == 2 and SPEC.replicas == 1  # the stored spec is never written
    assert build_deployment(owner, served)["spec"]["replicas"] == 2
    lws = make_spec(parallelism={"podsPerReplica": 2, "expertParallelSize": 2})
    assert build_leader_worker_set(owner, serving_spec(lws, status))["spec"]["replicas"] == 2


def test_the_state_round_trips_through_status() -> None:
    state = AutoscaleState(2, ago(100), up_since=ago(20))
    decision = autoscale.ScaleDecision(state, "hold", "Up", "r", autoscale.ScaleSignals())
    status, _ = autoscale.autoscaled(MoEInferenceServiceStatus(), decision)
    assert state_of(report.read_status(report.status_patch(MoEInferenceServiceStatus(), status)), SPEC) == state
    assert state_of(MoEInferenceServiceStatus(), make_spec(replicas=2)) == AutoscaleState(2)


# --- the rules ------------------------------------------------------------------------------------------------


def test_a_missed_slo_adds_one_replica_after_the_up_window() -> None:
    first = run(obs(ttft=MISSED), AutoscaleState(1))
    assert (first.direction, first.recommendation, first.state.up_since) == ("hold", "Up", NOW)
    assert "attainment 50% < target 90%" in first.reason and "scale-up window of 30s" in first.reason
    early = run(obs(ttft=MISSED), AutoscaleState(1, up_since=ago(29)))
    assert early.direction == "hold"
    up = run(obs(ttft=MISSED), AutoscaleState(1, up_since=ago(30)))
    assert (up.direction, up.state) == ("up", AutoscaleState(2, NOW))  # the step restarts both windows
    assert "1 -> 2 replicas" in up.reason and "fits the memory model" in up.reason


def test_an_slo_judged_on_too_few_requests_adds_nothing() -> None:
    d = run(obs(ttft=FEW, tpot=FEW), AutoscaleState(1, up_since=ago(600)))
    assert d.recommendation != "Up" and d.direction == "hold" and d.signals.met is None


def test_a_deep_queue_adds_a_replica_and_only_one_per_step() -> None:
    d = run(obs(2, queue=500.0), AutoscaleState(2, up_since=ago(60)))
    assert (d.direction, d.state.desired) == ("up", 3)
    assert "queue 500.0 requests/replica > 4" in d.reason


def test_the_queue_is_per_replica() -> None:
    # two pods with 3 waiting each: 3 per replica, under 4; one LWS replica of two pods: 6 per replica, over
    assert run(obs(2, queue=3.0), AutoscaleState(2, up_since=ago(60))).recommendation != "Up"
    lws = make_spec(parallelism={"podsPerReplica": 2, "expertParallelSize": 2})
    d = run(obs(2, queue=3.0), AutoscaleState(1, up_since=ago(60)), spec=lws)
    assert d.signals.queue_per_replica == 6.0 and d.direction == "up"


def test_calm_removes_a_replica_only_after_the_whole_down_window() -> None:
    first = run(obs(2), AutoscaleState(2))
    assert (first.direction, first.recommendation, first.state.down_since) == ("hold", "Down", NOW)
    assert run(obs(2), AutoscaleState(2, down_since=ago(299))).direction == "hold"
    down = run(obs(2), AutoscaleState(2, down_since=ago(300)))
    assert (down.direction, down.state) == ("down", AutoscaleState(1, NOW))
    assert "attainment 95% >= target 90%" in down.reason and "2 -> 1 replicas" in down.reason


def test_an_idle_service_is_calm() -> None:
    d = run(obs(2, ttft=None), AutoscaleState(2, down_since=ago(300)))
    assert d.direction == "down" and "fewer than 10 interactive requests answered" in d.reason


def test_no_removal_while_the_queue_would_pass_the_target_on_one_replica_fewer() -> None:
    # 3 per replica on 2 replicas: 6 waiting, over 4 on one replica: removing one would recommend adding it
    d = run(obs(2, queue=3.0), AutoscaleState(2, down_since=ago(600)))
    assert (d.direction, d.recommendation, d.state.down_since) == ("hold", "Hold", None)
    assert run(obs(2, queue=2.0), AutoscaleState(2, down_since=ago(600))).direction == "down"


def test_a_missed_slo_never_removes_a_replica() -> None:
    d = run(obs(3, ttft=MISSED), AutoscaleState(3, down_since=ago(600)))
    assert d.direction == "hold" and d.recommendation == "Up"


@given(n=st.integers(2, 64), waiting=st.floats(0, 10_000, allow_nan=False), target=st.floats(0.1, 1000))
@settings(max_examples=200, deadline=None)
def test_a_removal_never_recommends_the_next_addition(n: int, waiting: float, target: float) -> None:
    """No oscillation by construction: whatever removes a replica leaves the same queue under the target."""
    spec = make_spec(autoscaling=AUTO | {"maxReplicas": 64, "queueRequestsPerReplica": target})
    down = run(obs(n, queue=waiting / n), AutoscaleState(n, down_since=ago(600)), spec=spec)
    if down.direction == "down":
        after = run(obs(n - 1, queue=waiting / (n - 1)), AutoscaleState(n - 1, up_since=ago(600)), spec=spec)
        assert after.recommendation != "Up"


@pytest.mark.parametrize(("blind", "words"), [
    ({"error": "Prometheus unreachable", "memory_ratio": None}, "metrics unavailable (Prometheus unreachable)"),
    ({"reporting_pods": ("w-0",)}, "silent pods w-1"),
    ({"crash_looping_pods": ("w-1",)}, "crash-looping pods w-1"),
    ({"short_history_pods": ("w-1",), "short_history": "w-1 has 4s of its 10s window"}, "w-1 has 4s"),
    ({"signals": None, "signals_missing": "diagnosis query failed"}, "queue depth not seen (diagnosis query failed)"),
])
def test_blind_time_holds_and_restarts_both_windows(blind: dict[str, Any], words: str) -> None:
    for state in (AutoscaleState(2, up_since=ago(600)), AutoscaleState(2, down_since=ago(600))):
        calm_or_missed = obs(2, ttft=MISSED if state.up_since else MET, **blind)
        d = run(calm_or_missed, state)
        assert (d.direction, d.recommendation, d.state) == ("hold", "Hold", AutoscaleState(2))
        assert words in d.reason and "holding 2 replicas" in d.reason


def test_a_pod_without_its_queue_is_blind_not_calm() -> None:
    o = obs(2, signals=DiagnosisSignals(pods=(PodSignals("w-0", queue_requests=0.0), PodSignals("w-1"))))
    d = run(o, AutoscaleState(2, down_since=ago(600)))
    assert d.direction == "hold" and "queue depth not seen" in d.reason


def test_skew_and_the_leak_window_do_not_blind_the_autoscaler() -> None:
    o = obs(1, ttft=MISSED, skew_ratio=None, skew_steps=5.0, slope_unknown="series gap")
    assert not o.fully_visible
    assert run(o, AutoscaleState(1, up_since=ago(60))).direction == "up"


def test_the_window_counts_from_the_blind_floor_and_the_last_scale() -> None:
    state = AutoscaleState(1, up_since=ago(600))
    assert run(obs(ttft=MISSED), state, blind_floor=ago(10)).direction == "hold"  # a restart: a full window again
    assert run(obs(ttft=MISSED), state, blind_floor=ago(30)).direction == "up"
    assert run(obs(ttft=MISSED), AutoscaleState(1, ago(10), up_since=ago(600))).direction == "hold"


def test_never_above_max_nor_below_min_and_a_count_outside_them_is_brought_in_at_once() -> None:
    top = run(obs(3, queue=100.0), AutoscaleState(3, up_since=ago(600)))
    assert top.direction == "hold" and "at maxReplicas 3" in top.reason
    bottom = run(obs(1), AutoscaleState(1, down_since=ago(600)))
    assert bottom.direction == "hold" and "at minReplicas 1" in bottom.reason
    above = run(obs(5), AutoscaleState(5))
    assert (above.direction, above.state.desired) == ("down", 3) and "maxReplicas 3: 5 -> 3" in above.reason
    raised = make_spec(autoscaling=AUTO | {"minReplicas": 2})
    below = run(obs(1, ttft=None, error="down", memory_ratio=None), AutoscaleState(1), spec=raised)
    assert (below.direction, below.state.desired) == ("up", 2)  # the bounds are the spec's, blind or not


# --- a scale-up that would not fit ------------------------------------------------------------------------------


def test_a_scale_up_that_would_not_fit_the_memory_model_is_refused_with_the_figures() -> None:
    tight = make_spec(resources={"gpus": 0, "softLimit": "840Mi", "hardLimit": "1152Mi"})
    fit = new_replica_fit(obs(), tight, BUDGETS)
    assert fit.fits is False and "would not fit the memory model" in fit.message and "softLimit 840 MiB" in fit.message
    d = run(obs(ttft=MISSED), AutoscaleState(1, up_since=ago(60)), spec=tight)
    assert (d.direction, d.state.desired, d.recommendation) == ("hold", 1, "Up")
    assert d.refused == fit.message and "scale-up refused" in d.reason
    assert d.state.up_since == ago(60)  # still recommended: tried again at the next look
    assert new_replica_fit(obs(), SPEC, BUDGETS).fits is True


def test_smaller_budgets_fit_where_the_spec_budgets_do_not() -> None:
    tight = make_spec(resources={"gpus": 0, "softLimit": "840Mi", "hardLimit": "1152Mi"})
    small = BUDGETS.model_copy(update={"max_prefill_tokens": 64, "max_batch_requests": 2})
    assert new_replica_fit(obs(), tight, small).fits is True


def test_an_unknown_fit_is_refused_where_the_model_applies_and_allowed_where_it_does_not() -> None:
    unknown = run(obs(ttft=MISSED, idle_mib=None), AutoscaleState(1, up_since=ago(60)))
    assert unknown.direction == "hold" and unknown.refused is not None and "idle footprint" in unknown.refused
    gpu = make_spec(resources={"gpus": 1, "softLimit": "840Mi", "hardLimit": "1152Mi"})
    d = run(obs(ttft=MISSED, idle_mib=None), AutoscaleState(1, up_since=ago(60)), spec=gpu)
    assert d.direction == "up" and "memory fit not predicted (GPU workers" in d.reason


def test_no_scale_up_while_a_replica_is_not_ready() -> None:
    d = run(obs(2, ttft=MISSED), AutoscaleState(2, up_since=ago(60)), ready=1)
    assert d.direction == "hold" and d.refused == "1/2 replicas ready: no replica is added until they are"


# --- status, Events and the workload -----------------------------------------------------------------------------


def test_status_shows_the_decision_and_the_signals_and_events_name_the_reason() -> None:
    up = run(obs(2, queue=10.0, ttft=MISSED), AutoscaleState(2, up_since=ago(60)))
    status, events = autoscale.autoscaled(MoEInferenceServiceStatus(replicas=2), up)
    block = status.autoscaling
    assert block is not None and status.replicas == 3
    assert (block.desired_replicas, block.recommendation, block.attainment, block.queue_requests_per_replica,
            block.requests, block.last_scale_time) == (3, "Up", 0.5, 10.0, 100.0, NOW)
    assert [(e.type, e.reason, e.message) for e in events] == [("Normal", "ScaledUp", up.reason)]
    down = run(obs(2), AutoscaleState(2, down_since=ago(300)))
    assert [e.reason for e in autoscale.autoscaled(status, down)[1]] == ["ScaledDown"]


def test_a_refusal_is_a_warning_event_once_not_at_every_look() -> None:
    tight = make_spec(resources={"gpus": 0, "softLimit": "840Mi", "hardLimit": "1152Mi"})
    refused = run(obs(ttft=MISSED), AutoscaleState(1, up_since=ago(60)), spec=tight)
    first, events = autoscale.autoscaled(MoEInferenceServiceStatus(), refused)
    assert [(e.type, e.reason) for e in events] == [("Warning", "ScaleUpRefused")]
    assert "would not fit the memory model" in events[0].message
    assert first.autoscaling is not None and first.autoscaling.scale_up_refused == refused.refused
    assert autoscale.autoscaled(first, refused)[1] == []
    cleared, _ = autoscale.autoscaled(first, run(obs(), AutoscaleState(1)))
    assert cleared.autoscaling is not None and cleared.autoscaling.scale_up_refused is None


def _prior(spec: MoEInferenceServiceSpec, auto: AutoscalingStatus | None = None) -> MoEInferenceServiceStatus:
    doc = BudgetDocument(generation=1, budgets=BUDGETS)
    base = report.reconciled(MoEInferenceServiceStatus(), spec, doc, "a=b", ago(3600), 1)
    ready = report.readiness(base, spec, spec.replicas, None, ago(3600), 1)
    return ready.model_copy(update={"autoscaling": auto, "control": ControlStatus(oom_checked_time=ago(3600))})


def _pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Running", "startTime": ago(3600).isoformat(),
                                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_look_scales_the_workload_after_status_and_the_workload_is_set_again_where_it_differs() -> None:
    prior = _prior(SPEC, AutoscalingStatus(desired_replicas=1, scale_up_since=ago(60)))
    served = serving_spec(SPEC, prior)
    step = tick.look_step(prior, served, [_pod("w-0")], None, obs(ttft=MISSED), ago(3600), NOW, 1,
                          workload_replicas=1)
    assert step.scale == 2 and step.status.replicas == 2 and step.autoscale is not None
    assert step.status.autoscaling is not None and step.status.autoscaling.desired_replicas == 2
    assert "ScaledUp" in [e.reason for e in step.events]
    assert SPEC.replicas == 1  # never written
    calm = tick.look_step(prior, served, [_pod("w-0")], None, obs(), ago(3600), NOW, 1, workload_replicas=1)
    assert calm.scale is None  # nothing to change
    drifted = tick.look_step(prior, served, [_pod("w-0")], None, obs(), ago(3600), NOW, 1, workload_replicas=4)
    assert drifted.scale == 1  # a hand-scaled Deployment is set back to the decision


def test_a_look_without_autoscaling_changes_nothing_about_replicas() -> None:
    plain = MoEInferenceServiceSpec.model_validate(BASE)
    prior = _prior(plain)
    step = tick.look_step(prior, plain, [_pod("w-0")], None, obs(queue=100.0, ttft=MISSED), ago(3600), NOW, 1,
                          workload_replicas=1)
    assert step.scale is None and step.autoscale is None and step.status.autoscaling is None
    assert step.status.replicas == 1 and not [e for e in step.events if e.reason.startswith("Scale")]


def test_a_reconcile_keeps_the_autoscaler_state_and_clears_it_once_autoscaling_is_removed() -> None:
    kept = AutoscalingStatus(desired_replicas=2, last_scale_time=ago(50))
    prior = MoEInferenceServiceStatus(autoscaling=kept)
    doc = BudgetDocument(generation=1, budgets=BUDGETS)
    again = report.reconciled(prior, serving_spec(SPEC, prior), doc, "a=b", NOW, 2)
    assert again.autoscaling == kept and again.replicas == 2
    plain = MoEInferenceServiceSpec.model_validate(BASE | {"replicas": 4})
    gone = report.reconciled(prior, serving_spec(plain, prior), doc, "a=b", NOW, 3)
    assert gone.autoscaling is None and gone.replicas == 4
