"""The predictive policy (``--policy predictive``, issue 30): budgets from each pod's predicted memory, overload
mode from SLO attainment. The shape and limits are the headline's (preset ``small``, softLimit 980 MiB, an idle
footprint near the measured 799 MiB); each rule is checked against the threshold policy where they differ."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from moeguard_operator.loop import policy
from moeguard_operator.loop.memory_fit import model_memory, predict
from moeguard_operator.loop.observation import ClassLatency, Observation, PodLoad
from moeguard_operator.loop.policy import PolicyState, ceilings, initial_budgets
from moeguard_operator.loop.predictive import decide
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

MIB = 2**20
INF = math.inf
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec.model_validate({
    "model": {"preset": "small"}, "resources": {"gpus": 0, "softLimit": "980Mi", "hardLimit": "1152Mi"},
    "batching": {"maxPrefillTokens": 256, "maxDecodeTokens": 8, "maxBatchRequests": 8, "maxConcurrentBatches": 1,
                 "maxLongRequestsPerBatch": 1, "maxQueueRequests": 8, "queueTimeoutSeconds": 2.0,
                 "ceilings": {"maxPrefillTokens": 1024, "maxBatchRequests": 16},
                 "floors": {"maxPrefillTokens": 64, "maxDecodeTokens": 1, "maxBatchRequests": 1,
                            "maxLongRequestsPerBatch": 1, "maxConcurrentBatches": 1, "maxQueueRequests": 1,
                            "queueTimeoutSeconds": 1.0}},
    "control": {"skewThreshold": 32, "cooldownSeconds": 30, "stabilizationWindowSeconds": 120,
                "rssSoftFraction": 0.9, "rssHardFraction": 0.95, "decreaseFactor": 0.5, "increaseStep": 0.1},
})
START = initial_budgets(SPEC.batching)
PODS = ("w-0", "w-1")
MET = ((3.0, 95.0), (INF, 100.0))  # TTFT: 95 of 100 within 3 s
MISSED = ((3.0, 60.0), (INF, 100.0))  # TTFT: 60 of 100
MET_TPOT = ((0.25, 95.0), (INF, 100.0))  # TPOT: 95 of 100 within 0.25 s
MISSED_TPOT = ((0.25, 50.0), (INF, 100.0))


def loads(idle_mib: float = 799, mean: float | None = 300, longest: float | None = 2048,
          skew: float | None = 2.0) -> tuple[PodLoad, ...]:
    return tuple(PodLoad(p, memory_bytes=850 * MIB, idle_footprint_bytes=idle_mib * MIB, skew_ratio=skew,
                         context_mean_tokens=mean, context_max_tokens=longest) for p in PODS)


def obs(**kw: Any) -> Observation:
    base: dict[str, Any] = {"time": NOW, "skew_ratio": 2.0, "skew_steps": 40, "memory_ratio": 0.74,
                            "expected_pods": PODS, "reporting_pods": PODS, "pod_loads": loads(),
                            "latency": (ClassLatency("interactive", MET, MET_TPOT),)}
    return Observation(**(base | kw))


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


CALM = PolicyState(START, last_change=ago(600), last_pressure=ago(600), last_blind=ago(600))


def test_skew_with_room_changes_nothing_where_the_threshold_policy_halves() -> None:
    at_ceilings = SPEC.model_copy(update={"batching": SPEC.batching.model_copy(
        update={"ceilings": type(SPEC.batching.ceilings)()})})  # ceilings unset: the initial budgets
    skewed = obs(skew_ratio=384.0, pod_loads=loads(skew=384.0))
    d = decide(skewed, CALM, at_ceilings, NOW)
    assert d.direction == "hold" and d.pressure == () and d.state.budgets == START
    assert d.state.last_pressure == CALM.last_pressure  # skew is not pressure
    assert "expert skew ratio 384.00 > skewThreshold 32, but every pod's predicted peak fits (132 MiB to spare)" \
        in d.reason
    assert [(m.pod, round(m.headroom_bytes / MIB)) for m in d.memory] == [("w-0", 132), ("w-1", 132)]
    old = policy.decide(skewed, CALM, at_ceilings, NOW)
    assert old.direction == "down" and old.state.budgets.max_prefill_tokens == 128


def test_a_predicted_peak_over_the_soft_limit_solves_the_budget_to_fit_not_half() -> None:
    tight = (PodLoad("w-0", idle_footprint_bytes=880 * MIB, skew_ratio=2.0, context_mean_tokens=800,
                     context_max_tokens=3072), loads()[1])
    d = decide(obs(pod_loads=tight), PolicyState(START), SPEC, NOW)
    assert d.direction == "down" and d.pressure == ("PredictedMemory",)
    assert d.state.budgets == START.model_copy(update={"max_batch_requests": 7})  # not 4: the largest that fits
    assert "w-0 predicted 982 MiB (idle 880 + KV 75 + step 27) of softLimit 980 MiB: 2 MiB over" in d.reason
    assert "maxBatchRequests 8 -> 7 (the largest that fit)" in d.reason
    model = model_memory(SPEC)[0]
    assert model is not None
    after = predict(model, d.state.budgets, tight[0], SPEC.resources.soft_limit_bytes)
    assert after is not None and after.fits
    assert d.state.last_pressure == NOW and d.state.last_change == NOW


def test_a_leaking_pods_overrun_is_left_to_its_replacement_and_cuts_no_budget() -> None:
    """Its idle footprint grew with the leak (880 MiB: 2 MiB over); cutting every pod's budgets would not stop it."""
    leaky = (PodLoad("w-0", idle_footprint_bytes=880 * MIB, skew_ratio=2.0, context_mean_tokens=800,
                     context_max_tokens=3072), loads()[1])
    restart = SPEC.model_copy(update={"control": SPEC.control.model_copy(update={"leak_action": "Restart"})})
    leaking = obs(pod_loads=leaky, pod_rss_slopes=(("w-0", 4 * MIB), ("w-1", 0.0)))
    d = decide(leaking, PolicyState(START, last_change=NOW), restart, NOW)  # in cooldown: no loosening either
    assert d.direction == "hold" and d.pressure == () and d.state.budgets == START
    assert ("w-0 predicted 982 MiB (idle 880 + KV 75 + step 27) of softLimit 980 MiB, but w-0 leaks (RSS +240 "
            "MiB/min): left to the leak replacement, no budget cut for it") in d.reason
    # The same look where leaks are only reported (leakAction Warn): no replacement, so the budgets fit the pod.
    assert decide(leaking, PolicyState(START), SPEC, NOW).state.budgets.max_batch_requests == 7
    # A slope within the noise floor is no leak: the overrun is cut as before.
    noisy = obs(pod_loads=leaky, pod_rss_slopes=(("w-0", 32 * 1024),))
    assert decide(noisy, PolicyState(START), restart, NOW).state.budgets.max_batch_requests == 7


