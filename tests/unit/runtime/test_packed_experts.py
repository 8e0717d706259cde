"""Expert weights packed once into oneDNN's blocked layout (``onednn_packed``, issue 16).

Tolerances: float32 results agree with ``F.linear`` within fp32 round-off (``rtol=1e-5``,
``atol=1e-5``: oneDNN and MKL sum the products in different orders); bfloat16 results with the
float32 product of the same bf16-rounded operands within ``rtol=atol=2e-2`` (bf16 keeps 8 bits of
mantissa, a relative step of 2**-8 = 3.9e-3 per rounding of the output and of the intermediate).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.unit.runtime.recording_log import RecordingLog

from moeguard_core import presets
from moeguard_runtime.model import kernel_select, moe
from moeguard_runtime.model.moe import KernelPlan, MatmulBackend, PackedExperts

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not moe.can_pack(torch.empty(0)), reason="no oneDNN reorder in this torch build")]

ROWS = (0, 1, 3, 4, 7, 16, 33, 300)
PACKED: MatmulBackend = "onednn_packed"
ALL_PACKED = KernelPlan(kernel_select.ROW_BUCKETS, (PACKED,) * len(kernel_select.ROW_BUCKETS))


def test_packed_bytes_are_onednns_blocked_size() -> None:
    """The weight bytes count the packed layout's real size: equal to the dense one at the benchmark's shape, the
    padding where oneDNN's blocks do not divide the shape."""
    for shape, dtype, ratio in (((5632, 1024), torch.float32, 1.0), ((1024, 2816), torch.bfloat16, 1.0)):
        w = torch.zeros(1, *shape, dtype=dtype)
        if not moe.can_pack(w):
            continue
        assert PackedExperts.pack(w).nbytes == w.numel() * w.element_size() * ratio
    odd = torch.zeros(1, 1001, 999)
    assert odd.numel() * 4 < PackedExperts.pack(odd).nbytes < odd.numel() * 4 * 1.1


def test_a_packed_weight_gives_f_linears_product_at_any_row_count() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 96, 64, generator=g)
    packed = PackedExperts.pack(w)
    assert packed.shape == (3, 96, 64) and packed.dtype == torch.float32 and len(packed) == 3
    assert all(p.is_mkldnn for p in packed)
    assert packed.nbytes == sum(int(torch.ops.mkldnn._nbytes(p)) for p in packed) >= w.numel() * 4
    for rows in ROWS:
        x = torch.randn(rows, 64, generator=g)
        for e in range(3):
            out = moe.expert_linear(x, packed[e], PACKED)
            assert out.shape == (rows, 96)
            torch.testing.assert_close(out, F.linear(x, w[e]), rtol=1e-5, atol=1e-5)
    # a packed weight takes oneDNN whatever the backend says (F.linear cannot read it)
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(moe.expert_linear(x, packed[0], "torch"), F.linear(x, w[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not moe.can_pack(torch.empty(0, dtype=torch.bfloat16)), reason="no oneDNN bf16 here")
def test_bf16_packed_weights_agree_within_bf16_tolerance() -> None:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2, 96, 64, generator=g) / 8).bfloat16()
    packed = PackedExperts.pack(w)
    assert packed.dtype == torch.bfloat16 and packed.nbytes >= w.numel() * 2
    for rows in ROWS:
        x = torch.randn(rows, 64, generator=g).bfloat16()
        out = moe.expert_linear(x, packed[1], PACKED)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w[1].float()), rtol=2e-2, atol=2e-2)


def test_packed_experts_dispatch_as_the_dense_ones() -> None:
    g = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(8, 96, 32, generator=g) / 32**0.5, torch.randn(8, 32, 48, generator=g) / 48**0.5
    gate = torch.randn(8, 32, generator=g)
    p13, p2 = PackedExperts.pack(w13), PackedExperts.pack(w2)
    for tokens in (1, 3, 16, 300):
        x = torch.randn(tokens, 32, generator=g)
        weights, experts = moe.route(x @ gate.T, 2)
        dense, counts, _ = moe.dispatch_experts(x, weights, experts, w13, w2, backend="onednn")
        packed, counts2, _ = moe.dispatch_experts(x, weights, experts, p13, p2, backend=ALL_PACKED)
        assert counts == counts2
        torch.testing.assert_close(packed, dense, rtol=1e-5, atol=1e-5)


