from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeguard_core.presets import VOCAB_SIZE
from moeguard_runtime.api import tokenizer

pytestmark = pytest.mark.unit


@given(st.text())
def test_round_trip_any_text(text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.BOS
    assert len(ids) == len(text.encode("utf-8")) + 1
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_known_bytes_and_special_ids_dropped() -> None:
    assert tokenizer.encode("hé", bos=False) == [104, 0xC3, 0xA9]
    assert tokenizer.decode([tokenizer.BOS, 104, tokenizer.PAD, 105, tokenizer.EOS]) == "hi"
    assert tokenizer.decode([0xFF]) == "\ufffd"


def test_stream_decoder_holds_partial_utf8() -> None:
    dec = tokenizer.StreamDecoder()
    pieces = [dec.push(b) for b in "é€".encode()]
    assert pieces == ["", "é", "", "", "€"]
    assert dec.push(tokenizer.EOS) == ""
    assert dec.flush() == ""
