from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeguard_core.contract import Budgets
from moeguard_operator.loop.observation import LEAK_NOISE_BYTES_PER_SECOND, Observation
from moeguard_operator.loop.policy import (
    PolicyState,
    ceilings,
    decide,
    decrease,
    floors,
    increase,
    initial_budgets,
    judge_leak,
    seconds_to_hard_limit,
)
from moeguard_operator.spec.models import BUDGET_FIELDS, MoEInferenceServiceSpec
from moeguard_runtime.memory.leak import DEFAULT_THRESHOLD_BYTES_PER_S

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec.model_validate({
    "batching": {"maxPrefillTokens": 4096, "maxDecodeTokens": 256, "maxBatchRequests": 32,
                 "ceilings": {"maxPrefillTokens": 8192}},
    "control": {"skewThreshold": 4.0, "cooldownSeconds": 30, "stabilizationWindowSeconds": 120,
                "rssSoftFraction": 0.8, "rssHardFraction": 0.95, "decreaseFactor": 0.5, "increaseStep": 0.1},
})
START = initial_budgets(SPEC.batching)
PODS = ("w-0", "w-1")


def obs(**kw: Any) -> Observation:
    base: dict[str, Any] = {"time": NOW, "skew_ratio": 2.0, "memory_ratio": 0.5, "expected_pods": PODS, "reporting_pods": PODS}
    return Observation(**(base | kw))


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def test_high_skew_halves_the_prefill_budgets_only() -> None:
    d = decide(obs(skew_ratio=9.5), PolicyState(START), SPEC, NOW)
    assert d.direction == "down" and d.pressure == ("ExpertSkew",)
    assert d.state.budgets.max_prefill_tokens == 2048
    assert d.state.budgets.max_long_requests_per_batch == 2
    assert d.state.budgets.max_decode_tokens == 256
    assert "expert skew ratio 9.50 > threshold 4" in d.reason
    assert "maxPrefillTokens 4096 -> 2048" in d.reason
    assert d.state.last_change == NOW and d.state.last_pressure == NOW


def test_memory_pressure_drops_every_budget_to_floors_at_most() -> None:
    d = decide(obs(memory_ratio=0.85), PolicyState(START), SPEC, NOW)
    b = d.state.budgets
    assert (b.max_prefill_tokens, b.max_decode_tokens, b.max_batch_requests, b.max_concurrent_batches,
            b.max_queue_requests, b.queue_timeout_seconds) == (2048, 128, 16, 1, 32, 15.0)
    assert "memory 85% of hardLimit > rssSoftFraction 80%" in d.reason


def test_halving_stops_at_the_floors() -> None:
    low = floors(SPEC.batching)
    d = decide(obs(memory_ratio=0.9), PolicyState(low), SPEC, NOW)
    assert d.direction == "hold" and d.state.budgets == low
    assert "budgets already at their floors" in d.reason


def test_cooldown_blocks_a_second_move_but_not_an_oom_kill() -> None:
    state = PolicyState(START, last_change=ago(10))
    held = decide(obs(skew_ratio=9.0), state, SPEC, NOW)
    assert held.direction == "hold" and "in cooldown" in held.reason
    oom = decide(obs(new_oom_kills=1), state, SPEC, NOW)
    assert oom.direction == "down" and oom.pressure == ("OOMKilled",)
    assert oom.state.budgets.max_decode_tokens == 128
    assert oom.state.overload == "On" and oom.overload_changed


@pytest.mark.parametrize("blind", [
    {"error": "Prometheus down", "skew_ratio": None, "memory_ratio": None},
    {"skew_ratio": None},
    {"memory_ratio": None},
    {"reporting_pods": ("w-0",)},
])
def test_never_loosens_while_blind(blind: dict[str, Any]) -> None:
    tight = decrease(START, 0.5, floors(SPEC.batching), BUDGET_FIELDS)
    state = PolicyState(tight, overload="On", last_change=ago(3600), last_pressure=ago(3600), last_overload_trigger=ago(3600))
    d = decide(obs(**blind), state, SPEC, NOW)
    assert d.direction == "hold" and d.state.budgets == tight
    assert d.state.overload == "On"
    assert "not loosening" in d.reason


