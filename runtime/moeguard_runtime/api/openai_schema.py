"""Request bodies of the OpenAI-compatible endpoints, and the checks pydantic cannot say well.

Types are strict, as JSON Schema states them: ``"5"`` and ``true`` are not
integers, while ``5.0`` is (JSON Schema's integers include numbers with a zero
fraction); ``"1"`` is not a number. Fields of OpenAI's API that the worker does
not implement are refused by name, never silently ignored: unknown ones by
``extra="forbid"``, ``n``/``best_of`` above 1 by their bounds, and the
combinations it does not serve by :func:`refused_fields`.

The sampling fields are vLLM's, with its ranges (:mod:`moeguard_runtime.engine.sampling`):
``top_p`` in (0, 1], ``top_k`` (0 or -1: off), ``min_p`` in [0, 1], ``presence_penalty``
and ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` > 0.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moeguard_runtime.engine.sampling import MAX_LOGPROBS, SamplingParams
from moeguard_runtime.engine.scheduler import (
    MAX_PRIORITY,
    PRIORITY_HELP,
    PRIORITY_NAMES,
    priority_class,
)

MAX_TOKENS_LIMIT = 1_048_576
MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop``."""
CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat message may have (``tool``: a tool's result, answering an assistant's ``tool_calls``)."""
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
"""OpenAI's limit on ``tools``."""
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for a function's name."""


class InvalidRequest(ValueError):
    """A 400: ``message`` names the field and the limit; ``param`` is the field."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` adds a last chunk with ``usage``
    (and ``"choices": []``) before ``[DONE]``. Other keys are refused."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(default=False, strict=True)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class JsonSchemaFormat(BaseModel):
    """OpenAI ``response_format.json_schema``: ``schema`` constrains the output (``strict`` is accepted either way:
    the grammar always enforces the schema, as vLLM does)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64, strict=True)
    description: str | None = Field(default=None, strict=True)
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema object.")
    strict: bool | None = Field(default=None, strict=True)


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: ``text`` (the default), ``json_object`` (any JSON object) or ``json_schema``
    (structured outputs: the output follows ``json_schema.schema``), by constrained decoding
    (:mod:`moeguard_runtime.engine.grammar`)."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(strict=True, json_schema_extra={"enum": list(RESPONSE_FORMATS)})
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's own shape (``json_schema.schema`` under that name)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class FunctionDefinition(BaseModel):
    """OpenAI ``tools[].function``: ``parameters`` is a JSON Schema object (absent: no parameters); ``strict`` is
    accepted either way (a forced call always follows the schema, as vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME, strict=True)
    description: str | None = Field(default=None, strict=True)
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON Schema object.")
    strict: bool | None = Field(default=None, strict=True)


class ToolDefinition(BaseModel):
    """OpenAI ``tools[]``: a function the model may call."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(strict=True, pattern="^function$", json_schema_extra={"enum": ["function"]})
    function: FunctionDefinition

    def as_template(self) -> dict[str, Any]:
        """The tool as chat templates read it (transformers' ``tools``): OpenAI's own shape."""
        return self.model_dump(exclude_none=True)


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(strict=True)


