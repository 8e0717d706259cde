"""The sampler's penalties, filters and log probabilities (:mod:`moeguard_runtime.engine.sampling`) against their
reference implementations: transformers' logits processors (``RepetitionPenaltyLogitsProcessor``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``; a test dependency only) and OpenAI's definition
of the frequency and presence penalties, written out here."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from moeguard_runtime.engine.sampling import (
    GREEDY,
    SamplingParams,
    filter_logits,
    penalize,
    sample_on_device,
    token_logprobs,
    unpack_logprobs,
)

pytestmark = pytest.mark.unit

V = 64


def logits(seed: int, vocab: int = V) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def kept(x: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_k", [1, 5, 40])
def test_top_k_keeps_what_transformers_keeps(seed: int, top_k: int) -> None:
    x = logits(seed)
    ref = transformers.TopKLogitsWarper(top_k)(torch.zeros(1, 1, dtype=torch.long), x[None].clone())[0]
    ours = filter_logits(x, SamplingParams(top_k=top_k))
    assert kept(ours) == kept(ref) and len(kept(ours)) == top_k
    assert torch.equal(ours[torch.isfinite(ours)], x[torch.isfinite(ours)])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_what_transformers_keeps(seed: int, top_p: float) -> None:
    x = logits(seed)
    ref = transformers.TopPLogitsWarper(top_p)(torch.zeros(1, 1, dtype=torch.long), x[None].clone())[0]
    ours = filter_logits(x, SamplingParams(top_p=top_p))
    assert kept(ours) == kept(ref)
    probs = torch.softmax(x, -1)
    assert float(probs[sorted(kept(ours))].sum()) >= top_p  # the kept mass reaches top_p
    assert int(torch.argmax(x)) in kept(ours)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("min_p", [0.01, 0.2, 0.9])
def test_min_p_keeps_what_transformers_keeps(seed: int, min_p: float) -> None:
    x = logits(seed)
    ref = transformers.MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), x[None].clone())[0]
    ours = filter_logits(x, SamplingParams(min_p=min_p))
    assert kept(ours) == kept(ref)


def test_filters_apply_in_vllms_order_min_p_then_top_k_then_top_p() -> None:
    """Probabilities 0.4, 0.3, 0.2, 0.06, 0.04: min_p 0.125 (threshold 0.05) drops 0.04; top_k 3 keeps
    0.4/0.3/0.2; top_p 0.75 on those renormalised (0.44, 0.33, 0.22) keeps two (0.22 <= 1 - 0.75 is removed)."""
    x = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04], dtype=torch.float64).log()
    ours = filter_logits(x, SamplingParams(min_p=0.125, top_k=3, top_p=0.75))
    assert kept(ours) == {0, 1}
    assert kept(filter_logits(x, SamplingParams(min_p=0.125))) == {0, 1, 2, 3}
    assert kept(filter_logits(x, SamplingParams(top_p=0.75))) == {0, 1, 2}  # 0.2 is needed on the raw mass


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty: float) -> None:
    x = logits(7)
    prompt, output = [1, 2, 3, 2], [9, 3, 40]
    ref = transformers.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), x[None].clone())[0]
    ours = penalize(x, prompt, output, SamplingParams(repetition_penalty=penalty))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    assert not torch.equal(ours, x)


def test_frequency_and_presence_penalties_are_openais_over_the_output_only() -> None:
    """OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c[j] the times j was sampled."""
    x = logits(3)
    prompt, output = [5, 6], [1, 1, 1, 2, 6]
    ours = penalize(x, prompt, output, SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25))
    expected = x.clone()
    for j, c in {1: 3, 2: 1, 6: 1}.items():
        expected[j] -= c * 0.5 + 1.0 * -1.25
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    assert ours[5] == x[5]  # in the prompt only: untouched


def test_no_penalty_returns_the_logits_themselves() -> None:
    x = logits(0)
    assert penalize(x, [1, 2], [3], GREEDY) is x
    assert filter_logits(x, GREEDY) is x


def test_greedy_is_the_argmax_of_the_penalized_logits() -> None:
    x = torch.tensor([0.0, 5.0, 4.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert int(sample_on_device(x, 0.0, gen)) == 1
    # token 1 generated three times: 5 - 3 * 1 = 2 < 4
    assert int(sample_on_device(x, 0.0, gen, SamplingParams(frequency_penalty=1.0), [], [1, 1, 1])) == 2


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.integers(0, V + 3), top_p=st.floats(0.01, 1.0),
       min_p=st.floats(0.0, 1.0), temperature=st.floats(0.05, 2.0))
def test_a_sampled_token_is_always_one_the_filters_kept(seed: int, top_k: int, top_p: float, min_p: float,
                                                       temperature: float) -> None:
    x = logits(seed)
    params = SamplingParams(top_p=top_p, top_k=top_k, min_p=min_p)
    allowed = kept(filter_logits(x / temperature, params))
    assert int(torch.argmax(x)) in allowed  # the most likely token always stays
    gen = torch.Generator().manual_seed(seed)
    for _ in range(5):
        assert int(sample_on_device(x, temperature, gen, params)) in allowed


def test_sampling_with_top_k_follows_the_renormalised_distribution() -> None:
    """top_k 2 of probabilities 0.5, 0.3, 0.2: 5/8 and 3/8 over 4,000 draws (a 4-sigma band)."""
    x = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log()
    gen = torch.Generator().manual_seed(0)
    n = 4000
    draws = [int(sample_on_device(x, 1.0, gen, SamplingParams(top_k=2))) for _ in range(n)]
    assert set(draws) == {0, 1}
    share = draws.count(0) / n
    assert abs(share - 5 / 8) < 4 * math.sqrt(5 / 8 * 3 / 8 / n)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_are_the_raw_logits_log_softmax(k: int) -> None:
    x = logits(11).float()
    token = torch.tensor(17)
    chosen, top = unpack_logprobs(token_logprobs(x, token, k).tolist(), k)
    ref = torch.log_softmax(x.double(), -1)
    assert abs(chosen - float(ref[17])) < 1e-5
    assert [i for i, _ in top] == torch.topk(ref, k).indices.tolist()
    assert all(abs(v - float(ref[i])) < 1e-5 for i, v in top)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.5),
                                 dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(logprobs=21), dict(logprobs=-1)])
def test_out_of_range_params_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_the_engine_applies_the_penalty_on_token_ids_greedy_picks_the_penalized_argmax() -> None:
    """Through :class:`Engine` on the tiny preset: at each step the chosen id's raw log probability minus 1.5 x its
    count so far is at least every top-20 alternative's (a position's softmax normaliser is common to all its
    tokens), and the penalty changes the greedy loop the model falls into without it."""
    from moeguard_core import presets
    from moeguard_runtime.engine.engine import Engine
    from moeguard_runtime.model.model import build_model

    model = build_model(presets.get_preset("tiny"), seed=0)

    def run(params: SamplingParams) -> tuple[list[int], list[tuple[float, tuple[tuple[int, float], ...]]]]:
        engine = Engine(model)
        engine.add("a", [256, *b"Hello"], max_new_tokens=24, params=params)
        out = engine.step([("a", 6)], [])
        tokens, values = [out.new_tokens["a"]], [out.logprobs["a"]]
        while "a" not in out.finished:
            out = engine.step([], ["a"])
            tokens.append(out.new_tokens["a"])
            values.append(out.logprobs["a"])
        return tokens, values

    plain, _ = run(SamplingParams(logprobs=20))
    tokens, values = run(SamplingParams(frequency_penalty=1.5, logprobs=20))
    counts: dict[int, int] = {}
    for token, (chosen, top) in zip(tokens, values, strict=True):
        for alt, value in top:
            assert chosen - 1.5 * counts.get(token, 0) >= value - 1.5 * counts.get(alt, 0) - 1e-4, (token, alt)
        counts[token] = counts.get(token, 0) + 1
    assert tokens != plain
    assert max(plain.count(t) for t in plain) > max(tokens.count(t) for t in tokens)
