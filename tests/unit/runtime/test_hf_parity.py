"""Each HF family loaded by the worker computes what ``transformers`` computes.

For every family: a tiny random configuration with a real vocabulary (32,000),
``transformers``' own model class built with a fixed seed (weights redrawn at
unit scale so routing, norms and biases matter), ``save_pretrained`` to a
folder, loaded by :func:`moeguard_runtime.model.hf_checkpoint.load_hf_checkpoint`:

* fp32 last-token logits of prompts of different lengths, packed in one step:
  relative error ``max|ours - hf| / max|hf|`` at most 1e-4;
* 32 greedy tokens per prompt through the worker's own loop (scheduler, continuous
  batching, chunked prefill of 8 tokens, three concurrent requests) equal to
  ``generate(do_sample=False)`` token for token;
* the same with the MoE guardrails forced on: experts processed 2 token-slots at
  a time and a capacity limit set (``capacity_factor = E / k``: a limit of T
  slots per expert, which no routing exceeds, so nothing may be dropped);
* the log probabilities the worker returns with those greedy tokens (the sampled
  token's and the 5 most likely) within 1e-4 of ``log_softmax`` of
  ``generate(output_logits=True)``'s raw logits, the same 5 tokens in the same order.

``transformers`` is the reference, imported by this test only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from moeguard_runtime.config import load_settings
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.sampling import GREEDY, SamplingParams
from moeguard_runtime.engine.service import Event, GenerationRequest, Worker
from moeguard_runtime.memory.memory import MemoryReading
from moeguard_runtime.model.families.decoder import SparseMoE
from moeguard_runtime.model.hf_checkpoint import (
    LoadedCheckpoint,
    load_hf_checkpoint,
    read_checkpoint_info,
)
from moeguard_runtime.model.hf_config import BuildOptions
from moeguard_runtime.model.model import KVCache, Segment
from moeguard_runtime.model.moe import MOEFeedForward
from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

pytestmark = pytest.mark.unit
transformers.utils.logging.disable_progress_bar()  # its tqdm would start a monitor thread

VOCAB = 32_000
NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 13, 21)
MAX_REL_ERR = 1e-4
MAX_LOGPROB_ERR = 1e-4
"""The issue's parity bound for log probabilities (absolute, nats)."""
TOP_LOGPROBS = 5
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, tie_word_embeddings=False)


@dataclass(frozen=True)
class Family:
    model_type: str
    make: Callable[[], Any]  # -> a transformers PreTrainedModel


def _mixtral() -> Any:
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=8,
                                     num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def _qwen3() -> Any:
    cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=96,
                                      moe_intermediate_size=48, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=True,
                                      mlp_only_layers=[1])
    return transformers.Qwen3MoeForCausalLM(cfg)


def _qwen2(**kw: Any) -> Any:
    cfg = transformers.Qwen2MoeConfig(**{**COMMON, **kw}, intermediate_size=96,
                                      moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    return transformers.Qwen2MoeForCausalLM(cfg)


def _olmoe() -> Any:
    cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=48, num_experts=8,
                                   num_experts_per_tok=2, clip_qkv=1.5, attention_bias=True,
                                   eos_token_id=2)
    return transformers.OlmoeForCausalLM(cfg)


def _deepseek(**kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        base: dict[str, Any] = dict(
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=24, first_k_dense_replace=1, routed_scaling_factor=2.5,
            num_mtp_layers=0,
            num_key_value_heads=COMMON["num_attention_heads"])  # HF's MLA repeats K/V by H / KvH
        cfg = transformers.DeepseekV3Config(**{**COMMON, **base, **kw})
        return transformers.DeepseekV3ForCausalLM(cfg)
    return make


FAMILIES = {
    "mixtral": Family("mixtral", _mixtral),
    "qwen3_moe": Family("qwen3_moe", _qwen3),
    "qwen2_moe": Family("qwen2_moe", _qwen2),
    "deepseek_v3": Family("deepseek_v3", _deepseek()),
    "olmoe": Family("olmoe", _olmoe),
    # no low-rank query, HF's half-split rotary layout, unnormalized top-k weights
    "deepseek_v3-plain": Family("deepseek_v3", _deepseek(q_lora_rank=None, rope_interleave=False,
                                                         norm_topk_prob=False)),
}
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
LOGITS_ONLY = {
    # YaRN as DeepSeek-V3 ships it (mscale, mscale_all_dim) and as Qwen3 documents it
    "deepseek_v3-yarn": Family("deepseek_v3", _deepseek(
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8})),
    "qwen3_moe-yarn": Family("qwen3_moe", lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=96,
                                    moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                    rope_parameters=YARN))),
    # no lm_head.weight in the file: the LM head is the embedding
    "qwen2_moe-tied": Family("qwen2_moe", lambda: _qwen2(tie_word_embeddings=True)),
}


