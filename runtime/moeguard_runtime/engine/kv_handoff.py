"""The step loop's side of disaggregated prefill/decode (issue 33): on a decode worker, a request whose
prompt another worker prefilled enters the engine with its KV read at admission; on a prefill worker, a
finished prompt's sequence is offered and held until a decode worker has read it, or its lease runs out.

The read is synchronous, in the engine thread, within ``timeout_s`` (the worker's
``MOEGUARD_KV_TRANSFER_TIMEOUT_SECONDS``): a step that admits a prefilled request waits for its KV, as a
local prefill would run its prompt there. vLLM's NIXL connector reads asynchronously and admits the request
once its KV has landed; on the 2-core machine of the benchmarks a read of a prompt's KV takes milliseconds
(``make bench-pd``), so the simpler form is kept until a measurement says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.generation import GenerationRequest
from moeguard_runtime.engine.kv_port import KVPort

KV_TRANSFER_REASON = "kv_transfer_failed"
"""The ``reason`` of a 503 for a request whose KV could not be read (or offered)."""
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_LEASE_S = 30.0
"""Seconds a prefill worker holds an offered KV that no decode worker reads (the decode worker died, or gave
up on its deadline) before it drops it."""


@dataclass
class KVHandoff:
    """``port``: the transport; ``timeout_s``: a read's deadline; ``lease_s``: how long an offer is held."""

    port: KVPort
    timeout_s: float = DEFAULT_TIMEOUT_S
    lease_s: float = DEFAULT_LEASE_S
    offered: dict[str, float] = field(default_factory=dict)
    """Offered request ids and when they were offered (clock seconds)."""
    transfer_seconds: list[float] = field(default_factory=list)
    """Seconds of each read since the last :meth:`take_transfers` (the worker's histogram)."""
    transfer_bytes: int = 0
    """Bytes read since the last :meth:`take_transfers` (the worker's counter)."""

    def receive(self, engine: Engine, req_id: str, request: GenerationRequest) -> str | None:
        """Register ``request`` (a :class:`RemotePrefill`'s) in ``engine`` and read its KV; None when done, else
        the reason it failed (the sequence is released)."""
        remote = request.remote_prefill
        assert remote is not None
        seq = engine.add_prefilled(req_id, request.prompt, request.max_new_tokens, remote.first_token,
                                   request.temperature, request.seed, request.sampling, request.constraint)
        try:
            self.transfer_seconds.append(self.port.pull(remote.offer, seq.cache, self.timeout_s))
        except Exception as exc:  # the transport's errors, a timeout or a refused offer: a 503 for this request
            engine.release(req_id)
            return f"reading the prompt's KV from the prefill worker failed: {exc}"[:500]
        n = len(request.prompt)  # the prompt's positions: the second-to-last dimension of k and v (KVCache)
        self.transfer_bytes += sum(t[..., :n, :].numel() * t.element_size() for t in (seq.cache.k, seq.cache.v))
        return None

    def offer(self, engine: Engine, req_id: str, now: float) -> Mapping[str, Any] | str:
        """Offer a finished prompt's KV (its sequence stays in ``engine``); the offer, or why it failed (the
        sequence is then the caller's to release)."""
        seq = engine.sequences[req_id]
        try:
            offer = self.port.offer_json(req_id, seq.cache, len(seq.prompt), seq.generated[0])
        except Exception as exc:
            return f"offering the prompt's KV failed: {exc}"[:500]
        self.offered[req_id] = now
        return offer

    def settle(self, engine: Engine, now: float) -> tuple[list[str], list[str]]:
        """Release the offered sequences read since the last call, and those whose lease ran out; returns
        ``(read, expired)`` ids."""
        read = [r for r in self.port.completed() if r in self.offered]
        expired = [r for r, at in self.offered.items() if now - at > self.lease_s and r not in read]
        for req_id in (*read, *expired):
            self.offered.pop(req_id, None)
            self.port.release(req_id)
            engine.release(req_id)
        return read, expired

    def take_transfers(self) -> tuple[list[float], int]:
        """The reads' seconds and bytes since the last call."""
        out, self.transfer_seconds = self.transfer_seconds, []
        nbytes, self.transfer_bytes = self.transfer_bytes, 0
        return out, nbytes
