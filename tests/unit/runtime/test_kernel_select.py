"""Kernel choice by measurement (issue 16), the fused gate/up layout, and their wiring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench.hf_reference import hf_expert_loop
from tests.unit.runtime.recording_log import RecordingLog

from moeguard_core import presets
from moeguard_runtime.model import kernel_select, moe, stream_kernel
from moeguard_runtime.model.checkpoint import from_hf_names, fuse_native
from moeguard_runtime.model.moe import KernelPlan, MatmulBackend

pytestmark = pytest.mark.unit


def fake_timer(table: dict[tuple[str, int], float], calls: list[tuple[str, int]] | None = None
               ) -> kernel_select.Timer:
    def timer(kernel: MatmulBackend, rows: int) -> float:
        if calls is not None:
            calls.append((kernel, rows))
        return table[(kernel, rows)]
    return timer


def test_the_faster_of_two_fake_timers_wins_each_bucket() -> None:
    table = {("onednn", 1): 3.0, ("torch", 1): 1.0, ("onednn", 64): 1.0, ("torch", 64): 2.0}
    calls: list[tuple[str, int]] = []
    plan, seconds = kernel_select.choose(("onednn", "torch"), fake_timer(table, calls), buckets=(1, 64), reps=3)
    assert plan == KernelPlan((1, 64), ("torch", "onednn"))
    assert seconds == {1: {"onednn": 3.0, "torch": 1.0}, 64: {"onednn": 1.0, "torch": 2.0}}
    # one warm-up per cell, then interleaved rounds: onednn, torch, onednn, torch ...
    assert calls[:4] == [("onednn", 1), ("torch", 1), ("onednn", 64), ("torch", 64)]
    assert len(calls) == 4 * (1 + 3)
    assert plan.kernel_for(1) == "torch" and plan.kernel_for(2) == "onednn" and plan.kernel_for(4096) == "onednn"
    assert plan.label == "torch<=1,onednn"


def test_a_tie_keeps_the_first_candidate_and_the_fastest_call_counts() -> None:
    times = iter([9.0, 9.0, 1.00, 0.99, 5.0, 5.0])  # warm-up, then two rounds

    def timer(kernel: MatmulBackend, rows: int) -> float:
        return next(times)

    plan, seconds = kernel_select.choose(("onednn", "torch"), timer, buckets=(4,), reps=2)
    assert seconds == {4: {"onednn": 1.0, "torch": 0.99}}  # min over rounds, warm-up not counted
    assert plan.kernels == ("onednn",)  # 1 % faster is inside TIE_FRACTION


def test_the_budget_stops_further_rounds() -> None:
    now = [0.0]
    calls: list[tuple[str, int]] = []

    def timer(kernel: MatmulBackend, rows: int) -> float:
        calls.append((kernel, rows))
        now[0] += 1.0
        return 1.0

    kernel_select.choose(("onednn", "torch"), timer, buckets=(1,), reps=10, budget_s=3.5, clock=lambda: now[0])
    assert len(calls) == 2 + 2  # warm-up, the first round (always); at 4 s > 3.5 s no second round


def test_a_decode_bucket_keeps_stream_within_the_fused_preference_and_a_prefill_bucket_does_not() -> None:
    """stream 5 % slower than torch: kept at 1 and 16 rows (the one-call decode needs it in every decode bucket), not
    at 64 rows; 15 % slower: torch at 1 row too."""
    slower = 1 + kernel_select.FUSED_PREFERENCE / 2
    table = {("torch", 1): 1.0, ("stream", 1): slower, ("torch", 16): 1.0, ("stream", 16): slower,
             ("torch", 64): 1.0, ("stream", 64): slower}
    plan, _ = kernel_select.choose(("torch", "stream"), fake_timer(table), buckets=(1, 16, 64), reps=1)
    assert plan.kernels == ("stream", "stream", "torch")
    table[("stream", 1)] = 1 + kernel_select.FUSED_PREFERENCE * 1.5
    plan, _ = kernel_select.choose(("torch", "stream"), fake_timer(table), buckets=(1, 16, 64), reps=1)
    assert plan.kernels == ("torch", "stream", "torch")


def test_selection_is_cached_per_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = torch.randn(4, 2 * 48, 32), torch.randn(4, 32, 48)
    table = {(k, r): (1.0 if k == "torch" else 2.0) for k in moe.MATMUL_BACKENDS for r in kernel_select.ROW_BUCKETS}
    calls: list[tuple[str, int]] = []
    first = kernel_select.select(w13, w2, str(tmp_path), threads=2, timer=fake_timer(table, calls), cpu="Test CPU")
    if kernel_select.candidates(torch.float32) == ("torch",):
        pytest.skip("no oneDNN linear in this torch build: nothing to choose")
    assert not first.cached and first.plan.label == "torch" and first.cache_error is None
    assert first.cache_file is not None and Path(first.cache_file).parent == tmp_path
    saved = json.loads(Path(first.cache_file).read_text())
    assert saved["key"]["cpu"] == "Test CPU" and saved["key"]["dim"] == 32 and saved["key"]["inter"] == 48
    assert saved["key"]["dtype"] == "float32" and saved["key"]["threads"] == 2
    assert saved["key"]["rule"] == kernel_select.SELECTION_RULE and "onednn_packed" in saved["key"]["kernels"]
    assert saved["key"]["stream"] == (stream_kernel.source_digest() if "stream" in saved["key"]["kernels"] else None)
    n = len(calls)
    again = kernel_select.select(w13, w2, str(tmp_path), threads=2, timer=fake_timer(table, calls), cpu="Test CPU")
    assert again.cached and again.plan == first.plan and len(calls) == n  # no measurement
    other = kernel_select.select(w13, w2, str(tmp_path), threads=1, timer=fake_timer(table, calls), cpu="Test CPU")
    assert not other.cached and len(calls) > n  # another thread count: measured again
    assert len(list(tmp_path.glob("*.json"))) == 2
    if "stream" in saved["key"]["kernels"]:  # a new stream kernel source: measured again
        monkeypatch.setattr(stream_kernel, "source_digest", lambda: "0" * 12)
        rebuilt = kernel_select.select(w13, w2, str(tmp_path), threads=2, timer=fake_timer(table, calls), cpu="Test CPU")
        assert not rebuilt.cached and len(list(tmp_path.glob("*.json"))) == 3


def test_packing_is_not_a_candidate_when_its_start_up_transient_exceeds_the_headroom(tmp_path: Path) -> None:
    if "onednn_packed" not in kernel_select.candidates(torch.float32):
        pytest.skip("no oneDNN reorder in this torch build: packing is never a candidate")
    w13, w2 = torch.randn(4, 2 * 48, 32), torch.randn(4, 32, 48)
    # 4 experts of (96*32 + 32*48) * 4 B = 18432 B: the probe takes all 4 (73728 B) > one layer's w13 (49152 B)
    assert kernel_select.packing_transient_bytes(w13, w2) == 4 * (96 * 32 + 32 * 48) * 4 == 73728
    table = {(k, r): (1.0 if k == "onednn_packed" else 2.0) for k in moe.MATMUL_BACKENDS
             for r in kernel_select.ROW_BUCKETS}
    calls: list[tuple[str, int]] = []
    tight = kernel_select.select(w13, w2, str(tmp_path), timer=fake_timer(table, calls), cpu="x",
                                 headroom_bytes=73727)
    assert tight.packed_skipped == "packing needs 73728 bytes at start-up; 73727 left under the memory limit"
    assert "onednn_packed" not in {k for k, _ in calls} and "onednn_packed" not in tight.plan.kernels
    assert "onednn_packed" not in tight.key["kernels"]  # its own cache entry: a roomier start measures packing
    calls.clear()
    roomy = kernel_select.select(w13, w2, str(tmp_path), timer=fake_timer(table, calls), cpu="x",
                                 headroom_bytes=73728)
    assert roomy.packed_skipped is None and roomy.plan.label == "onednn_packed" and not roomy.cached
    assert kernel_select.select(w13, w2, str(tmp_path), timer=fake_timer(table), cpu="x",
                                headroom_bytes=None).plan.label == "onednn_packed"  # no limit: no guard
    over = kernel_select.select(w13, w2, str(tmp_path), timer=fake_timer(table), cpu="x", headroom_bytes=-5)
    assert over.cached and over.packed_skipped is not None and "; 0 left under" in over.packed_skipped
    # Larger experts: one layer's w13 is what counts (the probe holds 2 experts of its 4)
    big13, big2 = torch.empty(4, 2 * 4096, 4096), torch.empty(4, 4096, 4096)
    assert kernel_select.packing_transient_bytes(big13, big2) == 4 * 2 * 4096 * 4096 * 4


def test_an_unwritable_cache_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    table = {(k, r): 1.0 for k in moe.MATMUL_BACKENDS for r in kernel_select.ROW_BUCKETS}
    sel = kernel_select.select(torch.randn(2, 96, 32), torch.randn(2, 32, 48), str(blocker / "sub"),
                               timer=fake_timer(table), cpu="x")
    if kernel_select.candidates(torch.float32) == ("torch",):
        pytest.skip("no oneDNN linear in this torch build")
    assert sel.cache_file is None and sel.cache_error is not None and "NotADirectoryError" in sel.cache_error
    # all ties: the first, but stream in the decode buckets where it is a candidate (FUSED_PREFERENCE)
    decode = "stream" if "stream" in kernel_select.candidates(torch.float32) else "onednn"
    assert sel.plan.kernels == tuple(decode if r <= kernel_select.DECODE_MAX_ROWS else "onednn"
                                     for r in kernel_select.ROW_BUCKETS)


def test_cpu_model_and_isa_flags_from_cpuinfo() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
    assert kernel_select.cpu_model(text) == "AMD EPYC"
    assert kernel_select.isa_flags(text) == ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    assert kernel_select.candidates(torch.float16) == ("torch",)  # no oneDNN: nothing to measure
    assert kernel_select.candidates(torch.float32, "meta") == ("torch",)


def test_a_forced_kernel_is_the_one_the_model_is_built_with() -> None:
    from moeguard_runtime.__main__ import initial_kernel
    from moeguard_runtime.config import load_settings

    built = {k: initial_kernel(load_settings({"MOEGUARD_MATMUL_BACKEND": k})) for k in ("auto", "onednn", "torch",
                                                                                           "torch_t", "onednn_packed")}
    assert built == {"auto": "onednn", "onednn": "onednn", "torch": "torch", "torch_t": "torch_t",
                     "onednn_packed": "onednn"}  # auto measures and packed packs after loading


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_transposed_kernel_gives_f_linears_outputs(dtype: torch.dtype) -> None:
    """Issue 31: ``torch_t`` computes ``(w @ x.T).T``; the expert, the linear and a dispatch whose plan mixes it
    with the other kernels agree with ``F.linear`` to round-off."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = (torch.randn(4, 96, 32, generator=g) / 6).to(dtype), (torch.randn(4, 32, 48, generator=g) / 7).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for n in (1, 4, 17, 300):
        x = torch.randn(n, 32, generator=g).to(dtype)
        out = moe.swiglu_expert(x, w13[0], w2[0], "torch_t")
        assert out.shape == (n, 32) and out.dtype == dtype
        torch.testing.assert_close(out, moe.swiglu_expert(x, w13[0], w2[0], "torch"), **tol)
        torch.testing.assert_close(moe.expert_linear(x, w13[1], "torch_t"), torch.nn.functional.linear(x, w13[1]),
                                   **tol)
    x = torch.randn(40, 32, generator=g).to(dtype)
    rw, ex = moe.route(x @ torch.randn(4, 32, generator=g).to(dtype).T, 2)
    mixed = KernelPlan((4, 16, 256), ("torch_t", "torch", "torch_t"))
    torch.testing.assert_close(moe.dispatch_experts(x, rw, ex, w13, w2, backend=mixed)[0],
                               moe.dispatch_experts(x, rw, ex, w13, w2, backend="torch")[0], **tol)