def _redraw(model: Any, gen: torch.Generator) -> None:
    """Unit-scale weights (HF's init is std 0.02, which makes every router nearly uniform)
    and norms, score-correction biases and projection biases away from their 1 / 0 defaults."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * noise)
            elif t.dim() == 1:  # biases, e_score_correction_bias
                t.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                t.copy_(noise)
            else:
                t.copy_(noise / t.shape[-1] ** 0.5)


@dataclass
class Reference:
    folder: Path
    hf: Any
    prompts: list[list[int]]
    _greedy: dict[str, tuple[list[int], torch.Tensor]] | None = None

    def greedy(self) -> dict[str, list[int]]:
        """``generate``'s greedy tokens of each prompt (computed once per family)."""
        return {r: tokens for r, (tokens, _) in self._generated().items()}

    def logprobs(self) -> dict[str, torch.Tensor]:
        """``log_softmax`` of ``generate``'s raw logits at each greedy token, ``[NEW_TOKENS, V]`` per prompt."""
        return {r: lp for r, (_, lp) in self._generated().items()}

    def _generated(self) -> dict[str, tuple[list[int], torch.Tensor]]:
        if self._greedy is None:
            self._greedy = {str(i): _hf_greedy(self.hf, p) for i, p in enumerate(self.prompts)}
        return self._greedy


_REFERENCES: dict[str, Reference] = {}