def test_the_rule_picks_packed_from_timings() -> None:
    dense = KernelPlan((1, 4, 16, 64, 256), ("onednn",) * 5)

    def seconds(packed: list[float], onednn: list[float] | None = None) -> dict[int, dict[str, float]]:
        onednn = onednn or [1.0] * 5
        return {r: {"onednn": o, "torch": 9.0, PACKED: p}
                for r, o, p in zip(dense.bounds, onednn, packed, strict=True)}

    # the AMD EPYC's figures (ms, 8 experts): a bit slower at 1 row, much faster at 4-16, faster above
    assert kernel_select.packed_wins(seconds([12.5, 10.4, 16.0, 49.5, 174], [11.9, 17.5, 24.7, 60.5, 186]), dense)
    assert not kernel_select.packed_wins(seconds([1.55, 0.5, 0.5, 0.5, 0.5]), dense)  # 55 % lost at 1 row
    assert kernel_select.packed_wins(seconds([1.5, 0.8, 0.8, 0.8, 0.8]), dense)  # 50 % lost: still allowed
    assert not kernel_select.packed_wins(seconds([0.99] * 5), dense)  # 1 % faster: a tie
    assert not kernel_select.packed_wins(seconds([1.1, 1.1, 0.9, 0.9, 1.0]), dense)  # geometric mean 0.998
    no_packed = seconds([0.5] * 5)
    del no_packed[64][PACKED]
    assert not kernel_select.packed_wins(no_packed, dense)
    # against a mixed dense plan each bucket compares with its own kernel
    mixed = KernelPlan((1, 4, 16, 64, 256), ("torch", "torch", "onednn", "onednn", "onednn"))
    assert not kernel_select.packed_wins(seconds([1.0] * 5, [5.0] * 5) | {1: {"onednn": 5, "torch": 0.5, PACKED: 1.0}},
                                         mixed)

    def timer(kernel: MatmulBackend, rows: int) -> float:
        return {"onednn": 2.0, "torch": 3.0, "torch_t": 3.0, "stream": 3.0, PACKED: 1.0}[kernel]

    plan, _ = kernel_select.choose(moe.MATMUL_BACKENDS, timer, reps=1)
    assert plan == ALL_PACKED and plan.label == "onednn_packed" and plan.packed
    plan, _ = kernel_select.choose(moe.MATMUL_BACKENDS, lambda k, r: {PACKED: 3.0}.get(k, 2.0), reps=1)
    # dense ties: onednn, but stream in the decode buckets (kernel_select.FUSED_PREFERENCE)
    assert plan.kernels == ("stream",) * 3 + ("onednn",) * 2 and not plan.packed


def test_the_real_timer_times_packed_copies_of_enough_experts() -> None:
    big13, big2 = torch.empty(8, 2 * 2816, 1024, device="meta"), torch.empty(8, 1024, 2816, device="meta")
    assert kernel_select.probe_experts(big13, big2) == 4  # 34.6 MB each in fp32: 138 MB >= 128 MiB
    assert kernel_select.probe_experts(big13.bfloat16(), big2.bfloat16()) == 8
    assert kernel_select.probe_experts(torch.empty(64, 28672, 4096, device="meta"),
                                       torch.empty(64, 4096, 14336, device="meta")) == 2
    w13, w2 = torch.randn(3, 96, 32), torch.randn(3, 32, 48)
    assert kernel_select.probe_experts(w13, w2) == 3
    timer = kernel_select.expert_timer(w13, w2)
    assert all(0 < timer(PACKED, r) < 1 for r in (1, 4, 5))
    assert not isinstance(w13, PackedExperts) and not w13.is_mkldnn  # the model's weights untouched


