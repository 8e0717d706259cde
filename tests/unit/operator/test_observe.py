from __future__ import annotations

import json
import ssl
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from moeguard_operator.loop.observe import (
    MALFORMED,
    Answer,
    fetch_all,
    leak_signals,
    observe,
    parse_by_label,
    parse_label_values,
    parse_scalar,
    problems,
    queries,
    read_answer,
    safe_url,
    skew_query,
    transport_problem,
)

pytestmark = pytest.mark.unit


def vector(*series: Any) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": list(series)}}).encode()


def answer(*series: Any) -> Answer:
    return read_answer(200, vector(*series))


def test_query_selects_the_service() -> None:
    b = 'moeguard_step_expert_skew_ratio_bucket{namespace="ns1",moeis="svc"}'
    r = 'moeguard_ep_rank_tokens_total{namespace="ns1",moeis="svc"}'
    g = "namespace, moeis, pod"
    assert skew_query("ns1", "svc", 30) == (
        f"max(max by ({g}) ((histogram_quantile(1, sum by ({g}, le) ({b} - {b} offset 30s))) or "
        f"(max by ({g}, layer) (({r} - {r} offset 30s)) / avg by ({g}, layer) (({r} - {r} offset 30s)))))")


@pytest.mark.parametrize(
    ("series", "value", "error"),
    [
        ([{"metric": {}, "value": [1.0, "7.25"]}], 7.25, None),
        ([], None, "no series matched"),
        ([{"metric": {}, "value": [1.0, "NaN"]}], None, "non-finite value"),
        ([{"metric": {}, "value": [1.0, "+Inf"]}], None, "non-finite value"),
        ([{"metric": {}}], None, MALFORMED),
    ],
)
def test_parse_scalar_never_reads_missing_as_zero(series: list[Any], value: float | None, error: str | None) -> None:
    assert parse_scalar(answer(*series)) == (value, error)


GOOD = {"metric": {"pod": "a"}, "value": [1.5, "2"]}
MALFORMED_SERIES = [
    pytest.param({"metric": None, "value": "NaN"}, id="metric-null-value-string"),
    pytest.param({"metric": None, "value": [1, "1"]}, id="metric-null"),
    pytest.param({"metric": ["pod"], "value": [1, "1"]}, id="metric-list"),
    pytest.param({"metric": {"pod": 7}, "value": [1, "1"]}, id="label-not-string"),
    pytest.param({"metric": {"pod": "a"}, "value": "1"}, id="value-not-pair"),
    pytest.param({"metric": {"pod": "a"}, "value": [1]}, id="value-one-element"),
    pytest.param({"metric": {"pod": "a"}, "value": [1, "1", 2]}, id="value-three-elements"),
    pytest.param({"metric": {"pod": "a"}, "value": [1, 1.0]}, id="value-number-not-string"),
    pytest.param({"metric": {"pod": "a"}, "value": ["t", "1"]}, id="time-not-number"),
    pytest.param({"metric": {"pod": "a"}, "value": [1, "abc"]}, id="non-numeric"),
    pytest.param({"metric": {"pod": "a"}, "value": None}, id="value-null"),
    pytest.param({"metric": {"pod": "a"}}, id="value-missing"),
    pytest.param({"value": [1, "1"]}, id="metric-missing"),
    pytest.param("series", id="series-a-string"),
    pytest.param(None, id="series-null"),
]


@pytest.mark.parametrize("bad", MALFORMED_SERIES)
def test_a_malformed_series_is_no_data_and_named(bad: Any) -> None:
    got = answer(GOOD, bad)
    assert got.series == (({"pod": "a"}, 2.0),)  # the good series stays
    assert got.problem == MALFORMED and not got.blind
    assert parse_by_label(got, "pod") == {"a": 2.0}
    assert parse_label_values(answer(bad), "pod") == ()
    assert parse_scalar(answer(bad)) == (None, MALFORMED)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_value_is_no_data_for_that_series(value: str) -> None:
    got = answer(GOOD, {"metric": {"pod": "b"}, "value": [1, value]})
    assert got.problem is None and parse_by_label(got, "pod") == {"a": 2.0}
    assert parse_label_values(got, "pod") == ("a", "b")  # the series exists: the pod reports


