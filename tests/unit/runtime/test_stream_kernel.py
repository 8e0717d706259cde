"""The ``stream`` kernel (moeguard's own few-row expert matmul, a C++ library) against the Python path it replaces:
``F.linear`` in float32 (its reference), and float32 arithmetic on the same bfloat16 values. The library is built
by ``make deps`` (``hack/install-deps.sh``); its build is tested in
``tests/integration/worker/test_stream_kernel_build.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeguard_runtime.model import kernel_select, moe, stream_kernel

pytestmark = pytest.mark.unit

needs_kernel = pytest.mark.skipif(stream_kernel.unavailable() is not None,
                                  reason=f"stream kernel not available here: {stream_kernel.unavailable()}")


def _pair(rows: int, inner: int, out: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inner, generator=gen).to(dtype), torch.randn(out, inner, generator=gen).to(dtype))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 33])
@pytest.mark.parametrize(("inner", "out"), [(1024, 5632), (2816, 1024), (37, 13), (8, 4)])
def test_float32_matches_f_linear(rows: int, inner: int, out: int) -> None:
    """Every row-group size (1, 2 and 3 at a time), weight rows not a multiple of 4, a reduction not a multiple
    of 8 (the scalar tails)."""
    x, w = _pair(rows, inner, out, torch.float32)
    y = stream_kernel.linear(x, w)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5 * inner ** 0.5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 33])
@pytest.mark.parametrize(("inner", "out"), [(2816, 1024), (1024, 5632), (37, 13), (8, 4)])
def test_bfloat16_weights_are_widened_exactly(rows: int, inner: int, out: int) -> None:
    """The bfloat16 result is the float32 product of the same bfloat16 values, rounded once: every row-group size
    (1, 2, 3 and 4 rows of x at a time), weight rows not a multiple of a group's 3, 4 or 6 (and a group's prefetch
    of the next rows reaching past the last), a reduction not a multiple of 8 (the scalar tails)."""
    x, w = _pair(rows, inner, out, torch.bfloat16)
    y = stream_kernel.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x.float(), w.float()).to(torch.bfloat16), rtol=1.6e-2, atol=1e-2)


@needs_kernel
def test_strided_rows_and_no_rows() -> None:
    """``swiglu_expert`` hands the gate half of ``[n, 2I]`` (rows 2I apart) to the second matmul."""
    h, w = _pair(4, 2 * 96, 40, torch.float32)
    gate = h[:, :96]
    assert not gate.is_contiguous()
    torch.testing.assert_close(stream_kernel.linear(gate, w[:, :96].contiguous()),
                               F.linear(gate, w[:, :96]), rtol=1e-5, atol=1e-5)
    empty = stream_kernel.linear(torch.empty(0, 8), torch.ones(3, 8))
    assert empty.shape == (0, 3)


@needs_kernel
def test_what_it_does_not_take_is_refused_with_the_shapes() -> None:
    x, w = _pair(2, 16, 8, torch.float32)
    assert not stream_kernel.supports(x, w.T)  # a transposed (non-contiguous) weight
    assert not stream_kernel.supports(x.half(), w.half())  # float16: not a dtype of the kernel
    assert not stream_kernel.supports(x[:, :8], w)  # inner sizes differ
    with pytest.raises(ValueError, match=r"unsupported tensors \(x \(2, 16\) torch.float32, w \(16, 8\)"):
        stream_kernel.linear(x, w.T)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_expert_on_the_stream_kernel_equals_the_torch_path(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    w13, w2 = torch.randn(2 * 48, 64, generator=gen).to(dtype), torch.randn(64, 48, generator=gen).to(dtype)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(moe.swiglu_expert(x, w13, w2, "stream"), moe.swiglu_expert(x, w13, w2, "torch"), **tol)


@needs_kernel
def test_it_is_a_candidate_in_both_dtypes_last_among_the_dense_kernels() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        kernels = kernel_select.candidates(dtype)
        assert "stream" in kernels
        dense = [k for k in kernels if k != moe.PACKED_BACKEND]
        assert dense[-1] == "stream"
    assert "stream" not in kernel_select.candidates(torch.float16)


def test_the_library_path_follows_the_source_the_flags_and_the_compiler(tmp_path: pytest.TempPathFactory) -> None:
    cxx = tmp_path / "g++"  # type: ignore[operator]
    cxx.write_text("#!/bin/sh\n")
    env = {stream_kernel.ENV_NATIVE_DIR: str(tmp_path)}
    first = stream_kernel.library_path(str(cxx), env)
    assert first.parent == tmp_path and first.name.startswith("stream_linear-") and first.suffix == ".so"
    assert stream_kernel.library_path(str(cxx), env) == first
    cxx.write_text("#!/bin/sh\n# a newer compiler\n")
    assert stream_kernel.library_path(str(cxx), env) != first
    assert stream_kernel.native_dir({}) == stream_kernel.Path(stream_kernel.DEFAULT_NATIVE_DIR).expanduser()


def test_where_it_cannot_be_built_it_is_no_candidate_and_the_worker_says_why(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.runtime.recording_log import RecordingLog

    from moeguard_core import presets
    from moeguard_runtime import __main__ as entry
    from moeguard_runtime.config import ConfigError, load_settings
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.telemetry.telemetry import Telemetry

    why = "no C++ compiler (g++ or $CXX) to build it"
    monkeypatch.setattr(stream_kernel, "_load", lambda: (None, why))  # as in the worker image: no compiler
    assert "stream" not in kernel_select.candidates(torch.float32)
    assert kernel_select.candidates(torch.bfloat16) in (("torch",), ("onednn", "torch", "torch_t", "onednn_packed"),
                                                        ("onednn", "torch", "torch_t"))
    monkeypatch.setenv(kernel_select.ENV_KERNEL_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(kernel_select, "expert_timer", lambda w13, w2, **_: lambda k, r: {"onednn": 1.0}.get(k, 2.0))
    log = RecordingLog()
    kernel = entry.choose_matmul_kernel(load_settings({}), build_model(presets.get_preset("tiny"), seed=0),
                                        Telemetry({"moeis": "m", "namespace": "n", "pod": "p"}, 8), log)
    assert kernel == "onednn"
    assert ("kernel_candidate_skipped", {"kernel": "stream", "reason": why}) in log.events
    with pytest.raises(ConfigError, match=r"MOEGUARD_MATMUL_BACKEND=stream runs on the CPU in float32 or bfloat16 "
                                          r"with the stream kernel built; .*no C\+\+ compiler"):
        load_settings({"MOEGUARD_MATMUL_BACKEND": "stream"})


@needs_kernel
def test_a_long_bfloat16_call_is_widened_a_slice_at_a_time_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _pair(11, 48, 24, torch.bfloat16)
    whole = stream_kernel.linear(x, w)
    monkeypatch.setattr(stream_kernel, "WIDE_ROWS", 4)  # 4 + 4 + 3 rows
    torch.testing.assert_close(stream_kernel.linear(x, w), whole, rtol=0, atol=0)
    torch.testing.assert_close(stream_kernel.linear(x[:, :], w), F.linear(x.float(), w.float()).to(torch.bfloat16),
                               rtol=1.6e-2, atol=1e-2)


@needs_kernel
def test_a_row_whose_values_are_not_adjacent_is_not_taken() -> None:
    w = torch.randn(8, 16)
    column = torch.randn(16, 3)[:, :1].T  # [1, 16], its values 3 floats apart
    assert column.stride(1) != 1 and not stream_kernel.supports(column, w)
    torch.testing.assert_close(moe.expert_linear(column, w, "stream"), F.linear(column, w))  # F.linear takes it