def _greedy(model: torch.nn.Module) -> tuple[list[int], list[torch.Tensor]]:
    from moeguard_runtime.api import tokenizer
    from moeguard_runtime.engine.engine import Engine

    logits: list[torch.Tensor] = []
    hook = model.output.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    engine = Engine(model)
    prompt = tokenizer.encode("Packed experts must not change a token.")
    engine.add("a", prompt, 10, temperature=0.0)
    out = engine.step([("a", len(prompt))], [])
    while "a" not in out.finished:
        out = engine.step([], ["a"])
    hook.remove()
    return engine.sequences["a"].generated, logits


def test_a_packed_model_generates_the_dense_models_tokens() -> None:
    from moeguard_runtime.model.model import build_model

    dense = build_model(presets.get_preset("tiny"), seed=3)
    packed = build_model(presets.get_preset("tiny"), seed=3)
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.parameters())
    kernel_select.apply_plan(dense, "onednn")
    assert kernel_select.apply_plan(packed, ALL_PACKED) == presets.get_preset("tiny").n_layer
    mods = [m for m in packed.modules() if hasattr(m, "w13")]
    assert mods and all(isinstance(m.w13, PackedExperts) and isinstance(m.w2, PackedExperts) for m in mods)
    packed_bytes = sum(m.w13.nbytes + m.w2.nbytes for m in mods)
    dense_experts = sum(m.w13.numel() * 4 + m.w2.numel() * 4 for m in dense.modules() if hasattr(m, "w13"))
    assert sum(moe.tensor_bytes(p) for p in packed.parameters()) == dense_bytes - dense_experts + packed_bytes
    assert packed_bytes >= dense_experts
    tokens, logits = _greedy(packed)
    ref_tokens, ref_logits = _greedy(dense)
    assert tokens == ref_tokens and len(tokens) > 1
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a packed layer stays on oneDNN when the others leave it (no dense weight for F.linear)
    moe.leave_onednn(packed)
    assert {m.matmul_backend for m in mods} == {ALL_PACKED}


