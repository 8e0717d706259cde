"""Generated ids to response text: end of sequence, stop strings, held-back bytes; the stream's
chunks (usage only when asked for); and the chat endpoint while the model loads."""

from __future__ import annotations

import httpx
import pytest

from moeguard_runtime.api import tokenizer
from moeguard_runtime.api.server import (
    WorkerSlot,
    _Job,
    _Output,
    create_app,
    finish_chunks,
    stream_chunk,
)
from moeguard_runtime.telemetry.telemetry import Telemetry

pytestmark = pytest.mark.unit


def run(ids: list[int], stops: list[str]) -> tuple[str, str | None]:
    out = _Output(tokenizer.ByteTokenizer(), [tokenizer.BOS], stops)
    texts = []
    for i in ids:
        text, finish = out.token(i)
        texts.append(text)
        if finish is not None:
            return "".join(texts), finish
    return "".join(texts) + out.end(), None


def test_eos_ends_with_stop_and_flushes_held_text() -> None:
    euro = list("€".encode())
    assert run([*b"ab", *euro[:2], tokenizer.EOS, *b"zz"], []) == ("ab\ufffd", "stop")
    assert run([*b"ab", *euro], []) == ("ab€", None)


def test_stop_string_is_cut_and_a_partial_match_released_at_the_end() -> None:
    assert run(list(b"hello world"), ["lo w"]) == ("hel", "stop")
    assert run(list(b"hello wo"), ["world"]) == ("hello wo", None)  # held "wo" released
    assert run(list("café!".encode()), ["é"]) == ("caf", "stop")


async def test_chat_while_loading_validates_then_answers_503() -> None:
    slot = WorkerSlot(Telemetry({"moeis": "s", "namespace": "n", "pod": "p"}, 8), "tiny", 1024,
                      model_aliases=("moeguard-tiny",))
    hello = [{"role": "user", "content": "hi"}]
    # the app in-process through httpx's ASGI transport: no server thread
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(slot)),
                                 base_url="http://worker") as client:
        r = await client.post("/v1/chat/completions", json={"messages": hello})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
        r = await client.post("/v1/chat/completions", json={"model": "other", "messages": hello})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        model = (await client.get("/v1/models")).json()["data"][0]
    assert model == {"id": "tiny", "object": "model", "created": 0, "owned_by": "moeguard",
                     "max_model_len": 1024, "model_type": "mixtral", "aliases": ["moeguard-tiny"]}


def job(chat: bool, include_usage: bool) -> _Job:
    return _Job(chat, [1, 2, 3], 4, 0.0, None, "interactive", True, include_usage, [], "tiny")


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_that_did_not_ask_for_usage_carries_none(chat: bool) -> None:
    """OpenAI sends usage in a stream only with ``stream_options.include_usage: true``: without it
    (absent, ``{}`` or false: all read as False) neither the finishing chunk nor any other has the key."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunks = [stream_chunk(job(chat, False), "id-1", 5, "", None, role=chat),
              stream_chunk(job(chat, False), "id-1", 5, "ab", None),
              *finish_chunks(job(chat, False), "id-1", 5, "c", "length", usage)]
    assert [("usage" in c) for c in chunks] == [False, False, False]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks[-1]["choices"]) == 1


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_that_asked_for_usage_ends_with_an_extra_usage_chunk(chat: bool) -> None:
    """With ``include_usage: true``: every chunk has ``"usage": null`` but an extra last one with
    ``"choices": []`` and the counts (OpenAI's ``ChatCompletionStreamOptions``)."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    token = stream_chunk(job(chat, True), "id-1", 5, "ab", None)
    last, extra = finish_chunks(job(chat, True), "id-1", 5, "c", "stop", usage)
    assert token["usage"] is None and last["usage"] is None
    assert last["choices"][0]["finish_reason"] == "stop"
    assert extra["choices"] == [] and extra["usage"] == usage
    assert extra["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert (extra["id"], extra["created"], extra["model"]) == ("id-1", 5, "tiny")
