"""The policy on signals that describe the present (issue 18 §3–5): an idle service climbs back, too little
history never loosens and never reads a leak as flat."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeguard_operator.loop.conditions import leak_unknown
from moeguard_operator.loop.observation import Observation
from moeguard_operator.loop.policy import PolicyState, ceilings, decide, initial_budgets, judge_leak
from moeguard_operator.loop.report import looked
from moeguard_operator.spec.models import MoEInferenceServiceSpec, MoEInferenceServiceStatus

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC = MoEInferenceServiceSpec.model_validate({
    "batching": {"maxPrefillTokens": 2048, "floors": {"maxPrefillTokens": 256}},
    "control": {"skewThreshold": 8, "cooldownSeconds": 2, "stabilizationWindowSeconds": 6, "increaseStep": 0.25},
})
PODS = ("w-0",)


def obs(t: datetime, **kw: Any) -> Observation:
    return Observation(**({"time": t, "memory_ratio": 0.3, "expected_pods": PODS, "reporting_pods": PODS} | kw))


def test_an_idle_service_after_a_burst_climbs_back_to_its_ceilings() -> None:
    state = PolicyState(initial_budgets(SPEC.batching))
    burst = decide(obs(T0, skew_ratio=192.0, skew_steps=40), state, SPEC, T0)
    assert burst.direction == "down" and burst.state.budgets.max_prefill_tokens == 1024
    state, t, moves = burst.state, T0, []
    for _ in range(60):  # then no batches at all: no skew data, no pressure, and seen
        t += timedelta(seconds=2)
        d = decide(obs(t, skew_steps=0), state, SPEC, t)
        moves.append(d.direction)
        state = d.state
    assert state.budgets == ceilings(SPEC.batching)
    assert "down" not in moves and moves.index("up") >= 2  # not before a stabilization window (6 s)


@pytest.mark.parametrize("blind", [
    {"short_history_pods": PODS, "short_history": "history shorter than 30s in Prometheus for w-0 (2 samples)"},
    {"slope_unknown": "history shorter than 600s in Prometheus for w-0 (no sample before the window)"},
    {"skew_unknown_pods": PODS},
    {"skew_steps": None},
    {"crash_looping_pods": PODS},
], ids=["short-window", "leak-window", "skew-reset", "skew-never-seen", "crash-loop"])
def test_budgets_never_rise_without_a_full_window(blind: dict[str, Any]) -> None:
    start = initial_budgets(SPEC.batching).model_copy(update={"max_prefill_tokens": 512})
    state = PolicyState(start, last_change=T0 - timedelta(hours=1), last_pressure=T0 - timedelta(hours=1))
    for i in range(30):
        t = T0 + timedelta(seconds=2 * i)
        d = decide(obs(t, **({"skew_steps": 0} | blind)), state, SPEC, t)
        assert d.direction == "hold" and "not loosening" in d.reason
        state = d.state


@given(st.floats(0, 1e9), st.floats(0, 1))
def test_a_leak_is_never_flat_while_the_window_is_short(slope: float, memory: float) -> None:
    o = obs(T0, rss_slope_bytes_per_second=slope, memory_ratio=memory, slope_unknown="short")
    verdict = judge_leak(o, SPEC)
    assert verdict is None or verdict.suspected  # Unknown, or a leak the full windows already show


def test_the_leak_condition_says_why_it_is_unknown() -> None:
    o = obs(T0, slope_unknown="history shorter than 600s in Prometheus for w-0 (4 samples)", skew_steps=0)
    assert leak_unknown(o) == ("InsufficientHistory", "history shorter than 600s in Prometheus for w-0 (4 samples); "
                                                      "judged once the leak window fills")
    assert leak_unknown(obs(T0)) == ("NoSlope", "RSS slope not yet measurable")
    state = PolicyState(initial_budgets(SPEC.batching))
    status, _ = looked(MoEInferenceServiceStatus(), SPEC, o, decide(o, state, SPEC, T0), None, 0, T0, 1)
    cond = next(c for c in status.conditions if c.type == "MemoryLeakSuspected")
    assert (cond.status, cond.reason) == ("Unknown", "InsufficientHistory")
