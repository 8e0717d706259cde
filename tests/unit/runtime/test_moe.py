"""Grouped dispatch against HF ``MixtralSparseMoeBlock``'s expert loop, and routing stats."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bench.hf_reference import hf_expert_loop

from moeguard_core import presets
from moeguard_runtime.model import moe
from moeguard_runtime.model.moe import (
    MOEFeedForward,
    dispatch_experts,
    fuse_gate_up,
    route,
    routing_stats,
)

pytestmark = pytest.mark.unit


def _weights(E: int = 8, D: int = 32, I: int = 48, seed: int = 0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, D, generator=g), torch.randn(E, I, D, generator=g) / D**0.5,
            torch.randn(E, D, I, generator=g) / I**0.5, torch.randn(E, I, D, generator=g) / D**0.5)


@pytest.mark.parametrize("chunk", [2048, 7, 1])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_dispatch_matches_hf_loop(chunk: int, top_k: int) -> None:
    gate, w1, w2, w3 = _weights()
    x = torch.randn(97, 32, generator=torch.Generator().manual_seed(1))
    weights, experts = route(x @ gate.T, top_k)
    out, counts, _ = dispatch_experts(x, weights, experts, fuse_gate_up(w1, w3), w2, expert_chunk_tokens=chunk)
    ref = hf_expert_loop(x, gate, w1, w2, w3, top_k)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert sum(counts) == 97 * top_k
    # chunk smaller than the top expert's slice really chunks
    assert chunk >= 2048 or max(counts) > chunk


def test_module_matches_hf_loop_with_skewed_input() -> None:
    """All tokens identical: one pair of experts takes every slot, chunked at 5."""
    gate, w1, w2, w3 = _weights()
    ff = MOEFeedForward(32, 48, 8, 2, expert_chunk_tokens=5)
    with torch.no_grad():
        ff.gate.weight.copy_(gate)
        ff.w1.copy_(w1)
        ff.w2.copy_(w2)
        ff.w3.copy_(w3)
    x = torch.randn(1, 32).expand(40, 32).contiguous()
    with torch.no_grad():
        out, stats = ff(x)
    torch.testing.assert_close(out, hf_expert_loop(x, gate, w1, w2, w3, 2), rtol=1e-5, atol=1e-5)
    assert sorted(stats.tokens_per_expert) == [0] * 6 + [40, 40]
    assert stats.expert_skew_ratio == 40.0  # median 0 floored at 1
    assert stats.balancedness == pytest.approx(10 / 40)


def test_router_weights_sum_to_one_and_are_top_k() -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, experts = route(logits, 2)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    assert experts.shape == (50, 2)
    ranked = torch.argsort(logits.float(), dim=-1, descending=True)[:, :2]
    assert torch.equal(experts, ranked)
    assert bool((weights[:, 0] >= weights[:, 1]).all())


@pytest.mark.parametrize(("counts", "skew", "balancedness"), [
    ([4, 4, 4, 4, 4, 4, 4, 4], 1.0, 1.0),
    ([32, 0, 0, 0, 0, 0, 0, 0], 32.0, 4 / 32),  # median 0 floored at 1
    ([10, 2, 2, 2, 2, 2, 2, 2], 5.0, 3 / 10),
    ([9, 1, 3, 5, 0, 0, 0, 6], 9 / 2, 3 / 9),  # median of 0,0,0,1,3,5,6,9 = (1+3)/2
    ([0, 0, 0, 0], 0.0, 1.0),  # empty batch
])
def test_skew_ratio_and_balancedness(counts: list[int], skew: float, balancedness: float) -> None:
    s = routing_stats(torch.tensor(counts))
    assert s.expert_skew_ratio == pytest.approx(skew)
    assert s.balancedness == pytest.approx(balancedness)
    assert s.routed_slots == sum(counts)
    assert s.top_expert_tokens == max(counts)


def test_capacity_follows_deepspeed_formula() -> None:
    from moeguard_runtime.model.moe import expert_capacity

    assert expert_capacity(100, 2, 8, 1.25) == 32  # ceil(100*2/8*1.25) = ceil(31.25)
    assert expert_capacity(3, 2, 8, 1.0) == 4  # min_capacity
    assert expert_capacity(64, 1, 8, 2.0, min_capacity=1) == 16


def test_capacity_drops_and_counts_overflow_first_choices_first() -> None:
    gate, w1, w2, w3 = _weights()
    x = torch.randn(1, 32).expand(40, 32).contiguous()  # every token picks the same 2 experts
    weights, experts = route(x @ gate.T, 2)
    out, counts, overflow = dispatch_experts(x, weights, experts, fuse_gate_up(w1, w3), w2, capacity=10)
    assert sorted(counts)[-2:] == [40, 40] and overflow == 60
    # tokens 0..9 keep both experts (renormalized weights = the dropless ones); others get nothing
    full, _, _ = dispatch_experts(x, weights, experts, fuse_gate_up(w1, w3), w2)
    torch.testing.assert_close(out[:10], full[:10], rtol=1e-5, atol=1e-5)
    assert float(out[10:].abs().max()) == 0.0
    ff = MOEFeedForward(32, 48, 8, 2, capacity_factor=1.0)
    for p in ff.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():
        _, stats = ff(x)
    assert stats.overflow_tokens == 80 - 2 * 10  # capacity ceil(40*2/8*1) = 10 per expert


def test_dropless_is_the_default() -> None:
    ff = MOEFeedForward(32, 48, 8, 2)
    assert ff.capacity_factor == 0.0
    for p in ff.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():
        _, stats = ff(torch.randn(1, 32).expand(64, 32).contiguous())
    assert stats.overflow_tokens == 0 and stats.routed_slots == 128


def test_memory_returns_to_baseline_after_a_batch() -> None:
    """malloc's bytes in use (glibc mallinfo2) after a prefill batch and the release
    of its KV cache equal those before it, within 256 KiB, though the batch
    itself allocated far more (activations, expert buffers, the KV cache)."""
    from moeguard_core.presets import ModelArgs
    from moeguard_runtime.engine.engine import Engine
    from moeguard_runtime.memory.procmem import malloc_in_use
    from moeguard_runtime.model.model import build_model

    if malloc_in_use() is None:
        pytest.skip("needs glibc mallinfo2")
    args = ModelArgs(n_layer=2, dim=256, n_head=4, n_kv_head=2, intermediate_size=512,
                     num_experts=8, top_k=2, max_seq_len=2048)
    engine = Engine(build_model(args, seed=0, expert_chunk_tokens=256))
    prompt = [i % 256 for i in range(1500)]

    def batch(name: str) -> int:
        engine.add(name, prompt, 4)
        engine.step([(name, len(prompt))], [])
        peak = engine.kv_cache_bytes()
        engine.release(name)
        return peak

    batch("warm-up")
    before = malloc_in_use()
    assert before is not None
    kv = batch("measured")
    after = malloc_in_use()
    assert after is not None
    assert kv > 2 << 20
    assert abs(after - before) < 256 << 10, (before, after)


@pytest.mark.parametrize("backend", moe.MATMUL_BACKENDS)
@pytest.mark.parametrize("tokens", [1, 3, 16, 200])
def test_small_and_large_batches_match_the_reference_with_either_matmul(
        tokens: int, backend: moe.MatmulBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to SMALL_BATCH_SLOTS token-slots (decode) the experts' rows are combined in
    one index_add_, above it chunk by chunk; oneDNN or F.linear for the matmuls:
    the same results as HF's loop either way."""
    assert 2 * 3 <= moe.SMALL_BATCH_SLOTS < 2 * 200
    gate, w1, w2, w3 = _weights()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(5))
    weights, experts = route(x @ gate.T, 2)
    out, _, _ = dispatch_experts(x, weights, experts, fuse_gate_up(w1, w3), w2, expert_chunk_tokens=7,
                                       backend=backend)
    torch.testing.assert_close(out, hf_expert_loop(x, gate, w1, w2, w3, 2), rtol=1e-5, atol=1e-5)
    capped, counts, overflow = dispatch_experts(x, weights, experts, fuse_gate_up(w1, w3), w2, capacity=2,
                                                      backend=backend)
    assert overflow == sum(c - min(c, 2) for c in counts)
    monkeypatch.setattr(moe, "SMALL_BATCH_SLOTS", 0)  # force the chunk-by-chunk combine
    chunked, _, _ = dispatch_experts(x, weights, experts, fuse_gate_up(w1, w3), w2, capacity=2,
                                           backend=backend)
    torch.testing.assert_close(capped, chunked, rtol=1e-6, atol=1e-6)


