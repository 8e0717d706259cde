"""The tokenizer interface and the byte-level tokenizer (the presets' default).

:class:`Tokenizer` is what the HTTP API needs of a tokenizer; two implement it:
:class:`ByteTokenizer` here (UTF-8 bytes 0..255 plus BOS, EOS and PAD, the
vocabulary of the presets, the demo and the tests) and
:class:`moeguard_runtime.api.checkpoint_tokenizer.CheckpointTokenizer` (a
checkpoint folder's ``tokenizer.json``).

Byte level: the vocabulary is :data:`moeguard_core.presets.VOCAB_SIZE` (259)
ids. Any string round-trips exactly; any id sequence decodes (invalid UTF-8
becomes U+FFFD, special ids are dropped).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol

from moeguard_core.presets import VOCAB_SIZE
from moeguard_runtime.api.detokenize import IncrementalDetokenizer

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


BYTE_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>\n"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""The byte tokenizer's chat template (it has no special tokens to mark turns): tools listed first, an
assistant's calls in the ``hermes`` format (:mod:`moeguard_runtime.api.tool_calls`), tool results as ``tool``
turns. Without tools it renders as before tools existed."""


class Tokenizer(Protocol):
    """What the HTTP API needs of a tokenizer. Ids are ints in ``[0, vocab_size)``."""

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (special and added tokens included)."""

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation (``finish_reason`` ``stop``)."""

    @property
    def chat_template(self) -> str | None:
        """The jinja2 chat template, or None when there is none."""

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ... as the chat template sees them."""

    def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt, special tokens (BOS) added as the tokenizer's config says."""

    def encode_chat(self, rendered: str) -> list[int]:
        """Ids of a rendered chat template (as transformers: the template carries BOS itself)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped, invalid UTF-8 as U+FFFD."""

    def decode_with_special(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (a tool call's markers may be special tokens)."""

    def added_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """The id of each of ``texts`` that is one added token of the vocabulary (special or not)."""

    def stream_decoder(self, prompt: Sequence[int] = ()) -> IncrementalDetokenizer:
        """An incremental decoder for the ids generated after ``prompt``."""


class ByteTokenizer:
    """:class:`Tokenizer` over the byte-level functions of this module."""

    vocab_size = VOCAB_SIZE
    eos_ids = frozenset({EOS})
    chat_template: str | None = BYTE_CHAT_TEMPLATE

    @property
    def special_tokens(self) -> dict[str, str]:
        return {}

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def encode_chat(self, rendered: str) -> list[int]:
        return encode(rendered)  # BOS has no text form here: added to the rendered text

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)

    def decode_with_special(self, ids: Sequence[int]) -> str:
        return decode(ids)  # its special ids (BOS, EOS, PAD) have no text

    def added_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        return {}

    def stream_decoder(self, prompt: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(decode, prompt)
