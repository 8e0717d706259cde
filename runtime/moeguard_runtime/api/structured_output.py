"""The serving tokenizer as the grammar library sees it (:mod:`moeguard_runtime.engine.grammar`): which bytes each
token id stands for, built from the byte tokenizer of the presets or a checkpoint's ``tokenizer.json``."""

from __future__ import annotations

from moeguard_runtime.api.checkpoint_tokenizer import CheckpointTokenizer
from moeguard_runtime.api.tokenizer import BOS, EOS, PAD, ByteTokenizer, Tokenizer
from moeguard_runtime.engine.grammar import GrammarCompiler, GrammarError


def compiler_for(tok: Tokenizer, vocab: int) -> GrammarCompiler:
    """The :class:`GrammarCompiler` of ``tok`` for logits ``vocab`` wide (the model's embedding rows).

    Raises:
        GrammarError: a tokenizer of another kind (structured outputs need the byte tokenizer or a
            ``tokenizer.json``).
    """
    if isinstance(tok, ByteTokenizer):
        specials = {BOS: b"<|bos|>", EOS: b"<|eos|>", PAD: b"<|pad|>"}
        tokens = [specials.get(i, bytes([i]) if i < 256 else b"") for i in range(vocab)]
        return GrammarCompiler.for_bytes(tokens, sorted(specials), BOS, EOS, list)
    if isinstance(tok, CheckpointTokenizer):
        return GrammarCompiler.for_tokenizer_json(tok.to_json(), vocab, tok.eos_ids)
    raise GrammarError(f"structured outputs need the byte tokenizer or a tokenizer.json, not a {type(tok).__name__}")
