"""The OpenAI API over real HTTP on a byte-level worker: chat completions (streaming
and not), every completion prompt form, stop strings, echo, the served model's
name, and each bad input a 400/404 naming the field and the limit."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_worker_http import assert_openai_error, metrics, post

pytestmark = pytest.mark.integration
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


def chat(w: WorkerProcess, body: object, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{w.base_url}/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=timeout)


def sse(w: WorkerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{w.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_models_reports_name_context_and_type(worker: WorkerProcess) -> None:
    model = httpx.get(f"{worker.base_url}/v1/models").json()["data"][0]
    assert (model["id"], model["max_model_len"], model["model_type"]) == ("tiny", 1024, "mixtral")
    for name in ("tiny", "moeguard-tiny", None):  # the preset and the former name are aliases
        r = chat(worker, {"model": name, "messages": HELLO, "max_tokens": 2, "top_p": 1,
                          "frequency_penalty": 0, "presence_penalty": 0})  # neutral: accepted
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    err = assert_openai_error(chat(worker, {"model": "gpt-4o", "messages": HELLO}), 404,
                              "The model `gpt-4o` does not exist", "'tiny'")
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert post(worker, {"model": "gpt-4o", "prompt": "x"}).status_code == 404


def test_chat_completion_streaming_and_not_agree(worker: WorkerProcess) -> None:
    body = {"model": "tiny", "messages": HELLO, "max_completion_tokens": 12, "temperature": 0}
    r = chat(worker, body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    # the byte chat template: "<|user|>\nHello, who are you?\n<|assistant|>\n" + BOS
    assert data["usage"]["prompt_tokens"] == len("<|user|>\nHello, who are you?\n<|assistant|>\n") + 1
    assert chat(worker, body).json()["choices"] == data["choices"]  # greedy: deterministic
    chunks = sse(worker, "/v1/chat/completions",
                 {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == data["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == choice["message"]["content"]
    if choice["finish_reason"] == "length":
        assert data["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stop_strings_end_generation_and_never_leak(worker: WorkerProcess, endpoint: str) -> None:
    chat_api = endpoint.endswith("chat/completions")

    def text_of(data: dict[str, Any]) -> str:
        choice = data["choices"][0]
        return str(choice["message"]["content"] if chat_api else choice["text"])

    for seed in range(10):  # a seeded request is reproducible; find a long enough answer
        base: dict[str, Any] = {"max_tokens": 24, "temperature": 1.0, "seed": seed}
        base.update({"messages": HELLO} if chat_api else {"prompt": "Hello, world"})
        full = text_of(httpx.post(f"{worker.base_url}{endpoint}", json=base, timeout=60).json())
        if len(full) >= 8:
            break
    assert len(full) >= 8, full
    stop = full[4:7]  # three bytes: three tokens, so the stop string spans stream chunks
    expected = full[:full.find(stop)]
    data = httpx.post(f"{worker.base_url}{endpoint}", json={**base, "stop": [stop, "never"]},
                      timeout=60).json()
    assert text_of(data) == expected and data["choices"][0]["finish_reason"] == "stop"
    chunks = sse(worker, endpoint, {**base, "stop": stop, "stream": True})
    pieces = [c["choices"][0]["delta"].get("content", "") if chat_api else c["choices"][0]["text"]
              for c in chunks]
    assert "".join(pieces) == expected and all(stop not in p for p in pieces)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_every_completion_prompt_form(worker: WorkerProcess) -> None:
    body = {"max_tokens": 5, "temperature": 0}
    text = post(worker, {**body, "prompt": "Hi"}).json()
    ids = [256, 72, 105]  # BOS, "H", "i": the same prompt as token ids
    for prompt in (["Hi"], ids, [ids]):
        r = post(worker, {**body, "prompt": prompt})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text["choices"][0]["text"]
        assert r.json()["usage"] == text["usage"]
    echo = post(worker, {**body, "prompt": "Hi", "echo": True}).json()
    assert echo["choices"][0]["text"] == "Hi" + text["choices"][0]["text"]
    chunks = sse(worker, "/v1/completions", {**body, "prompt": "Hi", "echo": True, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == echo["choices"][0]["text"]


@pytest.mark.parametrize(("body", "status", "needles", "param"), [
    ({"prompt": ["a", "b"]}, 400, ["2 prompts in one request", "limit: 1 prompt"], "prompt"),
    ({"prompt": [[1], [2]]}, 400, ["2 prompts in one request"], "prompt"),
    ({"prompt": [1, 259]}, 400, ["token id 259 is outside the vocabulary",
                                 "limit: 0 <= id < 259"], "prompt"),
    ({"prompt": []}, 400, ["the prompt must not be empty"], "prompt"),
    ({"prompt": [[]]}, 400, ["the prompt must not be empty"], "prompt"),
    ({"prompt": [1, "a"]}, 400, ["Input should be a string, a list of strings, a list of token "
                                 "ids or a list of token-id lists"], "prompt"),
    ({"prompt": "x", "logprobs": 2, "echo": True}, 400, ["'logprobs': with echo"], "logprobs"),
    ({"prompt": "x", "logprobs": 21}, 400, ["invalid field 'logprobs'", "limit: le 20"], "logprobs"),
    ({"prompt": "x", "best_of": 3}, 400, ["invalid field 'best_of'", "limit: le 1"], "best_of"),
    ({"prompt": "x", "n": 2}, 400, ["invalid field 'n'", "limit: le 1"], "n"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, ["at most 4 stop strings"], "stop"),
    ({"prompt": "x", "echo": "yes"}, 400, ["invalid field 'echo'"], "echo"),
])
def test_bad_completion_forms_name_the_field(worker: WorkerProcess, body: dict[str, Any],
                                             status: int, needles: list[str], param: str) -> None:
    err = assert_openai_error(post(worker, body), status, *needles)
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize(("body", "needles", "param"), [
    ({"messages": []}, ["at least one message is required", "min_length 1"], "messages"),
    ({}, ["the field 'messages' is missing"], "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]},
     ["invalid field 'messages.0.role': must be one of system, user, assistant", "'wizard'"],
     "messages.0.role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
     ["'messages.1.tool_call_id'", "names its id"], "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": 5}]},
     ["invalid field 'messages.0.content': must be a string or a list of text parts", "given: int"],
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": None}]}, ["given: null"], "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["images are not supported", "'image_url'"], "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     ["a content part must be {\"type\": \"text\", \"text\": <string>}"], "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     ["unknown field 'messages.0.tool_calls'"], "messages.0.tool_calls"),
    ({"messages": ["hi"]}, ["a message must be an object"], "messages.0"),
    ({"messages": [{"role": "user", "content": "x" * 1023}]},
     ["the conversation is 1048 tokens once rendered with the chat template",
      "the context is 1024 tokens", "must be <= 1023 tokens"], "messages"),
    ({"messages": HELLO, "max_tokens": 1000},
     ["the context is 1024 tokens; with max_tokens 1000 it must be <= 24 tokens"], "messages"),
    ({"messages": HELLO, "max_tokens": 5, "max_completion_tokens": 5},
     ["not both"], "max_completion_tokens"),
    ({"messages": HELLO, "logprobs": "yes"}, ["invalid field 'logprobs'"], "logprobs"),
    ({"messages": HELLO, "n": 3}, ["limit: le 1"], "n"),
    ({"messages": HELLO, "top_p": 1.5}, ["invalid field 'top_p'", "limit: le 1.0"], "top_p"),
    ({"messages": HELLO, "presence_penalty": -2.5}, ["limit: ge -2.0"], "presence_penalty"),
    ({"messages": HELLO, "top_k": True}, ["a JSON number, not bool"], "top_k"),
    ({"messages": HELLO, "tool_choice": "auto"}, ["only allowed when 'tools' are given"], "tool_choice"),
    ({"messages": HELLO, "max_completion_tokens": 0}, ["limit: ge 1"], "max_completion_tokens"),
])
def test_bad_chat_input_is_a_400_naming_field_and_limit(
        worker: WorkerProcess, body: dict[str, Any], needles: list[str], param: str) -> None:
    err = assert_openai_error(chat(worker, body), 400, *needles)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_chat_shares_admission_with_completions(start_worker: Callable[..., WorkerProcess]) -> None:
    """The same caps, codes and Retry-After as completions (one path serves both)."""
    w = start_worker(MOEGUARD_MAX_CONCURRENT_REQUESTS="1")
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(
        post(w, {"prompt": "a", "max_tokens": 1000, "temperature": 0})))
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait until the first one is in flight
        if any(v for _, v in metrics(w).get("moeguard_time_to_first_token_seconds_count", [])):
            break
        time.sleep(0.02)
    r = chat(w, {"messages": HELLO, "max_tokens": 1})
    rs = httpx.post(f"{w.base_url}/v1/chat/completions", timeout=60,
                    json={"messages": HELLO, "max_tokens": 1, "stream": True})
    t.join(60)
    for resp in (r, rs):
        err = assert_openai_error(resp, 429, "max_concurrent_requests is 1")
        assert err["code"] == "concurrency_limit" and resp.headers["retry-after"] == "1"
    assert first[0].status_code == 200