class NamedToolChoice(BaseModel):
    """OpenAI ``tool_choice`` naming one function: the model must call it."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(strict=True, pattern="^function$", json_schema_extra={"enum": ["function"]})
    function: NamedFunction


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256, strict=True,
                              description="The served model's name (GET /v1/models) or an alias; "
                                          "another name is a 404 model_not_found.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy.")
    seed: int | None = Field(default=None, ge=0, le=MAX_PRIORITY, description="Up to 2**53 - 1 (I-JSON's exact range).")
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = Field(
        default=None, description="OpenAI's stream options; only with stream: true.")
    stop: str | list[str] | None = Field(
        default=None, description=f"Up to {MAX_STOP_STRINGS} strings; generation ends before "
                                  "the first one, which is not returned (finish_reason stop).")
    n: int = Field(default=1, ge=1, le=1, description="Only 1 is supported.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0,
                         description="Nucleus sampling: the smallest set of most likely tokens whose probability "
                                     "adds up to top_p; 1 keeps every token.")
    top_k: int = Field(default=0, ge=-1, description="The most likely tokens kept (vLLM's); 0 or -1 keeps every token.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0,
                         description="Tokens below min_p x the most likely token's probability are removed (vLLM's).")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                     description="Subtracted from a token's logit once per time it was generated.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                    description="Subtracted from a token's logit if it was generated at all.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description=(
        "vLLM's (CTRL's): logits of tokens in the prompt or the output are divided by it (positive) or "
        "multiplied (negative); 1 is none."))
    user: str | None = Field(default=None, max_length=256, strict=True)
    response_format: ResponseFormat | None = Field(
        default=None, description="text (the default), json_object or json_schema (structured outputs).")
    priority: str | int | None = Field(
        default=None, description=f"The request's class, {PRIORITY_HELP}; default interactive "
                                  "(or the X-Priority header). Interactive requests go first in every mode.",
        json_schema_extra={"anyOf": [{"enum": list(PRIORITY_NAMES)},
                                     {"type": "integer", "minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY},
                                     {"type": "null"}]})

    @field_validator("priority", mode="before")
    @classmethod
    def _priority_class(cls, value: Any) -> Any:
        """The class name (:func:`scheduler.priority_class`) of one of :data:`scheduler.PRIORITY_NAMES` or
        an integer within :data:`scheduler.MAX_PRIORITY` (5.0 is an integer, as in JSON Schema)."""
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_PRIORITY:
            value = int(value)
        if isinstance(value, str) and value in PRIORITY_NAMES:
            return priority_class(value)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_PRIORITY:
            return priority_class(value)
        raise ValueError(f"must be {PRIORITY_HELP}")

    @field_validator("temperature", "seed", "n", "top_p", "top_k", "min_p", "frequency_penalty",
                     "presence_penalty", "repetition_penalty", mode="before", check_fields=False)
    @classmethod
    def _numbers_only(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):
            raise ValueError(f"Input should be a JSON number, not {type(value).__name__}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, given {len(value)}")
        return value

    @property
    def stops(self) -> list[str]:
        """``stop`` as a list (empty strings dropped)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, logprobs: int | None) -> SamplingParams:
        """The request's :class:`SamplingParams`, with ``logprobs`` alternatives (None: no log probabilities)."""
        return SamplingParams(top_p=self.top_p, top_k=max(0, self.top_k), min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logprobs=logprobs)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """The body of ``POST /v1/completions``.

    ``prompt``: a string, token ids, or a list of one of them (one prompt per
    request: a list of several is refused, as ``n`` > 1 is). Token ids are used
    as given (no BOS added). ``echo`` prepends the prompt's text to the output.
    """

    prompt: Prompt = Field(description="Text or token ids to complete; exactly one prompt.")
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT,
                            description="Tokens to generate; prompt tokens + max_tokens must fit "
                                        "the model's context (GET /v1/models max_model_len).")
    echo: bool = Field(default=False, strict=True, description="Return the prompt before the completion.")
    best_of: int | None = Field(default=None, ge=1, le=1, description="Only 1 is supported.")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description=(
        "Return the log probability of each generated token and of the this-many most likely tokens at its "
        "position (choices[].logprobs); null returns none. Not with echo."))

    @field_validator("max_tokens", "best_of", "logprobs", mode="before")
    @classmethod
    def _ints_only(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):
            raise ValueError(f"Input should be a JSON number, not {type(value).__name__}")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        """One of the four forms; token ids as JSON Schema integers (``5.0`` is one)."""
        def ids(v: Any) -> list[int] | None:
            if not isinstance(v, list) or not all(
                    (isinstance(i, int) and not isinstance(i, bool))
                    or (isinstance(i, float) and i.is_integer()) for i in v):
                return None
            return [int(i) for i in v]

        if isinstance(value, str):
            return value
        if (as_ids := ids(value)) is not None:
            return as_ids
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        lists = [ids(v) for v in value] if isinstance(value, list) else [None]
        if all(v is not None for v in lists):
            return lists
        raise ValueError("Input should be a string, a list of strings, a list of token ids "
                         "or a list of token-id lists")


