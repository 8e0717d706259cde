"""HTTP API: OpenAI-style completions, models, health, readiness, metrics, OpenAPI.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:

* 400 ``invalid_request_error``: malformed JSON, a body that is not UTF-8 or
  not an object, an unknown field, a wrong type or a value out of range (the
  message names the field, the limit and the given value), an empty prompt,
  or a prompt too long for the context, whose message follows TGI ("inputs
  tokens + max_new_tokens must be <= N. Given: X inputs tokens and Y
  max_new_tokens"; TGI answers 422, OpenAI 400);
* 413: a body over ``MOEGUARD_MAX_BODY_BYTES`` (read no further than the limit);
* 429 with ``Retry-After``: over ``max_concurrent_requests`` or a queue bound
  (TGI: "Model is overloaded"); the message names the cap;
* 503 with ``Retry-After``: above the hard memory limit, queue timeout, a
  context over the overload threshold, out of memory, or the model still loading.

Fields: those of OpenAI ``POST /v1/completions`` that the worker honours, plus
``priority`` (``interactive``, the default, or ``batch``; also the header
``X-Priority``), which orders the queue while overload mode is on. Other
OpenAI fields (``stop``, ``logprobs``, ``echo``, ``top_p`` …) are refused as
unknown rather than silently ignored.

Streaming answers its HTTP status only once the request is admitted to a
batch: a refusal or a queue timeout before that is the same JSON error (503 or
429, ``Retry-After``, the reason in ``code``) as without streaming; only a
failure after admission (out of memory in the batch) arrives as an SSE error
event. ``stream_options: {"include_usage": true}`` (OpenAI) adds a final chunk
with ``usage`` and ``"choices": []``; an unknown key in it is a 400 naming it.

A client that disconnects cancels its request (polled every 0.25 s while it
waits; a streaming response is cancelled by Starlette when the socket closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeguard_runtime import tokenizer
from moeguard_runtime.scheduler import Rejected
from moeguard_runtime.service import Event, GenerationRequest, Worker
from moeguard_runtime.telemetry import Telemetry

DISCONNECT_POLL_S = 0.25
MAX_TOKENS_LIMIT = 1_048_576


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` adds a last chunk with ``usage``
    (and ``"choices": []``) before ``[DONE]``. Other keys are refused."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(default=False, strict=True)


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``.

    Types are strict, as JSON Schema states them: ``"5"`` and ``true`` are not
    integers, while ``5.0`` is (JSON Schema's integers include numbers with a
    zero fraction); ``"1"`` is not a number.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256, strict=True)
    prompt: str = Field(min_length=1, strict=True,
                        description="Text to complete; at least one character.")
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT,
                            description="Tokens to generate; prompt tokens + max_tokens must fit "
                                        "the model's context (GET /v1/models max_model_len).")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy.")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = Field(
        default=None, description="OpenAI's stream options; only with stream: true.")
    n: int = Field(default=1, ge=1, le=1, description="Only 1 is supported.")
    user: str | None = Field(default=None, max_length=256, strict=True)
    priority: Literal["interactive", "batch"] | None = Field(
        default=None, description="Queue class while overload mode is on (default interactive).")

    @field_validator("max_tokens", "temperature", "seed", "n", mode="before")
    @classmethod
    def _numbers_only(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):
            raise ValueError(f"Input should be a JSON number, not {type(value).__name__}")
        return value


@dataclass
class WorkerSlot:
    """What the app serves: ``worker`` stays None while the model loads."""

    telemetry: Telemetry
    model_name: str
    max_len: int
    worker: Worker | None = None


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` of the first error: the field, the rule's limit and the given value."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    given = json.dumps(err.get("input"), default=repr)[:100]
    if err["type"] == "extra_forbidden":
        return f"unknown field {param!r} (given: {given}); see the OpenAPI document", param
    limit = ", ".join(f"{k} {v}" for k, v in (err.get("ctx") or {}).items()
                      if k in ("ge", "gt", "le", "lt", "min_length", "max_length", "expected"))
    limit_text = f"; limit: {limit}" if limit else ""
    return f"invalid field {param!r}: {err['msg']}{limit_text}; given: {given}", param


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's schema with its ``$defs`` inlined: the request body schema sits
    inside the OpenAPI document, where ``#/$defs/...`` would not resolve."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    result: dict[str, Any] = walk(schema)
    return result


_COMPLETIONS_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {
        "schema": _inline_refs(CompletionRequest.model_json_schema())}}},
    "responses": {
        "200": {"description": "The completion (JSON), or server-sent events when stream is true.",
                "content": {"application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": {}}}},
        **{str(code): {"description": why, "content": {"application/json": {
            "schema": _ERROR_SCHEMA}}} for code, why in (
            (400, "invalid request"), (413, "body too large"), (429, "overloaded"),
            (500, "inference failed"), (503, "unavailable"))}},
}


def create_app(slot: WorkerSlot, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI application serving ``slot.worker`` (once it is set)."""
    app = FastAPI(title="moeguard worker", version="1", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths and wrong methods answer in OpenAI's error shape too (not FastAPI's {"detail": ...}).
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, kind, code=str(exc.detail).lower().replace(" ", "_"),
                              headers=dict(exc.headers or {}))
    openapi = json.loads(json.dumps(_COMPLETIONS_OPENAPI))  # the context is known only now
    body_schema = openapi["requestBody"]["content"]["application/json"]["schema"]
    body_schema["properties"]["max_tokens"]["maximum"] = slot.max_len - 1
    tel = slot.telemetry
    max_len = slot.max_len

    def count(status: str, code: int) -> None:
        tel.requests.labels(**tel.l(status=status, code=str(code))).inc()

    def invalid(message: str, param: str | None = None, code: str | None = None,
                status: int = 400) -> JSONResponse:
        count("invalid", status)
        tel.rejections.labels(**tel.l(reason="invalid_request")).inc()
        return error_response(status, message, "invalid_request_error", code, param)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> Response:
        """Liveness: 200 while loading and while the engine loop runs."""
        w = slot.worker
        ok = w is None or w.alive
        return PlainTextResponse("ok" if ok else "engine loop stopped", status_code=200 if ok else 503)

    @app.get("/readyz", response_class=PlainTextResponse)
    async def readyz() -> Response:
        """Readiness: 503 while the model loads, the loop is stopped, memory is above hard, or
        before the first budget document (:attr:`Worker.not_ready_reason`); the body says why."""
        w = slot.worker
        why = "model is loading" if w is None else w.not_ready_reason
        if why is None:
            return PlainTextResponse("ready")
        return PlainTextResponse(why, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(tel.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": slot.model_name, "object": "model", "created": 0,
                                            "owned_by": "moeguard", "max_model_len": max_len}]}

    async def read_body(request: Request) -> bytes | None:
        """The body, or None once it exceeds ``max_body_bytes`` (read no further)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    @app.post("/v1/completions", openapi_extra=openapi)
    async def completions(request: Request) -> Response:
        raw = await read_body(request)
        if raw is None:
            return invalid(f"request body is larger than {max_body_bytes} bytes "
                           f"(MOEGUARD_MAX_BODY_BYTES)", code="body_too_large", status=413)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return invalid(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}")
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            return invalid(f"request body is not valid JSON: {exc}")
        except RecursionError:
            return invalid("request body is not valid JSON for this API: nested too deeply")
        if not isinstance(payload, dict):
            return invalid(f"request body must be a JSON object, given a {type(payload).__name__}")
        if "prompt" not in payload:
            return invalid("you must provide a prompt: the field 'prompt' is missing", "prompt")
        if payload["prompt"] == "":
            return invalid("invalid field 'prompt': the prompt must not be empty; given: \"\"",
                           "prompt")
        try:
            body = CompletionRequest.model_validate(payload)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            return invalid(message, param)
        if body.stream_options is not None and not body.stream:
            return invalid("invalid field 'stream_options': only allowed when 'stream' is true; "
                           "given: stream false", "stream_options", "stream_options_without_stream")
        prompt = tokenizer.encode(body.prompt)
        if len(prompt) + body.max_tokens > max_len:
            return invalid(f"inputs tokens + max_new_tokens must be <= {max_len}. Given: "
                           f"{len(prompt)} inputs tokens and {body.max_tokens} max_new_tokens",
                           "prompt", "context_length_exceeded")
        priority = body.priority or request.headers.get("x-priority", "interactive").lower()
        if priority not in ("interactive", "batch"):
            return invalid(f"invalid header 'X-Priority': must be interactive or batch; "
                           f"given: {priority!r}", "priority")
        worker = slot.worker
        if worker is None:
            count("rejected", 503)
            return error_response(503, "the model is loading", "service_unavailable_error",
                                  "loading", headers={"Retry-After": "5"})
        return await _serve(worker, body, prompt, priority, request, count)

    return app


def _event_error(event: Event) -> JSONResponse:
    """An ``error`` event as an HTTP error: 503 (with ``Retry-After``) or 500."""
    return error_response(event.status, event.message,
                          "service_unavailable_error" if event.status == 503 else "server_error",
                          event.reason,
                          headers={"Retry-After": "1"} if event.status == 503 else None)


async def _serve(worker: Worker, body: CompletionRequest, prompt: list[int], priority: str,
                 request: Request, count: Callable[[str, int], None]) -> Response:
    tel = worker.telemetry
    req_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    gen = GenerationRequest(req_id, prompt, body.max_tokens, body.temperature, body.seed, priority)
    try:
        worker.submit(gen, sink)
    except Rejected as rej:
        tel.rejections.labels(**tel.l(reason=rej.reason)).inc()
        count("rejected", rej.status)
        return error_response(rej.status, rej.message, "overloaded_error" if rej.status == 429
                              else "service_unavailable_error", rej.reason,
                              headers={"Retry-After": str(rej.retry_after_s)})
    created = int(time.time())
    model = body.model or f"moeguard-{worker.settings.preset}"
    next_poll = loop.time() + DISCONNECT_POLL_S

    async def next_event() -> Event | None:
        """The next event, or None once the client has gone (the request is cancelled)."""
        nonlocal next_poll
        while True:
            event = None
            with contextlib.suppress(TimeoutError):
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            if loop.time() >= next_poll:  # tokens may arrive faster than the poll period
                next_poll = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    worker.cancel(req_id)
                    count("cancelled", 499)
                    return None
            if event is not None:
                return event

    if body.stream:
        # No 200 before admission: a request refused or timed out in the queue gets the
        # same HTTP error (503/429, Retry-After, reason) as without streaming.
        first = await next_event()
        if first is None:
            return Response(status_code=499)
        if first.kind == "error":
            count("error", first.status)
            return _event_error(first)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _stream(worker, req_id, queue, created, model, len(prompt), count,
                    first if first.kind != "admitted" else None, include_usage),
            media_type="text/event-stream")
    tokens: list[int] = []
    while True:
        event = await next_event()
        if event is None:
            return Response(status_code=499)
        if event.kind == "admitted":
            continue
        if event.kind == "token":
            tokens.append(event.token)
            continue
        if event.kind == "error":
            count("error", event.status)
            return _event_error(event)
        count("ok", 200)
        return JSONResponse({
            "id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": tokenizer.decode(tokens), "logprobs": None,
                         "finish_reason": event.finish_reason}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
        })


async def _stream(worker: Worker, req_id: str, queue: asyncio.Queue[Event], created: int,
                  model: str, prompt_tokens: int, count: Any, first: Event | None = None,
                  include_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams completions, ending with ``data: [DONE]``.

    Started once the request is admitted (``first``: an event already taken off
    the queue, if any). An error after admission (out of memory in a batch)
    can only be an ``error`` event in the stream. Without ``include_usage`` the
    finishing chunk carries ``usage``; with it (OpenAI ``stream_options``), every
    chunk has ``"usage": null`` and a last chunk with ``"choices": []`` and the
    usage precedes ``[DONE]``.
    """
    decoder = tokenizer.StreamDecoder()
    done = False
    n = 0

    def chunk(text: str | None, finish: str | None, usage: dict[str, int] | None = None) -> str:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
        body: dict[str, Any] = {"id": req_id, "object": "text_completion", "created": created,
                                "model": model, "choices": choices}
        if usage is not None or include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        while True:
            event = first if first is not None else await queue.get()
            first = None
            if event.kind == "admitted":
                continue
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
                if include_usage:
                    yield chunk(decoder.flush(), event.finish_reason)
                    yield chunk(None, None, usage)
                else:
                    yield chunk(decoder.flush(), event.finish_reason, usage)
            yield "data: [DONE]\n\n"
            return
    finally:
        if not done:
            worker.cancel(req_id)
            count("cancelled", 499)