def test_the_worker_packs_frees_the_dense_weights_and_exports_the_choice(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from moeguard_runtime import __main__ as entry
    from moeguard_runtime.config import load_settings
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

    monkeypatch.setenv(kernel_select.ENV_KERNEL_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(kernel_select, "expert_timer",
                        lambda w13, w2, **_: lambda k, r: {"onednn": 2.0, "torch": 3.0, "torch_t": 3.0, "stream": 3.0, PACKED: 1.0}[k])
    model = build_model(presets.get_preset("tiny"), seed=0)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gone = [weakref.ref(m.w13) for m in model.modules() if isinstance(getattr(m, "w13", None), torch.Tensor)]
    telemetry = Telemetry({"moeis": "m", "namespace": "n", "pod": "p"}, 8)
    kernel = entry.choose_matmul_kernel(load_settings({}), model, telemetry, RateLimitedLog())
    assert kernel == "onednn_packed"
    gc.collect()
    assert gone and all(r() is None for r in gone)  # the dense stacks were freed, not kept beside
    packed_bytes = sum(m.w13.nbytes + m.w2.nbytes for m in model.modules() if isinstance(getattr(m, "w13", None),
                                                                                          PackedExperts))
    dense_experts = sum(r.numel() for r in (m for m in build_model(presets.get_preset("tiny")).parameters())
                        if r.dim() == 3) * 4
    assert telemetry.set_model_weights(model.parameters()) == dense_bytes - dense_experts + packed_bytes
    assert telemetry.registry.get_sample_value(
        "moeguard_matmul_kernel_info", {"moeis": "m", "namespace": "n", "pod": "p", "kernel": "onednn_packed",
                                        "cpu": kernel_select.cpu_model()}) == 1.0
    assert kernel_select.first_experts(model) is None  # nothing dense left to measure


def test_the_worker_does_not_pack_without_room_for_packing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeguard_runtime import __main__ as entry
    from moeguard_runtime.config import load_settings
    from moeguard_runtime.memory import memory
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.telemetry.telemetry import Telemetry

    log = RecordingLog()
    events = log.events

    def telemetry() -> Telemetry:
        return Telemetry({"moeis": "m", "namespace": "n", "pod": "p"}, 8)

    monkeypatch.setenv(kernel_select.ENV_KERNEL_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(kernel_select, "expert_timer",
                        lambda w13, w2, **_: lambda k, r: {"onednn": 2.0, "torch": 3.0, "torch_t": 3.0, "stream": 3.0, PACKED: 1.0}[k])
    model = build_model(presets.get_preset("tiny"), seed=0)
    need = kernel_select.packing_transient_bytes(*(kernel_select.first_experts(model) or ()))
    monkeypatch.setattr(memory, "read_memory", lambda: memory.MemoryReading(10 << 30, "cgroup_v2", (10 << 30) + need - 1))
    kernel = entry.choose_matmul_kernel(load_settings({}), model, telemetry(), log)
    assert kernel == "onednn"  # packing would have won; it did not fit
    assert not any(isinstance(m.w13, PackedExperts) for m in model.modules() if hasattr(m, "w13"))
    assert ("kernel_candidate_skipped", {"kernel": PACKED, "reason": f"packing needs {need} bytes at start-up; "
                                         f"{need - 1} left under the memory limit"}) in events
    # The hard limit counts too: a roomy cgroup, a tight MOEGUARD_HARD_LIMIT_BYTES
    monkeypatch.setattr(memory, "read_memory", lambda: memory.MemoryReading(1 << 30, "cgroup_v2", 64 << 30))
    settings = load_settings({"MOEGUARD_SOFT_LIMIT_BYTES": str(1 << 30),
                              "MOEGUARD_HARD_LIMIT_BYTES": str((1 << 30) + need - 1)})
    again = build_model(presets.get_preset("tiny"), seed=0)
    assert entry.choose_matmul_kernel(settings, again, telemetry(), log) == "onednn"
    monkeypatch.setattr(memory, "read_memory", lambda: memory.MemoryReading(1 << 30, "cgroup_v2", (1 << 30) + need))
    assert entry.choose_matmul_kernel(load_settings({}), again, telemetry(), log) == PACKED


def test_a_forced_packed_kernel_packs_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeguard_runtime import __main__ as entry
    from moeguard_runtime.config import load_settings
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.parallel.ep_worker import follower_kernel
    from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

    def no_timing(w13: torch.Tensor, w2: torch.Tensor, **_: object) -> None:
        raise AssertionError("a forced kernel is not measured")

    monkeypatch.setattr(kernel_select, "expert_timer", no_timing)
    settings = load_settings({"MOEGUARD_MATMUL_BACKEND": "onednn_packed"})
    model = build_model(presets.get_preset("tiny"), seed=0)
    dense = build_model(presets.get_preset("tiny"), seed=0)
    gone = [weakref.ref(m.w13) for m in model.modules() if isinstance(getattr(m, "w13", None), torch.Tensor)]
    telemetry = Telemetry({"moeis": "m", "namespace": "n", "pod": "p"}, 8)
    assert entry.choose_matmul_kernel(settings, model, telemetry, RateLimitedLog()) == "onednn_packed"
    gc.collect()
    assert gone and all(r() is None for r in gone)
    mods = [m for m in model.modules() if hasattr(m, "matmul_backend")]
    assert mods and {m.matmul_backend for m in mods} == {PACKED}
    assert all(isinstance(m.w13, PackedExperts) for m in mods if hasattr(m, "w13"))
    assert telemetry.registry.get_sample_value(
        "moeguard_matmul_kernel_info", {"moeis": "m", "namespace": "n", "pod": "p", "kernel": "onednn_packed",
                                        "cpu": kernel_select.cpu_model()}) == 1.0
    tokens, logits = _greedy(model)
    ref_tokens, ref_logits = _greedy(dense)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    w13, w2 = kernel_select.first_experts(dense) or (torch.empty(0), torch.empty(0))
    assert follower_kernel(settings, (w13, w2)) == "onednn_packed"  # the followers pack as the leader


def test_expert_parallel_serves_packed_experts() -> None:
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.parallel.ep_worker import pack_follower
    from moeguard_runtime.parallel.expert_parallel import (
        expert_block_forward,
        expert_weights,
        moe_modules,
        shard_experts,
        strip_to_experts,
    )

    model = build_model(presets.get_preset("tiny"), seed=4)
    lo, hi = shard_experts(model, 1, 2)
    strip_to_experts(model)
    weights = expert_weights(model)
    dense = [(a.clone(), b.clone()) for a, b in weights]
    packed = pack_follower(model, weights)
    assert weights == [] and len(packed) == len(dense) == len(moe_modules(model))
    assert all(isinstance(a, PackedExperts) and a.shape == d.shape for (a, _), (d, _) in zip(packed, dense, strict=True))
    assert strip_to_experts(model) == 0  # the packed experts are kept
    g = torch.Generator().manual_seed(5)
    dim = dense[0][0].shape[2]
    x = torch.randn(6, dim, generator=g)
    rows = torch.tensor([0, 1, 1, 2, 3, 5, 5])
    local = torch.tensor([0, 1, 3, 2, 0, 1, 3]) % (hi - lo)
    weight = torch.rand(7, generator=g)
    for (p13, p2), (d13, d2) in zip(packed, dense, strict=True):
        torch.testing.assert_close(expert_block_forward(x, rows, local, weight, p13, p2, ALL_PACKED),
                                   expert_block_forward(x, rows, local, weight, d13, d2, "onednn"),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "mixtral"])
def test_every_family_packs_and_keeps_its_logits(family: str) -> None:
    """The HF families' MoE modules (shared experts, grouped routers, a dense first layer) under a packed plan:
    the routed experts packed, the shared ones dense on oneDNN, the logits those of the dense model."""
    pytest.importorskip("transformers")
    from bench.family_checkpoints import checkpoint_folder
    from tests.integration.worker.test_ep_numerics import FAMILIES

    from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint
    from moeguard_runtime.model.model import Segment

    folder = checkpoint_folder(FAMILIES[family])

    def logits(plan: moe.MatmulChoice) -> torch.Tensor:
        model = load_hf_checkpoint(folder).model
        kernel_select.apply_plan(model, plan)
        tokens = list(range(3, 40))
        cache = model.new_cache(len(tokens), torch.float32, "cpu")
        with torch.inference_mode():
            out, _ = model(torch.tensor(tokens), torch.arange(len(tokens)), [Segment(cache, 0, len(tokens))])
        if plan == ALL_PACKED:
            assert any(isinstance(m.w13, PackedExperts) for m in model.modules() if hasattr(m, "w13"))
        return out

    torch.testing.assert_close(logits(ALL_PACKED), logits("onednn"), rtol=1e-4, atol=1e-4)


def test_warm_rows_cover_every_bucket_and_both_input_layouts() -> None:
    rows = moe.warm_rows(256)
    assert {moe.padded_rows(n) for n in range(1, 257)} == {moe.padded_rows(n) for n in rows}
    assert rows[:8] == [1, 2, 3, 4, 7, 8, 15, 16] and rows[-4:] == [223, 224, 255, 256]


def test_packing_creates_the_primitives_once_per_weight_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeguard_runtime.model.model import build_model

    model = build_model(presets.get_preset("tiny"), seed=1)
    seen: list[tuple[int, tuple[int, ...]]] = []
    real = moe.swiglu_expert

    def spy(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, backend: object = "onednn") -> torch.Tensor:
        seen.append((x.shape[0], tuple(w13.shape)))
        return real(x, w13, w2, backend)  # type: ignore[arg-type]

    monkeypatch.setattr(moe, "swiglu_expert", spy)
    layers = moe.pack_experts(model)
    assert layers == presets.get_preset("tiny").n_layer > 1
    # every layer of the preset has one expert shape: one warm pass, at every row count of warm_rows
    assert [n for n, _ in seen] == moe.warm_rows(moe.ONEDNN_CHUNK_TOKENS)
    assert moe.warm_packed(model, max_rows=4) == len(moe.warm_rows(4)) == 4
