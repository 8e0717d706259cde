from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeguard_operator.models import BudgetFloors, ControlSpec
from moeguard_operator.policy import Observation, decide
from moeguard_runtime.contract import Budgets

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
CONTROL = ControlSpec(skew_threshold=4.0, cooldown_seconds=30)
FLOORS = BudgetFloors(max_prefill_tokens=256)


def budgets(prefill: int) -> Budgets:
    return Budgets(max_prefill_tokens=prefill, max_decode_tokens=64, max_batch_requests=16, max_concurrent_batches=2)


def test_high_skew_halves_prefill() -> None:
    d = decide(Observation(NOW, 9.5), budgets(4096), CONTROL, FLOORS, None, NOW)
    assert d.changed and d.budgets.max_prefill_tokens == 2048
    assert d.budgets.max_decode_tokens == 64
    assert "9.50 > threshold 4" in d.reason


def test_halving_stops_at_floor() -> None:
    d = decide(Observation(NOW, 50.0), budgets(300), CONTROL, FLOORS, None, NOW)
    assert d.budgets.max_prefill_tokens == 256
    d2 = decide(Observation(NOW, 50.0), d.budgets, CONTROL, FLOORS, None, NOW)
    assert not d2.changed and "at its floor 256" in d2.reason


def test_missing_metrics_hold_budgets() -> None:
    d = decide(Observation(NOW, None, "Prometheus down"), budgets(4096), CONTROL, FLOORS, None, NOW)
    assert not d.changed and d.budgets.max_prefill_tokens == 4096
    assert "metrics unavailable (Prometheus down)" in d.reason


def test_cooldown_blocks_a_second_move() -> None:
    d = decide(Observation(NOW, 9.0), budgets(4096), CONTROL, FLOORS, NOW - timedelta(seconds=10), NOW)
    assert not d.changed and "cooldown" in d.reason
    d = decide(Observation(NOW, 9.0), budgets(4096), CONTROL, FLOORS, NOW - timedelta(seconds=31), NOW)
    assert d.changed


@given(
    prefill=st.integers(min_value=256, max_value=1_048_576),
    skew=st.one_of(st.none(), st.floats(min_value=0, max_value=1e6, allow_nan=False)),
    since=st.one_of(st.none(), st.integers(min_value=0, max_value=3600)),
)
def test_never_loosens_never_below_floor(prefill: int, skew: float | None, since: int | None) -> None:
    last = None if since is None else NOW - timedelta(seconds=since)
    d = decide(Observation(NOW, skew), budgets(prefill), CONTROL, FLOORS, last, NOW)
    assert FLOORS.max_prefill_tokens <= d.budgets.max_prefill_tokens <= prefill
    if skew is None or skew <= CONTROL.skew_threshold:
        assert d.budgets == budgets(prefill) and not d.changed