def test_silent_pod_is_named() -> None:
    o = obs(reporting_pods=("w-0",))
    assert o.silent_pods == ("w-1",) and o.available and not o.fully_visible
    assert "silent pods w-1" in decide(o, PolicyState(START), SPEC, NOW).reason


def test_recovery_waits_for_the_stabilization_window_then_climbs_additively() -> None:
    tight = START.model_copy(update={"max_prefill_tokens": 1024})
    early = decide(obs(), PolicyState(tight, last_change=ago(60), last_pressure=ago(60)), SPEC, NOW)
    assert early.direction == "hold" and "waiting for the stabilization window" in early.reason
    late = decide(obs(), PolicyState(tight, last_change=ago(121), last_pressure=ago(121)), SPEC, NOW)
    assert late.direction == "up"
    assert late.state.budgets.max_prefill_tokens == 1024 + 819  # + 0.1 x ceiling 8192, rounded
    assert late.state.budgets.max_decode_tokens == 256  # already at its ceiling (= initial)


def test_overload_auto_on_and_off_with_hysteresis() -> None:
    on = decide(obs(memory_ratio=0.97), PolicyState(START), SPEC, NOW)
    assert on.state.overload == "On" and "rssHardFraction 95%" in on.reason
    stays = decide(obs(), PolicyState(START, overload="On", last_overload_trigger=ago(30)), SPEC, NOW)
    assert stays.state.overload == "On" and not stays.overload_changed
    off = decide(obs(), PolicyState(START, overload="On", last_overload_trigger=ago(121)), SPEC, NOW)
    assert off.state.overload == "Off" and "no overload trigger for 120s" in off.reason
    latency = decide(obs(p99_latency_seconds=75.0), PolicyState(START), SPEC, NOW)
    assert latency.state.overload == "On" and "p99 latency 75.0s > 60s" in latency.reason


def test_overload_forced_by_spec() -> None:
    forced = SPEC.model_copy(update={"overload": SPEC.overload.model_copy(update={"mode": "On"})})
    assert decide(obs(), PolicyState(START), forced, NOW).state.overload == "On"


def test_leak_warn_and_restart() -> None:
    slope = 3 * 2**20  # 3 MiB/s = 180 MiB/min
    warn = decide(obs(rss_slope_bytes_per_second=slope), PolicyState(START), SPEC, NOW)
    assert warn.leak_suspected is True and not warn.restart
    assert "unclassified leak suspected: RSS +180.0 MiB/min over 600s at 50% of hardLimit" in warn.reason
    restart_spec = SPEC.model_copy(update={"control": SPEC.control.model_copy(update={"leak_action": "Restart"})})
    first = decide(obs(rss_slope_bytes_per_second=slope), PolicyState(START), restart_spec, NOW)
    assert first.restart and first.state.last_restart == NOW
    again = decide(obs(rss_slope_bytes_per_second=slope), first.state, restart_spec, NOW + timedelta(seconds=60))
    assert not again.restart  # at most once per leak window
    assert decide(obs(rss_slope_bytes_per_second=None), PolicyState(START), SPEC, NOW).leak_suspected is None


def test_decrease_and_increase_arithmetic() -> None:
    lower, upper = floors(SPEC.batching), ceilings(SPEC.batching)
    b = Budgets.model_validate({"maxPrefillTokens": 257, "maxDecodeTokens": 16, "maxBatchRequests": 3,
                                "maxConcurrentBatches": 2, "queueTimeoutSeconds": 1.5})
    d = decrease(b, 0.5, lower, BUDGET_FIELDS)
    assert (d.max_prefill_tokens, d.max_decode_tokens, d.max_batch_requests, d.max_concurrent_batches,
            d.queue_timeout_seconds) == (256, 16, 1, 1, 1.0)
    assert increase(d, 0.1, upper).max_prefill_tokens == 256 + 819
    assert increase(upper, 0.1, upper) == upper