ENVELOPES = [
    pytest.param(b"", id="empty"),
    pytest.param(b"<html><body>MARKER-BODY</body></html>", id="html"),
    pytest.param(b"not json", id="non-json"),
    pytest.param(b"\xff\xfe\x00", id="not-utf8"),
    pytest.param(b"[1, 2]", id="a-list"),
    pytest.param(b"null", id="null"),
    pytest.param(json.dumps({"status": "error", "error": "MARKER-BODY"}).encode(), id="status-error"),
    pytest.param(json.dumps({"status": "success"}).encode(), id="data-missing"),
    pytest.param(json.dumps({"status": "success", "data": None}).encode(), id="data-null"),
    pytest.param(json.dumps({"status": "success", "data": {"resultType": "vector"}}).encode(), id="result-missing"),
    pytest.param(json.dumps({"status": "success", "data": {"resultType": "vector", "result": {}}}).encode(),
                 id="result-not-list"),
    pytest.param(json.dumps({"status": "success", "data": {"resultType": "vector", "result": "x"}}).encode(),
                 id="result-string"),
    pytest.param(json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}).encode(),
                 id="wrong-result-type"),
    pytest.param(json.dumps({"status": "success", "data": {"resultType": "scalar", "result": [1, "1"]}}).encode(),
                 id="scalar-result"),
    pytest.param(json.dumps({"data": {"resultType": "vector", "result": []}}).encode(), id="status-missing"),
    pytest.param(b"[" * 100000, id="deeply-nested"),
]


@pytest.mark.parametrize("body", ENVELOPES)
def test_a_malformed_envelope_is_a_blind_query(body: bytes) -> None:
    got = read_answer(200, body)
    assert got == Answer(problem=MALFORMED, blind=True)
    assert parse_scalar(got) == (None, MALFORMED)
    assert parse_by_label(got, "pod") == {} and parse_label_values(got, "pod") == ()
    assert leak_signals(got, got, lambda pod: True) == ((), ())


@pytest.mark.parametrize(("status", "problem"), [
    (400, "PrometheusBadRequest"), (422, "PrometheusBadRequest"), (502, "PrometheusHTTPError 502"),
    (503, "PrometheusHTTPError 503"), (404, "PrometheusHTTPError 404"), (301, "PrometheusHTTPError 301"),
    (500, "PrometheusHTTPError 500"),
])
def test_an_http_error_is_its_status_code_and_a_fixed_reason_never_the_body(status: int, problem: str) -> None:
    body = json.dumps({"status": "error", "errorType": "bad_data", "error": "MARKER-BODY"}).encode()
    got = read_answer(status, body)
    assert got == Answer(problem=problem, blind=True)
    message = problems("http://prom:9090", {"memory": got, "skew": got})
    assert message == f"Prometheus at http://prom:9090: {problem}"


def test_problems_name_the_queries_when_only_some_failed() -> None:
    ok, bad = answer(GOOD), answer(GOOD, {"metric": None, "value": "NaN"})
    assert problems("http://p", {"memory": ok, "p99_latency": bad}) == \
        "Prometheus at http://p: PrometheusMalformedAnswer (p99_latency)"
    assert problems("http://p", {"memory": ok}) is None


@pytest.mark.parametrize(("url", "shown"), [
    ("https://user:secret@prom.example:9443/prom/?token=x#f", "https://prom.example:9443/prom/"),
    ("http://127.0.0.1:9090", "http://127.0.0.1:9090"),
    ("http://[::1]:9090/", "http://[::1]:9090/"),
    ("http://[::1", "(an invalid URL)"),
])
def test_messages_show_urls_without_credentials(url: str, shown: str) -> None:
    assert safe_url(url) == shown


def test_every_query_selects_the_service_and_keeps_each_pod() -> None:
    q = queries("ns1", "svc", 30, 600)
    sel, by = '{namespace="ns1",moeis="svc"}', "by (namespace, moeis, pod)"
    assert q.memory == f"max {by} (max_over_time(moeguard_memory_usage_bytes{sel}[30s]))"
    assert q.rss_slope == f"max {by} (deriv(moeguard_process_resident_memory_bytes{sel}[600s]))"
    assert q.rejection_rate == f"sum {by} (rate(moeguard_rejections_total{sel}[30s]))"
    assert q.reporting_pods == f"count {by} (moeguard_process_resident_memory_bytes{sel})"
    assert q.history == (f"max {by} (count_over_time(moeguard_process_resident_memory_bytes{sel}[30s]) "
                         f"and moeguard_process_resident_memory_bytes{sel} offset 30s)")
    assert q.leak_history.endswith(f"[600s]) and moeguard_process_resident_memory_bytes{sel} offset 600s)")
    c = f"moeguard_step_expert_skew_ratio_count{sel}"
    assert q.skew_steps == f"sum {by} ({c} - {c} offset 30s) unless on (namespace, moeis, pod) (resets({c}[30s]) > 0)"
    assert q.p99_latency.startswith("histogram_quantile(0.99, sum by (namespace, moeis, pod, le) "
                                    "(rate(moeguard_e2e_request_latency_seconds_bucket{")
    for promql in vars(q).values():
        assert sel in promql


