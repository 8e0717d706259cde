"""Log probabilities, penalties, the top-k / top-p / min-p filters and structured outputs over real HTTP, driven by
the official ``openai`` Python SDK with its defaults (a test dependency), streaming and not: the values the worker
returns, and the sampler really applying what was asked (a filter that keeps only the most likely token samples
what greedy decoding does; a penalty breaks the model's greedy loop; a random model's answer parses into the
pydantic model the SDK's ``parse`` was given)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pydantic
import pytest
from tests.integration.worker.conftest import WorkerProcess, start_worker_process

pytestmark = pytest.mark.integration
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """The tiny preset with seed 0: its greedy chat answer is 24 tokens (a loop), not an end of sequence at once
    (seed 3's, the shared fixture's)."""
    w = start_worker_process(tmp_path_factory.mktemp("worker"), {"MOEGUARD_SEED": "0"})
    yield w
    w.stop()


@pytest.fixture(scope="module")
def client(worker: WorkerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="not-checked") as c:
        yield c


def test_chat_logprobs_streamed_and_not_are_the_same_greedy_values(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=HELLO, max_completion_tokens=10, temperature=0, logprobs=True,
                              top_logprobs=3)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens > 0
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        # greedy: the sampled token is the most likely one, with the same value
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = []
    text = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    assert "".join(text) == choice.message.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, content, strict=True))


def test_chat_without_logprobs_has_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert r.usage is not None and len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens > 0
    offset = 0
    for token, value, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True):
        assert at == offset
        offset += len(token)
        assert top[token] == value and len(top) <= 3  # the 2 most likely and the sampled token
        assert value == max(top.values())  # greedy
    streamed: list[str] = []
    for chunk in client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, logprobs=2,
                                           stream=True):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.tokens or []
    assert streamed == lp.tokens


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"])
def test_a_filter_that_keeps_only_the_most_likely_token_samples_greedily(client: openai.OpenAI,
                                                                         extra: dict[str, Any]) -> None:
    greedy = client.completions.create(model="tiny", prompt="The weather today", max_tokens=16, temperature=0)
    sampled = [client.completions.create(model="tiny", prompt="The weather today", max_tokens=16, temperature=1.5,
                                         seed=seed, extra_body=extra) for seed in (1, 2)]
    unfiltered = client.completions.create(model="tiny", prompt="The weather today", max_tokens=16, temperature=1.5,
                                           seed=1)
    assert [s.choices[0].text for s in sampled] == [greedy.choices[0].text] * 2
    assert unfiltered.choices[0].text != greedy.choices[0].text  # temperature 1.5 alone samples something else


@pytest.mark.parametrize("extra", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                   {"extra_body": {"repetition_penalty": 1.8}}],
                         ids=["frequency", "presence", "repetition"])
def test_penalties_reach_the_sampler(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    """Greedy decoding of this model loops (a 7-token cycle); a penalty breaks the loop. That each penalized token
    is the argmax of the penalized logits is checked on token ids in tests/unit/runtime/test_sampling.py."""
    kw: dict[str, Any] = dict(model="tiny", messages=HELLO, max_completion_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    penalized = client.chat.completions.create(**kw, **extra).choices[0].message.content
    assert plain and penalized and penalized != plain
    assert client.chat.completions.create(**kw, **extra).choices[0].message.content == penalized  # deterministic


@pytest.mark.parametrize(("kw", "param", "needle"), [
    ({"top_p": 0}, "top_p", "limit: gt 0.0"),
    ({"extra_body": {"top_k": -2}}, "top_k", "limit: ge -1"),
    ({"extra_body": {"min_p": 1.5}}, "min_p", "limit: le 1.0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "limit: le 2.0"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "limit: gt 0.0"),
    ({"top_logprobs": 3}, "top_logprobs", "only with 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "limit: le 20"),
])
def test_bad_sampling_fields_are_a_400_naming_the_field(client: openai.OpenAI, kw: dict[str, Any], param: str,
                                                        needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=2, **kw)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and needle in error["message"], error


def test_completion_logprobs_with_echo_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="echo") as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=1, echo=True)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "logprobs"


class Answer(pydantic.BaseModel):
    """What the SDK's ``parse`` turns into a strict JSON schema (``additionalProperties`` false, all required)."""

    ok: bool
    digit: int = pydantic.Field(ge=0, le=9)
    color: Literal["red", "green", "blue"]


def test_structured_outputs_through_the_sdks_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """``response_format`` json_schema, as ``client.chat.completions.parse(response_format=Model)`` sends it: the
    random tiny model's answer parses into the model, greedy and sampled, streamed and not."""
    for temperature, seed in ((0.0, None), (1.0, 1), (1.5, 2)):
        r = client.chat.completions.parse(model="tiny", messages=HELLO, max_completion_tokens=64,
                                          temperature=temperature, seed=seed, response_format=Answer)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Answer), choice.message.content
    # pydantic's own schema allows other properties (JSON Schema's default): the SDK's parse adds
    # additionalProperties false, as this does
    strict = {**Answer.model_json_schema(), "additionalProperties": False}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": strict, "strict": True}}
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=HELLO, max_completion_tokens=64, temperature=0, stream=True,
        response_format=schema) if c.choices)  # type: ignore[arg-type]
    assert Answer.model_validate_json(text)


