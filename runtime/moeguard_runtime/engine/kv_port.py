"""What the step loop needs of a KV transport (disaggregated prefill/decode, issue 33), so that the engine
layer does not import one: :class:`moeguard_runtime.disagg.nixl_kv.NixlKV` implements it over NIXL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from moeguard_runtime.model.model import KVCache


class KVPort(Protocol):
    """The prefill side offers a finished prompt's cache and learns when it was read; the decode side reads
    an offer into its own cache."""

    def offer_json(self, req_id: str, cache: KVCache, tokens: int, first_token: int) -> Mapping[str, Any]:
        """Register ``cache``'s first ``tokens`` positions for a decode worker to read; the offer as JSON."""
        ...

    def completed(self) -> list[str]:
        """Offered request ids read since the last call."""
        ...

    def release(self, req_id: str) -> bool:
        """Drop an offered cache's registration."""
        ...

    def pull(self, offer: Any, cache: KVCache, timeout_s: float) -> float:
        """Read ``offer`` into ``cache`` within ``timeout_s``; seconds taken. Raises on failure or timeout."""
        ...
