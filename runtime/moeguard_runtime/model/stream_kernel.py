"""moeguard's own expert-matmul kernel for a few rows (decode): a C++ library built with the machine's compiler.

At a few rows an expert call is a pass over its weights, and the library kernels stream them well below the read
rate (issue 31: a decode step took 1.87x the time to read the touched experts' weights in float32 and 5.96x in
bfloat16 on the AMD EPYC of the benchmarks, where oneDNN has no native bfloat16). ``native/stream_linear.cpp``
computes ``x @ w.T`` in one pass over ``w`` (float32 or bfloat16 weights, widened in registers; float32
arithmetic) with AVX2 and FMA, its output rows split over torch's threads. It is the ``stream`` kernel of
:data:`moe.MatmulBackend`, one more candidate that :mod:`moeguard_runtime.model.kernel_select` measures; the plan
takes it only in the buckets where it is faster.

A decode step's whole routed-expert work of one layer also runs in one call (:func:`try_experts`, the library's
``moeguard_stream_experts_*``): the gathers, both matmuls, the SwiGLU activation and the weighted combine of every
expert in one OpenMP parallel region, where the dispatch's per-expert loop made about ten torch and library calls
per expert (issue 31: 3.5 of a 21.2 ms layer at D=1024, I=2816, 16 tokens, fp32, beside 17.7 ms of matmuls).
:func:`moe.dispatch_experts` takes it for a small batch whose every expert the plan gives to ``stream``.

Build: ``g++ -O3 -mavx2 -mfma -fopenmp -shared -fPIC`` (``$CXX`` if set) into
``<MOEGUARD_NATIVE_DIR or ~/.cache/moeguard/native>/stream_linear-<hash>.so``, the hash over the source, the flags
and the compiler's file, so a new compiler or source builds anew; ``make deps`` builds it at install time
(``python -m moeguard_runtime.model.stream_kernel``), and a worker that finds none builds it at its first use
(about 2 s) where a compiler exists. The worker image's build stage builds it into the package
(:data:`PREBUILT`, ``--prebuild``), since the final image has no compiler; it is loaded first, when it was built
from this very source. The library needs ``libgomp.so.1``, which torch has loaded: one OpenMP runtime
in the process. It is loaded with :mod:`ctypes`, which releases the GIL during the call.

Unavailable (and never a candidate, :func:`unavailable` says why): a CPU without AVX2 (torch's CPU capability),
neither a prebuilt library of this source nor a compiler, a build that fails, a folder that cannot be written.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native") / "stream_linear.cpp"
PREBUILT = SOURCE.with_suffix(".so")
"""The library built into the package (``python -m moeguard_runtime.model.stream_kernel --prebuild``: the worker
image's build stage, which has a compiler; the final image has none). Loaded only when its
``moeguard_stream_source()`` is :func:`source_digest` and its interface :data:`INTERFACE_VERSION`."""
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
         "-Wno-psabi")
"""Compiler flags: AVX2 and FMA (checked at run time through torch's CPU capability), OpenMP, a shared object."""
INTERFACE_VERSION = 2
"""``moeguard_stream_version()`` of the library this module calls; another version is not loaded (2: the
experts' call, :func:`try_experts`)."""
DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes the kernel reads (x and the arithmetic are float32)."""
CPU_CAPABILITIES = ("AVX2", "AVX512")
"""``torch.backends.cpu.get_cpu_capability()`` values under which the kernel runs (torch's AVX2 level needs
FMA too)."""
WIDE_ROWS = 256
"""Bfloat16 rows widened to float32 at once (``x``'s rows and the float32 result): their transient stays under
8 MB at D=1024, I=2816 whatever the call's rows (a prefill chunk may hold 2,048), so the bfloat16 path needs no
term of its own in the memory model."""
ENV_NATIVE_DIR = "MOEGUARD_NATIVE_DIR"
DEFAULT_NATIVE_DIR = "~/.cache/moeguard/native"
BUILD_TIMEOUT_S = 120.0


class BuildError(RuntimeError):
    """The library could not be built (the compiler's message in the text)."""


def compiler(env: Mapping[str, str] | None = None) -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++`` or ``c++`` on the PATH; None without one."""
    env = os.environ if env is None else env
    for name in (env.get("CXX"), "g++", "c++"):
        if name and (found := shutil.which(name)):
            return found
    return None


def native_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where built libraries live: ``MOEGUARD_NATIVE_DIR``, else :data:`DEFAULT_NATIVE_DIR`."""
    env = os.environ if env is None else env
    return Path(env.get(ENV_NATIVE_DIR) or DEFAULT_NATIVE_DIR).expanduser()


def library_path(cxx: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the library built by ``cxx`` lives: ``stream_linear-<hash>.so`` under :func:`native_dir`, the hash
    (12 hex digits of SHA-256) over the source, :data:`FLAGS` and the compiler's resolved path, size and
    modification time (a new compiler builds anew; no process is started to ask it its version)."""
    real = Path(cxx).resolve()
    st = real.stat()
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((*FLAGS, str(real), str(st.st_size), str(st.st_mtime_ns))).encode())
    return native_dir(env) / f"stream_linear-{digest.hexdigest()[:12]}.so"


def build(cxx: str, out: Path) -> Path:
    """Compile :data:`SOURCE` with ``cxx`` into ``out`` (through a temporary file in its folder, renamed when
    complete: workers that build at once never load a half-written file).

    Raises:
        BuildError: the compiler failed (its message), timed out, or ``out``'s folder cannot be written.
    """
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
        os.close(fd)
    except OSError as exc:
        raise BuildError(f"cannot write {out.parent}: {exc}") from exc
    try:
        done = subprocess.run([cxx, *FLAGS, f"-DMOEGUARD_STREAM_SOURCE=\"{source_digest()}\"", "-o", tmp,
                               str(SOURCE)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildError(f"{cxx} exited {done.returncode}: {(done.stderr or done.stdout).strip()[:2000]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from an image's non-root user
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{cxx} took more than {BUILD_TIMEOUT_S:g}s") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.moeguard_stream_version.restype = ctypes.c_int
    lib.moeguard_stream_source.restype = ctypes.c_char_p
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    for name in ("moeguard_stream_linear_f32", "moeguard_stream_linear_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    experts = [ptr, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ptr, i64, ptr, i64,
               ptr, i64, ctypes.c_int]
    for name in ("moeguard_stream_experts_f32", "moeguard_stream_experts_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = experts, ctypes.c_int
    return lib


def source_digest() -> str:
    """12 hex digits of SHA-256 over :data:`SOURCE`: what a prebuilt library must carry
    (``moeguard_stream_source()``) to be loaded."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def _prebuilt() -> ctypes.CDLL | None:
    """The library built into the package (:data:`PREBUILT`, the worker image's), where it exists and was built
    from this source at this interface."""
    if not PREBUILT.exists():
        return None
    try:
        lib = _bind(ctypes.CDLL(str(PREBUILT)))
    except (OSError, AttributeError):
        return None
    if lib.moeguard_stream_version() != INTERFACE_VERSION or lib.moeguard_stream_source() != source_digest().encode():
        return None
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CPU_CAPABILITIES:
        return None, f"the CPU's capability is {capability}, not AVX2"
    if (prebuilt := _prebuilt()) is not None:
        return prebuilt, None
    cxx = compiler()
    if cxx is None:
        return None, f"no prebuilt {PREBUILT.name} of this source and no C++ compiler (g++ or $CXX) to build it"
    try:
        path = library_path(cxx)
        if not path.exists():
            build(cxx, path)
        lib = _bind(ctypes.CDLL(str(path)))
    except (BuildError, OSError, subprocess.SubprocessError, AttributeError) as exc:
        return None, str(exc)  # AttributeError: a library without a function this module binds
    if (version := lib.moeguard_stream_version()) != INTERFACE_VERSION:
        return None, f"{path} has interface {version}, not {INTERFACE_VERSION}"
    return lib, None


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (building it first where needed), or None when it can."""
    return _load()[1]


def runs(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernel runs weights of ``dtype`` on ``device`` (CPU, :data:`DTYPES`, the library loaded)."""
    on_cpu = device == "cpu" or torch.device(device).type == "cpu"
    return on_cpu and dtype in DTYPES and _load()[0] is not None


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` takes ``x`` [n, in] and ``w`` [out, in]: both on the CPU in one of :data:`DTYPES`,
    ``w`` contiguous (a dense weight, not a packed one), ``x``'s rows each contiguous. Cheap (a decode step asks
    it twice per expert): attributes only."""
    return (x.dim() == 2 and w.dim() == 2 and x.is_cpu and w.is_cpu and not w.is_mkldnn and x.dtype == w.dtype
            and w.dtype in DTYPES and w.is_contiguous() and x.shape[1] == w.shape[1]
            and (x.shape[1] <= 1 or x.stride(1) == 1) and _load()[0] is not None)


def try_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """:func:`linear`, or None where it does not take the tensors (:func:`supports`): the dispatch's call, one
    check per call."""
    lib = _load()[0]
    if lib is None or not supports(x, w):
        return None
    n, inner = x.shape
    out = w.shape[0]
    threads = torch.get_num_threads()
    if w.dtype == torch.float32:
        y = torch.empty(n, out, dtype=torch.float32)
        if n:
            lib.moeguard_stream_linear_f32(x.data_ptr(), x.stride(0) if n > 1 else inner, n, inner, w.data_ptr(),
                                           out, y.data_ptr(), out, threads)
        return y
    y = torch.empty(n, out, dtype=x.dtype)
    for r0 in range(0, n, WIDE_ROWS):  # the float32 copies exist for WIDE_ROWS rows at a time
        xf = x[r0:r0 + WIDE_ROWS].float()
        yf = torch.empty(xf.shape[0], out, dtype=torch.float32)
        lib.moeguard_stream_linear_bf16(xf.data_ptr(), inner, xf.shape[0], inner, w.data_ptr(), out, yf.data_ptr(),
                                        out, threads)
        y[r0:r0 + WIDE_ROWS].copy_(yf)
    return y


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``x`` [n, in], ``w`` [out, in], as :func:`supports` requires) → [n, out] in ``x``'s dtype, in
    one pass over ``w`` on torch's threads (``torch.get_num_threads()``); float32 arithmetic, so a bfloat16 result
    is rounded once.

    Raises:
        ValueError: the library is not available or the tensors are not supported (:func:`supports`).
    """
    y = try_linear(x, w)
    if y is None:
        raise ValueError(f"stream kernel: {unavailable() or 'unsupported tensors'} (x {tuple(x.shape)} "
                         f"{x.dtype}, w {tuple(w.shape)} {w.dtype})")
    return y


EXPERTS_ERRORS = {1: "invalid bounds or sizes", 2: "a slot's token is out of range",
                  3: "its workspace could not be allocated"}
"""The experts' call's error codes (``moeguard_stream_experts_*``'s return value; 0 is success)."""


def experts_supported(x: torch.Tensor, w13: object, w2: object, out: torch.Tensor) -> bool:
    """Whether :func:`try_experts` takes these tensors: ``x`` [T, D] float32 on the CPU, each row's values
    adjacent; ``w13`` [E, 2I, D] and ``w2`` [E, D, I] dense contiguous tensors (not :class:`moe.PackedExperts`,
    not ``mkldnn``) of one of :data:`DTYPES` on the CPU; ``out`` contiguous float32 of ``x``'s shape; the
    library loaded. Cheap (attributes only; a decode step asks it once per layer)."""
    return (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and x.dim() == 2 and w13.dim() == 3
            and w2.dim() == 3 and x.is_cpu and w13.is_cpu and w2.is_cpu and out.is_cpu and not w13.is_mkldnn
            and not w2.is_mkldnn and x.dtype == torch.float32 and out.dtype == torch.float32
            and w13.dtype in DTYPES and w2.dtype == w13.dtype and w13.is_contiguous() and w2.is_contiguous()
            and out.is_contiguous() and out.shape == x.shape and (x.shape[1] <= 1 or x.stride(1) == 1)
            and _load()[0] is not None)


def try_experts(x: torch.Tensor, bounds: Sequence[int], slot_token: torch.Tensor, slot_weight: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor) -> bool:
    """One MoE layer's routed experts in one library call (a decode step's): adds into ``out``, for every expert
    ``e`` and every slot ``s`` in ``[bounds[e], bounds[e + 1])``,
    ``slot_weight[s] * w2[e] @ (silu(w13[e][:I] @ x[t]) * (w13[e][I:] @ x[t]))`` with ``t = slot_token[s]``
    (SwiGLU: Shazeer 2020, "GLU Variants Improve Transformer"; :func:`moe.swiglu_expert`'s product), the
    experts in ascending order, so each token's additions come in the order of :func:`moe.dispatch_experts`'
    ``index_add_`` over the sorted slots. Returns False, computing nothing, where it does not take the tensors
    (:func:`experts_supported`).

    Args:
        x: ``[T, D]`` float32 hidden states.
        bounds: ``E + 1`` ascending slot offsets, ``bounds[0] == 0``: expert ``e``'s slots are
            ``bounds[e]..bounds[e + 1] - 1`` (:func:`moe.dispatch_experts`' ``bounds``).
        slot_token: ``[S]`` int64 (contiguous, CPU), ``S = bounds[-1]``: each slot's token, in ``[0, T)``,
            ascending within an expert (:func:`moe.dispatch_experts`' order) for the closest numerics to its
            ``index_add_``; a token may repeat (each thread adds its own columns of every slot, in order).
        slot_weight: ``[S]`` float32 (contiguous, CPU): each slot's router weight.
        w13: ``[E, 2I, D]`` gate then up projections, float32 or bfloat16 (widened exactly; float32 arithmetic);
            ``w2``: ``[E, D, I]``, the same dtype.
        out: ``[T, D]`` float32, contiguous, added into.

    Design (``native/stream_linear.cpp``): every slot's row of ``x`` gathered once, then per expert the gate and
    up rows streamed with :func:`linear`'s blocks, the threads splitting ``I`` (each activates the columns it
    computed: no wait between the matmul and the activation), a barrier, the down projection with the threads
    splitting ``D``, each adding its own columns of ``weight * y`` into ``out``, a barrier; one parallel region
    of ``torch.get_num_threads()`` threads for the whole layer. silu's exp is a vectorised Cephes polynomial
    (silu within 2.4 float32 ulps of float64's); results differ from the loop's by summation and rounding
    order only. The library allocates its workspace: ``4 * (S * D + n * (2I + D))`` bytes, ``n`` the busiest
    expert's slots (0.3 MB at 32 slots, D=1024, I=2816; 7.8 MB at 256 slots on one expert).

    Raises:
        ValueError: the shapes disagree (``bounds``' length, ``S``, ``w13``/``w2``/``x``'s sizes, an odd
            ``w13`` row count), ``bounds`` is not ascending from 0, a slot's token is out of range, or the
            workspace could not be allocated: nothing is added then.
    """
    lib = _load()[0]
    if lib is None or not experts_supported(x, w13, w2, out):
        return False
    num_experts, rows13, dim = w13.shape
    inter = rows13 // 2
    slots = bounds[-1] if bounds else -1
    if (rows13 % 2 or tuple(w2.shape) != (num_experts, dim, inter) or x.shape[1] != dim
            or len(bounds) != num_experts + 1 or slot_token.shape != (slots,) or slot_weight.shape != (slots,)
            or slot_token.dtype != torch.int64 or slot_weight.dtype != torch.float32
            or not (slot_token.is_contiguous() and slot_weight.is_contiguous() and slot_token.is_cpu
                    and slot_weight.is_cpu)):
        raise ValueError(f"stream experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"{len(bounds)} bounds ending at {slots}, slot_token {tuple(slot_token.shape)} "
                         f"{slot_token.dtype}, slot_weight {tuple(slot_weight.shape)} {slot_weight.dtype}")
    fn = lib.moeguard_stream_experts_f32 if w13.dtype == torch.float32 else lib.moeguard_stream_experts_bf16
    tokens = x.shape[0]
    code = fn(x.data_ptr(), x.stride(0) if tokens > 1 else dim, tokens, dim, inter, num_experts,
              (ctypes.c_int64 * len(bounds))(*bounds), slot_token.data_ptr(), slot_weight.data_ptr(),
              w13.data_ptr(), w13.stride(0), w2.data_ptr(), w2.stride(0), out.data_ptr(), dim,
              torch.get_num_threads())
    if code:
        raise ValueError(f"stream experts: {EXPERTS_ERRORS.get(code, f'error {code}')} (x {tuple(x.shape)}, "
                         f"bounds {list(bounds)})")
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m moeguard_runtime.model.stream_kernel``: build the library now (``make deps``); exit 0 when it
    loads, or 0 with the reason on stderr where it cannot run here (the worker then leaves it out).

    ``--prebuild``: build it into the package (:data:`PREBUILT`) with ``$CXX`` or g++, whatever this CPU is
    (an image is built for the nodes, not for its builder); exit 1 with the compiler's message where that fails."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--prebuild"]:
        cxx = compiler()
        try:
            if cxx is None:
                raise BuildError("no C++ compiler (g++ or $CXX)")
            print(f"stream kernel: {build(cxx, PREBUILT)}")
        except BuildError as exc:
            print(f"stream kernel: {exc}", file=sys.stderr)
            return 1
        return 0
    lib, why = _load()
    if lib is not None:
        print(f"stream kernel: {lib._name}")  # the prebuilt one or the one built here
    else:
        print(f"stream kernel not available: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