class ChatCompletionRequest(_Sampling):
    """The body of ``POST /v1/chat/completions``.

    ``messages`` are checked by :func:`chat_messages` (roles, content types);
    ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens`` (give at
    most one). Without either, generation may fill the context.
    """

    messages: list[Any] = Field(description="The conversation: objects with role and content.")
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = Field(default=None, strict=True, description=(
        "Return the log probability of each generated token (choices[].logprobs.content)."))
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS, description=(
        "Functions the model may call, rendered through the model's chat template; calls come back in "
        "message.tool_calls (finish_reason tool_calls)."))
    tool_choice: str | NamedToolChoice | None = Field(default=None, description=(
        "none: no call; auto (the default with tools): the model chooses; required: at least one call; "
        "{\"type\": \"function\", \"function\": {\"name\": ...}}: that function. required and a named function "
        "are enforced by constrained decoding."), json_schema_extra={"anyOf": [
            {"enum": list(TOOL_CHOICES)}, {"type": "object", "additionalProperties": False,
                                           "required": ["type", "function"],
                                           "properties": {"type": {"const": "function"},
                                                          "function": {"type": "object", "additionalProperties": False,
                                                                       "required": ["name"],
                                                                       "properties": {"name": {"type": "string"}}}}},
            {"type": "null"}]})
    parallel_tool_calls: bool | None = Field(default=None, strict=True, description=(
        "Whether a forced answer may hold several calls (default true)."))
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description=(
        "With logprobs: also the this-many most likely tokens at each position."))

    @field_validator("max_tokens", "max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _ints_only(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):
            raise ValueError(f"Input should be a JSON number, not {type(value).__name__}")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in TOOL_CHOICES:
            raise ValueError(f"must be one of {', '.join(TOOL_CHOICES)} or a named function; given: {value!r}")
        return value

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (OpenAI's default: ``auto`` with tools, else ``none``)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def forced_tools(self) -> list[dict[str, Any]]:
        """The tools a forced call may name (``{"name", "parameters"}``): all for ``required``, the named one for a
        named choice, none otherwise."""
        tools = [t.function.model_dump(exclude_none=True) for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["name"] == self.tool_choice.function.name]
        return tools if self.tool_choice == "required" else []


def refused_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse fields OpenAI has and the worker does not implement.

    Raises:
        InvalidRequest: naming the field (``logprobs`` with ``echo``: the prompt's log
            probabilities are not computed; ``top_logprobs`` without ``logprobs: true``;
            ``stream_options`` without ``stream``; both max token fields).
    """
    if (rf := body.response_format) is not None:
        if rf.type not in RESPONSE_FORMATS:
            raise InvalidRequest(f"invalid field 'response_format.type': must be one of "
                                 f"{', '.join(RESPONSE_FORMATS)}; given: {rf.type!r}", "response_format.type")
        if (rf.type == "json_schema") != (rf.json_schema is not None):
            raise InvalidRequest("invalid field 'response_format.json_schema': required with type json_schema "
                                 f"and only with it; given: type {rf.type!r}", "response_format.json_schema",
                                 "response_format_mismatch")
    if isinstance(body, CompletionRequest) and body.logprobs is not None and body.echo:
        raise InvalidRequest("invalid field 'logprobs': with echo it would need the prompt's log "
                             "probabilities, which this worker does not compute; use one of them",
                             "logprobs", "unsupported_field")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("invalid field 'top_logprobs': only with 'logprobs': true (OpenAI's "
                                 f"rule); given: top_logprobs {body.top_logprobs}, logprobs "
                                 f"{json.dumps(body.logprobs)}", "top_logprobs", "top_logprobs_without_logprobs")
        _refused_tools(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise InvalidRequest("give 'max_completion_tokens' or its older name 'max_tokens', "
                                 "not both", "max_completion_tokens", "conflicting_fields")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("invalid field 'stream_options': only allowed when 'stream' is "
                             "true; given: stream false", "stream_options",
                             "stream_options_without_stream")


def _refused_tools(body: ChatCompletionRequest) -> None:
    """OpenAI's rules on ``tools`` and ``tool_choice``.

    Raises:
        InvalidRequest: ``tool_choice`` or ``parallel_tool_calls`` without tools, two tools of one name, a named
            choice that is not among the tools, a forced call with a constraining ``response_format``.
    """
    if not body.tools:
        for name, value in (("tool_choice", body.tool_choice), ("parallel_tool_calls", body.parallel_tool_calls)):
            if value is not None:
                raise InvalidRequest(f"invalid field '{name}': only allowed when 'tools' are given (OpenAI's "
                                     "rule)", name, "tools_missing")
        return
    names = [t.function.name for t in body.tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequest(f"invalid field 'tools': function names must be unique; given twice: {twice[0]!r}",
                             "tools", "duplicate_tool_name")
    if isinstance(body.tool_choice, NamedToolChoice) and body.tool_choice.function.name not in names:
        raise InvalidRequest(f"invalid field 'tool_choice': the function {body.tool_choice.function.name!r} is "
                             f"not among the tools ({', '.join(names)})", "tool_choice", "unknown_tool")
    rf = body.response_format
    if body.tool_mode in ("required", "named") and rf is not None and rf.type != "text":
        raise InvalidRequest(f"invalid field 'response_format': a forced tool call (tool_choice "
                             f"{body.tool_mode}) sets the output's grammar; {rf.type} would set another",
                             "response_format", "conflicting_fields")


def prompt_ids(prompt: Prompt, vocab_size: int) -> list[int] | str:
    """The one prompt of ``prompt``: its text (str) or its token ids (list).

    Raises:
        InvalidRequest: empty prompt, several prompts, or an id outside
            ``[0, vocab_size)`` (naming ``prompt`` and the limit).
    """
    value: Any = prompt
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise InvalidRequest(f"invalid field 'prompt': {len(value)} prompts in one request; "
                                 f"only one is supported (limit: 1 prompt, as n <= 1)", "prompt")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("invalid field 'prompt': the prompt must not be empty; given: \"\"",
                                 "prompt")
        return value
    if not value:
        raise InvalidRequest("invalid field 'prompt': the prompt must not be empty; given: []",
                             "prompt")
    bad = next((i for i in value if not 0 <= i < vocab_size), None)
    if bad is not None:
        shown = str(bad) if len(str(bad)) <= 40 else f"{str(bad)[:20]}...({len(str(bad))} digits)"
        raise InvalidRequest(f"invalid field 'prompt': token id {shown} is outside the vocabulary "
                             f"(limit: 0 <= id < {vocab_size})", "prompt")
    return list(value)


_REFUSED_PARTS = {"image_url": "images", "image": "images", "input_image": "images",
                  "input_audio": "audio", "audio": "audio", "file": "files", "video": "video"}


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """``messages`` as the chat template reads them: ``{"role", "content"[, "name"]}`` with ``content`` a string
    (text parts joined by newlines, as vLLM does); an assistant's ``tool_calls`` with each ``function.arguments``
    parsed into an object (templates render it with ``tojson``, as transformers documents; vLLM parses it too),
    a ``tool`` message's ``tool_call_id``.

    Raises:
        InvalidRequest: no message, a message that is not an object, an unknown
            role, an unknown key, content of the wrong type (images, audio and
            files are refused by name), a malformed tool call or a tool message
            without ``tool_call_id``; ``param`` is the field, e.g. ``messages.1.role``.
    """
    if not messages:
        raise InvalidRequest("invalid field 'messages': at least one message is required "
                             "(limit: min_length 1); given: []", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise InvalidRequest(f"invalid field '{where}': a message must be an object with role "
                                 f"and content; given a {type(message).__name__}", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"invalid field '{where}.role': must be one of "
                                 f"{', '.join(CHAT_ROLES)}; given: {role!r}", f"{where}.role")
        allowed = {"role", "content", "name"} | _ROLE_KEYS.get(role, set())
        extra = sorted(set(message) - allowed)
        if extra:
            raise InvalidRequest(f"unknown field '{where}.{extra[0]}': {role} messages hold "
                                 f"{', '.join(sorted(allowed))}", f"{where}.{extra[0]}")
        calls = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else []
        content = message.get("content")
        entry: dict[str, Any] = {"role": role, "content": "" if content is None and calls else
                                 _content(content, f"{where}.content")}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str):
                raise InvalidRequest(f"invalid field '{where}.tool_call_id': a tool message answers one call "
                                     "and names its id (a string)", f"{where}.tool_call_id")
            entry["tool_call_id"] = tool_call_id
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"invalid field '{where}.name': must be a string; given: "
                                     f"{type(name).__name__}", f"{where}.name")
            entry["name"] = name
        out.append(entry)
    return out


_ROLE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, each ``{"id", "type": "function", "function": {"name", "arguments"}}``
    with ``arguments`` parsed from its JSON text.

    Raises:
        InvalidRequest: naming the call's field.
    """
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise InvalidRequest(f"invalid field '{where}': must be a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.{j}"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or call.get("type", "function") != "function"
                or not isinstance(call.get("id"), str) or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)
                or set(call) - {"id", "type", "function"} or set(function) - {"name", "arguments"}):
            raise InvalidRequest(f"invalid field '{at}': a tool call is {{\"id\": <string>, \"type\": \"function\", "
                                 f"\"function\": {{\"name\": <string>, \"arguments\": <JSON text>}}}}; given: "
                                 f"{str(call)[:100]}", at)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"invalid field '{at}.function.arguments': must be the JSON text of an object; "
                                 f"given: {function['arguments'][:100]!r}", f"{at}.function.arguments",
                                 "invalid_tool_arguments")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        given = "null" if content is None else type(content).__name__
        raise InvalidRequest(f"invalid field '{where}': must be a string or a list of text parts "
                             f"({{\"type\": \"text\", \"text\": ...}}); given: {given}", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _REFUSED_PARTS:
            raise InvalidRequest(f"invalid field '{at}.type': {_REFUSED_PARTS[kind]} are not "
                                 f"supported, this model reads text only; given: {kind!r}",
                                 f"{at}.type", "unsupported_content")
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise InvalidRequest(f"invalid field '{at}': a content part must be "
                                 f"{{\"type\": \"text\", \"text\": <string>}}; given: "
                                 f"{str(part)[:100]}", at)
        texts.append(part["text"])
    return "\n".join(texts)


_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "additionalProperties": False, "required": ["id", "function"],
              "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                             "function": {"type": "object", "additionalProperties": False,
                                          "required": ["name", "arguments"],
                                          "properties": {"name": {"type": "string"},
                                                         "arguments": {"type": "string"}}}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}


def _message(role: str, required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["role", *required],
            "properties": {"role": {"const": role}, "name": {"type": "string"}, **props}}


MESSAGES_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 1, "items": {"anyOf": [
        _message("system", ["content"], content=_CONTENT),
        _message("user", ["content"], content=_CONTENT),
        _message("assistant", ["content"], content=_CONTENT,
                 tool_calls={"type": "array", "items": _TOOL_CALL}),
        _message("assistant", ["tool_calls"], content={"anyOf": [*_CONTENT["anyOf"], {"type": "null"}]},
                 tool_calls={"type": "array", "minItems": 1, "items": _TOOL_CALL}),
        _message("tool", ["content", "tool_call_id"], content=_CONTENT, tool_call_id={"type": "string"}),
    ]}}
"""What :func:`chat_messages` accepts, for the OpenAPI document."""


def prompt_schema(vocab_size: int) -> dict[str, Any]:
    """What :func:`prompt_ids` accepts, for the OpenAPI document."""
    ids = {"type": "array", "minItems": 1,
           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    text = {"type": "string", "minLength": 1}
    return {"description": "One prompt: text, token ids, or a list holding one of them.",
            "anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
                      {"type": "array", "minItems": 1, "maxItems": 1, "items": ids}]}
