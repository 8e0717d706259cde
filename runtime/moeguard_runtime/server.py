"""HTTP API: OpenAI-style completions, models, health, readiness, metrics.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:

* 400 ``invalid_request_error``: malformed JSON, a missing or non-string
  ``prompt``, a bad field, or a prompt too long for the context, whose message
  follows TGI ("inputs tokens + max_new_tokens must be <= N. Given: X inputs
  tokens and Y max_new_tokens"; TGI answers 422, OpenAI 400);
* 429 with ``Retry-After``: over ``max_concurrent_requests`` or a queue bound
  (TGI: "Model is overloaded"); the message names the cap;
* 503 with ``Retry-After``: above the hard memory limit, or queue timeout.

A client that disconnects cancels its request (polled every 0.25 s while it
waits; a streaming response is cancelled by Starlette when the socket closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moeguard_runtime import tokenizer
from moeguard_runtime.scheduler import Rejected
from moeguard_runtime.service import Event, GenerationRequest, Worker

DISCONNECT_POLL_S = 0.25
REJECT_STATUS = {"memory_hard_limit": 503}


class CompletionRequest(BaseModel):
    """The fields of OpenAI ``POST /v1/completions`` the worker honours (others ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(worker: Worker, model_name: str) -> FastAPI:
    """The FastAPI application serving ``worker``."""
    app = FastAPI(title="moeguard worker", docs_url=None, redoc_url=None)
    tel = worker.telemetry
    max_len = worker.engine.args.max_seq_len

    def count(status: str, code: int) -> None:
        tel.requests.labels(**tel.l(status=status, code=str(code))).inc()

    def invalid(message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        count("invalid", 400)
        return error_response(400, message, "invalid_request_error", code, param)

    @app.get("/healthz")
    async def healthz() -> Response:
        ok = worker.alive
        return PlainTextResponse("ok" if ok else "engine loop stopped", status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz() -> Response:
        if worker.ready:
            return PlainTextResponse("ready")
        why = "engine loop stopped" if not worker.alive else "above the hard memory limit"
        return PlainTextResponse(why, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(tel.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "moeguard", "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await request.body()
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return invalid(f"request body is not valid JSON: {exc}")
        if not isinstance(payload, dict):
            return invalid("request body must be a JSON object")
        if "prompt" not in payload:
            return invalid("you must provide a prompt: the field 'prompt' is missing", "prompt")
        try:
            body = CompletionRequest.model_validate(payload)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            return invalid(f"invalid field {param!r}: {err['msg']}", param)
        prompt = tokenizer.encode(body.prompt)
        if len(prompt) + body.max_tokens > max_len:
            return invalid(f"inputs tokens + max_new_tokens must be <= {max_len}. Given: "
                           f"{len(prompt)} inputs tokens and {body.max_tokens} max_new_tokens",
                           "prompt", "context_length_exceeded")
        req_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        gen = GenerationRequest(req_id, prompt, body.max_tokens, body.temperature, body.seed)
        try:
            worker.submit(gen, sink)
        except Rejected as rej:
            status = REJECT_STATUS.get(rej.reason, 429)
            tel.rejections.labels(**tel.l(reason=rej.reason)).inc()
            count("rejected", status)
            return error_response(status, rej.message, "overloaded_error" if status == 429
                                  else "service_unavailable_error", rej.reason,
                                  headers={"Retry-After": str(rej.retry_after_s)})
        created = int(time.time())
        model = body.model or model_name
        if body.stream:
            return StreamingResponse(_stream(worker, req_id, queue, created, model, len(prompt), count),
                                     media_type="text/event-stream")
        tokens: list[int] = []
        next_poll = loop.time() + DISCONNECT_POLL_S
        while True:
            event = None
            with contextlib.suppress(TimeoutError):
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            if loop.time() >= next_poll:  # tokens may arrive faster than the poll period
                next_poll = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    worker.cancel(req_id)
                    count("cancelled", 499)
                    return Response(status_code=499)
            if event is None:
                continue
            if event.kind == "token":
                tokens.append(event.token)
                continue
            if event.kind == "error":
                count("error", event.status)
                return error_response(event.status, event.message, "server_error", event.reason,
                                      headers={"Retry-After": "1"} if event.status == 503 else None)
            count("ok", 200)
            return JSONResponse({
                "id": req_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": tokenizer.decode(tokens), "logprobs": None,
                             "finish_reason": event.finish_reason}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                          "total_tokens": len(prompt) + len(tokens)},
            })

    return app


async def _stream(worker: Worker, req_id: str, queue: asyncio.Queue[Event], created: int,
                  model: str, prompt_tokens: int, count: Any) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams completions, ending with ``data: [DONE]``."""
    decoder = tokenizer.StreamDecoder()
    done = False
    n = 0

    def chunk(text: str, finish: str | None, usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {"id": req_id, "object": "text_completion", "created": created,
                                "model": model,
                                "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        while True:
            event = await queue.get()
            if event.kind == "token":
                n += 1
                text = decoder.push(event.token)
                if text:
                    yield chunk(text, None)
                continue
            done = True
            if event.kind == "error":
                count("error", event.status)
                err = {"message": event.message, "type": "server_error", "param": None,
                       "code": event.reason}
                yield f"data: {json.dumps({'error': err})}\n\n"
            else:
                count("ok", 200)
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                         "total_tokens": prompt_tokens + n}
                yield chunk(decoder.flush(), event.finish_reason, usage)
            yield "data: [DONE]\n\n"
            return
    finally:
        if not done:
            worker.cancel(req_id)
            count("cancelled", 499)
