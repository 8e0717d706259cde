"""The HTTP side of disaggregated prefill/decode (issue 33).

* A prefill worker answers ``POST contract.PREFILL_PATH`` (:func:`run_prefill`): the prompt runs through its
  own scheduler (budgets, memory admission, queue bounds: its refusals are the answer's status) as a request
  of one new token whose KV is offered at its finish; the answer is the offer.
* A decode worker's :class:`PrefillClient` calls it for each request (the prefill role's Service balances
  the calls across its pods), then submits the request prefilled (:class:`RemotePrefill`): its KV is read at
  admission. An unreachable prefill worker, a timeout, or a refusal ends the client's request with the
  prefill worker's status (429, 503 with ``Retry-After``), never a hang.

Requests with a grammar (structured outputs) or log probabilities are prefilled by the decode worker itself:
the prefill worker's first token would be drawn without the grammar's mask and without the log probabilities.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from moeguard_core import contract
from moeguard_runtime.disagg.nixl_kv import KVOffer
from moeguard_runtime.engine.generation import Event, GenerationRequest, RemotePrefill
from moeguard_runtime.engine.scheduler import Rejected
from moeguard_runtime.engine.service import Worker

PREFILL_UNAVAILABLE = "prefill_unavailable"
"""The ``reason`` of a decode worker's 503 when no prefill worker answered."""


class PrefillRequest(BaseModel):
    """The body of ``POST contract.PREFILL_PATH``."""

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    temperature: float = Field(0.0, ge=0.0)
    seed: int | None = None
    priority: str = "interactive"


async def run_prefill(worker: Worker, body: PrefillRequest, vocab_size: int, max_len: int,
                      timeout_s: float) -> dict[str, Any]:
    """Prefill ``body``'s prompt on ``worker`` and return ``{"offer": ...}`` once its KV is offered.

    Raises:
        Rejected: a prefill that did not happen: a token id outside the vocabulary or a prompt over the context
            (400), the scheduler's refusal (its own), an error event (its status), or no offer within
            ``timeout_s`` (503).
    """
    prompt = body.prompt_token_ids
    if any(not 0 <= t < vocab_size for t in prompt):
        raise Rejected("invalid_request", f"prompt_token_ids must be in [0, {vocab_size})", status=400)
    if len(prompt) + 1 > max_len:
        raise Rejected("context_length_exceeded", f"the prompt must be under {max_len} tokens", status=400)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    req = GenerationRequest(body.request_id, list(prompt), 1, body.temperature, body.seed, body.priority,
                            offer_kv=True)

    def sink(event: Event) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    try:
        worker.submit(req, sink)  # its Rejected is the answer
    except ValueError as exc:  # a priority the scheduler does not know
        raise Rejected("invalid_request", str(exc), status=400) from None
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                event = await events.get()
                if event.kind == "error":
                    raise Rejected(event.reason, event.message, status=event.status)
                if event.kind == "finish":
                    if event.kv_offer is None:
                        raise Rejected("kv_transfer_failed", "the prompt ran but no KV was offered", status=503)
                    return {"offer": dict(event.kv_offer)}
    except TimeoutError:
        worker.cancel(body.request_id)
        raise Rejected("prefill_timeout", f"the prefill took over {timeout_s:g} s", status=503) from None


class PrefillClient:
    """A decode worker's calls to its prefill workers (``base_url``: their Service), each within
    ``timeout_s`` seconds."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.url = base_url.rstrip("/") + contract.PREFILL_PATH
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def prefill(self, req_id: str, prompt: list[int], temperature: float, seed: int | None,
                      priority: str) -> RemotePrefill:
        """The prompt prefilled elsewhere: its first token and KV offer.

        Raises:
            Rejected: the prefill worker refused (its status and reason), or could not be reached or answered
                late (503 ``prefill_unavailable``).
        """
        body = {"request_id": req_id, "prompt_token_ids": prompt, "temperature": temperature, "seed": seed,
                "priority": priority}
        try:
            resp = await self._client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            raise Rejected(PREFILL_UNAVAILABLE,
                           f"no prefill worker answered at {self.url}: {type(exc).__name__}: {exc}"[:500],
                           retry_after_s=2, status=503) from None
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code != 200:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            retry = resp.headers.get("Retry-After", "1")
            raise Rejected(str(err.get("code") or PREFILL_UNAVAILABLE),
                           f"the prefill worker answered {resp.status_code}: {err.get('message', resp.text[:300])}",
                           int(retry) if retry.isdigit() else 1, status=resp.status_code)
        try:
            offer = KVOffer.from_json(data["offer"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Rejected(PREFILL_UNAVAILABLE, f"the prefill worker's answer holds no offer: {exc}",
                           status=503) from None
        return RemotePrefill(offer.first_token, offer)

    async def aclose(self) -> None:
        await self._client.aclose()
