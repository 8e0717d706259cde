"""What a generation request is, and what its sink receives (the worker's I/O types)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from moeguard_runtime.engine.grammar import Constraint
from moeguard_runtime.engine.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class RemotePrefill:
    """A prompt another worker prefilled (disaggregated prefill/decode, issue 33): the token it sampled and
    its offer of the prompt's KV (:class:`moeguard_runtime.disagg.nixl_kv.KVOffer`, opaque to the engine:
    the worker's :class:`moeguard_runtime.engine.kv_port.KVPort` reads it)."""

    first_token: int
    offer: Any


@dataclass(frozen=True)
class GenerationRequest:
    """One request: ``prompt`` token ids, at most ``max_new_tokens`` more; ``temperature``
    0 is greedy; ``seed`` None draws a fresh one (see :meth:`engine.Engine.add`);
    ``sampling``: penalties, filters and log probabilities (:mod:`sampling`); ``constraint``:
    the request's grammar (:mod:`grammar`, structured outputs), None for free text."""

    req_id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    priority: str = "interactive"
    sampling: SamplingParams = GREEDY
    constraint: Constraint | None = None
    remote_prefill: RemotePrefill | None = None
    """Set on a decode worker: the prompt was prefilled elsewhere, its KV is read at admission."""
    offer_kv: bool = False
    """Set on a prefill worker: at its finish the sequence's KV is offered (the ``finish`` event's
    ``kv_offer``) and held until a decode worker has read it."""


@dataclass(frozen=True)
class Event:
    """What a request's sink receives: ``admitted`` once, when the request leaves the
    queue for a batch (its KV cache allocated, just before its first step), then
    tokens, then one ``finish`` or ``error``. A request refused or timed out in
    the queue, or whose KV cache cannot be allocated, receives only ``error``, so
    a streaming response can still answer with an HTTP error status."""

    kind: Literal["admitted", "token", "finish", "error"]
    token: int = -1
    logprob: float | None = None
    """A ``token`` event's log probability, where the request asked (``SamplingParams.logprobs``)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """With ``logprob``: the most likely tokens' ``(id, logprob)`` at that position, most likely first."""
    finish_reason: str = ""
    kv_offer: Mapping[str, Any] | None = None
    """A ``finish`` event of an ``offer_kv`` request: the offer (JSON) a decode worker reads the KV with."""
    status: int = 200
    reason: str = ""
    message: str = ""


Sink = Callable[[Event], None]
