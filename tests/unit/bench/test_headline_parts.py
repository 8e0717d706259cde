"""The headline experiment's pure parts: traffic generators, metrics parsing, histogram quantiles."""

from __future__ import annotations

import pytest
from bench.headline_report import bucket_quantiles
from bench.headline_sampler import parse_metrics
from bench.traffic import TrafficConfig, build, describe, ramp_arrivals, skew_mix

pytestmark = pytest.mark.unit


def test_ramp_rate_climbs() -> None:
    times = ramp_arrivals(10.0, 10.0, 1.0, 9.0)
    assert len(times) == 50  # (1 + 9) / 2 x 10
    assert times == sorted(times) and times[0] >= 10.0 and times[-1] <= 20.0
    first, last = times[1] - times[0], times[-1] - times[-2]
    assert last < first / 3  # gaps shrink as the rate climbs


def test_skew_mix_share_and_prompts() -> None:
    items = skew_mix(0.0, 10.0, 2.0, 0.5, (100, 200), 8, seed=1)
    assert len(items) == 20
    skewed = [it for it in items if it.skewed]
    assert 4 <= len(skewed) <= 16
    for it in skewed:
        assert len(set(it.spec.prompt)) <= 2 and 100 <= len(it.spec.prompt) <= 200
    assert all(it.spec.max_tokens == 8 for it in items)


def test_build_is_deterministic_and_labels_phases() -> None:
    a, b = build(TrafficConfig()), build(TrafficConfig())
    assert [(x.spec.prompt, x.spec.at_s) for x in a] == [(x.spec.prompt, x.spec.at_s) for x in b]
    phases = describe(a)
    assert set(phases) == {"trace", "burst", "skew", "ramp"}
    assert phases["burst"]["first_s"] == phases["burst"]["last_s"] == TrafficConfig().burst_at_s
    assert all(len(x.spec.prompt) + x.spec.max_tokens <= TrafficConfig().max_context for x in a)


def test_parse_metrics() -> None:
    text = "\n".join([
        "# HELP x y",
        'moeguard_budget_max_prefill_tokens{moeis="s",pod="p"} 464.0',
        'moeguard_budget_shrink_factor{moeis="s"} 0.5',
        'moeguard_queue_requests{moeis="s"} 3.0',
        'moeguard_overload_active{source="worker"} 1.0',
        'moeguard_overload_active{source="env"} 0.0',
        'moeguard_rejections_total{reason="queue_full"} 7.0',
        'moeguard_batch_tokens_bucket{le="64.0",phase="prefill"} 2.0',
        'moeguard_batch_tokens_bucket{le="+Inf",phase="prefill"} 5.0',
    ])
    m = parse_metrics(text)
    assert m["max_prefill_tokens"] == 464 and m["shrink_factor"] == 0.5 and m["queue_requests"] == 3
    assert m["overload"] == 1 and m["rejections"] == {"queue_full": 7.0}
    assert m["batch_tokens_buckets"]["prefill"] == {"64.0": 2.0, "+Inf": 5.0}


def test_plan_overhead_rounds_up_and_keeps_the_floor() -> None:
    from bench.headline_policies import PLAN_OVERHEAD, MiB, plan_overhead

    assert plan_overhead(800 * MiB, 379 * MiB) == PLAN_OVERHEAD  # 421 MiB measured, 450 MiB floor
    assert plan_overhead(900 * MiB + 1, 379 * MiB) == 528 * MiB  # 521 MiB + 1 byte, up to 8 MiB


def test_bucket_quantiles() -> None:
    buckets = {"16": 1.0, "64": 5.0, "256": 9.0, "+Inf": 10.0}
    assert bucket_quantiles(buckets, (0.1, 0.5, 0.9, 0.99)) == [16.0, 64.0, 256.0, float("inf")]
    assert bucket_quantiles({}, (0.5,)) == [None]


def test_time_to_answer_counts_every_answer() -> None:
    from bench.headline_report import time_to_answer

    base = {"scheduled_s": 1.0, "status": 200, "error": None, "end_s": 3.5}
    assert time_to_answer(base, 30.0) == 2.5  # a success
    assert time_to_answer({**base, "status": 429, "error": "queue full", "end_s": 1.1}, 30.0) == \
        pytest.approx(0.1)  # a fast refusal
    assert time_to_answer({**base, "status": None, "error": "ConnectError", "end_s": 1.2}, 30.0) == \
        pytest.approx(0.2)  # refused connection while restarting
    assert time_to_answer({**base, "status": None, "error": "ReadTimeout", "end_s": 31.0}, 30.0) == 30.0
    assert time_to_answer({**base, "status": None, "error": "deadline", "end_s": None}, 30.0) == 30.0


def test_moeguard_env_bounds_queue_and_concurrency() -> None:
    from bench.headline_policies import STEP_PREFILL_TOKENS, moeguard_env

    env = moeguard_env({"max_prefill_tokens": 4096, "max_decode_tokens": 6, "max_batch_requests": 6})
    assert int(env["MOEGUARD_MAX_PREFILL_TOKENS"]) == STEP_PREFILL_TOKENS  # below the memory ceiling
    running = int(env["MOEGUARD_MAX_CONCURRENT_BATCHES"]) * 6
    assert int(env["MOEGUARD_MAX_CONCURRENT_REQUESTS"]) == running + int(env["MOEGUARD_MAX_QUEUE_REQUESTS"])
    assert float(env["MOEGUARD_QUEUE_TIMEOUT_SECONDS"]) <= 5
    assert moeguard_env({"max_prefill_tokens": 64, "max_decode_tokens": 1,
                         "max_batch_requests": 1})["MOEGUARD_MAX_PREFILL_TOKENS"] == "64"