def test_many_services_share_one_selector_of_literals() -> None:
    q = queries(["b", "a.x", "a.x"], ["svc.1", "svc-2"], 30, 600)
    assert 'namespace=~"a\\\\.x|b",moeis=~"svc\\\\-2|svc\\\\.1"' in q.memory
    with pytest.raises(ValueError, match="no value for namespace"):
        queries([], ["svc"], 30, 600)


def test_label_values() -> None:
    got = answer({"metric": {"pod": "b"}, "value": [0, "1"]}, {"metric": {"pod": "a"}, "value": [0, "1"]},
                 {"metric": {}, "value": [0, "1"]})
    assert parse_label_values(got, "pod") == ("a", "b")


def test_unreachable_prometheus_is_no_data() -> None:
    now = datetime.now(UTC)
    obs = observe("http://127.0.0.1:1", "ns", "svc", hard_limit_bytes=2**30, window_seconds=30,
                  leak_window_seconds=600, expected_pods=("p",), new_oom_kills=0, now=now)
    assert obs.skew_ratio is None and obs.memory_ratio is None and not obs.available
    assert obs.silent_pods == ("p",)
    assert obs.error == "Prometheus at http://127.0.0.1:1: PrometheusUnreachable"


def test_an_unreadable_ca_file_fails_every_query_with_a_tls_error() -> None:
    got = fetch_all("https://127.0.0.1:1", {"memory": "up"}, ca_file="/nonexistent/ca.pem")
    assert got == {"memory": Answer(problem="PrometheusTLSError", blind=True)}


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/", "not a url", "http://"])
def test_a_url_that_cannot_be_asked_is_unreachable(url: str) -> None:
    assert fetch_all(url, {"memory": "up"}) == {"memory": Answer(problem="PrometheusUnreachable", blind=True)}


def test_values_by_label_skip_bad_entries() -> None:
    got = answer({"metric": {"pod": "a"}, "value": [0, "2.5"]}, {"metric": {"pod": "b"}, "value": [0, "NaN"]},
                 {"metric": {"pod": "c"}}, {"metric": {}, "value": [0, "1"]})
    assert parse_by_label(got, "pod") == {"a": 2.5} and got.problem == MALFORMED


def test_leak_signals_are_the_counted_pods_kinds_and_highest_growth_per_part() -> None:
    kinds = answer({"metric": {"pod": "w-0", "kind": "native"}, "value": [0, "1"]},
                   {"metric": {"pod": "w-0", "kind": "python_heap"}, "value": [0, "0"]},
                   {"metric": {"pod": "young", "kind": "python_heap"}, "value": [0, "1"]},
                   {"metric": None, "value": "NaN"})
    growth = answer({"metric": {"pod": "w-0", "part": "rss_anonymous"}, "value": [0, "1000"]},
                    {"metric": {"pod": "w-1", "part": "rss_anonymous"}, "value": [0, "3000"]},
                    {"metric": {"pod": "young", "part": "rss_anonymous"}, "value": [0, "9e9"]},
                    {"metric": {"pod": "w-1", "part": "malloc_in_use"}, "value": [0, "NaN"]})
    assert leak_signals(kinds, growth, lambda pod: pod != "young") == (("native",), (("rss_anonymous", 3000.0),))


def _raised_from(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(("exc", "problem"), [
    (TimeoutError(), "PrometheusTimeout"),
    (httpx.ReadTimeout("MARKER"), "PrometheusTimeout"),
    (httpx.ConnectError("MARKER"), "PrometheusUnreachable"),
    (_raised_from(httpx.ConnectError("MARKER"), ssl.SSLCertVerificationError("MARKER")), "PrometheusTLSError"),
    (httpx.RemoteProtocolError("MARKER"), "PrometheusUnreachable"),
    (OSError("MARKER"), "PrometheusUnreachable"),
])
def test_transport_failures_are_fixed_reasons(exc: BaseException, problem: str) -> None:
    assert transport_problem(exc) == problem
