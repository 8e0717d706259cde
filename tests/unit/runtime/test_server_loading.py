"""While the model loads, the app is alive but not ready, and refuses completions with 503."""

from __future__ import annotations

import httpx
import pytest

from moeguard_runtime.api.server import WorkerSlot, create_app
from moeguard_runtime.telemetry.telemetry import Telemetry

pytestmark = pytest.mark.unit


async def test_loading_is_live_not_ready_and_refuses_with_503() -> None:
    """The app called in process (httpx's ASGI transport): no server, no thread."""
    slot = WorkerSlot(Telemetry({"moeis": "s", "namespace": "n", "pod": "p"}, 8), "moeguard-x", 1024)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(slot)),
                                 base_url="http://worker") as client:
        await check_loading(client)


async def check_loading(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).status_code == 200
    r = await client.get("/readyz")
    assert (r.status_code, r.text) == (503, "model is loading")
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"] == {"message": "the model is loading", "type": "service_unavailable_error",
                                 "param": None, "code": "loading"}
    # validation still answers while loading
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2000})
    assert r.status_code == 400 and "<= 1024" in r.json()["error"]["message"]
    assert (await client.get("/v1/models")).json()["data"][0]["max_model_len"] == 1024
    assert (await client.get("/openapi.json")).json()["paths"]["/v1/completions"]["post"][
        "requestBody"]["content"]["application/json"]["schema"]["properties"]["max_tokens"][
        "maximum"] == 1023
