"""HTTP API: OpenAI-style completions and chat completions, models, health, readiness,
metrics, OpenAPI.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:

* 400 ``invalid_request_error``: malformed JSON, a body that is not UTF-8 or
  not an object, an unknown field, a wrong type or a value out of range (the
  message names the field, the limit and the given value), an empty prompt,
  a prompt form not served (several prompts), a field of OpenAI's that the worker
  does not implement (``n`` or ``best_of`` above 1, ``logprobs`` with ``echo``),
  a ``response_format`` whose schema llguidance cannot compile, a bad chat
  message (unknown role, content of the wrong type, images), a chat template
  that raises on the conversation, or a prompt too long for the context, whose
  message follows TGI ("inputs tokens + max_new_tokens must be <= N. Given: X
  inputs tokens and Y max_new_tokens"; TGI answers 422, OpenAI 400);
* 404 ``model_not_found``: ``model`` names neither the served model
  (``GET /v1/models``) nor one of its aliases (the preset's name);
* 413: a body over ``MOEGUARD_MAX_BODY_BYTES`` (read no further than the limit);
* 429 with ``Retry-After``: over ``max_concurrent_requests`` or a queue bound
  (TGI: "Model is overloaded"); the message names the cap. The caps that do not
  depend on the body (and shutting down, and the hard memory limit) are checked
  before the body is read (:meth:`Worker.refuse_early`) when no batch request
  could make room: a refusal costs no parsing and no tokenization;
* 400 ``memory_predicted``: with memory-aware admission (:mod:`moeguard_core.memory_admission`),
  a request whose smallest step is predicted not to fit under the limit (the hard limit, or the
  memory cgroup's when smaller) even above the worker's idle footprint (it can never be served
  there); 503 ``memory_predicted`` with ``Retry-After`` when it fits the idle worker but not now
  (an SSE error event if a started stream can no longer progress);
* 503 with ``Retry-After``: a batch request shed for an interactive one
  (``priority_shed``; an SSE error event once its stream has answered), above the hard memory limit, queue timeout, a
  context over the overload threshold, out of memory, the model still loading, or
  shutting down (``shutting_down``: after SIGTERM, see ``__main__._draining_server``).

Fields: those of OpenAI ``POST /v1/completions`` and ``POST /v1/chat/completions``
that the worker honours (:mod:`moeguard_runtime.api.openai_schema`), plus
``priority`` (``interactive``, the default, or ``batch``; an llm-d criticality,
``Critical``/``Standard``/``Sheddable``; or vLLM's integer priority, lower first: ``<= 0``
interactive, ``> 0`` batch; also the header ``X-Priority``), which puts interactive requests
first in every mode (:mod:`moeguard_runtime.engine.scheduler`): a batch request may be preempted
(its stream pauses, then resumes) or shed to make room for one (503 ``priority_shed``). Both endpoints
share one path (:func:`_serve`): the same admission, budgets and refusals.

Output text is detokenized incrementally (:mod:`moeguard_runtime.api.detokenize`):
a character split across tokens is never emitted half. Generation ends with
``finish_reason`` ``stop`` on an end-of-sequence id of the tokenizer or on a
``stop`` string (not returned, even across stream chunks), ``length`` at
``max_tokens``.

Streaming answers its HTTP status only once the request's first step has run
in a batch: a refusal, a queue timeout or an allocation failure in that first
step is the same JSON error (503 or 429, ``Retry-After``, the reason in
``code``) as without streaming; only a failure in a later step (out of memory
in the batch) arrives as an SSE error event.
``stream_options: {"include_usage": true}`` (OpenAI) adds a final chunk
with ``usage`` and ``"choices": []`` (every other chunk then has ``"usage": null``); without it
(``stream_options`` absent, ``{}`` or ``include_usage: false``) no chunk carries ``usage``, as
OpenAI streams. An unknown key in it is a 400 naming it.

A client that disconnects cancels its request (polled every 0.25 s while it
waits; a streaming response is cancelled by Starlette when the socket closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeguard_core import contract
from moeguard_runtime.api.chat_template import ChatTemplate, ChatTemplateError
from moeguard_runtime.api.detokenize import StopMatcher
from moeguard_runtime.api.logprobs import LogprobsBuilder
from moeguard_runtime.api.openai_schema import (
    MAX_STOP_STRINGS,
    MESSAGES_SCHEMA,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    chat_messages,
    prompt_ids,
    prompt_schema,
    refused_fields,
)
from moeguard_runtime.api.pd_routes import (
    PrefillClient,
    PrefillRequest,
    run_prefill,
)
from moeguard_runtime.api.structured_output import compiler_for
from moeguard_runtime.api.tokenizer import ByteTokenizer, Tokenizer
from moeguard_runtime.api.tool_calls import ToolPlan, call_id, format_for
from moeguard_runtime.engine.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    grammar_of,
    grammar_of_lark,
)
from moeguard_runtime.engine.sampling import GREEDY, SamplingParams
from moeguard_runtime.engine.scheduler import Rejected, priority_class
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.telemetry.telemetry import Telemetry

DISCONNECT_POLL_S = 0.25


@dataclass
class WorkerSlot:
    """What the app serves: ``worker`` stays None while the model loads.

    ``model_name`` is the served name (``GET /v1/models``); requests may also
    name one of ``model_aliases``. ``chat_template`` None: compiled from the
    tokenizer's own (checked at start-up by the caller for a checkpoint).
    """

    telemetry: Telemetry
    model_name: str
    max_len: int
    worker: Worker | None = None
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    model_aliases: tuple[str, ...] = ()
    model_type: str = "mixtral"
    chat_template: ChatTemplate | None = None
    role: str = "single"
    """``contract.ENV_ROLE``: a ``prefill`` worker serves ``contract.PREFILL_PATH``."""
    prefill_client: PrefillClient | None = None
    """A ``decode`` worker's calls to its prefill workers."""
    prefill_timeout_s: float = 30.0
    """A prefill worker's bound on one prefill call (queueing included)."""