budget_values = st.fixed_dictionaries({
    "max_prefill_tokens": st.integers(256, 8192), "max_decode_tokens": st.integers(16, 256),
    "max_batch_requests": st.integers(1, 32), "max_long_requests_per_batch": st.integers(1, 4),
    "max_concurrent_batches": st.integers(1, 2), "max_queue_requests": st.integers(1, 64),
    "queue_timeout_seconds": st.floats(1.0, 30.0),
})
maybe = st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False))
maybe_time = st.one_of(st.none(), st.integers(0, 7200).map(lambda s: NOW - timedelta(seconds=s)))


@settings(max_examples=300, deadline=None)
@given(values=budget_values, skew=maybe, memory=st.one_of(st.none(), st.floats(0, 2, allow_nan=False)),
       ooms=st.integers(0, 3), error=st.sampled_from([None, "down"]), reporting=st.sampled_from([PODS, ("w-0",), ()]),
       last_change=maybe_time, last_pressure=maybe_time)
def test_budgets_stay_within_floors_and_ceilings_and_blind_never_loosens(
        values: dict[str, Any], skew: float | None, memory: float | None, ooms: int, error: str | None,
        reporting: tuple[str, ...], last_change: datetime | None, last_pressure: datetime | None) -> None:
    budgets = Budgets.model_validate(values)
    o = Observation(NOW, skew_ratio=skew, memory_ratio=memory, expected_pods=PODS, reporting_pods=reporting,
                    new_oom_kills=ooms, error=error)
    d = decide(o, PolicyState(budgets, last_change=last_change, last_pressure=last_pressure), SPEC, NOW)
    lower, upper = floors(SPEC.batching), ceilings(SPEC.batching)
    for name in BUDGET_FIELDS:
        new, old = getattr(d.state.budgets, name), getattr(budgets, name)
        assert getattr(lower, name) <= new or new == old
        assert new <= max(getattr(upper, name), old)
        if not o.fully_visible:
            assert new <= old, f"{name} loosened while blind"
        if d.direction == "down":
            assert new <= old
    if ooms:
        assert d.direction == "down" or d.state.budgets == budgets


def test_blind_time_restarts_the_stabilization_window() -> None:
    tight = START.model_copy(update={"max_prefill_tokens": 1024})
    # calm for an hour, but blind a moment ago: sight has just come back
    state = PolicyState(tight, last_change=ago(3600), last_pressure=ago(3600), last_blind=ago(5))
    d = decide(obs(), state, SPEC, NOW)
    assert d.direction == "hold" and "waiting for the stabilization window" in d.reason
    assert d.state.last_blind == ago(5)  # seeing now: the blind mark stays where it was
    later = decide(obs(), PolicyState(tight, last_change=ago(3600), last_pressure=ago(3600), last_blind=ago(121)), SPEC, NOW)
    assert later.direction == "up"
    blind = decide(obs(error="down", memory_ratio=None), state, SPEC, NOW)
    assert blind.state.last_blind == NOW


def test_no_skew_samples_yet_is_visible_but_does_not_loosen() -> None:
    o = obs(skew_ratio=None)
    assert o.available and not o.fully_visible
    tight = START.model_copy(update={"max_prefill_tokens": 1024})
    d = decide(o, PolicyState(tight, last_change=ago(3600), last_pressure=ago(3600)), SPEC, NOW)
    assert d.direction == "hold" and "no expert-skew samples yet" in d.reason


# --- the leak rule: projected time to the hard limit ---------------------------------------------------
GiB, MB = 2**30, 10**6


def _leak_spec(hard: str = "16Gi", horizon: int | None = None, legacy: int | None = None) -> MoEInferenceServiceSpec:
    control: dict[str, Any] = {}
    if horizon is not None:
        control["leakHorizonSeconds"] = horizon
    if legacy is not None:
        control["leakSlopeBytesPerSecond"] = legacy
    return MoEInferenceServiceSpec.model_validate({"resources": {"softLimit": "512Mi", "hardLimit": hard},
                                                   "control": control})


