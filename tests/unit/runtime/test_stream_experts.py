"""A layer's routed experts in one call of the ``stream`` library (:func:`stream_kernel.try_experts`, issue 31)
against the dispatch's per-expert loop, and when :func:`moe.dispatch_experts` takes it.

Tolerances: float32 results agree with the loop on ``F.linear`` within fp32 round-off (``rtol=atol=1e-5``: the
kernel and MKL sum the products in different orders, and silu's exp is the kernel's own); with bfloat16 weights
the reference is the float32 product of the same bf16 values, the fused result rounded once to bfloat16
(``rtol=1.6e-2, atol=1e-2``, as test_stream_kernel.py's), and the bf16 loop, which rounds ``h``, the activation
and every expert's output, within ``rtol=atol=3e-2``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from bench.hf_reference import hf_expert_loop

from moeguard_runtime.model import moe, stream_kernel
from moeguard_runtime.model.moe import KernelPlan, MatmulChoice, dispatch_experts

pytestmark = pytest.mark.unit

needs_kernel = pytest.mark.skipif(stream_kernel.unavailable() is not None,
                                  reason=f"stream kernel not available here: {stream_kernel.unavailable()}")

SHAPES = [  # (tokens, D, I, E, k)
    (16, 64, 48, 8, 2),
    (5, 37, 13, 4, 2),  # D and I not multiples of 4, 8 or 16: every scalar tail
    (1, 40, 24, 8, 2),  # one token (a lone sequence's decode)
    (7, 33, 17, 6, 3),
    (96, 100, 70, 8, 2),  # 192 slots, up to the small-batch bound
    (3, 1024, 2816, 2, 2),  # the benchmark's expert shape, two experts
]
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def _layer(tokens: int, dim: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype = torch.float32,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, weights, experts, w13, w2)``: random hidden states routed by a random gate (Mixtral's router)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, dim, generator=gen) / dim ** 0.5
    w2 = torch.randn(num_experts, dim, inter, generator=gen) / inter ** 0.5
    weights, experts = moe.route(x @ torch.randn(num_experts, dim, generator=gen).T, top_k)
    return x.to(dtype), weights, experts, w13.to(dtype), w2.to(dtype)


def _loop(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
          capacity: int | None = None) -> torch.Tensor:
    """The per-expert loop on ``F.linear`` (the ``torch`` kernel never takes the fused call)."""
    return dispatch_experts(x, weights, experts, w13, w2, capacity=capacity, backend="torch")[0]


class Spy:
    """Records :func:`stream_kernel.try_experts`' calls, passing them on (or declining: ``run=False``)."""

    def __init__(self, run: bool = True) -> None:
        self.calls = 0
        self.run = run
        self.real = stream_kernel.try_experts

    def __call__(self, *args: object) -> bool:
        self.calls += 1
        return self.real(*args) if self.run else False  # type: ignore[arg-type]


@needs_kernel
@pytest.mark.parametrize(("tokens", "dim", "inter", "num_experts", "top_k"), SHAPES)
def test_float32_matches_the_loop(tokens: int, dim: int, inter: int, num_experts: int, top_k: int, threads: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    x, weights, experts, w13, w2 = _layer(tokens, dim, inter, num_experts, top_k)
    spy = Spy()
    monkeypatch.setattr(stream_kernel, "try_experts", spy)
    out, counts, overflow = dispatch_experts(x, weights, experts, w13, w2, backend="stream")
    assert spy.calls == 1 and sum(counts) == tokens * top_k and overflow == 0
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, _loop(x, weights, experts, w13, w2), **FP32_TOL)