def hf_reference(name: str, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """transformers' model ``name`` with redrawn weights, saved once per test session."""
    if name not in _REFERENCES:
        family = {**FAMILIES, **LOGITS_ONLY}[name]
        torch.manual_seed(0)
        hf = family.make()
        hf.config._attn_implementation = "eager"
        gen = torch.Generator().manual_seed(1)
        _redraw(hf, gen)
        hf.eval()
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        _REFERENCES[name] = Reference(folder, hf, prompts)
    return _REFERENCES[name]


def _hf_last_logits(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=False)
    return out.logits[0, -1].float()  # type: ignore[no-any-return]


def _hf_greedy(hf: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """``generate``'s greedy tokens and ``log_softmax`` of its raw logits at each of them (``[NEW_TOKENS, V]``)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    logits = torch.stack([step[0] for step in out.logits]).double()
    return out.sequences[0, len(prompt):].tolist(), torch.log_softmax(logits, dim=-1)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|ours - ref| / max|ref|``."""
    return float((ours - ref).abs().max() / ref.abs().max())


def _packed_logits(loaded: LoadedCheckpoint, caches: list[KVCache], prompts: list[list[int]],
                   start: int) -> torch.Tensor:
    """One packed forward of ``p[start:]`` for every prompt (``start`` -1: one decode token
    each, after the rest was prefilled) → ``[S, V]`` last-token logits."""
    chunks = [p[start:] if start >= 0 else p[-1:] for p in prompts]
    starts = [start if start >= 0 else len(p) - 1 for p in prompts]
    tokens = torch.tensor([t for c in chunks for t in c])
    positions = torch.tensor([s0 + i for c, s0 in zip(chunks, starts, strict=True)
                              for i in range(len(c))])
    segments = [Segment(cache, s0, len(c)) for cache, c, s0 in zip(caches, chunks, starts, strict=True)]
    with torch.inference_mode():
        logits, stats = loaded.model(tokens, positions, segments)
    assert stats and all(s.routed_slots == len(tokens) * loaded.model.args.top_k  # type: ignore[attr-defined]
                         for s in stats)
    return logits


@pytest.mark.parametrize("name", sorted({**FAMILIES, **LOGITS_ONLY}))
def test_logits_match_transformers(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Last-token logits of every prompt, packed in one prefill step, and again as one
    decode step after prefilling all but the last token (MLA's other attention path)."""
    reference = hf_reference(name, tmp_path_factory)
    loaded = load_hf_checkpoint(reference.folder)
    assert loaded.model_type == reference.hf.config.model_type
    assert loaded.max_seq_len == 256
    prompts = reference.prompts
    ref = torch.stack([_hf_last_logits(reference.hf, p) for p in prompts])  # [S, V]
    caches = [loaded.model.new_cache(len(p), torch.float32, "cpu") for p in prompts]
    prefill = _packed_logits(loaded, caches, prompts, 0)
    caches = [loaded.model.new_cache(len(p), torch.float32, "cpu") for p in prompts]
    _packed_logits(loaded, caches, [p[:-1] for p in prompts], 0)
    decode = _packed_logits(loaded, caches, prompts, -1)
    assert prefill.shape == decode.shape == (len(prompts), VOCAB)
    errors = relative_error(prefill, ref), relative_error(decode, ref)
    print(f"\n{name}: max relative error {max(errors):.2e} (prefill {errors[0]:.2e}, "
          f"decode {errors[1]:.2e})")
    assert max(errors) <= MAX_REL_ERR


def _serve(loaded: LoadedCheckpoint, prompts: list[list[int]], sampling: SamplingParams = GREEDY,
           seen: dict[str, list[Event]] | None = None) -> tuple[dict[str, list[int]], Worker]:
    """Greedy generation of every prompt at once, through the worker loop driven by hand; ``seen`` receives
    each request's events."""
    settings = load_settings({"MOEGUARD_MAX_PREFILL_TOKENS": "8", "MOEGUARD_MAX_DECODE_TOKENS": "4"})
    worker = Worker(settings, Engine(loaded.model, eos_ids=frozenset(loaded.eos_token_ids)),
                    Telemetry({"moeis": "s", "namespace": "n", "pod": "p"},
                              loaded.model.args.num_experts),
                    RateLimitedLog(0.0, logger=_Quiet()), clock=lambda: 0.0,
                    memory_reader=lambda: MemoryReading(1, "rss"))
    events: dict[str, list[Event]] = {} if seen is None else seen
    for i, p in enumerate(prompts):
        events[str(i)] = []
        worker.submit(GenerationRequest(str(i), p, NEW_TOKENS, 0.0, sampling=sampling), events[str(i)].append)
    for _ in range(400):
        if all(e and e[-1].kind in ("finish", "error") for e in events.values()):
            break
        worker._iteration()
    for e in events.values():
        assert e[-1].kind == "finish" and e[-1].finish_reason == "length", e[-1]
    return {r: [ev.token for ev in e if ev.kind == "token" and ev.token is not None]
            for r, e in events.items()}, worker


class _Quiet:
    def info(self, event: str, **kw: object) -> None:
        pass


@pytest.mark.parametrize("guardrails", [False, True], ids=["plain", "chunked+capacity"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_tokens_match_transformers(name: str, guardrails: bool,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = hf_reference(name, tmp_path_factory)
    options = BuildOptions()
    if guardrails:
        info = read_checkpoint_info(reference.folder)
        options = BuildOptions(expert_chunk_tokens=2,
                               capacity_factor=info.num_experts / reference.hf.config.num_experts_per_tok)
    loaded = load_hf_checkpoint(reference.folder, options=options)
    ref = reference.greedy()
    seen: dict[str, list[Event]] = {}
    sampling = GREEDY if guardrails else SamplingParams(logprobs=TOP_LOGPROBS)  # log probabilities once a family
    ours, worker = _serve(loaded, reference.prompts, sampling, seen)
    compared = sum(len(t) for t in ours.values())
    print(f"\n{reference.folder.name} guardrails={guardrails}: {compared} tokens compared")
    assert ours == ref
    assert compared == NEW_TOKENS * len(reference.prompts)
    if not guardrails:
        worst = worst_logprob_error(seen, reference.logprobs())
        print(f"{reference.folder.name}: worst log probability error {worst:.2e}")
        assert worst <= MAX_LOGPROB_ERR
    # the routing statistics count every token-slot of every MoE layer; nothing dropped
    samples = [s for m in worker.telemetry.registry.collect() for s in m.samples]
    routed = sum(s.value for s in samples if s.name == "moeguard_expert_tokens_total")
    overflow = sum(s.value for s in samples if s.name == "moeguard_expert_overflow_tokens_total")
    model: Any = loaded.model
    moe_layers = sum(isinstance(m, (SparseMoE, MOEFeedForward)) for m in model.modules())
    tokens = sum(map(len, reference.prompts)) + (NEW_TOKENS - 1) * len(reference.prompts)
    assert routed == tokens * reference.hf.config.num_experts_per_tok * moe_layers
    assert overflow == 0


def worst_logprob_error(seen: dict[str, list[Event]], ref: dict[str, torch.Tensor]) -> float:
    """The largest ``|ours - transformers'|`` over every token event's log probability and its top
    :data:`TOP_LOGPROBS`, whose ids must be transformers' top ones in the same order."""
    worst = 0.0
    for r, events in seen.items():
        tokens = [e for e in events if e.kind == "token"]
        assert len(tokens) == NEW_TOKENS
        for step, event in enumerate(tokens):
            assert event.logprob is not None and len(event.top_logprobs) == TOP_LOGPROBS
            expected = torch.topk(ref[r][step], TOP_LOGPROBS)
            assert [t for t, _ in event.top_logprobs] == expected.indices.tolist()
            errors = [abs(event.logprob - float(ref[r][step, event.token]))] + [
                abs(v - float(ref[r][step, t])) for t, v in event.top_logprobs]
            worst = max(worst, *errors)
    return worst