def test_the_real_timer_times_the_models_expert() -> None:
    timer = kernel_select.expert_timer(torch.randn(3, 96, 32), torch.randn(3, 32, 48))
    assert all(0 < timer(k, r) < 1 for k in ("torch", "onednn") for r in (4, 5, 1))  # experts 0, 1, 2, 0, ...


def test_a_plan_travels_to_every_moe_layer_and_leaves_onednn_on_failure() -> None:
    from moeguard_runtime.model.model import Transformer

    with torch.device("meta"):
        model = Transformer(presets.get_preset("tiny"))
    plan = KernelPlan((4, 256), ("torch", "onednn"))
    assert kernel_select.apply_plan(model, plan) == presets.get_preset("tiny").n_layer
    w13, w2 = kernel_select.first_experts(model) or (None, None)
    assert w13 is not None and w2 is not None and w13.shape[1] == 2 * w2.shape[2] and w13.shape[0] == w2.shape[0]
    assert moe.leave_onednn(model) == presets.get_preset("tiny").n_layer
    assert {m.matmul_backend for m in model.modules() if hasattr(m, "matmul_backend")} == \
        {KernelPlan((4, 256), ("torch", "torch"))}


def test_the_plan_decides_each_slices_kernel_and_chunking() -> None:
    x = torch.randn(3, 8)
    onednn_chunk = moe.ONEDNN_CHUNK_TOKENS if moe._ONEDNN_LINEAR else 2048
    plan = KernelPlan((4, 256), ("torch", "onednn"))
    assert moe.slice_call(x, plan, 3, 2048) == ("torch", 2048)
    assert moe.slice_call(x, plan, 1000, 2048) == ("onednn", onednn_chunk)  # every chunk on oneDNN
    prefill_on_linear = KernelPlan((16, 256, 1024), ("onednn", "onednn", "torch"))
    assert moe.slice_call(x, prefill_on_linear, 200, 2048) == ("onednn", onednn_chunk)
    assert moe.slice_call(x, prefill_on_linear, 900, 2048) == ("torch", 2048)  # one F.linear call
    assert moe.slice_call(x, prefill_on_linear, 5000, 2048) == ("torch", 2048)
    assert moe.slice_call(x, prefill_on_linear, 900, 2048, packed=True) == ("onednn_packed", onednn_chunk)
    # the busiest expert's chunks follow its own slice's kernel
    assert moe.host_expert_chunks(x, [900, 200, 0], 2048, backend=prefill_on_linear) == \
        1  # 900 rows: one F.linear call; 200 rows: one oneDNN chunk
    assert moe.host_expert_chunks(x, [900, 300, 0], 2048, backend=KernelPlan((256,), ("onednn",))) == \
        (4 if moe._ONEDNN_LINEAR else 1)


