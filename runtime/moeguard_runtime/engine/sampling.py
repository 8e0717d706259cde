"""What a request asks of the sampler beyond its temperature and seed, and the pure tensor functions that do it:
penalties, the top-k / top-p / min-p filters, and the log probabilities returned to the client.

The semantics are vLLM's (``vllm.SamplingParams``, the v1 sampler), the order too:

1. **Penalties** on the raw logits ``[V]``: ``repetition_penalty`` (CTRL, Keskar et al. 2019, as transformers'
   ``RepetitionPenaltyLogitsProcessor``) over every token of the prompt and the output so far: a positive logit is
   divided by it, a negative one multiplied; then ``frequency_penalty`` x (times the token was generated) and
   ``presence_penalty`` x (generated at all) are subtracted (OpenAI's definition, over the output only).
2. **Temperature**: ``logits / temperature``; below :data:`MIN_TEMPERATURE` the token is the argmax of the
   penalized logits (the filters below never remove the argmax, so they are skipped).
3. **min-p** (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"): tokens whose probability is below
   ``min_p`` x the largest probability are removed.
4. **top-k** then **top-p** (nucleus, Holtzman et al. 2020): the ``top_k`` most likely tokens are kept, then the
   smallest set of those whose probability adds up to at least ``top_p`` (ties at the boundary as transformers'
   ``TopPLogitsWarper``: the ascending cumulative sum ``<= 1 - top_p`` is removed; the most likely token always
   stays).

Log probabilities are the model's: ``log_softmax`` of the raw logits in float32, before penalties, temperature
and filters (vLLM's default ``logprobs_mode`` ``raw_logprobs``; OpenAI's ``logprobs`` are the model's
distribution), of the sampled token and of the ``k`` most likely ones.

Everything here runs on the logits' device without a host synchronisation; only :func:`penalize` moves the
request's token ids to the device (one small copy, only for a request with a penalty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5
"""Below this, sampling is greedy: ``logits / 1e-234`` overflows to inf and softmax to NaN."""
MAX_LOGPROBS = 20
"""The most alternatives a request may ask for (OpenAI's ``top_logprobs`` limit, vLLM's default
``max_logprobs``)."""


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling controls besides ``temperature`` and ``seed`` (vLLM's names and defaults).

    Attributes:
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: the most likely tokens kept; 0 keeps every token.
        min_p: in [0, 1]; 0 keeps every token.
        presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's range); 0 is none.
        repetition_penalty: > 0; 1 is none.
        logprobs: None returns none; ``k`` >= 0 returns the sampled token's log probability and the ``k`` most
            likely tokens' (at most :data:`MAX_LOGPROBS`).
    """

    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        """Raises: ValueError: a value outside the ranges above (the API checks them first, with the field's name)."""
        checks = ((0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"), (self.top_k >= 0, "top_k must be >= 0"),
                  (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
                  (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
                  (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
                  (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
                  (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                   f"logprobs must be in [0, {MAX_LOGPROBS}]"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


GREEDY = SamplingParams()
"""No penalty, no filter, no log probabilities: what a request without those fields gets."""


def penalize(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
             params: SamplingParams) -> torch.Tensor:
    """``[V]`` logits with ``params``' penalties applied (step 1 of the module docstring), in the logits' dtype.
    ``prompt`` and ``output``: the request's token ids so far (ids outside ``[0, V)`` are not allowed)."""
    if not params.penalized:
        return logits
    vocab = logits.shape[-1]
    out = logits.clone()
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[torch.tensor([*prompt, *output], dtype=torch.long, device=logits.device)] = True
        scaled = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, scaled, out)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab].to(out.dtype)
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def filter_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[V]`` temperature-scaled logits with the tokens min-p, top-k and top-p remove set to ``-inf`` (steps 3-4
    of the module docstring). The most likely token is never removed."""
    if not params.filtered:
        return scaled
    out = scaled
    if params.min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < out.shape[-1]:
        kth = torch.topk(out, params.top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, index = torch.sort(out, descending=False)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1.0 - params.top_p
        remove[-1] = False  # the most likely token stays
        out = out.masked_fill(remove.scatter(0, index, remove), float("-inf"))
    return out


def sample_on_device(logits: torch.Tensor, temperature: float, generator: torch.Generator,
                     params: SamplingParams = GREEDY, prompt: Sequence[int] = (),
                     output: Sequence[int] = ()) -> torch.Tensor:
    """One token id from ``[V]`` logits, as a 0-d int64 tensor on the logits' device (no host synchronisation):
    the argmax of the penalized logits if ``temperature < MIN_TEMPERATURE``, else drawn with ``generator`` from
    ``softmax(filtered(penalized / temperature))`` (computed in float64); the argmax again when those
    probabilities are not finite. ``prompt`` and ``output``: the request's ids, for the penalties."""
    logits = penalize(logits, prompt, output, params)
    greedy = torch.argmax(logits)
    if temperature < MIN_TEMPERATURE:
        return greedy
    probs = torch.softmax(filter_logits(logits.double() / temperature, params), dim=-1)  # [V]
    finite = torch.isfinite(probs).all()
    safe = torch.where(finite, probs, torch.ones_like(probs))  # multinomial refuses NaN/inf
    drawn = torch.multinomial(safe, 1, generator=generator)[0]
    return torch.where(finite, drawn, greedy)


def token_logprobs(logits: torch.Tensor, token: torch.Tensor, k: int) -> torch.Tensor:
    """The model's log probabilities for one position, packed for one host transfer: a float32 ``[1 + 2k]``
    tensor holding the sampled ``token``'s log probability, then the ``k`` most likely tokens' ids (as floats:
    exact below 2**24, every vocabulary here) and their log probabilities. ``logits``: ``[V]`` raw logits;
    ``token``: the 0-d sampled id."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(0, token.reshape(1))
    if k == 0:
        return chosen
    top = torch.topk(lp, k)
    return torch.cat([chosen, top.indices.float(), top.values])


def unpack_logprobs(packed: Sequence[float], k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """:func:`token_logprobs`' values, read back: ``(the sampled token's log probability, ((id, logprob), ...)``
    most likely first)."""
    ids, values = packed[1:1 + k], packed[1 + k:1 + 2 * k]
    return float(packed[0]), tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