@dataclass(frozen=True)
class _Job:
    """A validated request, endpoint-neutral: what :func:`_serve` runs."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    priority: str
    stream: bool
    include_usage: bool
    stops: list[str]
    model: str
    echo: str = ""
    sampling: SamplingParams = GREEDY
    response_format: dict[str, Any] | None = None
    """``response_format`` when it constrains the output (json_object, json_schema), OpenAI's shape."""
    tools: ToolPlan | None = None
    """Where the answer may hold tool calls (``tool_choice`` not ``none``): parsed back at the end."""


def _finite_float(text: str) -> float:
    """``json.loads``' ``parse_float``: a JSON number with a fraction or an exponent.

    Raises:
        ValueError: it overflows a double (``1e999`` would otherwise become ``inf``).
    """
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (limit: a finite 64-bit float, "
                         f"|x| < 1.8e308)")
    return value


def _no_constant(name: str) -> float:
    """``json.loads``' ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity``, which Python's
    parser accepts and JSON (RFC 8259) does not.

    Raises:
        ValueError: always, naming the constant.
    """
    raise ValueError(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _number_error(exc: ValueError) -> str:
    """What was wrong with a number of the body: :func:`_finite_float`'s and :func:`_no_constant`'s
    own messages, or, for Python's integer-string conversion limit (``sys.get_int_max_str_digits()``,
    4300 digits by default; ``json.loads`` raises a bare ``ValueError``), one naming that limit."""
    limit = sys.get_int_max_str_digits()
    if "integer string conversion" in str(exc):
        return f"an integer has more than {limit} digits (limit: {limit} digits)"
    return str(exc)


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


def _openapi(model: type[BaseModel], slot: WorkerSlot) -> dict[str, Any]:
    """The operation's OpenAPI extras, with the bounds known only at start-up (the
    context, the vocabulary, the model names) written into the body schema."""
    schema = _inline_refs(model.model_json_schema())
    props = schema["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            bound = next(b for b in props[name].get("anyOf", [props[name]]) if "maximum" in b)
            bound["maximum"] = slot.max_len - 1
    names = sorted({slot.model_name, *slot.model_aliases})
    props["model"] = {"anyOf": [{"enum": names}, {"type": "null"}], "default": None,
                      "description": props["model"].get("description", "")}
    props["stop"]["anyOf"] = [{"type": "string"}, {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                                   "items": {"type": "string"}}, {"type": "null"}]
    props["logprobs"] = {"type": "null", "default": None, "description": "Not supported."}
    if "top_logprobs" in props:
        props["top_logprobs"] = {"type": "null", "default": None, "description": "Not supported."}
    if "prompt" in props:
        props["prompt"] = prompt_schema(slot.tokenizer.vocab_size)
    if "messages" in props:
        props["messages"] = MESSAGES_SCHEMA
        schema["not"] = {"required": ["max_tokens", "max_completion_tokens"]}  # one of the two
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": {"description": "The completion (JSON), or server-sent events when stream is true.",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {}}}},
            **{str(code): {"description": why, "content": {"application/json": {
                "schema": _ERROR_SCHEMA}}} for code, why in (
                (400, "invalid request"), (404, "model not found"), (413, "body too large"),
                (429, "overloaded"), (500, "inference failed"), (503, "unavailable"))}},
    }