def test_buckets_cover_a_full_prefill_budget_and_phases_weigh_half_each() -> None:
    assert kernel_select.prefill_rows(4096, 2, 8) == 1024 and kernel_select.prefill_rows(100, 2, 8) == 25
    assert kernel_select.row_buckets(None) == kernel_select.ROW_BUCKETS == (1, 4, 16, 64, 256)
    assert kernel_select.row_buckets(128) == (1, 4, 16, 64, 256)  # inside the fixed buckets
    assert kernel_select.row_buckets(1000) == (1, 4, 16, 64, 256, 1024)  # padded to its bucket
    assert kernel_select.row_buckets(6000, expert_chunk_tokens=2048) == (1, 4, 16, 64, 256, 2048)  # no call is larger
    w = kernel_select.phase_weights((1, 4, 16, 64, 256, 1024))
    assert w == pytest.approx({1: 1 / 6, 4: 1 / 6, 16: 1 / 6, 64: 1 / 6, 256: 1 / 6, 1024: 1 / 6})
    w = kernel_select.phase_weights((1, 4, 16, 1024))
    assert w == pytest.approx({1: 1 / 6, 4: 1 / 6, 16: 1 / 6, 1024: 1 / 2})
    assert kernel_select.phase_weights((64, 256)) == pytest.approx({64: 0.5, 256: 0.5})


