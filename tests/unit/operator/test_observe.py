from __future__ import annotations

from datetime import UTC, datetime

import pytest

from moeguard_operator.observe import (
    leak_signals,
    observe,
    parse_by_label,
    parse_label_values,
    parse_scalar,
    queries,
    skew_query,
)

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


def test_every_query_selects_the_service() -> None:
    q = queries("ns1", "svc", 30, 600)
    assert q.memory == 'max(max_over_time(moeguard_memory_usage_bytes{namespace="ns1",moeis="svc"}[30s]))'
    assert q.rss_slope == 'max by (pod) (deriv(moeguard_process_resident_memory_bytes{namespace="ns1",moeis="svc"}[600s]))'
    assert q.rejection_rate == 'sum(rate(moeguard_rejections_total{namespace="ns1",moeis="svc"}[30s]))'
    assert q.reporting_pods == 'count by (pod) (moeguard_process_resident_memory_bytes{namespace="ns1",moeis="svc"})'
    assert q.p99_latency.startswith("histogram_quantile(0.99, sum by (le) (rate(moeguard_e2e_request_latency_seconds_bucket{")


def test_label_values() -> None:
    result = [{"metric": {"pod": "b"}, "value": [0, "1"]}, {"metric": {"pod": "a"}, "value": [0, "1"]}, {"metric": {}}]
    assert parse_label_values(result, "pod") == ("a", "b")
    assert parse_label_values(None, "pod") == ()


def test_unreachable_prometheus_is_no_data() -> None:
    now = datetime.now(UTC)
    obs = observe("http://127.0.0.1:1", "ns", "svc", hard_limit_bytes=2**30, window_seconds=30,
                  leak_window_seconds=600, expected_pods=("p",), new_oom_kills=0, now=now)
    assert obs.skew_ratio is None and obs.memory_ratio is None and not obs.available
    assert obs.silent_pods == ("p",)
    assert obs.error is not None and obs.error.startswith("Prometheus at http://127.0.0.1:1 failed: ConnectionError")


def test_values_by_label_skip_bad_entries() -> None:
    result = [{"metric": {"pod": "a"}, "value": [0, "2.5"]}, {"metric": {"pod": "b"}, "value": [0, "NaN"]},
              {"metric": {"pod": "c"}}, {"metric": {}, "value": [0, "1"]}]
    assert parse_by_label(result, "pod") == {"a": 2.5}


def test_leak_signals_are_the_counted_pods_kinds_and_highest_growth_per_part() -> None:
    kinds = [{"metric": {"pod": "w-0", "kind": "native"}, "value": [0, "1"]},
             {"metric": {"pod": "w-0", "kind": "python_heap"}, "value": [0, "0"]},
             {"metric": {"pod": "young", "kind": "python_heap"}, "value": [0, "1"]},
             {"metric": None, "value": "NaN"}]
    growth = [{"metric": {"pod": "w-0", "part": "rss_anonymous"}, "value": [0, "1000"]},
              {"metric": {"pod": "w-1", "part": "rss_anonymous"}, "value": [0, "3000"]},
              {"metric": {"pod": "young", "part": "rss_anonymous"}, "value": [0, "9e9"]},
              {"metric": {"pod": "w-1", "part": "malloc_in_use"}, "value": [0, "NaN"]}]
    assert leak_signals(kinds, growth, lambda pod: pod != "young") == (("native",), (("rss_anonymous", 3000.0),))
    assert leak_signals(None, "garbage", lambda pod: True) == ((), ())
