"""Constrained decoding for structured outputs (OpenAI's ``response_format`` ``json_object`` and ``json_schema``)
with llguidance (the Low-level Guidance library: vLLM's ``guidance`` structured-outputs backend, SGLang's too).

* :func:`grammar_of` turns a ``response_format`` into an llguidance grammar (JSON Schema compiled to a grammar;
  ``json_object`` is the schema ``{"type": "object"}``, any JSON object, as vLLM maps it). Whitespace is
  compact (``whitespace_flexible`` false), so a model cannot spend its tokens on blank space.
* :class:`GrammarCompiler` holds the serving tokenizer as llguidance sees it (one per worker: building it from a
  150k-token vocabulary takes about a second) and compiles a grammar into a :class:`Constraint`, a request's own
  matcher; a schema llguidance cannot compile raises :class:`GrammarError` with its message (the API answers 400
  naming ``response_format``).
* Per step, :meth:`Constraint.allowed` is the ``[V]`` boolean mask of the tokens the grammar allows next, on the
  logits' device; the sampler sets the others to ``-inf`` before penalties, temperature and filters (vLLM's
  order), and :meth:`Constraint.advance` feeds the sampled token back. When the grammar is complete the mask allows
  only the end-of-sequence tokens, so the request ends with ``finish_reason`` ``stop``; ``max_tokens`` may still
  cut it first (``length``, the text then incomplete, as OpenAI's).

The mask is computed on the host (llguidance is CPU code: tens of microseconds for a byte vocabulary, about a
millisecond for 150k tokens) and copied to the logits' device: one small copy per constrained request per step, no
read back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""llguidance's JSON compile defaults: compact whitespace."""


class GrammarError(ValueError):
    """A ``response_format`` llguidance cannot compile; the message is llguidance's."""


def grammar_of(response_format: dict[str, Any]) -> str:
    """The llguidance grammar of an OpenAI ``response_format`` (``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}}``).

    Raises:
        GrammarError: another type, or a ``json_schema`` without an object ``schema``.
    """
    kind = response_format.get("type")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("json_schema.schema must be a JSON Schema object")
    else:
        raise GrammarError(f"type {kind!r} has no grammar (json_object, json_schema)")
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def grammar_of_lark(source: str) -> str:
    """The llguidance grammar of a Lark grammar in llguidance's dialect (``%json {...}`` inlines a JSON Schema,
    ``<[id]>`` matches a special token): the forced tool calls of :mod:`moeguard_runtime.api.tool_calls`. Its
    inlined schemas are compiled by :meth:`GrammarCompiler.compile` (once, off the event loop), which raises
    :class:`GrammarError` for a tool's ``parameters`` llguidance cannot compile.

    Raises:
        GrammarError: llguidance's message for Lark text it cannot read.
    """
    try:
        return str(llguidance.LLMatcher.grammar_from_lark(source))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


class _ByteVocabulary:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer, for a byte-level one: each id's bytes."""

    def __init__(self, tokens: Sequence[bytes], special: Sequence[int], bos: int | None, eos: int,
                 encode: Callable[[bytes], list[int]]) -> None:
        self.tokens, self.special_token_ids = list(tokens), list(special)
        self.bos_token_id, self.eos_token_id = bos, eos
        self._encode = encode

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text)


class GrammarCompiler:
    """The serving tokenizer as llguidance sees it, and the compiler of requests' grammars.

    Build it with :meth:`for_bytes` (the byte tokenizer of the presets) or :meth:`for_tokenizer_json` (a checkpoint's
    ``tokenizer.json``). ``vocab``: the logits' width (the model's embedding rows; ids the tokenizer lacks are never
    allowed)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, frozenset(eos_ids)

    @classmethod
    def for_bytes(cls, tokens: Sequence[bytes], special: Sequence[int], bos: int | None, eos: int,
                  encode: Callable[[bytes], list[int]]) -> GrammarCompiler:
        """``tokens``: each id's bytes (special ids' are never produced by a grammar)."""
        wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokens, special, bos, eos, encode))
        return cls(llguidance.LLTokenizer(wrapper, n_vocab=len(tokens), eos_token=eos), len(tokens), (eos,))

    @classmethod
    def for_tokenizer_json(cls, tokenizer_json: str, vocab: int, eos_ids: Iterable[int]) -> GrammarCompiler:
        """``tokenizer_json``: the HF ``tokenizers`` serialization (``Tokenizer.to_str()``)."""
        eos = sorted(eos_ids)
        return cls(llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos), vocab, eos)

    def compile(self, grammar: str) -> Constraint:
        """A new request's :class:`Constraint` on ``grammar`` (:func:`grammar_of`).

        Raises:
            GrammarError: llguidance's message for a grammar it cannot build (an unsupported JSON Schema keyword,
                a type it does not know).
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.vocab)


class Constraint:
    """One request's grammar state. Not thread-safe: the engine's thread drives it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher, self._vocab = matcher, vocab
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The ``[V]`` boolean mask of the tokens the grammar allows next, on ``device``."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = ((words.unsqueeze(-1) >> self._shifts) & 1).flatten()
        mask = torch.zeros(self._vocab, dtype=torch.bool)
        n = min(self._vocab, bits.numel())
        mask[:n] = bits[:n].bool()
        return mask.to(device)

    def advance(self, token: int) -> bool:
        """Feed the sampled ``token``; False when the grammar refused it (then the matcher is in error)."""
        return bool(self._matcher.consume_token(token))

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())