def test_packed_loses_when_it_saves_decode_but_costs_prefill_more() -> None:
    buckets = (1, 4, 16, 1024)
    dense = KernelPlan(buckets, ("onednn", "onednn", "onednn", "torch"))
    # decode 10 % faster packed, the 1024-row prefill slice 30 % slower: half the weight each
    seconds = {r: {"onednn": 1.0, "torch": 1.0, "onednn_packed": 0.9 if r <= 16 else 1.3} for r in buckets}
    assert kernel_select.packed_ratio(seconds, dense) == pytest.approx((0.9 * 1.3) ** 0.5)
    assert not kernel_select.packed_wins(seconds, dense)
    seconds[1024]["onednn_packed"] = 1.0
    assert kernel_select.packed_wins(seconds, dense)  # decode faster, prefill even
    seconds[1]["onednn_packed"] = 1.6
    assert kernel_select.packed_ratio(seconds, dense) == float("inf")  # one bucket 60 % slower


def test_the_timer_runs_a_bucket_as_the_dispatch_runs_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, str]] = []
    real = kernel_select.swiglu_expert

    def spy(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, backend: moe.MatmulChoice = "onednn"
            ) -> torch.Tensor:
        calls.append((x.shape[0], str(backend)))
        return real(x, w13, w2, backend)

    monkeypatch.setattr(kernel_select, "swiglu_expert", spy)
    w13, w2 = torch.randn(2, 96, 32), torch.randn(2, 32, 48)
    timer = kernel_select.expert_timer(w13, w2)
    assert kernel_select.spread_rows(600) == (600, 490, 565)
    timer("torch", 600)
    assert calls == [(600, "torch"), (490, "torch"), (565, "torch")]
    calls.clear()
    timer("onednn", 600)
    assert calls[:3] == ([(256, "onednn"), (256, "onednn"), (88, "onednn")] if moe._ONEDNN_LINEAR
                         else [(600, "onednn")])