def create_app(slot: WorkerSlot, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI application serving ``slot.worker`` (once it is set).

    Raises:
        ChatTemplateError: the tokenizer's chat template does not compile.
    """
    app = FastAPI(title="moeguard worker", version="1", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths and wrong methods answer in OpenAI's error shape too (not FastAPI's {"detail": ...}).
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, kind, code=str(exc.detail).lower().replace(" ", "_"),
                              headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a client's fault: still OpenAI's shape (never Starlette's text/plain 500).
        slot.telemetry.requests.labels(**slot.telemetry.l(status="error", code="500")).inc()
        return error_response(500, f"{request.method} {request.url.path}: internal error "
                                   f"{type(exc).__name__}", "server_error", "internal_error")
    tel = slot.telemetry
    max_len = slot.max_len
    tok = slot.tokenizer
    compilers: dict[str, GrammarCompiler] = {}
    """The serving tokenizer's grammar compiler, built at the first structured-output request."""
    template = slot.chat_template
    if template is None and tok.chat_template is not None:
        template = ChatTemplate(tok.chat_template, tok.special_tokens)
    model_names = {slot.model_name, *slot.model_aliases}
    # the byte tokenizer's template (the presets, whose model_type reads mixtral) is ours, in the hermes format
    tool_format = format_for("preset" if isinstance(tok, ByteTokenizer) else slot.model_type)
    tool_marker_ids = tok.added_token_ids(tool_format.markers)

    def count(status: str, code: int) -> None:
        tel.requests.labels(**tel.l(status=status, code=str(code))).inc()

    def invalid(message: str, param: str | None = None, code: str | None = None,
                status: int = 400) -> JSONResponse:
        count("invalid", status)
        tel.rejections.labels(**tel.l(reason="invalid_request")).inc()
        return error_response(status, message, "invalid_request_error", code, param)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> Response:
        """Liveness: 200 while loading and while the engine loop runs and can allocate
        (:attr:`Worker.not_alive_reason`); else 503, the body says why."""
        w = slot.worker
        why = None if w is None else w.not_alive_reason
        return PlainTextResponse("ok" if why is None else why, status_code=200 if why is None else 503)

    @app.get("/readyz", response_class=PlainTextResponse)
    async def readyz() -> Response:
        """Readiness: 503 while the model loads, the loop is stopped, memory is above hard, steps
        failed to allocate (until a probe step runs), or before the first budget document
        (:attr:`Worker.not_ready_reason`); the body says why."""
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
        """The served model: its name, context length (tokens) and ``model_type``."""
        return {"object": "list", "data": [{
            "id": slot.model_name, "object": "model", "created": 0, "owned_by": "moeguard",
            "max_model_len": max_len, "model_type": slot.model_type,
            "aliases": sorted(model_names - {slot.model_name})}]}

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

    async def parse(request: Request, model: type[CompletionRequest | ChatCompletionRequest | PrefillRequest],
                    required: str) -> CompletionRequest | ChatCompletionRequest | PrefillRequest | JSONResponse:
        """The validated body, or the 4xx answer; or, before the body is read, the refusal any
        request would get now (:meth:`Worker.refuse_early`: 429/503 with Retry-After)."""
        if slot.worker is not None:
            try:
                slot.worker.refuse_early()
            except Rejected as rej:
                # Counted by class without reading the body: the X-Priority header's class, else the
                # default (interactive); a body's own priority is not known here.
                try:
                    early = priority_class(request.headers.get("x-priority") or "interactive")
                except ValueError:
                    early = "interactive"
                tel.priority_rejections.labels(**tel.l(priority=early, reason=rej.reason)).inc()
                return _refused(tel, rej, count)
        raw = await read_body(request)
        if raw is None:
            return invalid(f"request body is larger than {max_body_bytes} bytes "
                           f"(MOEGUARD_MAX_BODY_BYTES)", code="body_too_large", status=413)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return invalid(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}")
        try:
            payload = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            return invalid(f"request body is not valid JSON: {exc}")
        except RecursionError:
            return invalid("request body is not valid JSON for this API: nested too deeply")
        except ValueError as exc:  # a number this API cannot hold
            return invalid(f"request body is not valid JSON for this API: {_number_error(exc)}")
        if not isinstance(payload, dict):
            return invalid(f"request body must be a JSON object, given a {type(payload).__name__}")
        if required not in payload:
            return invalid(f"you must provide {required}: the field {required!r} is missing",
                           required)
        try:
            body = model.model_validate(payload)
            if not isinstance(body, PrefillRequest):
                refused_fields(body)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            return invalid(message, param)
        except InvalidRequest as exc:
            return invalid(exc.message, exc.param, exc.code)
        return body

    def priority_of(body: CompletionRequest | ChatCompletionRequest,
                    request: Request) -> str | JSONResponse:
        """The request's class: the body's ``priority``, else the ``X-Priority`` header, else
        interactive; each as :func:`scheduler.priority_class` reads it."""
        if isinstance(body.priority, str):
            return body.priority  # already a class name (openai_schema)
        header = request.headers.get("x-priority")
        if header is None:
            return "interactive"
        try:
            return priority_class(header)
        except ValueError as exc:
            return invalid(f"invalid header 'X-Priority': {exc}; given: {header!r}", "priority")

    async def run(job: _Job, request: Request) -> Response:
        worker = slot.worker
        if worker is None:
            count("rejected", 503)
            return error_response(503, "the model is loading", "service_unavailable_error",
                                  "loading", headers={"Retry-After": "5"})
        constraint = None
        plan = job.tools
        forced = plan is not None and bool(plan.forced)
        if job.response_format is not None or forced:
            try:
                if compilers.get("tok") is None:  # built once: about a second for a 150k-token vocabulary
                    compilers["tok"] = await asyncio.to_thread(compiler_for, tok, worker.engine.args.vocab_size)
                if plan is not None and forced:
                    grammar = grammar_of_lark(plan.grammar())
                else:
                    assert job.response_format is not None
                    grammar = grammar_of(job.response_format)
                constraint = await asyncio.to_thread(compilers["tok"].compile, grammar)
            except GrammarError as exc:
                if forced:
                    return invalid(f"invalid field 'tools': a tool's parameters cannot be compiled into a "
                                   f"grammar for the forced call: {exc}", "tools", "invalid_tool_parameters")
                return invalid(f"invalid field 'response_format': the JSON schema cannot be compiled into a "
                               f"grammar: {exc}", "response_format", "invalid_response_format")
        return await _serve(worker, job, tok, request, count, constraint, slot.prefill_client)

    def model_not_found(name: str | None) -> JSONResponse | None:
        if name is None or name in model_names:
            return None
        count("invalid", 404)
        tel.rejections.labels(**tel.l(reason="invalid_request")).inc()
        return error_response(404, f"The model `{name}` does not exist; this worker serves "
                                   f"{slot.model_name!r} (GET /v1/models)",
                              "invalid_request_error", "model_not_found", "model")

    if slot.role == "prefill":
        @app.post(contract.PREFILL_PATH, include_in_schema=False)
        async def prefill(request: Request) -> Response:
            worker = slot.worker
            if worker is None:
                return error_response(503, "the model is loading", "service_unavailable_error", "loading",
                                      headers={"Retry-After": "5"})
            body = await parse(request, PrefillRequest, "prompt_token_ids")
            if isinstance(body, JSONResponse):
                return body
            assert isinstance(body, PrefillRequest)
            try:
                answer = await run_prefill(worker, body, tok.vocab_size, max_len, slot.prefill_timeout_s)
            except Rejected as exc:
                return _prefill_refused(exc, count)
            count("ok", 200)
            return JSONResponse(answer)

    @app.post("/v1/completions", openapi_extra=_openapi(CompletionRequest, slot))
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest, "prompt")
        if isinstance(body, JSONResponse):
            return body
        assert isinstance(body, CompletionRequest)
        if (missing := model_not_found(body.model)) is not None:
            return missing
        try:
            given = prompt_ids(body.prompt, tok.vocab_size)
        except InvalidRequest as exc:
            return invalid(exc.message, exc.param, exc.code)
        prompt = tok.encode(given) if isinstance(given, str) else given
        if len(prompt) + body.max_tokens > max_len:
            return invalid(f"inputs tokens + max_new_tokens must be <= {max_len}. Given: "
                           f"{len(prompt)} inputs tokens and {body.max_tokens} max_new_tokens",
                           "prompt", "context_length_exceeded")
        priority = priority_of(body, request)
        if isinstance(priority, JSONResponse):
            return priority
        echo = (given if isinstance(given, str) else tok.decode(given)) if body.echo else ""
        return await run(_Job(False, prompt, body.max_tokens, body.temperature, body.seed, priority,
                              body.stream, body.include_usage, body.stops, slot.model_name, echo,
                              body.sampling(body.logprobs), constrained(body)), request)

    @app.post("/v1/chat/completions", openapi_extra=_openapi(ChatCompletionRequest, slot))
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest, "messages")
        if isinstance(body, JSONResponse):
            return body
        assert isinstance(body, ChatCompletionRequest)
        if (missing := model_not_found(body.model)) is not None:
            return missing
        if template is None:
            return invalid("this model's tokenizer has no chat template "
                           "(tokenizer_config.json chat_template); use /v1/completions",
                           "messages", "no_chat_template")
        try:
            rendered = template.render(chat_messages(body.messages),
                                       tools=[t.as_template() for t in body.tools] if body.tools else None)
        except InvalidRequest as exc:
            return invalid(exc.message, exc.param, exc.code)
        except ChatTemplateError as exc:
            return invalid(f"the model's chat template refused the conversation: {exc}",
                           "messages", "chat_template_error")
        prompt = tok.encode_chat(rendered)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked or max_len - len(prompt)
        if max_tokens < 1 or len(prompt) + max_tokens > max_len:
            field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            limit = (f"; with {field_name} {asked} it must be <= {max_len - asked} tokens"
                     if asked else f"; it must be <= {max_len - 1} tokens")
            return invalid(f"invalid field 'messages': the conversation is {len(prompt)} tokens "
                           f"once rendered with the chat template, the context is {max_len} "
                           f"tokens{limit}", "messages", "context_length_exceeded")
        priority = priority_of(body, request)
        if isinstance(priority, JSONResponse):
            return priority
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plan = (None if body.tool_mode == "none" else
                ToolPlan(tool_format, tool_marker_ids, tuple(body.forced_tools()), body.parallel_tool_calls is not False))
        return await run(_Job(True, prompt, max_tokens, body.temperature, body.seed, priority,
                              body.stream, body.include_usage, body.stops, slot.model_name,
                              sampling=body.sampling(logprobs), response_format=constrained(body), tools=plan),
                         request)

    return app


