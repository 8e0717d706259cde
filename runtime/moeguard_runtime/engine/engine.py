"""Prefill and decode steps over a batch of sequences. No I/O, no clock.

One :meth:`Engine.step` runs one forward pass over a packed batch made of
prefill chunks (a slice of a prompt, chunked prefill when a prompt exceeds the
step's prefill budget) and decode tokens (one per running sequence), like
vLLM's mixed steps. The scheduler decides what goes into a step; the engine
only executes it and samples.

Sampling (:mod:`sampling`): ``temperature == 0`` is greedy (argmax of the
penalized logits); otherwise softmax of the penalized, filtered
``logits / temperature`` sampled with the request's own ``torch.Generator``
(seeded from the request's ``seed``, so a seeded request is reproducible
whatever else shares its batch). The generator lives on the engine's device, so
a seed reproduces on the same device type; CPU and CUDA draw different streams.
A request that asks for log probabilities gets the model's (raw logits), read
back in one more host transfer in the steps where such a request samples. A
request with a grammar (:mod:`grammar`, structured outputs) samples only the
tokens its grammar allows (the others' logits set to ``-inf`` first); the
sampled token advances the grammar once read back.

Device: the KV caches, the token and position tensors and the generators are
created on the weights' device (``MOEGUARD_DEVICE``); only the sampled token ids
come back to the host, with the routing counts, in one transfer per step
(:func:`moe.read_back`). With the device dispatch (CUDA bfloat16,
:mod:`moeguard_runtime.model.moe_device`) that is the step's only host
synchronisation; the host dispatch (:func:`moe.dispatch_experts`, the CPU's)
adds one per MoE layer, its ``[E]`` counts. Timings add none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moeguard_runtime.api.tokenizer import EOS
from moeguard_runtime.engine.grammar import Constraint
from moeguard_runtime.engine.sampling import (
    GREEDY,
    SamplingParams,
    sample_on_device,
    token_logprobs,
    unpack_logprobs,
)
from moeguard_runtime.model.model import KVCache, Segment
from moeguard_runtime.model.moe import RoutingStats, read_back
from moeguard_runtime.model.serving import ServingModel


@dataclass
class SequenceState:
    """One sequence being generated.

    ``num_computed``: tokens whose keys/values are in ``cache`` (prompt tokens
    prefilled so far, then one more per decode step).
    """

    seq_id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    generator: torch.Generator
    cache: KVCache
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    params: SamplingParams = GREEDY
    constraint: Constraint | None = None

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclass(frozen=True)
class StepOutput:
    """Result of one step.

    Attributes:
        new_tokens: token sampled for each sequence that produced one this step
            (decoded sequences and sequences whose last prefill chunk ran).
        finished: ``finish_reason`` ("stop" on EOS, "length" at max_new_tokens)
            of sequences that finished this step.
        routing: per-layer routing statistics of the whole step.
        prefill_tokens: prompt tokens processed; decode_tokens: decode tokens.
        logprobs: for each sequence in ``new_tokens`` that asked for them
            (``SamplingParams.logprobs``): the new token's log probability and the
            most likely tokens' ``(id, logprob)``, most likely first.
    """

    new_tokens: dict[str, int]
    finished: dict[str, str]
    routing: list[RoutingStats]
    prefill_tokens: int
    decode_tokens: int
    logprobs: dict[str, tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=dict)


class Engine:
    """Owns the model and the sequences' KV caches. Not thread-safe: one thread drives it."""

    def __init__(self, model: ServingModel, eos_ids: frozenset[int] | None = None) -> None:
        """``eos_ids``: token ids that end a sequence (``finish_reason`` "stop"): the serving
        tokenizer's end-of-sequence ids; default the byte tokenizer's EOS (the presets')."""
        self.model = model
        self.eos_ids = frozenset((EOS,)) if eos_ids is None else frozenset(eos_ids)
        self.args = model.args
        first = next(model.parameters())
        self.dtype = first.dtype
        self.device = first.device
        """Where the KV caches, token tensors and sampling generators live: the weights' device."""
        self.sequences: dict[str, SequenceState] = {}

    def add(self, seq_id: str, prompt: list[int], max_new_tokens: int,
            temperature: float = 0.0, seed: int | None = None,
            params: SamplingParams = GREEDY, constraint: Constraint | None = None) -> SequenceState:
        """Register a sequence; allocates its KV cache (prompt + max_new_tokens). ``params``:
        its penalties, filters and log probabilities (:mod:`sampling`); ``constraint``: its
        grammar (:mod:`grammar`), None for free text.

        Raises:
            ValueError: empty prompt, max_new_tokens below 1, or prompt + max_new_tokens over max_seq_len.
        """
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if max_new_tokens < 1:  # else a prompt longer than the context passed the sum's check below
            raise ValueError(f"max_new_tokens must be >= 1, given {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.args.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens must be <= {self.args.max_seq_len}")
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()  # a fresh non-deterministic seed for this generator; the global one is untouched
        else:
            gen.manual_seed(seed)
        cache = self.model.new_cache(len(prompt) + max_new_tokens, self.dtype, self.device)
        seq = SequenceState(seq_id, list(prompt), max_new_tokens, temperature, gen, cache, params=params,
                            constraint=constraint)
        self.sequences[seq_id] = seq
        return seq

    def add_prefilled(self, seq_id: str, prompt: list[int], max_new_tokens: int, first_token: int,
                      temperature: float = 0.0, seed: int | None = None, params: SamplingParams = GREEDY,
                      constraint: Constraint | None = None) -> SequenceState:
        """Register a sequence whose prompt another worker prefilled (disaggregated prefill/decode, issue 33):
        its cache is allocated as :meth:`add` allocates it and counted prefilled (``num_computed`` = the
        prompt), ``first_token`` (the prefill's sample) is its first generated token. The caller fills the
        cache's first ``len(prompt)`` positions (:meth:`moeguard_runtime.disagg.nixl_kv.NixlKV.pull`) before
        the sequence's first decode step. A ``first_token`` that ends the sequence (EOS, a refusing grammar,
        ``max_new_tokens == 1``) sets ``finish_reason`` at once.

        A seeded sampled request does not draw what the single worker would: the first token was drawn by
        the prefill worker's generator, this one starts fresh from ``seed``. Greedy decoding is identical.

        Raises:
            ValueError: as :meth:`add`.
        """
        seq = self.add(seq_id, prompt, max_new_tokens, temperature, seed, params, constraint)
        seq.num_computed = len(seq.prompt)
        seq.generated.append(first_token)
        refused = constraint is not None and first_token not in self.eos_ids and not constraint.advance(first_token)
        if first_token in self.eos_ids or refused:
            seq.finish_reason = "stop"
        elif max_new_tokens <= 1:
            seq.finish_reason = "length"
        return seq

    def release(self, seq_id: str) -> None:
        """Forget a sequence and free its KV cache (no error if unknown)."""
        self.sequences.pop(seq_id, None)

    def kv_cache_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self.sequences.values())

    def step(self, prefill: Sequence[tuple[str, int]], decode: Sequence[str]) -> StepOutput:
        """Run one forward pass.

        Args:
            prefill: ``(seq_id, n)``: prefill the next ``n`` prompt tokens.
            decode: sequences (fully prefilled, not finished) to advance one token.
        """
        tokens: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        order: list[SequenceState] = []
        for seq_id, n in prefill:
            seq = self.sequences[seq_id]
            start = seq.num_computed
            if n < 1 or start + n > len(seq.prompt):
                raise ValueError(f"bad prefill chunk for {seq_id}: {start}+{n} of {len(seq.prompt)}")
            tokens += seq.prompt[start:start + n]
            positions += range(start, start + n)
            segments.append(Segment(seq.cache, start, n))
            order.append(seq)
        for seq_id in decode:
            seq = self.sequences[seq_id]
            if not seq.prefilled or not seq.generated or seq.finish_reason is not None:
                raise ValueError(f"sequence {seq_id} cannot decode")
            tokens.append(seq.generated[-1])
            positions.append(seq.num_computed)
            segments.append(Segment(seq.cache, seq.num_computed, 1))
            order.append(seq)
        if not segments:
            return StepOutput({}, {}, [], 0, 0)
        with torch.inference_mode():
            logits, routing = self.model(torch.tensor(tokens, device=self.device),
                                         torch.tensor(positions, device=self.device), segments)
        sampling: list[tuple[SequenceState, torch.Tensor]] = []
        wanted: list[tuple[SequenceState, torch.Tensor]] = []  # the packed log probabilities asked for
        for i, (seq, segment) in enumerate(zip(order, segments, strict=True)):
            seq.num_computed += segment.length
            if seq.prefilled:  # else a middle prefill chunk: nothing to sample yet
                row = logits[i] if seq.constraint is None else logits[i].masked_fill(
                    ~seq.constraint.allowed(logits.device), float("-inf"))
                token = sample_on_device(row, seq.temperature, seq.generator, seq.params, seq.prompt,
                                         seq.generated)
                sampling.append((seq, token))
                if seq.params.logprobs is not None:
                    wanted.append((seq, token_logprobs(logits[i], token, seq.params.logprobs)))
        # The step's one host transfer: every sampled token id, with the routing counts
        # that are still on the device (the device dispatch's).
        stats, ids = read_back(list(routing), torch.stack([t for _, t in sampling]) if sampling else None)
        logprobs: dict[str, tuple[float, tuple[tuple[int, float], ...]]] = {}
        if wanted:  # one more transfer, only in a step where a request asked for log probabilities
            host = torch.cat([p for _, p in wanted]).tolist()
            at = 0
            for seq, packed in wanted:
                k = seq.params.logprobs or 0
                logprobs[seq.seq_id] = unpack_logprobs(host[at:at + packed.numel()], k)
                at += packed.numel()
        new_tokens: dict[str, int] = {}
        finished: dict[str, str] = {}
        for (seq, _), tok in zip(sampling, ids, strict=True):
            seq.generated.append(tok)
            new_tokens[seq.seq_id] = tok
            # a grammar that refused the token (the mask allowed it, so only a matcher error) ends the text: "stop"
            refused = seq.constraint is not None and tok not in self.eos_ids and not seq.constraint.advance(tok)
            if tok in self.eos_ids or refused:
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.max_new_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                finished[seq.seq_id] = seq.finish_reason
        n_prefill = sum(n for _, n in prefill)
        return StepOutput(new_tokens, finished, stats, n_prefill, len(decode), logprobs)
