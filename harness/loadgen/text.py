"""Prompt text for the load generator.

moeguard's tokenizer is byte-level: one token is one UTF-8 byte (plus a BOS the
worker may add). Every string built here is pure ASCII, so its length in
characters equals its length in bytes equals its length in tokens.

Real prompts are cut from the Python documentation that ships with CPython
(``pydoc_data.topics.topics``), so no download is needed and the text is the
same on every machine running the same Python version.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
import unicodedata
from functools import lru_cache

# Typographic characters found in pydoc_data, mapped to ASCII before the
# generic NFKD fallback (which would otherwise simply drop them).
_ASCII_MAP = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
    "\u2013": "-", "\u2014": "--", "\u2026": "...", "\u00b0": " degrees",
    "\u00df": "ss", "\u00a0": " ",
})
# Lines that only underline a heading ("*****", "=====", "-----").
_DECORATION = re.compile(r"^\s*([*=\-~^#+])\1{2,}\s*$", re.MULTILINE)
_WHITESPACE = re.compile(r"\s+")


def to_ascii(text: str) -> str:
    """Map ``text`` to ASCII: typographic quotes/dashes replaced, other non-ASCII dropped."""
    text = text.translate(_ASCII_MAP)
    text = unicodedata.normalize("NFKD", text)
    return text.encode("ascii", "ignore").decode("ascii")


@lru_cache(maxsize=1)
def corpus() -> str:
    """The prompt corpus: all pydoc topics, keys sorted, ASCII, whitespace collapsed.

    Deterministic for a given Python version; about 450,000 characters (= bytes
    = tokens) on CPython 3.11. Heading underlines are removed and every run of
    whitespace becomes one space; topics are joined with a single space.
    """
    from pydoc_data.topics import topics  # stdlib; imported lazily (large module)

    parts: list[str] = []
    for key in sorted(topics):
        text = _DECORATION.sub(" ", to_ascii(topics[key]))
        text = _WHITESPACE.sub(" ", text).strip()
        if text:
            parts.append(text)
    return " ".join(parts)


def corpus_fingerprint() -> str:
    """First 16 hex digits of the SHA-256 of :func:`corpus`, to record with results."""
    return hashlib.sha256(corpus().encode("ascii")).hexdigest()[:16]


def prompt_of_length(n_tokens: int, offset: int = 0) -> str:
    """Real text exactly ``n_tokens`` tokens (= ASCII bytes) long.

    Args:
        n_tokens: length of the prompt in tokens (bytes); ``0`` gives ``""``.
        offset: start position in the corpus, in bytes; taken modulo the corpus
            length, so any integer is valid. The slice wraps around the end of
            the corpus (as often as needed when ``n_tokens`` exceeds it).

    Raises:
        ValueError: ``n_tokens`` is negative.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    text = corpus()
    size = len(text)
    start = offset % size
    out: list[str] = []
    remaining = n_tokens
    while remaining > 0:
        piece = text[start:start + remaining]
        out.append(piece)
        remaining -= len(piece)
        start = 0
    return "".join(out)


def repetitive_prompt(n_tokens: int, seed: int = 0) -> str:
    """A skewed prompt of exactly ``n_tokens`` ASCII bytes with at most 2 distinct characters.

    The pattern is one lowercase letter repeated (``"aaaa..."``) or two
    different letters alternating (``"abab..."``), chosen deterministically from
    ``seed``: such inputs send most tokens to the same few experts, which is
    what moeguard's skew detection must notice.

    Raises:
        ValueError: ``n_tokens`` is negative.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    rng = random.Random(seed)
    letters = rng.sample(string.ascii_lowercase, 2)
    pattern = letters[0] if rng.random() < 0.5 else letters[0] + letters[1]
    repeats = n_tokens // len(pattern) + 1
    return (pattern * repeats)[:n_tokens]
