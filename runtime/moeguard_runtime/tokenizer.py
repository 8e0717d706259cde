"""Byte-level tokenizer: UTF-8 bytes 0..255 plus BOS, EOS and PAD.

The vocabulary is :data:`moeguard_runtime.presets.VOCAB_SIZE` (259) ids. Any
string round-trips exactly; any id sequence decodes (invalid UTF-8 becomes
U+FFFD, special ids are dropped).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from moeguard_runtime.presets import VOCAB_SIZE

BOS = 256
"""Beginning of sequence; prepended to every prompt."""
EOS = 257
"""End of sequence; generation stops when it is sampled (finish_reason "stop")."""
PAD = 258
assert VOCAB_SIZE == 259


def encode(text: str, *, bos: bool = True) -> list[int]:
    """Token ids of ``text``: ``[BOS]`` (if ``bos``) followed by its UTF-8 bytes.

    ``usage.prompt_tokens`` counts the BOS, so it is ``len(text.encode()) + 1``.
    """
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``; special ids (>= 256) are skipped, bad UTF-8 is replaced."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class StreamDecoder:
    """Incremental decoder for streaming: holds back a partial UTF-8 sequence
    until its last byte arrives, so every emitted chunk is valid text."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Text completed by ``token`` (possibly ``""``)."""
        if not 0 <= token < 256:
            return ""
        return self._dec.decode(bytes([token]))

    def flush(self) -> str:
        """Whatever is left (a dangling partial sequence becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)
