"""Summary statistics on hand-made results (exact values)."""

from __future__ import annotations

import pytest
from harness.loadgen.records import RequestResult, RunResult
from harness.loadgen.stats import format_summary, percentiles, status_key, summarize

pytestmark = pytest.mark.unit


def _ok(i: int, latency: float, ttft: float, tokens: int) -> RequestResult:
    return RequestResult(index=i, url="http://127.0.0.1:1", scheduled_s=0.0, prompt_bytes=100,
                         max_tokens=64, send_s=1.0, first_byte_s=1.0 + ttft,
                         end_s=1.0 + latency, status=200, prompt_tokens=101,
                         completion_tokens=tokens)


def _results() -> list[RequestResult]:
    ok = [_ok(i, float(i + 1), (i + 1) / 10, 10 * (i + 1)) for i in range(5)]
    refused = RequestResult(index=5, url="u", scheduled_s=0.0, prompt_bytes=100, max_tokens=64,
                            send_s=0.5, first_byte_s=0.6, end_s=0.6, status=429,
                            retry_after="2", error="over budget", completion_tokens=None)
    failed = RequestResult(index=6, url="u", scheduled_s=0.0, prompt_bytes=100, max_tokens=64,
                           send_s=0.5, end_s=3.0, error="ReadTimeout")
    unsent = RequestResult(index=7, url="u", scheduled_s=9.0, prompt_bytes=100, max_tokens=64,
                           error="not sent: run deadline reached")
    cut = RequestResult(index=8, url="u", scheduled_s=0.0, prompt_bytes=100, max_tokens=64,
                        send_s=2.0, status=200, error="cancelled: run deadline reached")
    busy = RequestResult(index=9, url="u", scheduled_s=0.0, prompt_bytes=100, max_tokens=64,
                         send_s=2.0, first_byte_s=2.1, end_s=2.1, status=503, error="busy")
    return [*ok, refused, failed, unsent, cut, busy]


def test_summary_exact_values() -> None:
    s = summarize(RunResult(results=_results(), wall_s=10.0))
    assert s.n_requests == 10
    assert s.by_status == {"200": 5, "429": 1, "503": 1, "error": 1, "incomplete": 1,
                           "not_sent": 1}
    assert s.n_ok == 5
    assert s.completion_tokens_ok == 150
    assert s.prompt_tokens_ok == 505
    assert s.goodput_tok_s == pytest.approx(15.0)
    assert s.ok_rate_req_s == pytest.approx(0.5)
    # numpy linear percentiles of [1, 2, 3, 4, 5]: p95 = 1 + 0.95 * 4
    assert s.latency_s == pytest.approx({"p50": 3.0, "p95": 4.8, "p99": 4.96})
    assert s.ttft_s == pytest.approx({"p50": 0.3, "p95": 0.48, "p99": 0.496})


def test_summary_of_plain_list_uses_span() -> None:
    s = summarize(_results())
    # earliest send 0.5 (429), latest end 6.0 (ok #5)
    assert s.wall_s == pytest.approx(5.5)
    assert s.goodput_tok_s == pytest.approx(150 / 5.5)
    assert summarize(_results(), wall_s=3.0).goodput_tok_s == pytest.approx(50.0)


def test_empty_and_buckets() -> None:
    s = summarize([])
    assert (s.n_requests, s.n_ok, s.goodput_tok_s, s.wall_s) == (0, 0, 0.0, 0.0)
    assert s.latency_s == {"p50": None, "p95": None, "p99": None}
    assert [status_key(r) for r in _results()[5:]] == ["429", "error", "not_sent", "incomplete",
                                                       "503"]
    assert percentiles([2.0]) == {"p50": 2.0, "p95": 2.0, "p99": 2.0}


def test_format_summary_lines() -> None:
    lines = format_summary(summarize(RunResult(results=_results(), wall_s=10.0)))
    assert lines[0] == ("requests      10  (200: 5, 429: 1, 503: 1, error: 1, incomplete: 1, "
                        "not_sent: 1)")
    assert lines[1] == "ok            5 in 10.00 s  (0.50 req/s)"
    assert lines[2].startswith("goodput       15.0 completion tok/s")
    assert lines[4].split() == ["latency", "ms", "3000.0", "4800.0", "4960.0"]
    assert lines[5].split() == ["ttft", "ms", "300.0", "480.0", "496.0"]
    assert lines[6:] == ["error x1     over budget", "error x1     ReadTimeout",
                         "error x1     not sent: run deadline reached"]
    assert all("\n" not in line for line in lines)
