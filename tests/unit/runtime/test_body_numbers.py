"""Every number a request body can hold, anywhere, is answered in OpenAI's error shape or
served: never a 500 (the app in process, while the model loads: a valid body gets 503 ``loading``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.unit.runtime.test_service import LABELS

from moeguard_runtime.api.server import WorkerSlot, create_app
from moeguard_runtime.api.tokenizer import ByteTokenizer
from moeguard_runtime.telemetry.telemetry import Telemetry

pytestmark = pytest.mark.unit

NUMBERS = st.one_of(
    st.integers(min_value=4290, max_value=4310).map(lambda n: "9" * n),  # around Python's 4,300-digit limit
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0", "5e0", "1.8e308"]),
)
NOT_JSON_NUMBERS = ("NaN", "Infinity", "1e999")


def call(body: str) -> httpx.Response:
    slot = WorkerSlot(Telemetry(LABELS, 8), "tiny", 1024)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(slot)),
                                     base_url="http://worker") as client:
            return await client.post("/v1/completions", content=body,
                                     headers={"content-type": "application/json"})

    return asyncio.run(post())


@given(prompt=st.one_of(NUMBERS.map(lambda n: f"[{n}]"), st.just('"hi"')), max_tokens=NUMBERS,
       seed=st.one_of(NUMBERS, st.just("null")), temperature=NUMBERS)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_number_in_any_field_is_a_400_or_served(prompt: str, max_tokens: str, seed: str,
                                                    temperature: str) -> None:
    body = f'{{"prompt": {prompt}, "max_tokens": {max_tokens}, "seed": {seed}, "temperature": {temperature}}}'
    r = call(body)
    assert r.status_code in (400, 503), (body[:200], r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if r.status_code == 400 else "service_unavailable_error")
    if any(n in body for n in NOT_JSON_NUMBERS) or "9" * 4301 in body:
        assert r.status_code == 400 and "not valid JSON for this API" in err["message"]


class _BrokenTokenizer(ByteTokenizer):
    def encode(self, text: str) -> list[int]:
        raise RuntimeError("a bug")


async def test_an_unhandled_error_is_a_500_in_openai_shape_not_text() -> None:
    slot = WorkerSlot(Telemetry(LABELS, 8), "tiny", 1024, tokenizer=_BrokenTokenizer())
    transport = httpx.ASGITransport(app=create_app(slot), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"] == {"message": "POST /v1/completions: internal error RuntimeError",
                                 "type": "server_error", "param": None, "code": "internal_error"}
