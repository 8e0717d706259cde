"""Refusals over real HTTP: a request that can never be admitted never gets a retryable 429,
a full worker refuses before it reads the body, and expert chunking is exported."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import httpx
import pytest
from harness.stack import wait_for
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_worker_http import assert_openai_error, metrics, post

pytestmark = pytest.mark.integration


def value(w: WorkerProcess, name: str) -> float:
    return sum(v for _, v in metrics(w).get(name, []))


def test_a_lone_prompt_over_the_queue_token_bound_is_served(
        start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(MOEGUARD_MAX_QUEUE_TOKENS="2048",
                     MOEGUARD_MODEL_OVERRIDES=json.dumps({"max_seq_len": 4096}))
    r = post(w, {"prompt": "x" * 2099, "max_tokens": 1, "temperature": 0})  # 2,100 tokens with BOS
    assert r.status_code == 200, r.text  # was 429 "queue is full", Retry-After 1, for ever
    assert r.json()["usage"]["prompt_tokens"] == 2100
    # over the context (a fixed limit): a 400 naming it, never a 429
    err = assert_openai_error(post(w, {"prompt": "x" * 4095, "max_tokens": 1}), 400,
                              "inputs tokens + max_new_tokens must be <= 4096")
    assert err["code"] == "context_length_exceeded"


def test_a_full_worker_refuses_before_reading_the_body(
        start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(MOEGUARD_MAX_CONCURRENT_REQUESTS="1", MOEGUARD_TEST_FAULTS="1",
                     MOEGUARD_FAULT_STEP_DELAY_SECONDS="0.5")
    held = threading.Thread(target=post, args=(w, {"prompt": "hold", "max_tokens": 8}))
    held.start()
    wait_for(lambda: value(w, "moeguard_running_requests") + value(w, "moeguard_queue_requests") == 1,
             10, "one request in flight")
    r = post(w, "{not json at all")  # a 429, not a 400: the body was never parsed
    err = assert_openai_error(r, 429, "Model is overloaded: 1 requests in flight, "
                                      "max_concurrent_requests is 1")
    assert err["code"] == "concurrency_limit" and r.headers["retry-after"] == "1"
    held.join(60)
    assert post(w, {"prompt": "after", "max_tokens": 1}).status_code == 200


def test_expert_chunking_is_a_metric_and_a_log_field(start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(MOEGUARD_EXPERT_CHUNK_TOKENS="4", MOEGUARD_LOG_INTERVAL_SECONDS="0")
    assert value(w, "moeguard_expert_split_steps_total") == 0
    assert post(w, {"prompt": "x" * 99, "max_tokens": 1}).status_code == 200  # 200 slots, 8 experts
    assert value(w, "moeguard_expert_split_steps_total") == 1
    assert value(w, "moeguard_step_expert_chunks_count") == 1
    chunks = value(w, "moeguard_step_expert_chunks_sum")
    assert chunks >= 200 / 8 / 4  # the busiest expert has at least the mean, 25 slots: 7+ chunks of 4
    line = next(x for x in w.logs().splitlines() if "event=moe_routing_stats" in x)
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    assert max(int(c) for c in fields["expert_chunks"].split(",")) == chunks
    assert httpx.get(f"{w.base_url}/healthz").status_code == 200
