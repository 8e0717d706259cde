"""The load runner against a real loopback HTTP server written here (asyncio.start_server).

The server speaks just enough HTTP/1.1 (keep-alive, Content-Length bodies) to
act like a worker's ``POST /v1/completions``. What it answers depends on the
prompt's first word: ``REFUSE`` -> 429 with Retry-After, ``BAD`` -> 400 with the
OpenAI error shape, ``BUSY`` -> 503 with no body, ``HANG`` -> never answers;
anything else -> 200 after 50 ms with ``max_tokens`` completion tokens.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness.loadgen.client import PROMPT_STRIDE, burst, replay
from harness.loadgen.stats import summarize
from harness.loadgen.text import prompt_of_length
from harness.loadgen.trace import ScheduledRequest, TraceRecord, scale

pytestmark = pytest.mark.integration
"""A loopback server, real sockets and sleeps: not a unit test (the URL guard's are in
tests/unit/bench/test_loadgen_urls.py)."""

DELAY_S = 0.05


@dataclass
class FakeWorker:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    recv_times: list[float] = field(default_factory=list)


async def _respond(writer: asyncio.StreamWriter, status: int, reason: str,
                   body: bytes = b"", headers: dict[str, str] | None = None) -> None:
    head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()


async def _stream(writer: asyncio.StreamWriter, req: dict[str, Any]) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")

    async def chunk(data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    await asyncio.sleep(DELAY_S)
    for _ in range(req["max_tokens"]):
        await chunk(b'data: {"choices": [{"index": 0, "text": "y"}]}\n\n')
        await asyncio.sleep(0.005)
    usage = {"prompt_tokens": len(req["prompt"].encode()), "completion_tokens": req["max_tokens"]}
    await chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await chunk(b"data: [DONE]\n\n")
    await chunk(b"")


async def _handle(worker: FakeWorker, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode().split("\r\n")
            assert lines[0] == "POST /v1/completions HTTP/1.1", lines[0]
            headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            req = json.loads(await reader.readexactly(int(headers["content-length"])))
            worker.bodies.append(req)
            worker.recv_times.append(loop.time())
            word = req["prompt"].split(" ", 1)[0]
            if word == "HANG":
                await asyncio.sleep(3600)
            elif word == "REFUSE":
                body = json.dumps({"error": {"message": "token budget exhausted",
                                             "type": "rate_limit_exceeded"}}).encode()
                await _respond(writer, 429, "Too Many Requests", body,
                               {"Retry-After": "2", "Content-Type": "application/json"})
            elif word == "BAD":
                body = json.dumps({"error": {"message": "prompt too long: 2000 > 1024"}}).encode()
                await _respond(writer, 400, "Bad Request", body)
            elif word == "BUSY":
                await _respond(writer, 503, "Service Unavailable")
            elif req.get("stream"):
                await _stream(writer, req)
            else:
                await asyncio.sleep(DELAY_S)
                n_prompt = len(req["prompt"].encode())
                body = json.dumps({
                    "id": "cmpl-1", "object": "text_completion", "model": req["model"],
                    "choices": [{"index": 0, "text": "x" * req["max_tokens"],
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": req["max_tokens"],
                              "total_tokens": n_prompt + req["max_tokens"]},
                }).encode()
                await _respond(writer, 200, "OK", body, {"Content-Type": "application/json"})
    finally:
        writer.close()


@pytest.fixture
async def workers() -> AsyncIterator[list[FakeWorker]]:
    fakes = [FakeWorker(), FakeWorker()]
    servers = []
    for fake in fakes:
        server = await asyncio.start_server(
            functools.partial(_handle, fake), host="127.0.0.1", port=0)
        fake.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        servers.append(server)
    yield fakes
    for server in servers:
        server.close()
    await asyncio.gather(*(s.wait_closed() for s in servers), return_exceptions=True)


# --- replay against a real loopback server ----------------------------------------
async def test_replay_records_fields(workers: list[FakeWorker]) -> None:
    sched = scale([TraceRecord(0.0, 40, 8), TraceRecord(2.0, 30, 4), TraceRecord(4.0, 20, 3),
                   TraceRecord(6.0, 25, 2), TraceRecord(8.0, 10, 6)],
                  time_compression=10, max_context=1024)
    kinds = {1: "REFUSE", 2: "BAD", 3: "BUSY"}

    def prompt(r: ScheduledRequest) -> str:
        word = kinds.get(r.index, "hello")
        return (word + " " + "z" * r.prompt_tokens)[:r.prompt_tokens]

    t0 = asyncio.get_running_loop().time()
    run = await replay([workers[0].url], sched, prompt_fn=prompt, seed=100, progress=False,
                       timeout_s=10)
    assert not run.timed_out
    assert run.meta["mode"] == "replay" and run.meta["schedule"]["time_compression"] == 10
    r = run.results
    assert [x.status for x in r] == [200, 429, 400, 503, 200]
    assert [x.scheduled_s for x in r] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    assert [x.send_s for x in r] == sorted(x.send_s for x in r if x.send_s is not None)
    for x in r:
        assert x.url == workers[0].url
        assert x.send_s is not None and x.first_byte_s is not None and x.end_s is not None
        assert x.send_s >= x.scheduled_s - 0.005  # never early (lateness is not asserted: a loaded machine is late)
        assert x.send_s <= x.first_byte_s <= x.end_s
    ok, refused, bad, busy, last = r
    assert ok.ok and last.ok
    assert (ok.prompt_bytes, ok.max_tokens, ok.prompt_tokens, ok.completion_tokens) == (40, 8, 40, 8)
    assert ok.text == "x" * 8 and ok.error is None and ok.retry_after is None
    assert ok.latency_s is not None and ok.latency_s >= DELAY_S
    assert (last.prompt_tokens, last.completion_tokens) == (10, 6)
    assert refused.retry_after == "2" and refused.error == "token budget exhausted"
    assert not refused.ok and refused.completion_tokens is None
    assert bad.error == "prompt too long: 2000 > 1024"
    assert busy.error == "" and not busy.ok
    # What the server received: the OpenAI-style body, seeds = seed + index
    assert [b["seed"] for b in workers[0].bodies] == [100, 101, 102, 103, 104]
    assert workers[0].bodies[0] == {"model": "tiny", "prompt": "hello " + "z" * 34,
                                    "max_tokens": 8, "temperature": 0.0, "seed": 100}
    # Never received early (on the server's clock, from before replay started); arrival order kept.
    # Gaps between arrivals are not asserted: on a loaded machine a late first request arrives
    # bunched with the next ones (the CI run of 2026-11-30 received all five within 0.31 s).
    assert workers[0].recv_times == sorted(workers[0].recv_times)
    for x, got in zip(r, workers[0].recv_times, strict=True):
        assert got >= t0 + x.scheduled_s - 0.005
    s = summarize(run)
    assert s.by_status == {"200": 2, "400": 1, "429": 1, "503": 1}
    assert s.completion_tokens_ok == 14
    assert s.goodput_tok_s == pytest.approx(14 / run.wall_s)
    assert run.wall_s >= 0.8 + DELAY_S  # never early; how late is the machine's, not asserted


async def test_replay_default_prompts_are_real_text(workers: list[FakeWorker]) -> None:
    sched = scale([TraceRecord(0.0, 300, 2), TraceRecord(0.0, 1000, 100)], max_context=512)
    run = await replay(workers[0].url, sched, progress=False)
    assert [x.status for x in run.results] == [200, 200]
    got = sorted((b["seed"], b["prompt"]) for b in workers[0].bodies)
    assert got == [(0, prompt_of_length(300, 0)), (1, prompt_of_length(412, PROMPT_STRIDE))]
    assert all(len(p.split()) > 30 and p.isascii() for _, p in got)
    assert run.meta["prompts"] == "pydoc" and len(run.meta["corpus_sha256_16"]) == 16


async def test_deadline_stops_the_run(workers: list[FakeWorker]) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reqs = [ScheduledRequest(0, 0.0, 10, 2, 10, 2), ScheduledRequest(1, 0.0, 10, 2, 10, 2),
            ScheduledRequest(2, 30.0, 10, 2, 10, 2)]
    run = await replay(workers[0].url, reqs, prompt_fn=lambda r: "HANG" if r.index == 1 else "hi",
                       timeout_s=0.5, progress=False)
    # the deadline ended the run, not the request scheduled at 30 s (bounds far from both: a loaded machine)
    assert loop.time() - t0 < 15.0
    assert run.timed_out and 0.5 <= run.wall_s < 15.0
    done, hung, never = run.results
    assert done.ok
    assert hung.status is None and hung.end_s is None and hung.error is not None
    assert hung.error.startswith("cancelled")
    assert never.send_s is None and never.error is not None and never.error.startswith("not sent")
    assert summarize(run).by_status == {"200": 1, "incomplete": 1, "not_sent": 1}


async def test_request_timeout_is_an_error(workers: list[FakeWorker]) -> None:
    run = await burst(workers[0].url, ["HANG now"], request_timeout_s=0.2, timeout_s=5,
                      progress=False)
    (res,) = run.results
    assert not run.timed_out and res.status is None and res.end_s is not None
    assert res.error is not None and "Timeout" in res.error
    assert summarize(run).by_status == {"error": 1}


async def test_connection_refused_is_an_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, host="127.0.0.1", port=0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    run = await burst(f"http://127.0.0.1:{port}", ["hi"], timeout_s=5, progress=False)
    assert run.results[0].status is None and "Connect" in (run.results[0].error or "")


# --- burst -----------------------------------------------------------------------
async def test_burst_round_robin_and_in_flight_cap(workers: list[FakeWorker]) -> None:
    urls = [w.url for w in workers]
    run = await burst(urls, [f"p{i} text" for i in range(6)], max_tokens=[1, 2, 3, 4, 5, 6],
                      progress=False, timeout_s=10)
    assert [x.url for x in run.results] == urls * 3
    assert [x.completion_tokens for x in run.results] == [1, 2, 3, 4, 5, 6]
    # all sent at once: every send happens before the first answer comes back (no wall-clock bound)
    first_end = min(x.end_s for x in run.results if x.end_s is not None)
    assert all(x.ok and x.send_s is not None and x.send_s < first_end for x in run.results)
    assert len(workers[0].bodies) == len(workers[1].bodies) == 3
    # cap of 1: strictly one after another, each waits >= 50 ms for the previous
    capped = await burst(workers[0].url, ["a", "b", "c"], max_in_flight=1, progress=False)
    sends = [x.send_s or 0.0 for x in capped.results]
    assert all(b - a >= DELAY_S * 0.9 for a, b in itertools.pairwise(sends))
    with pytest.raises(ValueError):
        await burst(urls, ["a", "b"], max_tokens=[1])


async def test_streaming_first_token_and_usage(workers: list[FakeWorker]) -> None:
    run = await burst(workers[0].url, ["hello stream"], max_tokens=5, stream=True, progress=False)
    (res,) = run.results
    assert res.ok and res.text == "yyyyy"
    assert (res.prompt_tokens, res.completion_tokens) == (12, 5)
    assert res.send_s is not None and res.first_byte_s is not None and res.end_s is not None
    assert res.first_byte_s - res.send_s >= DELAY_S
    assert res.end_s - res.first_byte_s >= 4 * 0.005
    body = workers[0].bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