@needs_kernel
@pytest.mark.parametrize(("tokens", "dim", "inter", "num_experts", "top_k"), SHAPES)
def test_bfloat16_weights_match_the_float32_product_of_their_values(
        tokens: int, dim: int, inter: int, num_experts: int, top_k: int, threads: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    x, weights, experts, w13, w2 = _layer(tokens, dim, inter, num_experts, top_k, torch.bfloat16)
    spy = Spy()
    monkeypatch.setattr(stream_kernel, "try_experts", spy)
    out = dispatch_experts(x, weights, experts, w13, w2, backend="stream")[0]
    assert spy.calls == 1 and out.dtype == torch.bfloat16
    ref = _loop(x.float(), weights, experts, w13.float(), w2.float())
    torch.testing.assert_close(out, ref.to(torch.bfloat16), **BF16_TOL)
    torch.testing.assert_close(out, _loop(x, weights, experts, w13, w2), rtol=3e-2, atol=3e-2)


@needs_kernel
def test_the_call_itself_adds_weighted_experts_into_out() -> None:
    """The library call without the dispatch: a float32 ``x`` with bfloat16 weights, added into an ``out`` that
    holds values already, against ``swiglu_expert`` on ``F.linear`` expert by expert."""
    x, weights, experts, w13, w2 = _layer(6, 48, 40, 4, 2, torch.float32, seed=4)
    w13b, w2b = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    slot_token, slot_weight = order // 2, weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=4).tolist()
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    start = torch.randn(6, 48, generator=torch.Generator().manual_seed(9))
    out = start.clone()
    assert stream_kernel.try_experts(x, bounds, slot_token, slot_weight, w13b, w2b, out)
    ref = start.clone()
    for e in range(4):
        tok = slot_token[bounds[e]:bounds[e + 1]]
        y = moe.swiglu_expert(x[tok], w13b[e].float(), w2b[e].float(), "torch")
        ref.index_add_(0, tok, y * slot_weight[bounds[e]:bounds[e + 1], None])
    torch.testing.assert_close(out, ref, **FP32_TOL)


@needs_kernel
def test_a_token_repeated_within_an_expert_adds_each_slot(threads: int) -> None:
    """Not what top-k routes (a token's experts are distinct), but the call's contract: each slot is added."""
    x, _, _, w13, w2 = _layer(3, 24, 20, 2, 1, seed=7)
    tok, wt = torch.tensor([1, 1, 2, 1, 0]), torch.tensor([0.5, 0.25, 1.0, 2.0, 1.0])
    out = torch.zeros(3, 24)
    assert stream_kernel.try_experts(x, [0, 3, 5], tok, wt, w13, w2, out)
    ref = torch.zeros(3, 24)
    for s, e in enumerate([0, 0, 0, 1, 1]):
        ref[tok[s]] += wt[s] * moe.swiglu_expert(x[tok[s]][None], w13[e], w2[e], "torch")[0]
    torch.testing.assert_close(out, ref, **FP32_TOL)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_idle_experts_one_busy_expert_and_capacity_drops(dtype: torch.dtype, threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    monkeypatch.setattr(stream_kernel, "try_experts", spy)
    x, weights, _, w13, w2 = _layer(12, 40, 36, 8, 2, dtype, seed=2)
    to_two = torch.tensor([[5, 2], [2, 5]] * 6)  # experts 0, 1, 3, 4, 6, 7 get nothing
    everyone = torch.full((12, 1), 3)  # k=1, every slot on expert 3
    cases = [(weights, to_two, None), (torch.ones(12, 1), everyone, None), (weights, to_two, 4),
             (torch.ones(12, 1), everyone, 5)]
    for w, chosen, capacity in cases:
        out, counts, overflow = dispatch_experts(x, w, chosen, w13, w2, capacity=capacity, backend="stream")
        assert overflow == (0 if capacity is None else sum(c - min(c, capacity) for c in counts))
        ref = _loop(x.float(), w, chosen, w13.float(), w2.float(), capacity)
        torch.testing.assert_close(out, ref.to(dtype), **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
    assert spy.calls == len(cases)


@needs_kernel
def test_silu_is_within_three_ulps_of_float64() -> None:
    """Weights that make every matmul exact (one product of 1.0 per output): ``out`` is silu of ``x``'s values
    itself, from -90 to 90 (past exp's clamp at +-88.38: silu is about 0 there, off by 4e-37 at most) and near 0, through the vector path (8 at a time) and
    the scalar tail (I = 255)."""
    inter, tokens = 255, 64
    v = torch.cat([torch.linspace(-90.0, 90.0, tokens * inter - 200), torch.linspace(-1e-3, 1e-3, 200)])
    x = torch.cat([v.reshape(tokens, inter), torch.ones(tokens, 1)], dim=1)  # [T, I + 1], the last column 1
    w13 = torch.zeros(1, 2 * inter, inter + 1)
    w13[0, :inter, :inter] = torch.eye(inter)  # gate = v
    w13[0, inter:, inter] = 1.0  # up = 1
    w2 = torch.zeros(1, inter + 1, inter)
    w2[0, :inter] = torch.eye(inter)
    out = torch.zeros(tokens, inter + 1)
    assert stream_kernel.try_experts(x, [0, tokens], torch.arange(tokens), torch.ones(tokens), w13, w2, out)
    got = out[:, :inter].reshape(-1).double()
    exact = v.double() * torch.sigmoid(v.double())
    normal = v >= -88.0  # e^-v under exp's clamp at 88.38
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.float())[1] - 24)  # a float32 ulp of each value
    assert ((got - exact).abs() / ulp)[normal].max().item() <= 3.0
    assert (got - exact)[~normal].abs().max().item() < 1e-36  # the kernel's v / 2.4e38 at worst
    assert (~normal).sum().item() > 0


@needs_kernel
def test_what_the_call_does_not_take_it_declines_and_bad_routing_raises() -> None:
    x, _, _, w13, w2 = _layer(4, 16, 8, 2, 1)
    tok, wt = torch.tensor([0, 1, 2, 3]), torch.ones(4)
    out = torch.zeros(4, 16)
    for args in ((x.to(torch.bfloat16), w13.to(torch.bfloat16), w2.to(torch.bfloat16), out),  # x not float32
                 (x, w13.half(), w2.half(), out),  # float16 weights
                 (x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, out),  # a non-contiguous weight
                 (x, w13, w2.to(torch.bfloat16), out),  # two dtypes
                 (x, w13, w2, out.to(torch.bfloat16))):  # out not float32
        assert not stream_kernel.try_experts(args[0], [0, 2, 4], tok, wt, args[1], args[2], args[3])
    with pytest.raises(ValueError, match=r"stream experts: x \(4, 16\), w13 \(2, 16, 16\), w2 \(2, 16, 8\), "
                                         r"2 bounds ending at 4"):
        stream_kernel.try_experts(x, [0, 4], tok, wt, w13, w2, out)
    with pytest.raises(ValueError, match="a slot's token is out of range"):
        stream_kernel.try_experts(x, [0, 2, 4], torch.tensor([0, 1, 2, 4]), wt, w13, w2, out)
    for bounds in ([0, 5, 4], [1, 2, 4]):  # descending; not from 0
        with pytest.raises(ValueError, match="invalid bounds or sizes"):
            stream_kernel.try_experts(x, bounds, tok, wt, w13, w2, out)
    assert out.abs().sum().item() == 0.0  # nothing added where it raised
    assert stream_kernel.try_experts(x, [0, 3, 4], tok, wt, w13, w2, out)
    assert out.abs().sum().item() > 0.0


@needs_kernel
def test_the_library_is_the_experts_interface() -> None:
    lib = stream_kernel._load()[0]
    assert lib is not None and lib.moeguard_stream_version() == stream_kernel.INTERFACE_VERSION == 2


MIXED = KernelPlan((1, 4, 256), ("stream", "onednn", "stream"))
"""``stream`` for 1 row and for 5-256 rows, ``onednn`` for 2-4."""


@pytest.mark.parametrize(("backend", "experts", "chunk", "fused"), [
    ("stream", [[0, 1], [1, 2]], 2048, True),
    (KernelPlan((16, 256), ("stream", "stream")), [[0, 1], [1, 2]], 2048, True),
    (MIXED, [[0, 1], [2, 3]], 2048, True),  # every expert 1 row: the stream bucket
    (MIXED, [[0, 1], [0, 3]], 2048, False),  # expert 0 has 2 rows: oneDNN's bucket
    (MIXED, [[0, 1]] * 5, 2048, True),  # 5 rows each
    ("stream", [[0, 1]] * 5, 4, False),  # 5 rows in chunks of 4: the loop chunks them
    ("torch", [[0, 1], [1, 2]], 2048, False),
    ("onednn", [[0, 1], [1, 2]], 2048, False),
])
def test_the_dispatch_takes_the_call_only_where_the_plan_runs_every_expert_on_stream(
        backend: MatmulChoice, experts: list[list[int]], chunk: int, fused: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pure logic (a spy that declines, so the loop runs after it either way): asked once per layer exactly when
    :func:`moe.fused_stream` holds; the result is the loop's either way."""
    spy = Spy(run=False)
    monkeypatch.setattr(stream_kernel, "try_experts", spy)
    chosen = torch.tensor(experts)
    x, weights, _, w13, w2 = _layer(chosen.shape[0], 16, 8, 4, 2, seed=3)
    kept = torch.bincount(chosen.reshape(-1), minlength=4).tolist()
    assert moe.fused_stream(x, kept, backend, chunk) is fused
    out = dispatch_experts(x, weights, chosen, w13, w2, expert_chunk_tokens=chunk, backend=backend)[0]
    assert spy.calls == int(fused)
    torch.testing.assert_close(out, _loop(x, weights, chosen, w13, w2), **FP32_TOL)


def test_large_batches_packed_weights_and_empty_layers_keep_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(run=False)
    monkeypatch.setattr(stream_kernel, "try_experts", spy)
    x, weights, experts, w13, w2 = _layer(moe.SMALL_BATCH_SLOTS // 2 + 1, 16, 8, 4, 2)  # 258 slots
    dispatch_experts(x, weights, experts, w13, w2, backend="stream")
    assert spy.calls == 0
    assert not moe.fused_stream(x, [1, 2], "stream", 2048, packed=True)
    assert not moe.fused_stream(x, [0, 0], "stream", 2048)
    dispatch_experts(x[:0], weights[:0], experts[:0], w13, w2, backend="stream")
    assert spy.calls == 0


@needs_kernel
def test_a_decode_step_of_the_module_matches_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    """:class:`moe.MOEFeedForward` on ``stream``: the fused call, HF's expert loop's result."""
    spy = Spy()
    monkeypatch.setattr(stream_kernel, "try_experts", spy)
    gen = torch.Generator().manual_seed(6)
    ff = moe.MOEFeedForward(32, 48, 8, 2, matmul_backend="stream", dispatch="host")
    gate = torch.randn(8, 32, generator=gen)
    w1, w3 = (torch.randn(8, 48, 32, generator=gen) / 32 ** 0.5 for _ in range(2))
    w2 = torch.randn(8, 32, 48, generator=gen) / 48 ** 0.5
    with torch.no_grad():
        ff.gate.weight.copy_(gate)
        ff.w1.copy_(w1)
        ff.w3.copy_(w3)
        ff.w2.copy_(w2)
        x = torch.randn(4, 32, generator=gen)
        out, stats = ff(x)
    assert spy.calls == 1 and isinstance(stats, moe.RoutingStats) and stats.expert_chunks == 1
    torch.testing.assert_close(out, hf_expert_loop(x, gate, w1, w2, w3, 2), **FP32_TOL)
