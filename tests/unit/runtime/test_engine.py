from __future__ import annotations

import pytest
import torch

from moeguard_core import presets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.model.model import build_model

pytestmark = pytest.mark.unit

ENGLISH = ("The quick brown fox jumps over the lazy dog. Kubernetes operators reconcile the "
           "desired state with the observed state, and mixture-of-experts models send each "
           "token to a few experts chosen by a learned router. ") * 2


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return build_model(presets.get_preset("tiny"), seed=7)


def generate(engine: Engine, sid: str, text: str, n: int, **kw: object) -> list[int]:
    prompt = tokenizer.encode(text)
    engine.add(sid, prompt, n, **kw)  # type: ignore[arg-type]
    out = engine.step([(sid, len(prompt))], [])
    while sid not in out.finished:
        out = engine.step([], [sid])
    return engine.sequences[sid].generated


def test_same_seed_same_weights_and_tokens(model: torch.nn.Module) -> None:
    other = build_model(presets.get_preset("tiny"), seed=7)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert not torch.equal(build_model(presets.get_preset("tiny"), seed=8).output.weight,
                           other.output.weight)
    greedy = [generate(Engine(m), "a", "Hello", 12, temperature=0.0) for m in (model, other)]
    assert greedy[0] == greedy[1] and len(greedy[0]) <= 12
    sampled = [generate(Engine(model), "b", "Hello", 12, temperature=1.0, seed=s) for s in (5, 5, 6)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_chunked_prefill_and_batching_match_single_pass(model: torch.nn.Module) -> None:
    """Prefill in chunks of 7 next to another sequence == one-shot prefill alone."""
    prompt = tokenizer.encode(ENGLISH[:60])
    alone = Engine(model)
    alone.add("x", prompt, 5)
    ref = alone.step([("x", len(prompt))], [])
    ref_logits_tok = ref.new_tokens["x"]
    ref_cache = alone.sequences["x"].cache.k[:, :, :len(prompt)].clone()

    eng = Engine(model)
    eng.add("x", prompt, 5)
    eng.add("y", tokenizer.encode("other"), 20)
    eng.step([("y", 6)], [])
    done = 0
    while done < len(prompt):
        n = min(7, len(prompt) - done)
        out = eng.step([("x", n)], ["y"])
        done += n
        if done < len(prompt):
            assert "x" not in out.new_tokens
            assert out.prefill_tokens == n and out.decode_tokens == 1
    assert out.new_tokens["x"] == ref_logits_tok
    torch.testing.assert_close(eng.sequences["x"].cache.k[:, :, :len(prompt)], ref_cache,
                               rtol=1e-4, atol=1e-5)


def test_finish_reasons_and_bounds(model: torch.nn.Module) -> None:
    eng = Engine(model)
    toks = generate(eng, "a", "abc", 3, temperature=0.0)
    assert eng.sequences["a"].finish_reason in ("length", "stop")
    assert len(toks) == 3 or toks[-1] == tokenizer.EOS
    with pytest.raises(ValueError, match="<= 1024"):
        eng.add("big", [1] * 1000, 100)
    with pytest.raises(ValueError):
        eng.add("empty", [], 1)
    with pytest.raises(ValueError, match=">= 1, given -76"):  # a prompt over the context, a sum that fits
        eng.add("over", [1] * 1100, -76)
    eng.release("a")
    assert "a" not in eng.sequences and eng.kv_cache_bytes() == 0


def test_repeated_bytes_skew_far_more_than_english(model: torch.nn.Module) -> None:
    def skew(text: str) -> list[float]:
        eng = Engine(model)
        prompt = tokenizer.encode(text)
        eng.add("s", prompt, 1)
        return [s.expert_skew_ratio for s in eng.step([("s", len(prompt))], []).routing]

    english, repeated = skew(ENGLISH), skew("a" * len(ENGLISH))
    print(f"\nskew per layer on tiny, {len(ENGLISH) + 1} tokens: english={english} repeated={repeated}")
    assert max(english) < 4.0
    assert max(repeated) > 10 * max(english)


def test_tiny_temperature_is_greedy_not_nan() -> None:
    """Found by schemathesis: temperature 1e-234 made logits/temperature infinite."""
    from moeguard_runtime.engine.sampling import sample_on_device

    logits = torch.tensor([0.1, 3.0, -2.0])
    gen = torch.Generator().manual_seed(0)
    assert int(sample_on_device(logits, 1.1446065092161173e-234, gen)) == 1
    assert int(sample_on_device(logits, 1e-300, gen)) == 1
    assert int(sample_on_device(logits, 1.0, gen)) in (0, 1, 2)


def test_a_sequence_ends_on_the_serving_tokenizers_eos_ids_not_the_byte_eos() -> None:
    """A checkpoint tokenizer's EOS is its own id; the byte tokenizer's 257 is an ordinary token there."""
    model = build_model(presets.get_preset("tiny"), seed=0)
    greedy = Engine(model)
    assert greedy.eos_ids == {tokenizer.EOS}
    greedy.add("a", [1, 2, 3], max_new_tokens=6)
    first = greedy.step([("a", 3)], []).new_tokens["a"]
    assert first != tokenizer.EOS
    ends_on_first = Engine(model, eos_ids=frozenset({first}))
    ends_on_first.add("b", [1, 2, 3], max_new_tokens=6)
    out = ends_on_first.step([("b", 3)], [])
    assert (out.new_tokens["b"], out.finished) == (first, {"b": "stop"})
