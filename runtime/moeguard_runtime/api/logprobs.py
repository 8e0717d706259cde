"""Log probabilities in OpenAI's two response shapes, from the worker's ``token`` events (pure).

* Chat completions (``logprobs: true``, ``top_logprobs`` k): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}], "refusal": null}``.
* Completions (``logprobs`` k, the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
  each ``top_logprobs`` entry maps the k most likely tokens' text, and the sampled token's, to their log
  probabilities ("up to logprobs+1 elements", OpenAI's API reference); ``text_offset`` is each token's character
  offset in the completion's text.

A token's text is its own decoding (``tokenizer.decode([id])``), as vLLM returns it: a token that ends inside a
UTF-8 character decodes to U+FFFD, and ``bytes`` are that text's UTF-8 bytes. Values are the model's log
probabilities (:mod:`moeguard_runtime.engine.sampling`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LogprobsBuilder:
    """Collects the log probabilities of one response's tokens; :meth:`take` returns those not yet sent (for
    a stream's next chunk), :meth:`take` at the end of a non-streamed response returns all of them.

    ``decode``: the tokenizer's ``decode``; ``chat``: the chat shape, else the completions shape."""

    decode: Callable[[Sequence[int]], str]
    chat: bool
    _pending: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    _offset: int = 0

    def add(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> None:
        """One generated token: its id, log probability and the most likely ``(id, logprob)`` at its position."""
        self._pending.append((token, logprob, top))

    def take(self, final: bool = False) -> dict[str, Any] | None:
        """The pending tokens' log probabilities in the response's shape, and forget them. None when there are
        none, unless ``final`` (a whole response's: the empty shape, OpenAI's ``content: []``)."""
        if not self._pending and not final:
            return None
        pending, self._pending = self._pending, []
        if self.chat:
            return {"content": [{**self._entry(t, lp),
                                 "top_logprobs": [self._entry(i, v) for i, v in top]} for t, lp, top in pending],
                    "refusal": None}
        tokens = [self.decode([t]) for t, _, _ in pending]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in pending],
                "top_logprobs": [{self.decode([i]): v for i, v in (*top, (t, lp))} for t, lp, top in pending],
                "text_offset": offsets}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
