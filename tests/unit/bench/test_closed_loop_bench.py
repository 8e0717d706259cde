"""The closed-loop benchmarks' pure parts: control-latency arithmetic, SLO goodput, the four-arm
traffic, the full arm's spec and the report's request outcomes."""

from __future__ import annotations

import pytest
from bench.control_stats import all_reached, direction_changes, first_time, steps, summary
from bench.headline_loop import arm_envs, full_spec
from bench.headline_loop_report import host_regime, outcome, per_rep, ratio_row
from bench.headline_traffic import LoopTrafficConfig, build_loop
from bench.slo import Slo, meets, percentile, slo_goodput, tpot, ttft

from moeguard_operator.spec.spec_checks import parse_spec

pytestmark = pytest.mark.unit

OK = {"status": 200, "error": None, "send_s": 1.0, "first_byte_s": 2.0, "end_s": 5.0, "completion_tokens": 31}


def test_direction_changes_count_flips_not_steps() -> None:
    assert direction_changes([4096, 2048, 1024, 1434, 1844, 4096]) == 1  # down, then a monotone climb
    assert direction_changes([4096, 4096, 2048]) == 0
    assert direction_changes([4096, 2048, 2458, 1229, 1639]) == 3  # oscillation
    assert direction_changes([]) == 0


def test_steps_and_first_times() -> None:
    series = [(0.0, 4096.0), (1.0, 4096.0), (2.0, 2048.0), (3.0, 2048.0), (4.0, 4096.0)]
    assert steps(series) == [4096.0, 2048.0, 4096.0]
    assert first_time(series, 0.5, lambda v: v < 4096) == 2.0
    assert first_time(series, 3.5, lambda v: v < 4096) is None
    other = [(0.0, 4096.0), (2.5, 2048.0)]
    assert all_reached({"a": series, "b": other}, 0.0, lambda v: v < 4096) == 2.5
    assert all_reached({"a": series, "b": [(0.0, 4096.0)]}, 0.0, lambda v: v < 4096) is None
    assert all_reached({}, 0.0, lambda v: True) is None
    with pytest.raises(TypeError):
        first_time(series, 0.0, 5)


def test_summary_median_and_max() -> None:
    assert summary([3.0, 1.0, 2.0, 10.0]) == {"n": 4, "median": 2.5, "min": 1.0, "max": 10.0}
    assert summary([])["median"] is None


def test_ttft_tpot_and_slo_goodput() -> None:
    assert ttft(OK) == 1.0 and tpot(OK) == pytest.approx(0.1)
    assert tpot({**OK, "completion_tokens": 1}) == 0.0
    slo = Slo(ttft_s=1.5, tpot_s=0.2)
    assert meets(OK, slo)
    slow_first = {**OK, "first_byte_s": 3.0}  # TTFT 2 s
    slow_decode = {**OK, "end_s": 11.0}  # 0.3 s per token
    refused = {**OK, "status": 429, "error": "queue full"}
    cut = {**OK, "status": 200, "error": "stream ended"}
    assert not any(meets(r, slo) for r in (slow_first, slow_decode, refused, cut))
    assert slo_goodput([OK, OK, slow_first, refused], slo, 4.0) == 0.5
    with pytest.raises(ValueError):
        slo_goodput([OK], slo, 0.0)
    with pytest.raises(ValueError):
        Slo(0.0, 1.0)


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None


def test_outcomes_of_a_request() -> None:
    assert outcome(OK) == "ok"
    assert outcome({**OK, "status": 503, "error": "over the hard limit"}) == "refused"
    assert outcome({**OK, "error": "queue timeout"}) == "in-stream"
    assert outcome({"status": None, "error": "ConnectError: [Errno 111] Connection refused", "end_s": 1.0}) == "no-endpoint"
    assert outcome({"status": None, "error": "RemoteProtocolError: peer closed connection", "end_s": 1.0}) == "cut"
    assert outcome({"status": None, "error": "ReadTimeout", "end_s": 1.0}) == "timeout"
    assert outcome({"status": None, "error": "not sent: run deadline reached"}) == "deadline"