def test_a_predicted_overrun_waits_for_the_cooldown_an_oom_kill_does_not() -> None:
    tight = (PodLoad("w-0", idle_footprint_bytes=880 * MIB, context_mean_tokens=800, context_max_tokens=3072),)
    state = PolicyState(START, last_change=ago(10))
    held = decide(obs(pod_loads=tight), state, SPEC, NOW)
    assert held.direction == "hold" and "in cooldown" in held.reason
    oom = decide(obs(new_oom_kills=1), state, SPEC, NOW)
    assert oom.direction == "down" and oom.pressure == ("OOMKilled",)
    b = oom.state.budgets
    assert (b.max_prefill_tokens, b.max_decode_tokens, b.max_batch_requests, b.max_queue_requests,
            b.queue_timeout_seconds) == (128, 4, 4, 4, 1.0)
    assert oom.state.overload == "On" and "OOM kill" in oom.reason


def test_room_full_sight_and_calm_loosen_toward_the_ceilings_as_far_as_the_prediction_fits() -> None:
    d = decide(obs(), CALM, SPEC, NOW)
    assert d.direction == "up"
    b = d.state.budgets
    assert (b.max_prefill_tokens, b.max_batch_requests) == (358, 10)  # + 0.1 x the ceilings 1024 and 16
    model = model_memory(SPEC)[0]
    assert model is not None
    for load in loads():
        p = predict(model, b, load, SPEC.resources.soft_limit_bytes)
        assert p is not None and p.fits
    # close to the limit: the climb stops where the prediction would pass it, one budget at a time
    near = decide(obs(pod_loads=loads(idle_mib=920)), CALM, SPEC, NOW)
    assert (near.state.budgets.max_prefill_tokens, near.state.budgets.max_batch_requests) == (356, 10)
    nearer = decide(obs(pod_loads=loads(idle_mib=925)), CALM, SPEC, NOW)
    assert (nearer.state.budgets.max_prefill_tokens, nearer.state.budgets.max_batch_requests) == (358, 8)