def test_a_prefill_bucket_is_timed_off_its_power_of_two_and_scaled_to_its_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GEMM that is fast only at exactly 1,024 rows (as MKL's transposed product was: issue 31) does not win
    the bucket: the bucket's figure is the mean over 1,024, 835 and 963 rows, each scaled to 1,024."""
    assert kernel_select.spread_rows(16) == (16,) and kernel_select.spread_rows(1) == (1,)
    assert kernel_select.spread_rows(1024) == (1024, 835, 963)
    assert kernel_select.spread_rows(64) == (64, 55, 63)

    def fake(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kernel: str, chunk: int = 0) -> float:
        n = x.shape[0]
        per_row = 1.0 if kernel == "torch" else (0.9 if n == 1024 else 1.3)  # torch_t: fast at 2^10 only
        return n * per_row

    monkeypatch.setattr(kernel_select, "slice_seconds", fake)
    timer = kernel_select.expert_timer(torch.randn(2, 8, 4), torch.randn(2, 4, 4))
    assert timer("torch", 1024) == pytest.approx(1024.0)
    assert timer("torch_t", 1024) == pytest.approx(1024 * (0.9 + 1.3 + 1.3) / 3)
    assert timer("torch_t", 16) == pytest.approx(16 * 1.3)  # a decode bucket: its own count only
    plan, _ = kernel_select.choose(["torch", "torch_t"], timer, buckets=[16, 1024], reps=1)
    assert plan.kernel_for(1024) == "torch" and plan.kernel_for(16) == "torch"


def test_fused_weights_give_the_unfused_outputs() -> None:
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(48, 32, generator=g) / 32**0.5, torch.randn(48, 32, generator=g) / 32**0.5
    w2 = torch.randn(32, 48, generator=g) / 48**0.5
    w13 = moe.stack_gate_up([w1], [w3])[0]
    assert torch.equal(w13, torch.cat([w1, w3]))
    for rows in (1, 5, 16, 300):
        x = torch.randn(rows, 32, generator=g)
        for kernel in moe.MATMUL_BACKENDS:
            torch.testing.assert_close(moe.swiglu_expert(x, w13, w2, kernel),
                                       moe.swiglu_mlp(x, w1, w2, w3, kernel), rtol=1e-5, atol=1e-6)
    for plan in (KernelPlan((4, 256), ("torch", "onednn")), KernelPlan((4,), ("onednn",))):
        gate = torch.randn(8, 32, generator=g)
        e1, e3 = torch.randn(8, 48, 32, generator=g) / 32**0.5, torch.randn(8, 48, 32, generator=g) / 32**0.5
        e2 = torch.randn(8, 32, 48, generator=g) / 48**0.5
        x = torch.randn(40, 32, generator=g)
        weights, experts = moe.route(x @ gate.T, 2)
        out, _, _ = moe.dispatch_experts(x, weights, experts, moe.fuse_gate_up(e1, e3), e2, backend=plan)
        torch.testing.assert_close(out, hf_expert_loop(x, gate, e1, e2, e3, 2), rtol=1e-5, atol=1e-5)


def test_bf16_experts_agree_with_fp32_within_bf16_tolerance() -> None:
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(8, 64, generator=g)
    w1, w3 = torch.randn(8, 96, 64, generator=g) / 8, torch.randn(8, 96, 64, generator=g) / 8
    w2 = torch.randn(8, 64, 96, generator=g) / 96**0.5
    x = torch.randn(16, 64, generator=g)
    weights, experts = moe.route(x @ gate.T, 2)
    ref = hf_expert_loop(x, gate, w1, w2, w3, 2)
    for kernel in moe.MATMUL_BACKENDS:
        out, _, _ = moe.dispatch_experts(x.bfloat16(), weights, experts, moe.fuse_gate_up(w1, w3).bfloat16(),
                                         w2.bfloat16(), backend=kernel)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_loaders_fill_the_fused_layout() -> None:
    args = presets.get_preset("tiny")
    e, i, d = args.num_experts, args.intermediate_size, args.dim
    g = torch.Generator().manual_seed(2)
    hf = {f"model.layers.0.block_sparse_moe.experts.{x}.{w}.weight": torch.randn(*(d, i) if w == "w2" else (i, d),
                                                                                  generator=g)
          for x in range(e) for w in ("w1", "w2", "w3")}
    out = from_hf_names({**hf, "lm_head.weight": torch.zeros(1)}, args)
    w13 = out["layers.0.feed_forward.w13"]
    assert w13.shape == (e, 2 * i, d) and "layers.0.feed_forward.w1" not in out
    for x in range(e):
        assert torch.equal(w13[x, :i], hf[f"model.layers.0.block_sparse_moe.experts.{x}.w1.weight"])
        assert torch.equal(w13[x, i:], hf[f"model.layers.0.block_sparse_moe.experts.{x}.w3.weight"])
        assert torch.equal(out["layers.0.feed_forward.w2"][x], hf[f"model.layers.0.block_sparse_moe.experts.{x}.w2.weight"])
    native = fuse_native({"a.w1": torch.ones(2, 3, 4), "a.w3": torch.zeros(2, 3, 4), "a.w2": torch.ones(2, 4, 3)})
    assert set(native) == {"a.w13", "a.w2"} and native["a.w13"][:, :3].eq(1).all() and native["a.w13"][:, 3:].eq(0).all()


def test_seeded_weights_are_those_of_the_unfused_layout() -> None:
    """The fused w13 is drawn as w1 and w3 were: a seed gives the model it gave before."""
    from moeguard_runtime.model.model import build_model

    model = build_model(presets.get_preset("tiny"), seed=0)
    names = sorted(n for n, _ in model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    expanded = sorted(n2 for n in names for n2 in ((n[:-2] + "1", n[:-2] + "3") if n.endswith("w13") else (n,)))
    params = dict(model.named_parameters())
    for name in expanded:
        if name.endswith((".w1", ".w3")):
            w13 = params[name[:-1] + "13"]
            half = w13.shape[1] // 2
            p = w13[:, :half] if name.endswith("1") else w13[:, half:]
        else:
            p = params[name]
        if name.endswith("norm.weight"):
            continue
        want = torch.randn(p.shape, generator=gen)
        if name != "tok_embeddings.weight":
            want = want / p.shape[-1] ** 0.5
        assert torch.equal(p, want), name
    ff = model.layers[0].feed_forward
    assert torch.equal(ff.w1, ff.w13[:, :ff.w2.shape[2]]) and ff.w3.shape == ff.w1.shape


def test_settings_default_to_auto() -> None:
    from moeguard_runtime.config import load_settings

    assert load_settings({}).matmul_backend == "auto"
    assert load_settings({"MOEGUARD_MATMUL_BACKEND": "torch"}).matmul_backend == "torch"
    assert load_settings({"MOEGUARD_MATMUL_BACKEND": "onednn"}).matmul_backend == "onednn"
    if moe.can_pack(torch.empty(0)):
        assert load_settings({"MOEGUARD_MATMUL_BACKEND": " onednn_packed "}).matmul_backend == "onednn_packed"


def test_the_worker_measures_applies_logs_and_exports_the_choice(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from moeguard_runtime import __main__ as entry
    from moeguard_runtime.config import load_settings
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.telemetry.telemetry import Telemetry

    log = RecordingLog()
    events = log.events
    monkeypatch.setenv(kernel_select.ENV_KERNEL_CACHE_DIR, str(tmp_path))
    model = build_model(presets.get_preset("tiny"), seed=0)
    buckets = kernel_select.row_buckets(kernel_select.model_prefill_rows(model, load_settings({}).budgets.max_prefill_tokens))
    assert buckets[-1] > kernel_select.ROW_BUCKETS[-1]  # the default prefill budget's rows per expert are timed
    table = {(k, r): (1.0 if (k == "torch") == (r <= 4) else 2.0) + (1.0 if k == "onednn_packed" else 0.0)
             for k in moe.MATMUL_BACKENDS for r in buckets}
    monkeypatch.setattr(kernel_select, "expert_timer", lambda w13, w2, **_: fake_timer(table))
    telemetry = Telemetry({"moeis": "m", "namespace": "n", "pod": "p"}, 8)
    kernel = entry.choose_matmul_kernel(load_settings({}), model, telemetry, log)
    if kernel_select.candidates(torch.float32) == ("torch",):
        assert kernel == "torch"
        return
    # 16 rows: onednn and stream tie, and a decode bucket keeps stream (FUSED_PREFERENCE)
    stream = "stream" in kernel_select.candidates(torch.float32)
    assert kernel == ("torch<=4,stream<=16,onednn" if stream else "torch<=4,onednn")
    at_16 = ("stream",) if stream else ("onednn",)
    assert {m.matmul_backend for m in model.modules() if hasattr(m, "matmul_backend")} == \
        {KernelPlan(buckets, ("torch", "torch") + at_16 + ("onednn",) * (len(buckets) - 3))}
    name, kw = events[-1]
    assert name == "matmul_kernel_selected" and kw["kernel"] == kernel and kw["cached"] is False
    value = telemetry.registry.get_sample_value(
        "moeguard_matmul_kernel_info", {"moeis": "m", "namespace": "n", "pod": "p", "kernel": kernel,
                                        "cpu": kernel_select.cpu_model()})
    assert value == 1.0
    explicit = entry.choose_matmul_kernel(load_settings({"MOEGUARD_MATMUL_BACKEND": "torch"}),
                                          build_model(presets.get_preset("tiny"), seed=0), telemetry, log)
    assert explicit == "torch" and telemetry.registry.get_sample_value(
        "moeguard_matmul_kernel_info", {"moeis": "m", "namespace": "n", "pod": "p", "kernel": kernel,
                                        "cpu": kernel_select.cpu_model()}) is None
