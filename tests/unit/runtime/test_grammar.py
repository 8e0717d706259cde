"""Structured outputs (:mod:`moeguard_runtime.engine.grammar`): a JSON schema compiled by llguidance constrains the
engine's sampling, so the tiny random model's output parses and validates against the schema (checked with
``jsonschema_rs``, an independent validator), for the byte tokenizer and for a BPE ``tokenizer.json``; a schema
llguidance cannot compile is a :class:`GrammarError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import torch
from tests.unit.runtime.bpe_folder import write_bpe_tokenizer

from moeguard_core import presets
from moeguard_runtime.api.checkpoint_tokenizer import CheckpointTokenizer
from moeguard_runtime.api.structured_output import compiler_for
from moeguard_runtime.api.tokenizer import EOS, ByteTokenizer
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.grammar import Constraint, GrammarCompiler, GrammarError, grammar_of
from moeguard_runtime.engine.sampling import SamplingParams
from moeguard_runtime.model.model import build_model

pytestmark = pytest.mark.unit

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["ok", "digit", "color"],
    "properties": {"ok": {"type": "boolean"}, "digit": {"type": "integer", "minimum": 0, "maximum": 9},
                   "color": {"enum": ["red", "green", "blue"]}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def generate(engine: Engine, compiler: GrammarCompiler, prompt: list[int], temperature: float, seed: int,
             max_new_tokens: int = 64, response_format: dict[str, Any] = JSON_SCHEMA,
             params: SamplingParams | None = None) -> tuple[list[int], str]:
    """The sequence's tokens (end of sequence dropped) and its finish reason."""
    return generate_constrained(engine, compiler.compile(grammar_of(response_format)), prompt, temperature, seed,
                                max_new_tokens, params)


def generate_constrained(engine: Engine, constraint: Constraint, prompt: list[int], temperature: float, seed: int,
                         max_new_tokens: int = 64, params: SamplingParams | None = None) -> tuple[list[int], str]:
    """One sequence under ``constraint``, to its end: its tokens (end of sequence dropped) and its finish reason."""
    engine.add("a", prompt, max_new_tokens, temperature, seed, params or SamplingParams(), constraint)
    out = engine.step([("a", len(prompt))], [])
    while "a" not in out.finished:
        out = engine.step([], ["a"])
    seq = engine.sequences["a"]
    engine.release("a")
    assert seq.finish_reason is not None
    return [t for t in seq.generated if t not in engine.eos_ids], seq.finish_reason


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(build_model(presets.get_preset("tiny"), seed=0))


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 1), (2.0, 2)])
def test_byte_tokenizer_output_follows_the_schema(engine: Engine, temperature: float, seed: int) -> None:
    tok = ByteTokenizer()
    compiler = compiler_for(tok, engine.args.vocab_size)
    tokens, finish = generate(engine, compiler, tok.encode("Answer in JSON:"), temperature, seed,
                              params=SamplingParams(top_k=50, frequency_penalty=0.5))
    text = tok.decode(tokens)
    assert finish == "stop", text  # the grammar completed and then allowed only the end of sequence
    value = json.loads(text)
    jsonschema_rs.validate(SCHEMA, value)
    assert text == json.dumps(value, separators=(",", ":"))  # compact: no whitespace to spend tokens on


def test_unconstrained_the_same_model_does_not_write_json(engine: Engine) -> None:
    tok = ByteTokenizer()
    engine.add("a", tok.encode("Answer in JSON:"), 24, 0.0, 0)
    out = engine.step([("a", len(tok.encode("Answer in JSON:")))], [])
    while "a" not in out.finished:
        out = engine.step([], ["a"])
    text = tok.decode(engine.sequences["a"].generated)
    engine.release("a")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_object_is_any_object(engine: Engine) -> None:
    tok = ByteTokenizer()
    compiler = compiler_for(tok, engine.args.vocab_size)
    tokens, finish = generate(engine, compiler, tok.encode("{"), 1.0, 4, max_new_tokens=48,
                              response_format={"type": "json_object"})
    text = tok.decode(tokens)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # max_tokens cut it: an object's beginning all the same
        assert finish == "length" and text.startswith("{")


def test_max_tokens_cuts_a_structured_output_with_finish_length(engine: Engine) -> None:
    tok = ByteTokenizer()
    compiler = compiler_for(tok, engine.args.vocab_size)
    tokens, finish = generate(engine, compiler, tok.encode("x"), 0.0, 0, max_new_tokens=5)
    assert finish == "length" and tok.decode(tokens) == '{"ok"'


def test_a_bpe_tokenizer_json_constrains_its_multi_byte_tokens(tmp_path: Path) -> None:
    vocab = write_bpe_tokenizer(tmp_path / "tok")
    tok = CheckpointTokenizer(tmp_path / "tok")
    args = presets.get_preset("tiny")
    model = build_model(type(args)(**{**args.__dict__, "vocab_size": vocab}), seed=1)
    engine = Engine(model, eos_ids=tok.eos_ids)
    compiler = compiler_for(tok, vocab)
    for seed in range(2):
        tokens, finish = generate(engine, compiler, tok.encode("Answer in JSON:"), 1.0, seed)
        text = tok.decode(tokens)
        assert finish == "stop", text
        jsonschema_rs.validate(SCHEMA, json.loads(text))


def test_the_mask_allows_only_what_the_grammar_allows() -> None:
    tok = ByteTokenizer()
    compiler = compiler_for(tok, presets.VOCAB_SIZE)
    constraint = compiler.compile(grammar_of(JSON_SCHEMA))
    allowed = constraint.allowed(torch.device("cpu"))
    assert allowed.shape == (presets.VOCAB_SIZE,) and torch.nonzero(allowed).flatten().tolist() == [ord("{")]
    for byte in b'{"ok":true,"digit":7,"color":"red"}':
        assert constraint.advance(byte)
    assert torch.nonzero(constraint.allowed(torch.device("cpu"))).flatten().tolist() == [EOS]
    assert not compiler.compile(grammar_of(JSON_SCHEMA)).advance(ord("x"))  # refused: not an object's start


@pytest.mark.parametrize(("response_format", "needle"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}, "wizard"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}},
     "regex"),
])
def test_a_schema_llguidance_cannot_compile_is_a_grammar_error(response_format: dict[str, Any], needle: str) -> None:
    compiler = compiler_for(ByteTokenizer(), presets.VOCAB_SIZE)
    with pytest.raises(GrammarError, match=needle):
        compiler.compile(grammar_of(response_format))


def test_grammar_of_refuses_what_is_not_a_schema() -> None:
    with pytest.raises(GrammarError, match=r"json_schema\.schema"):
        grammar_of({"type": "json_schema", "json_schema": {"name": "x", "schema": 5}})
    with pytest.raises(GrammarError, match="regex"):
        grammar_of({"type": "regex"})