def test_no_room_no_loosening() -> None:
    d = decide(obs(pod_loads=loads(idle_mib=930)), CALM, SPEC, NOW)
    assert d.direction == "hold" and d.state.budgets == START
    assert "the predicted peak leaves no room to loosen" in d.reason


@pytest.mark.parametrize("blind", [
    {"error": "Prometheus at http://p: PrometheusTimeout"},
    {"reporting_pods": ("w-0",)},  # a silent pod
    {"short_history_pods": ("w-1",), "short_history": "history shorter than 30s"},
    {"crash_looping_pods": ("w-1",)},
])
def test_blind_never_loosens_and_restarts_the_window(blind: dict[str, Any]) -> None:
    d = decide(obs(**blind), CALM, SPEC, NOW)
    assert d.direction == "hold" and d.state.budgets == START and d.state.last_blind == NOW
    assert "not loosening" in d.reason


def test_just_after_blind_time_the_stabilization_window_holds_the_climb() -> None:
    d = decide(obs(), PolicyState(START, last_change=ago(600), last_pressure=ago(600), last_blind=ago(60)), SPEC, NOW)
    assert d.direction == "hold" and "room to loosen; waiting for the stabilization window" in d.reason


def test_a_pod_without_an_idle_footprint_is_not_read_as_room() -> None:
    missing = (PodLoad("w-0", context_mean_tokens=300, context_max_tokens=2048), loads()[1])
    d = decide(obs(pod_loads=missing), CALM, SPEC, NOW)
    assert d.direction == "hold" and "no idle footprint (moeguard_memory_idle_footprint_bytes) yet for w-0" in d.reason


def test_an_idle_window_predicts_at_the_full_context_for_loosening_but_never_tightens() -> None:
    idle = obs(skew_ratio=None, skew_steps=0, pod_loads=loads(mean=None, longest=None, skew=None), latency=())
    model = model_memory(SPEC)[0]
    assert model is not None
    full = predict(model, START, idle.pod_loads[0], SPEC.resources.soft_limit_bytes)
    assert full is not None and not full.fits  # 8 sequences at 4,096 tokens would not fit
    d = decide(idle, CALM, SPEC, NOW)
    assert d.direction == "hold" and d.pressure == () and d.state.budgets == START
    assert "the predicted peak leaves no room to loosen" in d.reason


def test_interactive_attainment_below_target_turns_overload_on() -> None:
    d = decide(obs(latency=(ClassLatency("interactive", MISSED, MET_TPOT),)), PolicyState(START), SPEC, NOW)
    assert d.state.overload == "On" and d.overload_changed
    assert ("overload mode Off -> On (interactive SLO attainment TTFT 60%, TPOT 95% (target 90%; 100 first "
            "tokens, 100 answers))") in d.reason
    assert d.pressure == () and d.direction != "down"  # a latency miss is not a memory problem: no tightening


def test_batch_attainment_alone_does_not_turn_overload_on() -> None:
    d = decide(obs(latency=(ClassLatency("interactive", MET, MET_TPOT), ClassLatency("batch", MISSED, MISSED_TPOT))),
               PolicyState(START), SPEC, NOW)
    assert d.state.overload == "Off"


def test_refusals_alone_never_turn_overload_on() -> None:
    loud = obs(rejection_rate_per_second=5.0, p99_latency_seconds=90.0)
    d = decide(loud, PolicyState(START), SPEC, NOW)
    assert d.state.overload == "Off" and not d.overload_changed
    assert policy.decide(loud, PolicyState(START), SPEC, NOW).state.overload == "On"  # the threshold policy's rule


