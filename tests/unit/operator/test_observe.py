from __future__ import annotations

from datetime import UTC, datetime

import pytest

from moeguard_operator.observe import observe, parse_scalar, skew_query

pytestmark = pytest.mark.unit


def test_query_selects_the_service() -> None:
    assert skew_query("ns1", "svc", 30) == 'max(max_over_time(moeguard_expert_skew_ratio{namespace="ns1",moeis="svc"}[30s]))'


@pytest.mark.parametrize(
    ("result", "value", "error"),
    [
        ([{"metric": {}, "value": [1.0, "7.25"]}], 7.25, None),
        ([], None, "no series matched"),
        (None, None, "no series matched"),
        ([{"metric": {}, "value": [1.0, "NaN"]}], None, "non-finite value nan"),
        ([{"metric": {}}], None, "malformed Prometheus answer: KeyError('value')"),
    ],
)
def test_parse_scalar_never_reads_missing_as_zero(result: object, value: float | None, error: str | None) -> None:
    assert parse_scalar(result) == (value, error)


def test_unreachable_prometheus_is_no_data() -> None:
    now = datetime.now(UTC)
    obs = observe("http://127.0.0.1:1", "ns", "svc", 30, now)
    assert obs.skew_ratio is None and not obs.available
    assert obs.error is not None and obs.error.startswith("Prometheus at http://127.0.0.1:1 failed: ConnectionError")