def constrained(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
    """The body's ``response_format`` where it constrains the output (not ``text``), OpenAI's shape; else None."""
    rf = body.response_format
    return None if rf is None or rf.type == "text" else rf.as_dict()


def _refused(tel: Telemetry, rej: Rejected, count: Callable[[str, int], None]) -> JSONResponse:
    """A refusal at admission: counted by reason; 429 ``overloaded_error`` or 503 with Retry-After,
    or another 4xx ``invalid_request_error`` without (a request that can never be served here)."""
    tel.rejections.labels(**tel.l(reason=rej.reason)).inc()
    count("rejected", rej.status)
    if rej.status < 500 and rej.status != 429:
        return error_response(rej.status, rej.message, "invalid_request_error", rej.reason)
    return error_response(rej.status, rej.message, "overloaded_error" if rej.status == 429
                          else "service_unavailable_error", rej.reason,
                          headers={"Retry-After": str(rej.retry_after_s)})


def _prefill_refused(exc: Rejected, count: Callable[[str, int], None]) -> JSONResponse:
    """A prefill that did not happen (here, or at the prefill worker) as the client's HTTP error, counted: 429
    and 503 as refused, any other status as an error."""
    count("rejected" if exc.status in (429, 503) else "error", exc.status)
    kind = ("overloaded_error" if exc.status == 429 else "service_unavailable_error" if exc.status >= 500
            else "invalid_request_error")
    return error_response(exc.status, exc.message, kind, exc.reason,
                          headers={"Retry-After": str(exc.retry_after_s)} if exc.status in (429, 503) else None)


def _event_error(event: Event) -> JSONResponse:
    """An ``error`` event as an HTTP error: 503 (with ``Retry-After``) or 500."""
    return error_response(event.status, event.message,
                          "service_unavailable_error" if event.status == 503 else "server_error",
                          event.reason,
                          headers={"Retry-After": "1"} if event.status == 503 else None)


class _Output:
    """Generated ids to output text: incremental detokenization, end of sequence
    and stop strings. :meth:`token` returns ``(text, finish_reason or None)``."""

    def __init__(self, tok: Tokenizer, prompt: Sequence[int], stops: Sequence[str],
                 logprobs: LogprobsBuilder | None = None, tools: ToolPlan | None = None) -> None:
        self._tok = tok
        self._detok = tok.stream_decoder(prompt)
        self._stop = StopMatcher(stops)
        self._eos = tok.eos_ids
        self.tokens = 0
        self.ids: list[int] = []
        self.logprobs = logprobs
        """Where the request asked for log probabilities: its tokens' (:meth:`token` adds them)."""
        self.tools = tools
        self._hold = None if tools is None else tools.content_hold()

    def token(self, token: int, event: Event | None = None) -> tuple[str, str | None]:
        """``event``: the token's event, whose log probabilities are kept where the request asked."""
        if token in self._eos:  # the engine stops on the same ids (Engine.eos_ids) and drops the token
            return self.end(), "stop"
        self.tokens += 1
        self.ids.append(token)
        if self.logprobs is not None and event is not None and event.logprob is not None:
            self.logprobs.add(token, event.logprob, event.top_logprobs)
        text, stopped = self._stop.push(self._detok.push(token))
        if self._hold is not None:
            text = self._hold.push(token, text)
        return text, "stop" if stopped else None

    def end(self) -> str:
        """The held-back text once generation ended."""
        text, stopped = self._stop.push(self._detok.flush())
        text = text if stopped else text + self._stop.flush()
        if self._hold is not None:
            text = self._hold.push(None, text) + self._hold.end()
        return text

    @property
    def calling(self) -> bool:
        """Whether a tool call began (the content after it is held back)."""
        return self._hold is not None and self._hold.calling

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """Once generation ended, OpenAI's ``tool_calls`` of the output, or None where none parses (then the whole
        output is content, :meth:`unparsed`, as vLLM answers)."""
        if self.tools is None or not self.calling:
            return None
        parsed = self.tools.format.parse(self._tok.decode_with_special(self.ids))
        if parsed is None:
            return None
        return [call.as_openai(call_id(self.tools.format.name)) for call in parsed[1]]

    def unparsed(self) -> str:
        """The whole output as content (special tokens skipped), where a call began and did not parse."""
        return self._tok.decode(self.ids)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _serve(worker: Worker, job: _Job, tok: Tokenizer, request: Request,
                 count: Callable[[str, int], None], constraint: Constraint | None = None,
                 prefill: PrefillClient | None = None) -> Response:
    """Run ``job`` on ``worker`` and answer it; with ``prefill`` (a decode worker) its prompt is prefilled by
    a prefill worker first (not a constrained request nor one asking for log probabilities: see
    :mod:`moeguard_runtime.api.pd_routes`)."""
    tel = worker.telemetry
    req_id = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    remote = None
    if prefill is not None and constraint is None and job.sampling.logprobs is None:
        try:
            remote = await prefill.prefill(req_id, job.prompt, job.temperature, job.seed, job.priority)
        except Rejected as exc:
            tel.rejections.labels(**tel.l(reason=exc.reason)).inc()
            return _prefill_refused(exc, count)
    gen = GenerationRequest(req_id, job.prompt, job.max_tokens, job.temperature, job.seed,
                            job.priority, job.sampling, constraint, remote_prefill=remote)
    try:
        worker.submit(gen, sink)
    except Rejected as rej:
        return _refused(tel, rej, count)
    created = int(time.time())
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

    output = _Output(tok, job.prompt, job.stops,
                     None if job.sampling.logprobs is None else LogprobsBuilder(tok.decode, job.chat), job.tools)
    if job.stream:
        # No 200 before admission: a request refused or timed out in the queue gets the
        # same HTTP error (503/429, Retry-After, reason) as without streaming.
        first = await next_event()
        if first is None:
            return Response(status_code=499)
        if first.kind == "error":
            count("error", first.status)
            return _event_error(first)
        return StreamingResponse(
            _stream(worker, job, req_id, queue, created, output, count,
                    first if first.kind != "admitted" else None),
            media_type="text/event-stream")
    texts = [job.echo]
    while True:
        event = await next_event()
        if event is None:
            return Response(status_code=499)
        if event.kind == "admitted":
            continue
        if event.kind == "token":
            text, finish = output.token(event.token, event)
            texts.append(text)
            if finish is None:
                continue
            worker.cancel(req_id)  # ended here (EOS of the tokenizer, a stop string)
            break
        if event.kind == "error":
            count("error", event.status)
            return _event_error(event)
        texts.append(output.end())
        finish = event.finish_reason
        break
    count("ok", 200)
    text = "".join(texts)
    logprobs = None if output.logprobs is None else output.logprobs.take(final=True)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if output.calling:
        calls = output.tool_calls()
        if calls:
            message, finish = {"role": "assistant", "content": text if text.strip() else None,
                               "tool_calls": calls}, "tool_calls"
        else:
            message["content"] = output.unparsed()
    choice: dict[str, Any] = (
        {"index": 0, "message": message, "logprobs": logprobs,
         "finish_reason": finish} if job.chat else
        {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
    return JSONResponse({
        "id": req_id, "object": "chat.completion" if job.chat else "text_completion",
        "created": created, "model": job.model, "choices": [choice],
        "usage": _usage(len(job.prompt), output.tokens)})


def stream_chunk(job: _Job, req_id: str, created: int, text: str | None, finish: str | None,
                 usage: dict[str, int] | None = None, role: bool = False,
                 logprobs: dict[str, Any] | None = None,
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One SSE chunk's JSON body, as OpenAI streams completions (``object`` ``text_completion``) and chat
    completions (``chat.completion.chunk``; ``delta``, the first ``{"role": "assistant", "content": ""}``).
    ``text`` None: a chunk with ``"choices": []`` (the usage chunk). The ``usage`` key is there only when
    the request asked for it (``stream_options.include_usage``), null but on the usage chunk: OpenAI's
    ``ChatCompletionStreamOptions`` ("All other chunks will also include a usage field, but with a null
    value"); without it no chunk has the key (pure). ``tool_calls``: a chat chunk whose delta holds them (OpenAI's
    ``delta.tool_calls``, each with its ``index``), all at once: a call is parsed once generation ended."""
    choices: list[dict[str, Any]] = []
    if tool_calls is not None and job.chat:
        items = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choices = [{"index": 0, "delta": {"tool_calls": items}, "logprobs": logprobs, "finish_reason": finish}]
    elif text is not None and job.chat:
        delta: dict[str, str] = {"role": "assistant", "content": text} if role else (
            {"content": text} if text or finish is None else {})
        choices = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    elif text is not None:
        choices = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    body: dict[str, Any] = {"id": req_id, "created": created, "model": job.model,
                            "object": "chat.completion.chunk" if job.chat else "text_completion",
                            "choices": choices}
    if job.include_usage:
        body["usage"] = usage
    return body


def finish_chunks(job: _Job, req_id: str, created: int, text: str, reason: str,
                  usage: dict[str, int], logprobs: dict[str, Any] | None = None,
                  tool_calls: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chunks that end a stream before ``[DONE]``: the one with ``finish_reason`` (and the last
    text, or the tool calls with ``finish_reason`` ``tool_calls``), then, only when the request asked
    (``stream_options.include_usage``), OpenAI's extra chunk with ``"choices": []`` and ``usage`` (pure).
    Without it no chunk carries usage, as OpenAI streams (a client that reads usage from the finishing
    chunk must ask with ``include_usage: true``)."""
    if tool_calls:  # as OpenAI streams them: the calls' delta, then an empty delta with the finish reason
        last = [*([stream_chunk(job, req_id, created, text, None)] if text else []),
                stream_chunk(job, req_id, created, None, None, logprobs=logprobs, tool_calls=tool_calls),
                stream_chunk(job, req_id, created, "", "tool_calls")]
    else:
        last = [stream_chunk(job, req_id, created, text, reason, logprobs=logprobs)]
    return [*last, stream_chunk(job, req_id, created, None, None, usage)] if job.include_usage else last


async def _stream(worker: Worker, job: _Job, req_id: str, queue: asyncio.Queue[Event],
                  created: int, output: _Output, count: Any,
                  first: Event | None = None) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams completions and chat completions (:func:`stream_chunk`,
    :func:`finish_chunks`), ending with ``data: [DONE]``.

    Started once the request is admitted (``first``: an event already taken off
    the queue, if any). An error after admission (out of memory in a batch)
    can only be an ``error`` event in the stream.
    """
    done = False
    sent = ""
    """The content streamed so far."""

    def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
        nonlocal sent
        sent += text or ""
        logprobs = None if role or output.logprobs is None else output.logprobs.take()
        return f"data: {json.dumps(stream_chunk(job, req_id, created, text, finish, role=role, logprobs=logprobs))}\n\n"

    def finish(text: str, reason: str) -> list[str]:
        count("ok", 200)
        usage = _usage(len(job.prompt), output.tokens)
        logprobs = None if output.logprobs is None else output.logprobs.take()
        calls = output.tool_calls()
        if output.calling and not calls:  # no call parses: the rest of the output is content after all
            whole = output.unparsed()
            text = whole[len(sent):] if whole.startswith(sent) else text
        return [f"data: {json.dumps(c)}\n\n"
                for c in finish_chunks(job, req_id, created, text, reason, usage, logprobs, calls)]

    try:
        if job.chat:
            yield chunk("", None, role=True)
        elif job.echo:
            yield chunk(job.echo, None)
        while True:
            event = first if first is not None else await queue.get()
            first = None
            if event.kind == "admitted":
                continue
            if event.kind == "token":
                text, reason = output.token(event.token, event)
                if reason is not None:
                    done = True
                    worker.cancel(req_id)  # ended here (EOS of the tokenizer, a stop string)
                    for line in finish(text, reason):
                        yield line
                    break
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
                for line in finish(output.end(), event.finish_reason):
                    yield line
            break
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            worker.cancel(req_id)
            count("cancelled", 499)
