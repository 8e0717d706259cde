"""Prompt text: exact lengths, ASCII real text, skewed prompts."""

from __future__ import annotations

import pytest
from harness.loadgen.text import corpus, corpus_fingerprint, prompt_of_length, repetitive_prompt

pytestmark = pytest.mark.unit


def test_corpus_is_ascii_deterministic_and_normalized() -> None:
    text = corpus()
    assert text.isascii()
    assert len(text) > 100_000
    assert text.startswith('The "assert" statement Assert statements are a convenient way')
    assert "  " not in text and "\n" not in text and "\t" not in text
    assert "statement ***" not in text  # heading underlines removed
    assert len(corpus_fingerprint()) == 16


@pytest.mark.parametrize("n", [0, 1, 17, 374, 1020, 14_050])
def test_prompt_of_length_is_exact_ascii_real_text(n: int) -> None:
    prompt = prompt_of_length(n, offset=12_345)
    assert len(prompt.encode("utf-8")) == n
    assert prompt.isascii()
    if n >= 374:
        assert " the " in prompt  # English prose, not filler
        assert len(set(prompt)) > 20


def test_prompt_of_length_offsets_and_wrap_around() -> None:
    text = corpus()
    assert prompt_of_length(30, offset=0) == text[:30]
    assert prompt_of_length(30, offset=100) == text[100:130]
    wrapped = prompt_of_length(20, offset=len(text) - 5)
    assert wrapped == text[-5:] + text[:15]
    assert prompt_of_length(10, offset=-5) == text[-5:] + text[:5]
    longer = prompt_of_length(2 * len(text) + 3)
    assert longer == text + text + text[:3]


def test_prompt_of_length_rejects_negative() -> None:
    with pytest.raises(ValueError, match="n_tokens"):
        prompt_of_length(-1)


@pytest.mark.parametrize("seed", range(12))
def test_repetitive_prompt_has_at_most_two_characters(seed: int) -> None:
    prompt = repetitive_prompt(1001, seed)
    assert len(prompt.encode("utf-8")) == 1001
    assert prompt.isascii()
    assert 1 <= len(set(prompt)) <= 2
    assert repetitive_prompt(1001, seed) == prompt  # deterministic
    pattern = prompt[:2] if len(set(prompt)) == 2 else prompt[0]
    assert prompt == (pattern * 1001)[:1001]


def test_repetitive_prompt_patterns_vary_with_seed() -> None:
    patterns = {repetitive_prompt(4, s) for s in range(20)}
    assert len(patterns) > 5
    assert any(len(set(p)) == 1 for p in patterns)
    assert any(len(set(p)) == 2 for p in patterns)
    assert repetitive_prompt(0, 3) == ""