def test_memory_past_the_hard_fraction_turns_overload_on() -> None:
    d = decide(obs(memory_ratio=0.97), PolicyState(START), SPEC, NOW)
    assert d.state.overload == "On" and "memory 97% of hardLimit > rssHardFraction 95%" in d.reason


def test_overload_turns_off_after_recovery_only_with_a_window_of_full_sight() -> None:
    on = PolicyState(START, overload="On", last_overload_trigger=ago(60), last_blind=ago(600))
    assert decide(obs(), on, SPEC, NOW).state.overload == "On"  # recovered, but not for the window yet
    recovered = PolicyState(START, overload="On", last_overload_trigger=ago(121), last_blind=ago(600))
    d = decide(obs(), recovered, SPEC, NOW)
    assert d.state.overload == "Off" and "no overload trigger for 120s" in d.reason
    assert decide(obs(reporting_pods=("w-0",)), recovered, SPEC, NOW).state.overload == "On"  # blind: stays
    few = ((3.0, 1.0), (INF, 3.0))  # 3 requests, 1 met: reported, not judged (minRequests 10)
    assert decide(obs(latency=(ClassLatency("interactive", few, few),)), recovered, SPEC, NOW).state.overload == "Off"


def test_where_the_operator_cannot_predict_it_holds_and_says_why() -> None:
    gpu = SPEC.model_copy(update={"resources": SPEC.resources.model_copy(update={"gpus": 1})})
    d = decide(obs(), CALM, gpu, NOW)
    assert d.direction == "hold" and d.memory == ()
    assert "no memory prediction (GPU workers: the memory model is of the CPU path): not loosening" in d.reason
    assert ceilings(gpu.batching) != START  # there was room to climb


def test_status_shows_the_prediction_at_a_mib_grain_so_page_noise_writes_nothing() -> None:
    noisy = tuple(PodLoad(p.pod, idle_footprint_bytes=(p.idle_footprint_bytes or 0) + 12_288, skew_ratio=2.0,
                          context_mean_tokens=300, context_max_tokens=2048) for p in loads())
    assert decide(obs(), PolicyState(START), SPEC, NOW).memory == decide(obs(pod_loads=noisy), PolicyState(START),
                                                                        SPEC, NOW).memory
    (first, _) = decide(obs(), PolicyState(START), SPEC, NOW).memory
    assert first.idle_footprint_bytes == 799 * MIB and first.predicted_peak_bytes % MIB == 0


def test_an_oom_kill_under_a_memory_cut_never_writes_a_long_cap_above_the_batch() -> None:
    """Stop 45's bench-control-predictive: the kill halved maxLongRequestsPerBatch (4 -> 2) while the memory model
    cut maxBatchRequests to 1; the workers refused that document (budget_watch.check_consistency) and the
    survivors kept their old budgets. The cap now follows the batch, and the document applies."""
    from moeguard_core.contract import BudgetDocument
    from moeguard_runtime.engine.budget_watch import check_consistency, decide_update

    spec = MoEInferenceServiceSpec.model_validate({
        "model": {"preset": "tiny"}, "resources": {"gpus": 0, "softLimit": "1536Mi", "hardLimit": "2Gi"}})
    start = initial_budgets(spec.batching)
    assert (start.max_batch_requests, start.max_long_requests_per_batch) == (32, 4)
    leaker = PodLoad("w-0", idle_footprint_bytes=1600 * MIB, skew_ratio=2.0, context_mean_tokens=64,
                     context_max_tokens=128)
    d = decide(obs(new_oom_kills=1, pod_loads=(leaker, loads()[1])), PolicyState(start), spec, NOW)
    b = d.state.budgets
    assert d.direction == "down" and b.max_batch_requests == 1
    assert b.max_long_requests_per_batch == 1  # halved to 2, then capped at the batch
    assert "maxLongRequestsPerBatch 4 -> 1" in d.reason
    doc = BudgetDocument(generation=2, budgets=b, overload_mode="On", reason=d.reason[:200])
    assert check_consistency(doc) is None
    assert decide_update(doc.to_configmap_data(), 1).action == "apply"


