"""The GPU path made right on the CPU: GQA attention without a KV copy, the host
synchronisations of one step counted, and stage clocks that synchronise a CUDA
device (a fake one here)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from moeguard_core import presets
from moeguard_runtime.api import tokenizer
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.model import timing
from moeguard_runtime.model.model import Attention, KVCache, Segment, build_model, rope_angles

pytestmark = pytest.mark.unit

ARGS = presets.get_preset("tiny")
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
"""Tensor methods that read a device value on the host (a synchronisation on CUDA)."""


def test_gqa_attention_equals_the_per_head_reference() -> None:
    """Query head j attends with KV head j // (H / KvH) (HF ``repeat_kv``): a prefill
    chunk then a decode token, against a per-head softmax(q k^T / sqrt(hd)) v."""
    assert ARGS.n_head > ARGS.n_kv_head
    torch.manual_seed(0)
    attn = Attention(ARGS, layer=0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    angles = rope_angles(16, ARGS.head_dim, ARGS.rope_base)
    cache = KVCache(ARGS, 8)
    x = torch.randn(6, ARGS.dim)
    with torch.no_grad():
        prefill = attn(x[:5], angles[:5], [Segment(cache, 0, 5)])  # [5, D]
        decode = attn(x[5:], angles[5:6], [Segment(cache, 5, 1)])  # [1, D]
    got = torch.cat([prefill, decode])  # [6, D]
    h, kvh, hd = ARGS.n_head, ARGS.n_kv_head, ARGS.head_dim
    with torch.no_grad():
        from moeguard_runtime.model.model import apply_rope

        q = apply_rope(attn.wqkv(x)[:, :h * hd].view(6, h, hd), angles[:6])  # [6, H, hd]
        heads = []
        for j in range(h):
            k = cache.k[0, j // (h // kvh), :6]  # [6, hd]
            v = cache.v[0, j // (h // kvh), :6]
            scores = q[:, j] @ k.T / math.sqrt(hd)  # [6, 6]
            scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v)  # [6, hd]
        want = attn.wo(torch.stack(heads, dim=1).reshape(6, h * hd))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every host read of a tensor while the fixture is active, by method name."""
    calls: list[str] = []

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            calls.append(name)
            return real(self, *a, **kw)
        return wrapper

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    yield calls


def test_a_step_reads_the_device_once_per_moe_layer_plus_once(host_reads: list[str]) -> None:
    """A mixed step (prefill + decode, greedy and sampled): one transfer of the counts
    per MoE layer (the grouped dispatch's slice bounds) and one of all sampled
    tokens; routing statistics, telemetry marks and sampling add none."""
    engine = Engine(build_model(ARGS, seed=3))
    prompts = {"a": tokenizer.encode("Hello"), "b": tokenizer.encode("Hi")}
    engine.add("a", prompts["a"], 8)
    engine.add("b", prompts["b"], 8, temperature=0.8, seed=1)
    first = engine.step([(r, len(p)) for r, p in prompts.items()], [])
    decode = [r for r in prompts if r not in first.finished]
    assert decode
    hey = tokenizer.encode("Hey")
    engine.add("c", hey, 4, temperature=1.0)
    host_reads.clear()
    out = engine.step([("c", len(hey))], decode)
    assert len(out.new_tokens) == 1 + len(decode) and len(out.routing) == ARGS.n_layer
    assert host_reads == ["tolist"] * (ARGS.n_layer + 1)
    assert all(r.routing_seconds >= 0 and r.expert_seconds >= 0 for r in out.routing)


def test_with_the_device_dispatch_a_step_reads_the_device_once(host_reads: list[str]) -> None:
    """The grouped_mm dispatch (CUDA bfloat16's by default; forced here on the CPU)
    keeps the counts on the device: the step's one transfer carries the sampled
    tokens and every layer's counts."""
    engine = Engine(build_model(ARGS, seed=3, dispatch="device"))
    host = Engine(build_model(ARGS, seed=3, dispatch="host"))
    for e in (engine, host):
        e.add("a", tokenizer.encode("Hello there"), 4)
        e.add("b", tokenizer.encode("Hi"), 4, temperature=0.8, seed=1)
    host_reads.clear()
    out = engine.step([("a", 12), ("b", 3)], [])
    assert host_reads == ["tolist"]
    ref = host.step([("a", 12), ("b", 3)], [])
    assert out.new_tokens == ref.new_tokens
    assert [r.tokens_per_expert for r in out.routing] == [r.tokens_per_expert for r in ref.routing]


@pytest.mark.parametrize("capacity", [None, 2])
@pytest.mark.parametrize("chunk", [1, 7, 2048])
@pytest.mark.parametrize("tokens", [1, 3, 16, 200])
def test_device_dispatch_equals_the_host_dispatch(tokens: int, chunk: int, capacity: int | None) -> None:
    """Same outputs, counts and overflow as :func:`moe.dispatch_experts` (itself tested
    against HF's loop), dropless or with capacity, in any chunking."""
    from moeguard_runtime.model.moe import dispatch_experts, fuse_gate_up, route
    from moeguard_runtime.model.moe_device import device_dispatch

    g = torch.Generator().manual_seed(11)
    gate, w1, w3 = torch.randn(8, 32, generator=g), torch.randn(8, 48, 32, generator=g), \
        torch.randn(8, 48, 32, generator=g)
    w2 = torch.randn(8, 32, 48, generator=g)
    x = torch.randn(tokens, 32, generator=g)
    weights, experts = route(x @ gate.T, 2)
    w13 = fuse_gate_up(w1, w3)
    want, counts, overflow = dispatch_experts(x, weights, experts, w13, w2, chunk, capacity, "torch")
    got, dev_counts, dev_overflow = device_dispatch(x, weights, experts, w13, w2, chunk, capacity)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert dev_counts.tolist() == counts and int(dev_overflow) == overflow


def test_no_global_reseed_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unseeded request gets its own freshly seeded generator; the global one is untouched."""
    def refuse() -> int:
        raise AssertionError("torch.seed() reseeds the global generator")

    monkeypatch.setattr(torch, "seed", refuse)
    engine = Engine(build_model(ARGS, seed=3))
    torch.manual_seed(42)
    before = torch.random.get_rng_state()
    a = engine.add("a", [1, 2], 2, temperature=1.0)
    b = engine.add("b", [1, 2], 2, temperature=1.0)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.generator.initial_seed() != b.generator.initial_seed()
    assert engine.add("c", [1], 1, seed=9).generator.initial_seed() == 9


class FakeEvent:
    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1000.0  # milliseconds, as torch.cuda.Event


def test_the_clock_synchronises_a_cuda_device_first(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(f"sync {device}"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: order.append("clock") or 1.5)
    assert timing.clock(torch.device("cuda:1")) == 1.5
    assert order == ["sync cuda:1", "clock"]
    order.clear()
    assert timing.clock("cpu") == 1.5
    assert order == ["clock"]  # no synchronisation off CUDA


def test_marks_are_events_on_cuda_and_read_without_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[float] = []
    ticks = iter([10.0, 10.25])

    class Event(FakeEvent):
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            super().__init__(next(ticks))

        def record(self) -> None:
            recorded.append(self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronised"))
    start, end = timing.mark("cuda"), timing.mark("cuda")
    assert recorded == [10.0, 10.25]
    assert timing.seconds_between(start, end) == pytest.approx(0.25)
    assert timing.seconds_between(1.0, 3.5) == 2.5  # CPU marks: perf_counter seconds
