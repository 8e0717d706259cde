"""Refusals are cheap and honest: the caps that do not depend on the body refuse before it is
read (so before any parsing or tokenization), and a queue-token bound never refuses a request
that arrives at an empty queue (a retryable 429 that no retry could turn into a 200)."""

from __future__ import annotations

import httpx
import pytest
from tests.unit.runtime.test_service import LABELS, Lines

from moeguard_core import presets
from moeguard_core.contract import DEFAULT_BUDGETS
from moeguard_runtime.api import tokenizer
from moeguard_runtime.api.server import WorkerSlot, create_app
from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.scheduler import QueueLimits, Rejected, Scheduler
from moeguard_runtime.engine.service import GenerationRequest, Worker
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.model import build_model
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit


def test_a_prompt_longer_than_the_queue_token_bound_is_queued_into_an_empty_queue() -> None:
    s = Scheduler(DEFAULT_BUDGETS, QueueLimits(max_queue_tokens=2048), clock=lambda: 0.0)
    s.submit("lone", 2100, 16)  # was 429 queue_tokens_full, Retry-After 1, for ever
    assert s.queue_tokens == 2100
    with pytest.raises(Rejected) as exc:  # behind it the bound holds: this one can succeed later
        s.submit("next", 1, 16)
    assert exc.value.reason == "queue_tokens_full" and exc.value.status == 429
    plan = s.schedule().plan
    assert plan is not None and plan.admitted == ("lone",) and s.queue_tokens == 0
    s.submit("next", 2100, 16)




def worker(env: dict[str, str]) -> Worker:
    w = Worker(load_settings(env), Engine(build_model(presets.get_preset("tiny"), seed=1)),
               Telemetry(LABELS, 8), RateLimitedLog(0.0, logger=Lines()), clock=lambda: 0.0,
               memory_reader=lambda: MemoryReading(100, "rss"), idle_wait_s=0.0)
    w.check_memory(force=True)
    return w


@pytest.mark.parametrize(("env", "reason", "needle"), [
    ({"MOEGUARD_MAX_CONCURRENT_REQUESTS": "2"}, "concurrency_limit",
     "Model is overloaded: 2 requests in flight, max_concurrent_requests is 2"),
    ({"MOEGUARD_MAX_QUEUE_REQUESTS": "2"}, "queue_full",
     "queue is full: 2 requests waiting, max_queue_requests is 2"),
])
async def test_a_full_worker_refuses_before_reading_the_body(
        env: dict[str, str], reason: str, needle: str) -> None:
    w = worker(env)
    for i in range(2):  # queued, not yet run: the loop is driven by hand
        w.submit(GenerationRequest(f"r{i}", tokenizer.encode("hi"), 4), lambda e: None)
    slot = WorkerSlot(w.telemetry, "tiny", 1024, worker=w)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(slot)),
                                 base_url="http://worker") as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            # not JSON at all: a 429 (not a 400) shows the body was never parsed
            r = await client.post(path, content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert (err["code"], err["type"]) == (reason, "overloaded_error") and needle in err["message"]
    assert w.telemetry.registry.get_sample_value("moeguard_rejections_total",
                                                 {**LABELS, "reason": reason}) == 2
    w.drain()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(slot)),
                                 base_url="http://worker") as client:
        r = await client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