def test_a_spec_whose_batch_is_below_the_default_long_cap_starts_coherent() -> None:
    """``maxBatchRequests: 2`` with ``maxLongRequestsPerBatch`` left at its default 4: the first document's cap is
    the batch, not a cap the workers refuse."""
    spec = MoEInferenceServiceSpec.model_validate({"model": {"preset": "tiny"}, "resources": {"gpus": 0},
                                                   "batching": {"maxBatchRequests": 2}})
    assert spec.batching.max_long_requests_per_batch == 4
    for budgets in (initial_budgets(spec.batching), ceilings(spec.batching), policy.floors(spec.batching)):
        assert budgets.max_long_requests_per_batch <= budgets.max_batch_requests
    assert initial_budgets(spec.batching).max_long_requests_per_batch == 2


LOOSENED = PolicyState(START.model_copy(update={"max_prefill_tokens": 460, "max_batch_requests": 12}),
                       last_change=ago(600), last_pressure=ago(600), last_blind=ago(600))


def test_tpot_below_target_above_the_specs_budgets_undoes_one_loosening_never_below_the_spec() -> None:
    missed = obs(latency=(ClassLatency("interactive", MET, MISSED_TPOT),))
    d = decide(missed, LOOSENED, SPEC, NOW)
    assert d.direction == "down" and d.pressure == ("SloAttainment",) and d.state.last_pressure == NOW
    b = d.state.budgets
    assert (b.max_prefill_tokens, b.max_batch_requests) == (358, 10)  # - 0.1 x the ceilings 1024 and 16
    assert b.max_decode_tokens == START.max_decode_tokens  # at the spec's value: kept
    assert ("interactive SLO attainment TTFT 95%, TPOT 50% (target 90%; 100 first tokens, 100 answers): TPOT below "
            "target with budgets above the spec's, one loosening undone") in d.reason
    # one step above the spec: back to the spec, not below it
    near = PolicyState(START.model_copy(update={"max_batch_requests": 9}), last_change=ago(600))
    assert decide(missed, near, SPEC, NOW).state.budgets == START
    # at the spec's budgets a TPOT miss cuts nothing (not a memory problem) and holds the climb
    at_spec = decide(missed, CALM, SPEC, NOW)
    assert at_spec.direction == "hold" and at_spec.state.budgets == START and at_spec.pressure == ()
    assert "TPOT below target, not loosening" in at_spec.reason
    # the undo waits for the cooldown, as any move but an OOM kill's
    fresh = PolicyState(LOOSENED.budgets, last_change=ago(10))
    assert decide(missed, fresh, SPEC, NOW).direction == "hold"
    # TPOT met: the same state climbs on
    assert decide(obs(), LOOSENED, SPEC, NOW).direction == "up"


def test_a_tpot_miss_on_too_few_answers_is_not_judged_and_undoes_nothing() -> None:
    few = ((0.25, 2.0), (INF, 4.0))
    d = decide(obs(latency=(ClassLatency("interactive", ((3.0, 4.0), (INF, 4.0)), few),)), LOOSENED, SPEC, NOW)
    assert d.direction == "up" and "SloAttainment" not in d.pressure


def test_a_leaking_pod_being_replaced_does_not_hold_back_the_loosening_where_leaks_are_only_reported_it_does() -> None:
    leaky = (PodLoad("w-0", idle_footprint_bytes=935 * MIB, skew_ratio=2.0, context_mean_tokens=300,
                     context_max_tokens=2048), loads()[1])
    slopes = (("w-0", 4 * MIB), ("w-1", 0.0))
    restart = SPEC.model_copy(update={"control": SPEC.control.model_copy(update={"leak_action": "Restart"})})
    replaced = decide(obs(pod_loads=leaky, pod_rss_slopes=slopes), CALM, restart, NOW)
    assert replaced.direction == "up"
    assert (replaced.state.budgets.max_prefill_tokens, replaced.state.budgets.max_batch_requests) == (358, 10)
    warned = decide(obs(pod_loads=leaky, pod_rss_slopes=slopes), CALM, SPEC, NOW)
    assert warned.direction != "up" and warned.state.budgets.max_batch_requests <= START.max_batch_requests
