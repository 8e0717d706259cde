"""A real worker process over real HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.stack import wait_for
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.worker.conftest import WorkerProcess, start_worker_process

from moeguard_core import contract

pytestmark = pytest.mark.integration

IDENTITY = {"moeis": "demo", "namespace": "ns-test", "pod": "demo-0"}


def post(w: WorkerProcess, body: object, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{w.base_url}/v1/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=timeout)


def metrics(w: WorkerProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{w.base_url}/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def assert_openai_error(r: httpx.Response, status: int, *needles: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"]
    return err


def test_completion_with_usage_counts_and_determinism(worker: WorkerProcess) -> None:
    body = {"model": "tiny", "prompt": "Hello, world", "max_tokens": 7, "temperature": 0}
    r = post(worker, body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["model"] == "tiny" and isinstance(data["created"], int)
    choice = data["choices"][0]
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(b"Hello, world") + 1  # + BOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 7
    else:
        assert choice["finish_reason"] == "stop" and usage["completion_tokens"] < 7
    assert len(choice["text"].encode("utf-8", "replace")) >= 1 or usage["completion_tokens"] == 0
    assert post(worker, body).json()["choices"][0]["text"] == choice["text"]  # greedy
    seeded = {**body, "temperature": 1.0, "seed": 42, "max_tokens": 12}
    assert post(worker, seeded).json()["choices"] == post(worker, seeded).json()["choices"]


def test_models_and_health(worker: WorkerProcess) -> None:
    models = httpx.get(f"{worker.base_url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    assert httpx.get(f"{worker.base_url}/healthz").status_code == 200
    assert httpx.get(f"{worker.base_url}/readyz").status_code == 200


def test_malformed_json_and_missing_prompt_are_400(worker: WorkerProcess) -> None:
    err = assert_openai_error(post(worker, '{"prompt": "x", '), 400, "not valid JSON")
    assert err["type"] == "invalid_request_error"
    err = assert_openai_error(post(worker, {"max_tokens": 3}), 400, "prompt")
    assert err["param"] == "prompt"
    err = assert_openai_error(post(worker, {"prompt": ["a", "b"]}), 400, "prompt")
    assert_openai_error(post(worker, {"prompt": "a", "max_tokens": 0}), 400, "max_tokens")
    assert_openai_error(post(worker, "[1, 2]"), 400, "JSON object")


def test_prompt_over_context_is_refused_naming_limit_and_length(worker: WorkerProcess) -> None:
    r = post(worker, {"prompt": "x" * 1020, "max_tokens": 16})
    err = assert_openai_error(r, 400, "inputs tokens + max_new_tokens must be <= 1024. "
                                      "Given: 1021 inputs tokens and 16 max_new_tokens")
    assert err["code"] == "context_length_exceeded"


def test_streaming_completion(worker: WorkerProcess) -> None:
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{worker.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    assert "usage" not in last  # not asked for (stream_options.include_usage)
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    plain = post(worker, {**body, "stream": False}).json()["choices"][0]["text"]
    assert text == plain


def test_stream_options_include_usage_ends_with_a_usage_chunk(worker: WorkerProcess) -> None:
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{worker.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "text_completion"
    completion = sum(1 for _ in chunks)  # at least the finish and the usage chunks
    assert completion >= 2
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] == 3
    assert usage["total_tokens"] == 3 + usage["completion_tokens"]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    plain = post(worker, {"prompt": "Hi", "max_tokens": 6, "temperature": 0}).json()
    assert usage == plain["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == plain["choices"][0]["text"]


STREAM_BODIES = {"/v1/completions": {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "stream": True},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                                          "temperature": 0, "stream": True}}


def stream_chunks(w: WorkerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{w.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path", list(STREAM_BODIES))
@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}], ids=["absent", "empty", "false"])
def test_a_stream_that_did_not_ask_for_usage_carries_none(
        worker: WorkerProcess, path: str, options: dict[str, bool] | None) -> None:
    """OpenAI streams usage only with ``stream_options.include_usage: true`` (issue 29 item 2: the
    finishing chunk carried it whatever the request asked)."""
    body = dict(STREAM_BODIES[path])
    if options is not None:
        body["stream_options"] = options
    chunks = stream_chunks(worker, path, body)
    assert [c for c in chunks if "usage" in c] == []
    assert all(len(c["choices"]) == 1 for c in chunks)
    finish = chunks[-1]["choices"][0]["finish_reason"]
    assert finish in ("length", "stop")
    asked = stream_chunks(worker, path, {**body, "stream_options": {"include_usage": True}})
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["prompt_tokens"] > 0
    assert all(c["usage"] is None for c in asked[:-1]) and len(asked) == len(chunks) + 1


def test_stream_options_are_validated(worker: WorkerProcess) -> None:
    base = {"prompt": "Hi", "max_tokens": 2, "stream": True}
    err = assert_openai_error(post(worker, {**base, "stream_options": {"include_usage": True,
                                                                       "chunk_size": 3}}),
                              400, "unknown field 'stream_options.chunk_size' (given: 3)")
    assert err["param"] == "stream_options.chunk_size"
    err = assert_openai_error(post(worker, {**base, "stream_options": {"include_usage": "yes"}}),
                              400, "invalid field 'stream_options.include_usage'", '"yes"')
    assert err["param"] == "stream_options.include_usage"
    err = assert_openai_error(post(worker, {**base, "stream": False,
                                            "stream_options": {"include_usage": True}}),
                              400, "'stream_options': only allowed when 'stream' is true")
    assert err["param"] == "stream_options" and err["code"] == "stream_options_without_stream"


def test_metrics_carry_identity_labels(worker: WorkerProcess) -> None:
    post(worker, {"prompt": "The quick brown fox jumps over the lazy dog" * 3, "max_tokens": 3,
                  "temperature": 0})
    m = metrics(worker)
    expected = [
        "moeguard_batch_tokens_bucket", "moeguard_expert_skew_ratio",
        "moeguard_expert_balancedness", "moeguard_expert_tokens_total",
        "moeguard_budget_max_prefill_tokens", "moeguard_budget_max_decode_tokens",
        "moeguard_budget_max_batch_requests", "moeguard_budget_max_concurrent_batches",
        "moeguard_budget_generation", "moeguard_process_resident_memory_bytes",
        "moeguard_requests_total", "moeguard_queue_requests", "moeguard_queue_tokens",
        "moeguard_time_to_first_token_seconds_count", "moeguard_e2e_request_latency_seconds_count",
    ]
    for name in expected:
        assert name in m, name
        for labels, _ in m[name]:
            assert {k: labels.get(k) for k in IDENTITY} == IDENTITY, (name, labels)
    phases = {lab["phase"] for lab, _ in m["moeguard_batch_tokens_count"]}
    assert phases == {"prefill", "decode"}
    layers = {lab["layer"] for lab, _ in m["moeguard_expert_skew_ratio"]}
    assert layers == {"0", "1"}
    ok = [v for lab, v in m["moeguard_requests_total"] if lab["status"] == "ok"]
    assert ok and ok[0] >= 1
    # a worker started without the variables runs with the contract's defaults (the operator's)
    assert [v for _, v in m["moeguard_budget_max_prefill_tokens"]] == [contract.DEFAULT_BUDGETS.max_prefill_tokens]
    assert next(v for _, v in m["moeguard_process_resident_memory_bytes"]) > 10e6


def test_over_concurrency_cap_is_429_with_retry_after(
        start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(MOEGUARD_MAX_CONCURRENT_REQUESTS="1")
    long_body = {"prompt": "a", "max_tokens": 1000, "temperature": 0}
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(post(w, long_body)))
    t.start()
    wait_for(lambda: any(v for _, v in metrics(w).get("moeguard_time_to_first_token_seconds_count", [])),
             60, "the first request in flight", 0.02)
    r = post(w, {"prompt": "b", "max_tokens": 1})
    t.join(60)
    err = assert_openai_error(r, 429, "max_concurrent_requests is 1")
    assert err["code"] == "concurrency_limit"
    assert r.headers["retry-after"] == "1"
    assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 1000
    rej = metrics(w)["moeguard_rejections_total"]
    assert [v for lab, v in rej if lab["reason"] == "concurrency_limit"] == [1]


def test_above_hard_limit_is_503_and_not_ready(start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(MOEGUARD_HARD_LIMIT_BYTES="1000")
    r = post(w, {"prompt": "hello"})
    err = assert_openai_error(r, 503, "above the hard limit 1000 bytes")
    assert err["code"] == "memory_hard_limit" and "retry-after" in r.headers
    r = post(w, {"prompt": "hello", "stream": True})  # refused before admission: JSON, not SSE
    err = assert_openai_error(r, 503, "above the hard limit 1000 bytes")
    assert err["code"] == "memory_hard_limit" and r.headers["retry-after"] == "5"
    assert r.headers["content-type"] == "application/json"
    assert httpx.get(f"{w.base_url}/readyz").status_code == 503
    assert "event=memory_source" in w.logs()


def test_client_disconnect_cancels_request(start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker()
    with pytest.raises(httpx.ReadTimeout):
        post(w, {"prompt": "a", "max_tokens": 1000, "temperature": 0}, timeout=0.3)
    cancelled = wait_for(lambda: [v for lab, v in metrics(w).get("moeguard_requests_total", [])
                                  if lab["status"] == "cancelled"], 60, "a cancelled request", 0.1)
    assert cancelled == [1]
    # the worker is still serving
    assert post(w, {"prompt": "b", "max_tokens": 2}).status_code == 200


def test_bfloat16_worker_serves_and_says_where_it_runs(
        start_worker: Callable[..., WorkerProcess]) -> None:
    """MOEGUARD_DEVICE/MOEGUARD_DTYPE reach the worker: bf16 on the CPU serves
    greedy completions, and worker_start names the device and dtype."""
    w = start_worker(MOEGUARD_DEVICE="cpu", MOEGUARD_DTYPE="bf16")
    r = post(w, {"prompt": "Hello, bf16", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 5
    start = next(line for line in w.logs().splitlines() if "event=worker_start" in line)
    assert "device=cpu" in start and "dtype=bfloat16" in start
    assert "omp_wait_policy=PASSIVE" in start  # set by the worker before torch loads libgomp


def test_bad_device_stops_the_worker_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited with 2") as info:
        start_worker_process(tmp_path, {"MOEGUARD_DEVICE": "tpu"})
    assert "MOEGUARD_DEVICE='tpu' must be auto, cpu, cuda or cuda:N" in str(info.value)
