"""Interactive first, always (issue 13 §3), over real HTTP against a real worker process.

A worker whose one batch holds two requests and whose queue holds one, each step slowed to 20 ms by the
test-only fault switch (so a 100-token request runs for seconds). It is filled with batch requests, each
naming its class another way (the body's class name, vLLM's integer priority, llm-d's criticality in
``X-Priority``); then an interactive request arrives. It is admitted at once and finishes first; the latest
running batch request is preempted and resumes (its stream ends normally, every token there); the queued
batch request is shed with 503 ``priority_shed`` and ``Retry-After``. Under ``fcfs`` the same interactive
request is the one refused. The worker's metrics say the same, by class.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from harness.stack import wait_for
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_scenarios import value
from tests.integration.worker.test_worker_http import assert_openai_error

pytestmark = pytest.mark.integration

FULL_OF_BATCH = {"MOEGUARD_MAX_BATCH_REQUESTS": "2", "MOEGUARD_MAX_CONCURRENT_BATCHES": "1",
                 "MOEGUARD_MAX_QUEUE_REQUESTS": "1", "MOEGUARD_OVERLOAD_MODE": "Off",
                 "MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_STEP_DELAY_SECONDS": "0.02"}
PROMPT = "hello there"  # greedy: no end of sequence in its first 200 tokens (no early finish)
USAGE = {"stream_options": {"include_usage": True}}  # a stream's usage only when asked for, as OpenAI's


@dataclass
class Call:
    """One request sent from a thread; ``done_order`` is when it ended among the test's calls."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    text: str = ""
    done_order: int = -1

    @property
    def events(self) -> list[Any]:
        return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
                for line in self.text.splitlines() if line.startswith("data: ")]


class Calls:
    def __init__(self, w: WorkerProcess) -> None:
        self.w = w
        self.threads: list[threading.Thread] = []
        self.finished = 0
        self.lock = threading.Lock()

    def start(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Call:
        call = Call({"model": "tiny", "prompt": PROMPT, "temperature": 0, **body}, headers or {})

        def run() -> None:
            with httpx.stream("POST", f"{self.w.base_url}/v1/completions", json=call.body,
                              headers=call.headers, timeout=120) as r:
                call.status, call.response_headers = r.status_code, dict(r.headers)
                call.text = r.read().decode()
            with self.lock:
                call.done_order, self.finished = self.finished, self.finished + 1

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)
        return call

    def join(self) -> None:
        for t in self.threads:
            t.join(120)


def fill_with_batch(w: WorkerProcess, calls: Calls) -> tuple[Call, Call, Call]:
    """Two batch streams running (the batch is full), a third batch request queued (the queue is full)."""
    first = calls.start({"max_tokens": 100, "stream": True, **USAGE, "priority": "batch"})
    wait_for(lambda: value(w, "moeguard_running_requests") >= 1, 60, "the first batch request running", 0.02)
    second = calls.start({"max_tokens": 100, "stream": True, **USAGE, "priority": 5})  # vLLM: > 0 is below default
    wait_for(lambda: value(w, "moeguard_running_requests") >= 2, 60, "two batch requests running", 0.02)
    queued = calls.start({"max_tokens": 4}, headers={"X-Priority": "Sheddable"})  # llm-d criticality
    wait_for(lambda: value(w, "moeguard_queue_requests") >= 1, 60, "a batch request queued", 0.02)
    return first, second, queued


def test_interactive_is_admitted_into_a_worker_full_of_batch(start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(**FULL_OF_BATCH)
    calls = Calls(w)
    first, second, queued = fill_with_batch(w, calls)
    interactive = calls.start({"max_tokens": 5})
    calls.join()

    assert interactive.status == 200, interactive.text
    assert json.loads(interactive.text)["usage"]["completion_tokens"] == 5
    assert interactive.done_order < min(first.done_order, second.done_order)  # it did not wait for them
    # the queued batch request made room for it: refused, retryable, with the reason named
    assert queued.status == 503 and queued.response_headers["retry-after"] == "1", queued.text
    err = json.loads(queued.text)["error"]
    assert err["code"] == "priority_shed" and "shed to make room for interactive work" in err["message"]
    # the preempted stream (the latest running batch request) paused, then resumed: nothing lost
    for call in (first, second):
        events = call.events
        assert call.status == 200 and events[-1] == "[DONE]", call.text[-300:]
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 100
    assert value(w, "moeguard_preemptions_total", priority="batch") >= 1
    assert value(w, "moeguard_preemptions_total", priority="interactive") == 0
    assert value(w, "moeguard_priority_rejections_total", priority="batch", reason="priority_shed") == 1
    assert value(w, "moeguard_priority_rejections_total", priority="interactive") == 0
    assert value(w, "moeguard_rejections_total", reason="priority_shed") == 1
    assert value(w, "moeguard_time_to_first_token_seconds_count", priority="interactive") == 1
    assert value(w, "moeguard_time_to_first_token_seconds_count", priority="batch") == 2
    assert value(w, "moeguard_priority_requests") == 0  # nothing left in the worker
    assert "event=preempted" in w.logs() and "event=priority_shed" in w.logs()


def test_a_running_batch_stream_shed_at_the_concurrency_cap_ends_with_an_sse_error(
        start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(**FULL_OF_BATCH, MOEGUARD_MAX_CONCURRENT_REQUESTS="2")
    calls = Calls(w)
    first = calls.start({"max_tokens": 100, "stream": True, **USAGE, "priority": "batch"})
    wait_for(lambda: value(w, "moeguard_running_requests") >= 1, 60, "the first batch request running", 0.02)
    second = calls.start({"max_tokens": 100, "stream": True}, headers={"X-Priority": "batch"})
    wait_for(lambda: value(w, "moeguard_running_requests") >= 2, 60, "two batch requests running", 0.02)
    interactive = calls.start({"max_tokens": 5, "priority": "Critical"})
    calls.join()

    assert interactive.status == 200, interactive.text
    events = second.events  # nothing queued to shed: the latest running batch request made room
    assert second.status == 200 and events[-1] == "[DONE]", second.text[-300:]
    assert events[-2]["error"]["code"] == "priority_shed", events[-2]
    assert first.status == 200 and first.events[-2]["usage"]["completion_tokens"] == 100
    assert value(w, "moeguard_priority_rejections_total", priority="batch", reason="priority_shed") == 1


def test_fcfs_is_the_old_behaviour_interactive_is_refused(start_worker: Callable[..., WorkerProcess]) -> None:
    w = start_worker(**FULL_OF_BATCH, MOEGUARD_SCHEDULING_POLICY="fcfs")
    calls = Calls(w)
    first, second, queued = fill_with_batch(w, calls)
    r = httpx.post(f"{w.base_url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5},
                   timeout=60)
    calls.join()
    err = assert_openai_error(r, 429, "max_queue_requests is 1")
    assert err["code"] == "queue_full"
    assert {first.status, second.status, queued.status} == {200}
    assert value(w, "moeguard_priority_rejections_total", priority="interactive", reason="queue_full") == 1
    assert value(w, "moeguard_preemptions_total") == 0
