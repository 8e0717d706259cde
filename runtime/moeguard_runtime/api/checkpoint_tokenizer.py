"""A checkpoint folder's tokenizer: ``tokenizer.json`` through the ``tokenizers``
library, with ``tokenizer_config.json`` (and ``generation_config.json``) read
the way ``transformers``' ``PreTrainedTokenizerFast`` reads them.

* Special and added tokens come from ``tokenizer.json`` (``added_tokens``).
* ``bos_token``/``eos_token``/``unk_token``/``pad_token`` from
  ``tokenizer_config.json`` (a string or ``{"content": ...}``).
* BOS/EOS on a completion prompt: ``tokenizer.json``'s post-processor decides;
  without one, ``add_bos_token``/``add_eos_token`` of the config do (transformers
  5 builds a post-processor from them only then).
* ``chat_template``: a string, or a list of ``{"name", "template"}`` (the one
  named ``default``); or a ``chat_template.jinja`` file next to it.
* End of sequence: the ``eos_token`` and ``generation_config.json``'s
  ``eos_token_id`` (an int or a list; else ``config.json``'s), as ``generate``
  stops on both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from moeguard_runtime.api.chat_template import ChatTemplate, ChatTemplateError
from moeguard_runtime.api.detokenize import IncrementalDetokenizer
from moeguard_runtime.api.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer, Tokenizer

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be used; the message names the file."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, given {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` is a directory holding a ``tokenizer.json``."""
    return (Path(folder) / "tokenizer.json").is_file()


class CheckpointTokenizer:
    """The :class:`moeguard_runtime.api.tokenizer.Tokenizer` of a checkpoint folder.

    Raises:
        TokenizerError: unreadable ``tokenizer.json`` or config, or a special
            token the config names that the vocabulary lacks (the message names
            the file).
    """

    def __init__(self, folder: str | Path) -> None:
        root = Path(folder)
        self.path = root / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises Exception for a bad file
            raise TokenizerError(f"cannot read {self.path}: {exc}") from None
        config_path = root / "tokenizer_config.json"
        config = _read_json(config_path)
        self._special = {name: text for name in SPECIAL_NAMES
                         if (text := _token_text(config.get(name))) is not None}
        ids: dict[str, int] = {}
        for name, text in self._special.items():
            token_id = self._tok.token_to_id(text)
            if token_id is None:
                raise TokenizerError(f"{config_path}: {name} {text!r} is not in the vocabulary "
                                     f"of {self.path}")
            ids[name] = token_id
        self.bos_id, self.eos_id = ids.get("bos_token"), ids.get("eos_token")
        self._flags = (None if self._tok.post_processor is not None else
                       (bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))))
        eos = {self.eos_id} if self.eos_id is not None else set()
        generation = _read_json(root / "generation_config.json").get("eos_token_id")
        if generation is None:  # generate's default: the model config's
            generation = _read_json(root / "config.json").get("eos_token_id")
        for value in generation if isinstance(generation, list) else [generation]:
            if isinstance(value, int) and not isinstance(value, bool):
                eos.add(value)
        self._eos_ids = frozenset(eos)
        self._chat_template = self._template(config.get("chat_template"), config_path,
                                             root / "chat_template.jinja")

    @staticmethod
    def _template(value: Any, config_path: Path, jinja_path: Path) -> str | None:
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
            if value is None:
                raise TokenizerError(f"{config_path}: chat_template is a list without a "
                                     f"'default' template (names: {sorted(map(str, named))})")
        if value is None and jinja_path.is_file():
            value = jinja_path.read_text(encoding="utf-8")
        if value is not None and not isinstance(value, str):
            raise TokenizerError(f"{config_path}: chat_template must be a string, "
                                 f"given {type(value).__name__}")
        return value

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def max_id(self) -> int:
        """The largest id the tokenizer can produce (added tokens may leave gaps)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self._special)

    def encode(self, text: str) -> list[int]:
        if self._flags is None:
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        add_bos, add_eos = self._flags
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_chat(self, rendered: str) -> list[int]:
        return list(self._tok.encode(rendered, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def decode_with_special(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def added_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        return {text: added[text] for text in texts if text in added}

    def stream_decoder(self, prompt: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, prompt)

    def to_json(self) -> str:
        """The ``tokenizers`` serialization of the vocabulary (``tokenizer.json``'s content, added tokens
        included), for the grammar library (:mod:`moeguard_runtime.api.structured_output`)."""
        return str(self._tok.to_str())


def load_tokenizer(checkpoint: str | None, embedding_rows: int) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer to serve and its compiled chat template, checked at start-up.

    A checkpoint folder with a ``tokenizer.json`` gives a :class:`CheckpointTokenizer`;
    anything else (no checkpoint, a single file, a folder without one) the byte
    tokenizer. ``embedding_rows`` is the model's vocabulary (embedding rows).

    Raises:
        TokenizerError: an unreadable tokenizer, a vocabulary with ids beyond the
            embedding, or a chat template that does not compile or raises on a
            one-turn conversation; the message names the file.
    """
    if checkpoint is None or not has_tokenizer(checkpoint):
        byte = ByteTokenizer()
        return byte, ChatTemplate(BYTE_CHAT_TEMPLATE)
    tok = CheckpointTokenizer(checkpoint)
    if tok.max_id >= embedding_rows:
        raise TokenizerError(f"{tok.path}: the vocabulary has ids up to {tok.max_id}, the model's "
                             f"embedding has {embedding_rows} rows (vocab_size)")
    if tok.chat_template is None:
        return tok, None
    config_path = Path(checkpoint) / "tokenizer_config.json"
    try:
        template = ChatTemplate(tok.chat_template, tok.special_tokens)
        template.check()
    except ChatTemplateError as exc:
        raise TokenizerError(f"{config_path}: chat_template: {exc}") from None
    return tok, template