def test_expert_linear_uses_onednn_on_cpu_float32_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, w: torch.Tensor, *a: object) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, w, *a)  # type: ignore[no-any-return]

    monkeypatch.setattr(moe, "torch", _TorchWithSpy(spy))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 16, generator=g), torch.randn(24, 16, generator=g)
    y = moe.expert_linear(x, w)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)  # padding rows sliced off: [5, 24]
    assert calls == ([(8, 16)] if moe._ONEDNN_LINEAR else [])  # 5 rows padded to the bucket of 8
    bf = moe.expert_linear(x.bfloat16(), w.bfloat16())
    assert bf.dtype == torch.bfloat16  # bf16: oneDNN where it supports bf16, else F.linear
    assert len(calls) == (2 if moe._ONEDNN_BF16 else 1 if moe._ONEDNN_LINEAR else 0)
    n = len(calls)
    assert moe.expert_linear(x[:0], w).shape == (0, 24)
    assert moe.expert_linear(x, w, "torch").shape == (5, 24) and len(calls) == n  # F.linear
    assert moe.expert_linear(x.half(), w.half()).dtype == torch.float16 and len(calls) == n  # fp16: F.linear


def test_the_matmul_backend_is_a_model_parameter() -> None:
    """No module-level switch: the backend travels from the model's construction to
    every MoE layer."""
    from moeguard_runtime.model.model import Transformer

    with torch.device("meta"):
        model = Transformer(presets.get_preset("tiny"), matmul_backend="torch")
    layers = [m for m in model.modules() if isinstance(m, MOEFeedForward)]
    assert layers and all(m.matmul_backend == "torch" for m in layers)
    assert not hasattr(moe, "USE_ONEDNN")


def test_row_buckets_bound_the_shapes_onednn_sees() -> None:
    assert [moe.padded_rows(n) for n in (1, 2, 3, 5, 17, 32, 33, 64, 65, 255, 256)] == \
        [1, 2, 4, 8, 32, 32, 64, 64, 96, 256, 256]
    assert len({moe.padded_rows(n) for n in range(1, 257)}) == 13


class _TorchWithSpy:
    """``torch`` as moe.py sees it, with ``ops.mkldnn._linear_pointwise`` replaced."""

    def __init__(self, spy: object) -> None:
        self._spy = spy

    def __getattr__(self, name: str) -> object:
        if name == "ops":
            return _Ns(mkldnn=_Ns(_linear_pointwise=self._spy))
        return getattr(torch, name)


class _Ns:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)
