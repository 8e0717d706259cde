"""Incremental, UTF-8-safe detokenization and stop strings for streamed output.

:class:`IncrementalDetokenizer` is the prefix-offset/read-offset method of vLLM
(``detokenize_incrementally``) and TGI (``decode_token``): the text of a token
depends on its neighbours (byte-level BPE pieces that are parts of one
character, SentencePiece's leading space), so each new token decodes a small
window ``ids[prefix_offset:]`` and emits only what the window adds to
``ids[prefix_offset:read_offset]``. A window whose text ends in U+FFFD (an
incomplete UTF-8 sequence) emits nothing yet: a multi-byte character split
across tokens is never emitted half.

:class:`StopMatcher` cuts the output at the first stop string: text that could
still be the start of a stop string is held back until it is decided, so a stop
string never leaks into the output, even across stream chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens that seed the window (vLLM's choice): the first generated token
decodes with its left context, so a SentencePiece leading space is kept right."""


class IncrementalDetokenizer:
    """Text of a growing id sequence, emitted piece by piece.

    Args:
        decode: ids to text (special tokens skipped; invalid UTF-8 as U+FFFD).
        prompt: the prompt's ids; its last :data:`PROMPT_CONTEXT_TOKENS` give
            the first generated token its left context (never emitted).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token: int) -> str:
        """The text ``token`` completes (``""`` while a character is incomplete)."""
        self._ids.append(token)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return window[len(prefix):]
        return ""

    def flush(self) -> str:
        """What is still held back (a dangling partial character becomes U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return window[len(prefix):] if len(window) > len(prefix) else ""


class StopMatcher:
    """Cuts streamed text at the first of ``stops`` (empty strings are ignored).

    :meth:`push` returns ``(text safe to emit, stopped)``; once stopped, the
    text is everything before the stop string and later pushes return ``""``.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Emit what can no longer be part of a stop string."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._held += text
        hits = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._held, self.stopped = self._held[:min(hits)], "", True
            return out, True
        keep = 0  # longest tail of the held text that begins some stop string
        for s in self._stops:
            for n in range(min(len(s) - 1, len(self._held)), keep, -1):
                if self._held.endswith(s[:n]):
                    keep = n
                    break
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return out, False

    def flush(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