def test_json_object_and_text_formats(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="{", max_tokens=48, temperature=1.0, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=4, temperature=0)
    as_text = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=4, temperature=0,
                                             response_format={"type": "text"})
    assert as_text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("response_format", "param", "needle"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}, "response_format",
     "cannot be compiled into a grammar"),
    ({"type": "json_schema"}, "response_format.json_schema", "required with type json_schema"),
    ({"type": "regex"}, "response_format.type", "must be one of text, json_object, json_schema"),
])
def test_a_bad_response_format_is_a_400_naming_it(client: openai.OpenAI, response_format: dict[str, Any],
                                                  param: str, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=4,
                                       response_format=response_format)  # type: ignore[arg-type]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and needle in error["message"], error


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


CLOCK_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "now", "description": "The time.", "strict": True,
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
                   "additionalProperties": False}}}


def test_a_forced_tool_call_comes_back_parsed_by_the_sdk_streamed_and_not(client: openai.OpenAI) -> None:
    """``tool_choice`` required, as ``client.chat.completions.parse(tools=[pydantic_function_tool(...)])`` sends it
    (strict): the random model's answer is forced into the preset's (hermes) tool-call format, comes back in
    ``message.tool_calls`` with ``finish_reason`` tool_calls, and the SDK parses its arguments into the model; the
    stream's ``delta.tool_calls`` carry the same calls."""
    tools = [openai.pydantic_function_tool(Weather), CLOCK_TOOL]
    for seed in (1, 2, 3):
        r = client.chat.completions.parse(model="tiny", messages=HELLO, max_completion_tokens=300, temperature=1.0,
                                          seed=seed, tools=tools, tool_choice="required")  # type: ignore[arg-type]
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls or []
        assert calls and choice.message.content is None
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            if call.function.name == "Weather":
                assert isinstance(call.function.parsed_arguments, Weather)
            else:
                assert call.function.name == "now" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
        streamed: dict[int, Any] = {}
        finish = None
        for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=300,
                                                    temperature=1.0, seed=seed, tools=tools,  # type: ignore[arg-type]
                                                    tool_choice="required", stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            for item in (delta.tool_calls or []) if delta else []:
                assert item.function is not None
                streamed[item.index] = (item.function.name, json.loads(item.function.arguments or "null"))
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        assert finish == "tool_calls"
        assert [streamed[i] for i in sorted(streamed)] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls]  # the same seed, the same calls


def test_a_named_tool_choice_calls_that_function_once(client: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(Weather), CLOCK_TOOL]
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=200, temperature=1.0,
                                       seed=4, tools=tools, parallel_tool_calls=False,  # type: ignore[arg-type]
                                       tool_choice={"type": "function", "function": {"name": "now"}})
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "now" and json.loads(calls[0].function.arguments)["tz"] in ("UTC", "CET")


def test_a_conversation_with_a_call_and_its_result_renders_and_auto_or_none_answer_in_text(
        client: openai.OpenAI) -> None:
    """The assistant's call and the tool's result go through the chat template (the prompt grows by them); with
    ``tool_choice`` none or auto the random model answers in text, which stays content."""
    history: list[Any] = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    bare = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=8, temperature=0)
    for choice_mode in ("none", "auto"):
        r = client.chat.completions.create(model="tiny", messages=history, max_completion_tokens=8, temperature=0,
                                           tools=[CLOCK_TOOL], tool_choice=choice_mode)  # type: ignore[arg-type]
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
        assert isinstance(r.choices[0].message.content, str)
        assert r.usage is not None and bare.usage is not None
        rendered = '{"type": "function", "function": ' + json.dumps(CLOCK_TOOL["function"]) + "}"
        assert r.usage.prompt_tokens >= bare.usage.prompt_tokens + len(rendered)  # byte tokens: tools and turns


@pytest.mark.parametrize(("kw", "param", "code", "needle"), [
    ({"tool_choice": "required"}, "tool_choice", "tools_missing", "only allowed when 'tools' are given"),
    ({"tools": [CLOCK_TOOL], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
     "unknown_tool", "the function 'fly' is not among the tools (now)"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "wizard"}}}],
      "tool_choice": "required"}, "tools", "invalid_tool_parameters", "Invalid type: wizard"),
    ({"tools": [CLOCK_TOOL], "tool_choice": "always"}, "tool_choice", None,
     "must be one of none, auto, required or a named function"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(client: openai.OpenAI, kw: dict[str, Any], param: str,
                                                    code: str | None, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=4, **kw)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and (code is None or error["code"] == code), error
    assert needle in error["message"], error
