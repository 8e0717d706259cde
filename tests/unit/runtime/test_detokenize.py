"""Incremental detokenization (no half character ever emitted) and stop strings
cut across stream chunks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.unit.runtime.bpe_folder import training_text, write_bpe_tokenizer

from moeguard_runtime.api.checkpoint_tokenizer import CheckpointTokenizer
from moeguard_runtime.api.detokenize import StopMatcher
from moeguard_runtime.api.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit
MULTI_BYTE = "naïve café: 3 € for a 🦀, 中文 ok"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> CheckpointTokenizer:
    folder = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(folder)
    return CheckpointTokenizer(folder)


def stream(tok: ByteTokenizer | CheckpointTokenizer, ids: list[int],
           prompt: list[int] | None = None) -> list[str]:
    dec = tok.stream_decoder(prompt or [])
    return [*(dec.push(i) for i in ids), dec.flush()]


def test_byte_tokenizer_never_emits_half_a_character() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(MULTI_BYTE)[1:]
    pieces = stream(tok, ids)
    assert "".join(pieces) == MULTI_BYTE
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["n", "a", ""]  # "ï" is two bytes: nothing after the first


def test_bpe_characters_split_across_tokens_are_held_until_complete(
        bpe: CheckpointTokenizer) -> None:
    ids = bpe.encode_chat(MULTI_BYTE)
    split = [i for i in ids if "\ufffd" in bpe.decode([i])]
    assert split, "the test needs a character split across tokens (🦀, 中 are not in the docs)"
    pieces = stream(bpe, ids, prompt=bpe.encode("Hello"))
    assert "".join(pieces) == MULTI_BYTE == bpe.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the tokens holding the first bytes of a character emitted nothing


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40))
def test_bpe_stream_equals_decode_for_any_text(bpe: CheckpointTokenizer, text: str) -> None:
    ids = bpe.encode_chat(text)
    pieces = stream(bpe, ids)
    assert "".join(pieces) == bpe.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_a_dangling_partial_character_is_flushed_as_a_replacement() -> None:
    tok = ByteTokenizer()
    assert stream(tok, list("€".encode())[:2]) == ["", "", "\ufffd"]


def run_stop(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return out, True
    return [*out, matcher.flush()], False


def test_stop_string_across_chunks_never_leaks() -> None:
    out, stopped = run_stop(["Hel", "lo w", "orld!"], ["o wor"])
    assert stopped and "".join(out) == "Hell" and out == ["Hel", "l", ""]
    out, stopped = run_stop(["ab", "c", "x"], ["cd"])  # "c" held, then released
    assert not stopped and out == ["ab", "", "cx", ""]
    out, stopped = run_stop(["ab", "c"], ["cd"])  # held "c" flushed at the end
    assert not stopped and "".join(out) == "abc"
    out, stopped = run_stop(["xxSTOPyySTOP"], ["yy", "STOP"])  # the first one wins
    assert stopped and out == ["xx"]


@given(text=st.text(alphabet="abc", max_size=30), stop=st.text(alphabet="abc", min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_equals_cutting_the_whole_text(text: str, stop: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = run_stop(pieces, [stop])
    assert stopped == (stop in text)
    assert "".join(out) == (text[:text.find(stop)] if stop in text else text)
    assert all(stop not in p for p in out)


def llama_style(folder: Path) -> CheckpointTokenizer:
    """A SentencePiece-style BPE as Llama/Mistral/Mixtral ship it in tokenizer.json:
    Metaspace ("▁" for spaces, one prepended), byte fallback (<0xNN> pieces for
    characters outside the vocabulary), and the decoder that strips the first space."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, trainers

    def llama_pipeline(model: models.Model) -> Tokenizer:
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(Regex(" "), "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        return tok

    trained = llama_pipeline(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator(training_text(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    # the <0xNN> byte pieces are ordinary vocabulary entries (not special tokens), as in Llama's
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = llama_pipeline(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return CheckpointTokenizer(folder)


def test_sentencepiece_style_first_token_keeps_its_space_and_bytes_fuse(tmp_path: Path) -> None:
    tok = llama_style(tmp_path)
    prompt = tok.encode_chat("The worker says")
    ids = tok.encode_chat(" hello to the 🦀 and ß")  # byte-fallback pieces for 🦀
    assert any(tok.decode([i]) == "\ufffd" for i in ids), "needs a character in byte pieces"
    pieces = stream(tok, ids, prompt=prompt)
    whole = tok.decode(prompt + ids)
    assert "".join(pieces) == whole[len(tok.decode(prompt)):]
    assert pieces[0].startswith(" ")  # decoded alone, the first token would lose its space
    assert all("\ufffd" not in p for p in pieces)