def test_host_regime_says_where_the_fixed_slos_sit() -> None:
    # OK: TTFT 1 s, TPOT 0.1 s; slow: TTFT 4 s (over 3), TPOT 0.3 s (over 0.25); a refusal is not served
    slow = {**OK, "first_byte_s": 5.0, "end_s": 14.0}
    refused = {**OK, "status": 429, "error": "queue full"}
    line = host_regime([{"results": [OK, slow, refused]}, {"results": [slow]}])
    assert "(3 over its repetitions)" in line
    assert "TPOT median of 0.300 s against the 0.25-s objective" in line
    assert "33% of them met TPOT and 33% met TTFT" in line
    assert "not measured" in host_regime([{"results": [refused]}])


def test_the_ratio_row_pairs_repetitions_by_number() -> None:
    full = [{"rep": 0, "slo_goodput": 0.6}, {"rep": 2, "slo_goodput": 0.9}]  # rep 1's run failed
    inner = [{"rep": 0, "slo_goodput": 0.4}, {"rep": 1, "slo_goodput": 0.5}, {"rep": 2, "slo_goodput": 0.0}]
    assert per_rep(full, 3) == [0.6, None, 0.9]
    assert ratio_row(full, inner, 3) == "| full-moeguard / inner-loop | 1.50× | n/a | n/a |"


def test_loop_traffic_is_the_trace_window_with_a_skewed_tenant() -> None:
    cfg = LoopTrafficConfig()
    items, duration = build_loop(cfg)
    again, _ = build_loop(cfg)
    assert duration == 75.0 and [i.spec for i in items] == [i.spec for i in again]  # seeded: the same every arm
    assert len(items) == 717 and all(0 <= i.spec.at_s < duration for i in items)  # every 4th of 2,868
    assert len(build_loop(LoopTrafficConfig(thin=12))[0]) == 239  # the light run's load
    skewed = [i for i in items if i.skewed]
    assert skewed and min(i.spec.at_s for i in skewed) >= cfg.skew_at * duration
    assert all(len(set(i.spec.prompt)) <= 2 for i in skewed)
    before = [i for i in items if i.spec.at_s < cfg.skew_at * duration]
    assert before and not any(i.skewed for i in before)
    assert all(i.spec.max_tokens <= cfg.max_new_tokens_cap for i in items)
    with pytest.raises(ValueError):
        LoopTrafficConfig(skew_at=1.5)


def test_the_full_arm_spec_is_valid_and_matches_the_inner_loop_arm() -> None:
    budgets = {"max_prefill_tokens": 592, "max_decode_tokens": 8, "max_batch_requests": 8}
    envs = arm_envs(budgets)
    inner = envs["inner-loop"]
    assert "MOEGUARD_MAX_QUEUE_TOKENS" not in inner  # no spec field sets it: both arms keep the default
    spec = parse_spec(full_spec(inner))
    b = spec.batching
    assert b.max_prefill_tokens == int(inner["MOEGUARD_MAX_PREFILL_TOKENS"]) == 256
    assert b.max_decode_tokens == 8 and b.max_batch_requests == 8 and b.max_queue_requests == 8
    assert b.queue_timeout_seconds == float(inner["MOEGUARD_QUEUE_TIMEOUT_SECONDS"])
    assert b.floors.max_prefill_tokens == 64 < b.max_prefill_tokens  # room for the outer loop to tighten
    assert spec.control.leak_action == "Restart" and spec.control.query_interval_seconds == 5  # one look per scrape
    assert spec.resources.hard_limit_bytes == 1152 * 2**20 and spec.resources.gpus == 0


def test_a_stream_the_run_cancelled_is_open_at_the_end_not_a_refusal() -> None:
    assert outcome({"status": 200, "error": "cancelled: run deadline reached", "end_s": 90.0}) == "deadline"