def test_the_default_flags_the_seeds_leak_and_an_afternoon_leak_and_names_the_kind() -> None:
    spec = _leak_spec("80Gi")
    seed = judge_leak(obs(rss_slope_bytes_per_second=400 * MB / 60, memory_ratio=0.3,
                          leak_kinds=("native",), growth_bytes_per_second=(("rss_anonymous", 400 * MB / 60),)), spec)
    assert seed is not None and seed.suspected and seed.kind == "native" and seed.reason == "NativeLeak"
    assert seed.message.startswith("native leak suspected: RSS +381.5 MiB/min over 600s at 30% of hardLimit")
    assert "rss_anonymous +381 MiB/min" in seed.message and "hardLimit reached in 2.5 h" in seed.message
    # 50 MB/min (the old default, 1 MiB/s, never flagged it) on a worker 4 h from its 16Gi limit.
    afternoon = judge_leak(obs(rss_slope_bytes_per_second=50 * MB / 60, memory_ratio=0.3,
                               leak_kinds=("python_heap",)), _leak_spec("16Gi"))
    assert afternoon is not None and afternoon.suspected and afternoon.reason == "PythonHeapLeak"
    assert "python_heap leak suspected" in afternoon.message


def test_noise_and_far_horizons_are_not_flagged_and_the_deprecated_threshold_still_works() -> None:
    spec = _leak_spec("16Gi")
    noise = judge_leak(obs(rss_slope_bytes_per_second=LEAK_NOISE_BYTES_PER_SECOND, memory_ratio=0.99), spec)
    assert noise is not None and not noise.suspected and noise.reason == "RSSFlat" and noise.kind == "none"
    far = judge_leak(obs(rss_slope_bytes_per_second=200 * 1024, memory_ratio=0.1), spec)  # 14.4 GiB at 200 KiB/s: 21 h
    assert far is not None and not far.suspected
    legacy = judge_leak(obs(rss_slope_bytes_per_second=200 * 1024, memory_ratio=0.1), _leak_spec(legacy=100 * 1024))
    assert legacy is not None and legacy.suspected
    assert judge_leak(obs(rss_slope_bytes_per_second=None), spec) is None
    assert seconds_to_hard_limit(-5.0, 0.5, GiB) == math.inf


def test_the_noise_floor_is_the_workers_own() -> None:
    assert LEAK_NOISE_BYTES_PER_SECOND == DEFAULT_THRESHOLD_BYTES_PER_S


@settings(max_examples=300, deadline=None)
@given(slope=st.floats(-1e7, 1e9), ratio=st.one_of(st.none(), st.floats(0.0, 1.2)),
       hard_gib=st.integers(1, 512), horizon=st.integers(60, 604_800))
def test_leak_rule_properties(slope: float, ratio: float | None, hard_gib: int, horizon: int) -> None:
    spec = _leak_spec(f"{hard_gib}Gi", horizon)
    verdict = judge_leak(obs(rss_slope_bytes_per_second=slope, memory_ratio=ratio), spec)
    assert verdict is not None
    eta = seconds_to_hard_limit(slope, ratio, hard_gib * GiB)
    # flagged exactly when above the noise floor and the hard limit is within the horizon
    assert verdict.suspected == (slope > LEAK_NOISE_BYTES_PER_SECOND and eta <= horizon)
    if slope <= LEAK_NOISE_BYTES_PER_SECOND:
        assert not verdict.suspected
    # a steeper slope, from the same use, is never less suspect
    steeper = judge_leak(obs(rss_slope_bytes_per_second=slope * 2 + 1, memory_ratio=ratio), spec)
    assert steeper is not None and (steeper.suspected or not verdict.suspected)
    # with the default horizon, any leak that would kill within 6 hours (an afternoon) is flagged
    default = judge_leak(obs(rss_slope_bytes_per_second=slope, memory_ratio=ratio), _leak_spec(f"{hard_gib}Gi"))
    assert default is not None
    if slope > LEAK_NOISE_BYTES_PER_SECOND and eta <= 6 * 3600:
        assert default.suspected
    # the seed's 400 MB/min is flagged at any use with up to 268 GiB of headroom
    if hard_gib <= 268:
        seed = judge_leak(obs(rss_slope_bytes_per_second=400 * MB / 60, memory_ratio=ratio), _leak_spec(f"{hard_gib}Gi"))
        assert seed is not None and seed.suspected
