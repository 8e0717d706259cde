"""Mixture-of-Experts feed-forward: router, grouped dispatch, routing statistics.

Shapes: ``T`` tokens in the batch (packed, all sequences together), ``D`` the
hidden size, ``I`` the expert SwiGLU width, ``E`` experts, ``k`` experts per
token. A *token-slot* is one (token, chosen expert) pair; a batch routes
``T * k`` of them.

Router (Mixtral, HF ``MixtralSparseMoeBlock``): softmax over the expert logits
in float32, top-k, then the k weights are renormalized to sum to 1.

Dispatch is *grouped*: the token-slots are sorted by expert so each expert runs
once on a contiguous slice (a dense ``[n, D] @ [D, I]`` matmul). gpt-fast's
per-token weight gather (``w1[expert_indices]``, ``[T, k, I, D]``) is fast for
decode but materialises ``T*k`` weight copies and runs out of memory at prefill,
so it is not used. A slice longer than ``expert_chunk_tokens`` is processed in
chunks, so the temporaries (``[chunk, D]`` gather, ``[chunk, I]`` activations)
are bounded by the chunk, not by the top expert's token count (the vLLM fused-MoE
fix chunks at about 2048 tokens). By default no token is dropped (dropless, as
MegaBlocks). With a ``capacity_factor`` (DeepSpeed ``sharded_moe.py``, GShard,
Switch), each expert takes at most :func:`expert_capacity` token-slots; first
choices are served before second choices, then in token order (DeepSpeed's
``top2gating`` priority); the slots over capacity are dropped and counted as
``overflow_tokens``, and each token's kept weights are renormalized.

Weight layout: HF's nn.Linear orientation (Mixtral checkpoints load without
transposes), with the gate and up projections fused as vLLM and SGLang store them
(``w13_weight``): ``w13``: ``[E, 2I, D]``, rows ``0..I-1`` the gate projection
(HF ``w1``/``gate_proj``) and rows ``I..2I-1`` the up projection (``w3``/``up_proj``);
``w2``: ``[E, D, I]``. One ``[n, D] x [D, 2I]`` matmul per expert replaces two, so a
decode step reads each touched expert's gate and up weights in one pass.
:func:`stack_gate_up` builds the fused tensor from per-expert checkpoints.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moeguard_runtime.model import stream_kernel
from moeguard_runtime.model.moe_device import (
    PendingRouting,
    capacity_keep,
    device_dispatch,
    grouped_mm_available,
)
from moeguard_runtime.model.timing import Mark, mark, seconds_between

DEFAULT_EXPERT_CHUNK_TOKENS = 2048
DEFAULT_MIN_CAPACITY = 4
"""DeepSpeed's ``min_capacity`` default."""


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float,
                    min_capacity: int = DEFAULT_MIN_CAPACITY) -> int:
    """DeepSpeed's formula: ``ceil(tokens * k / experts * capacity_factor)``, at least
    ``min_capacity`` token-slots per expert."""
    return max(min_capacity, math.ceil(num_tokens * top_k / num_experts * capacity_factor))


@dataclass(frozen=True)
class RoutingStats:
    """Routing of one batch through one MoE layer (plain Python numbers: built from
    the one host transfer of the counts that the dispatch makes anyway).

    Attributes:
        tokens_per_expert: ``E`` ints, token-slots routed to each expert.
        routed_slots: ``T * k``, the sum of ``tokens_per_expert``.
        top_expert_tokens: the largest entry of ``tokens_per_expert``.
        median_expert_tokens: the median entry (mean of the two middle entries
            when ``E`` is even).
        expert_skew_ratio: ``top / max(median, 1)``. The median is floored at one
            token so that a batch where most experts get nothing (e.g. a single
            decode token) gives a finite ratio equal to the top count, instead
            of infinity. 1.0 is perfect balance; an empty batch gives 0.0.
        balancedness: ``mean / max`` of ``tokens_per_expert`` (vLLM EPLB's
            measure): 1.0 is perfect balance, ``1/E`` is everything on one
            expert; an empty batch gives 1.0.
        overflow_tokens: token-slots dropped over capacity (0 when dropless).
        marks: :func:`timing.mark` before the router, after it, and after the
            experts; read them (:attr:`routing_seconds`, :attr:`expert_seconds`)
            after the step has synchronised.
        expert_chunks: how many chunks the layer's expert work was split into: with
            the host dispatch the most chunks of any one expert's token-slots
            (:func:`host_expert_chunks`), with the device dispatch the grouped
            matmuls over all slots (:func:`device_expert_chunks`). 1: not split;
            0: no slot routed.
    """

    tokens_per_expert: tuple[int, ...]
    routed_slots: int
    top_expert_tokens: int
    median_expert_tokens: float
    expert_skew_ratio: float
    balancedness: float
    overflow_tokens: int = 0
    marks: tuple[Mark, Mark, Mark] = (0.0, 0.0, 0.0)
    expert_chunks: int = 1

    @property
    def routing_seconds(self) -> float:
        """Wall time of the router in this layer, seconds."""
        return seconds_between(self.marks[0], self.marks[1])

    @property
    def expert_seconds(self) -> float:
        """Wall time of the expert matmuls in this layer, seconds."""
        return seconds_between(self.marks[1], self.marks[2])


def routing_stats(tokens_per_expert: Sequence[int] | torch.Tensor, overflow_tokens: int = 0,
                  marks: tuple[Mark, Mark, Mark] = (0.0, 0.0, 0.0),
                  expert_chunks: int = 1) -> RoutingStats:
    """Statistics of ``E`` token-slot counts (see :class:`RoutingStats`); a tensor is
    read with one ``tolist()``, a sequence of ints costs no device access."""
    counts = [int(c) for c in (tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor)
                               else tokens_per_expert)]
    total = sum(counts)
    top = max(counts, default=0)
    median = float(statistics.median(counts)) if counts else 0.0
    mean = total / len(counts) if counts else 0.0
    skew = top / max(median, 1.0)
    balancedness = mean / top if top > 0 else 1.0
    return RoutingStats(tuple(counts), total, top, median, skew, balancedness, overflow_tokens,
                        marks, expert_chunks if total else 0)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral router.

    Args:
        router_logits: ``[T, E]`` gate outputs (any float dtype).
        top_k: experts per token.

    Returns:
        ``(weights, experts)``: ``[T, k]`` float32 weights summing to 1 per token,
        and ``[T, k]`` int64 expert indices (highest weight first).
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k], [T, k]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


SMALL_BATCH_SLOTS = 256
"""At most this many token-slots (decode steps): combine the experts' outputs in one
``index_add_`` from a ``[slots, D]`` buffer (at most 256 rows, 1 MiB at D=1024 fp32)."""

_ONEDNN_LINEAR = (bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
                  and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
_ONEDNN_BF16 = _ONEDNN_LINEAR and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
_ONEDNN_PACK = _ONEDNN_LINEAR and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
DenseBackend = Literal["onednn", "torch", "torch_t", "stream"]
MatmulBackend = DenseBackend | Literal["onednn_packed"]
"""A kernel of the expert matmuls on the host.

``onednn``: oneDNN's linear primitive (``torch.ops.mkldnn._linear_pointwise`` on the dense
weight, no packed copy) for CPU float32, and bfloat16 where oneDNN supports it
(``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); rows padded to :func:`padded_rows`.
On the 2-core AMD EPYC of the benchmarks it ran the [1024, 1024] x [1024, 2816] float32
expert matmul at about 130 GFLOP/s against MKL's 60; on an Intel Xeon with AVX-512 it lost
to MKL (issue 16), so the worker chooses by measurement (:class:`KernelPlan`,
:mod:`moeguard_runtime.model.kernel_select`). Other devices and dtypes use ``F.linear``.
``torch``: ``F.linear`` everywhere (MKL sgemm for CPU float32, oneDNN's matmul for CPU bfloat16).
``torch_t``: the same product taken transposed, ``(w @ x.T).T`` (CPU only): the weight is the GEMM's left
operand (M = the output features, N = the rows), so at a few rows the BLAS runs its tall-skinny path, which
streams the weight, where ``x @ w.T`` (M = the rows) runs a small-M GEMM far below the read rate (issue 31:
decode). In :func:`swiglu_expert` the ``[2I, n]`` intermediate stays transposed, so no copy is added.
``stream``: moeguard's own kernel for a few rows (:mod:`moeguard_runtime.model.stream_kernel`, a C++ library
built with the machine's compiler): one pass over the dense weight at the read rate, float32 or bfloat16 weights
with float32 arithmetic, AVX2 CPUs only; elsewhere (no library) ``F.linear``. On the AMD EPYC, 4 rows of the
``[2I, D]`` fp32 weight at D=1024, I=2816: 15.4 GB/s against 11.2 for ``torch_t`` and 18.1 to read it.
``onednn_packed``: the same oneDNN primitive on expert weights reordered once into oneDNN's
blocked layout (:class:`PackedExperts`, ``torch.ops.mkldnn._reorder_linear_weight``, the path
inductor's CPU weight freezing takes), which *replace* the dense ones (:func:`pack_experts`).
On the AMD EPYC, 8 experts at D=1024, I=2816 in fp32, 4 rows each: 9.4-11.5 ms against
16.7-18.2 ms for ``onednn`` on the dense weights and 10.1 ms to read the weights once; at 1 row
slightly slower, at 16-1024 rows 5-35 % faster. A packed weight feeds no other kernel, so a
plan that has it has it in every bucket (:func:`moeguard_runtime.model.kernel_select.choose`); layers
with dense weights (shared experts) run ``onednn`` under it."""
DENSE_BACKENDS: tuple[DenseBackend, ...] = ("onednn", "torch", "torch_t", "stream")
"""The kernels that run on the dense weights (and the ``MOEGUARD_MATMUL_BACKEND`` values besides ``auto``)."""
PACKED_BACKEND: MatmulBackend = "onednn_packed"
MATMUL_BACKENDS: tuple[MatmulBackend, ...] = (*DENSE_BACKENDS, PACKED_BACKEND)
PACK_HINT_ROWS = 4
"""The ``batch_size_hint`` of ``_reorder_linear_weight``: a decode step's rows per expert. Measured:
a weight packed for 4 or for 64 rows ran every row count (1-1024) within noise of the other."""


@dataclass(frozen=True)
class KernelPlan:
    """The expert-matmul kernel for each bucket of row counts, chosen by measurement
    (:func:`moeguard_runtime.model.kernel_select.choose`).

    Attributes:
        bounds: ascending row counts; a call of ``n`` rows uses the first bucket with
            ``n <= bound`` (the last bucket takes every larger call too).
        kernels: one :data:`MatmulBackend` per bound.
    """

    bounds: tuple[int, ...]
    kernels: tuple[MatmulBackend, ...]

    def __post_init__(self) -> None:
        if not self.bounds or len(self.bounds) != len(self.kernels) or list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"a kernel plan needs ascending bounds, one kernel each: {self}")

    def kernel_for(self, rows: int) -> MatmulBackend:
        """The kernel of a call of ``rows`` rows."""
        for bound, kernel in zip(self.bounds, self.kernels, strict=True):
            if rows <= bound:
                return kernel
        return self.kernels[-1]

    @property
    def packed(self) -> bool:
        """Whether the plan runs the experts on packed weights (:data:`PACKED_BACKEND`)."""
        return PACKED_BACKEND in self.kernels

    def replacing(self, old: MatmulBackend, new: MatmulBackend) -> KernelPlan:
        """This plan with ``old`` replaced by ``new`` in every bucket."""
        return replace(self, kernels=tuple(new if k == old else k for k in self.kernels))

    @property
    def label(self) -> str:
        """``onednn`` when one kernel serves every bucket, else ``torch<=4,onednn`` style (the last
        bucket unbounded): the value of the ``kernel`` label of ``moeguard_matmul_kernel_info``."""
        if len(set(self.kernels)) == 1:
            return self.kernels[0]
        parts = []
        for i, (bound, kernel) in enumerate(zip(self.bounds, self.kernels, strict=True)):
            if i + 1 < len(self.kernels) and self.kernels[i + 1] == kernel:
                continue  # merged into the next bucket
            parts.append(kernel if i + 1 == len(self.kernels) else f"{kernel}<={bound}")
        return ",".join(parts)


MatmulChoice = MatmulBackend | KernelPlan
"""What a module's ``matmul_backend`` holds: one kernel for every call, or a measured plan."""


def kernel_for(backend: MatmulChoice, rows: int) -> MatmulBackend:
    """The kernel ``backend`` uses for a call of ``rows`` rows."""
    return backend.kernel_for(rows) if isinstance(backend, KernelPlan) else backend


def uses_packed(backend: MatmulChoice) -> bool:
    """Whether ``backend`` wants the experts' weights packed (:func:`pack_experts`)."""
    return backend.packed if isinstance(backend, KernelPlan) else backend == PACKED_BACKEND


class PackedExperts(nn.ParameterList):
    """One layer's stacked expert weights (``[E, out, in]``) in oneDNN's blocked layout: one opaque
    ``mkldnn`` tensor per expert (``torch.ops.mkldnn._reorder_linear_weight``), held as parameters,
    so ``parameters()`` (the weight-bytes telemetry) sees them with their ``numel`` and dtype.

    Stands where the dense ``w13``/``w2`` stood for the readers of the dispatch: ``[e]`` is expert
    ``e``'s ``[out, in]`` weight (usable by :func:`expert_linear` only), ``shape`` is the stack's
    ``[E, out, in]``, ``dtype``, ``device`` and ``nbytes`` as a tensor's. No slicing, no ``F.linear``,
    no ``state_dict`` round trip (an opaque tensor has no storage): packing comes last, after the
    checkpoint is loaded and the experts are sharded."""

    def __init__(self, packed: Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype) -> None:
        super().__init__([nn.Parameter(p, requires_grad=False) for p in packed])
        self.stack_shape = torch.Size(shape)
        self.stack_dtype = dtype

    @classmethod
    def pack(cls, w: torch.Tensor, hint: int = PACK_HINT_ROWS) -> PackedExperts:
        """``w`` ``[E, out, in]`` (CPU, a dtype :func:`onednn_supports`), reordered expert by expert
        into new tensors; ``w`` itself is left as it is (the caller drops it to free it)."""
        w = w.detach()
        return cls([torch.ops.mkldnn._reorder_linear_weight(w[e], hint) for e in range(w.shape[0])],
                   w.shape, w.dtype)

    @property
    def shape(self) -> torch.Size:
        """``[E, out, in]``, the dense stack's shape."""
        return self.stack_shape

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return self.stack_dtype

    @property
    def device(self) -> torch.device:
        """The CPU."""
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """The packed tensors' bytes (:func:`tensor_bytes`): the dense stack's where ``out`` and ``in``
        fill oneDNN's blocks (D=1024, I=2816: equal), more where they are padded ([1001, 999]: +3 %)."""
        return sum(tensor_bytes(p) for p in self)

    def dim(self) -> int:
        """3, as the dense stack."""
        return 3


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t``'s data holds: ``numel * element_size``, or for an opaque oneDNN tensor (a packed
    weight) oneDNN's own size of its blocked layout (``torch.ops.mkldnn._nbytes``, with the padding)."""
    if t.is_mkldnn:
        return int(torch.ops.mkldnn._nbytes(t))
    return int(t.numel()) * int(t.element_size())


ExpertWeights = torch.Tensor | PackedExperts
"""A layer's ``w13`` or ``w2``: the dense ``[E, out, in]`` tensor or its :class:`PackedExperts`."""


def can_pack(w: torch.Tensor) -> bool:
    """Whether ``w``'s experts can be packed: oneDNN's reorder exists and :func:`onednn_supports` ``w``."""
    return _ONEDNN_PACK and onednn_supports(w)


def pack_experts(model: object, hint: int = PACK_HINT_ROWS) -> int:
    """Replace every routed-expert module's dense ``w13``/``w2`` (``[E, 2I, D]``, ``[E, D, I]``) by
    :class:`PackedExperts` (where :func:`can_pack`, and not on a module with ``dispatch == "device"``,
    whose grouped matmul reads the dense stack); returns how many modules were packed.

    The dense tensors are released as each is packed (``w13`` before ``w2`` is packed), so the
    extra memory is one layer's ``w13`` at most, and only while that layer packs; a dense tensor
    that something else still references (a caller's variable) stays until that reference goes.
    Call it last: after loading and expert-parallel sharding, which slice the dense stack."""
    packed = 0
    if not isinstance(model, nn.Module):
        return 0
    for module in list(model.modules()):
        w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
        if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3
                and can_pack(w13) and can_pack(w2) and getattr(module, "dispatch", "host") != "device"):
            continue
        for name in ("w13", "w2"):
            dense = getattr(module, name)
            delattr(module, name)
            setattr(module, name, PackedExperts.pack(dense, hint))
            del dense
        packed += 1
    if packed:
        warm_packed(model)
    return packed


def warm_rows(max_rows: int) -> list[int]:
    """The row counts :func:`warm_packed` runs: each bucket of :func:`padded_rows` up to ``max_rows``,
    and one row below it where that row count pads to it (ascending)."""
    buckets = sorted({padded_rows(n) for n in range(1, max_rows + 1)})
    rows = set(buckets) | {b - 1 for b in buckets if b > 1 and padded_rows(b - 1) == b}
    return sorted(rows)


def warm_packed(model: nn.Module, max_rows: int | None = None) -> int:
    """Create, at start-up, every oneDNN primitive that a packed expert call can need: one
    :func:`swiglu_expert` per distinct packed ``(w13, w2)`` shape and dtype at each row count of
    :func:`warm_rows` (default up to :data:`ONEDNN_CHUNK_TOKENS`, the oneDNN path's chunk bound).
    A row count that is its own bucket feeds ``w2`` a strided view of the ``[n, 2I]`` product; one
    below it, a padded contiguous copy: both layouts get their primitive. Returns the calls made.

    Why: a oneDNN primitive that failed to be created under memory pressure kept failing once the
    memory was back (measured under ``prlimit --as``, tests/integration/worker/test_out_of_memory.py),
    and packed experts have no dense weight to leave oneDNN for (:func:`leave_onednn`). Created
    here, from oneDNN's primitive cache (1,024 entries by default), no step has to create one. Cost:
    ~2,400 rows through one expert per shape (D=1024, I=2816, fp32: ~0.2 s)."""
    limit = ONEDNN_CHUNK_TOKENS if max_rows is None else max_rows
    seen: set[tuple[torch.Size, torch.Size, torch.dtype]] = set()
    calls = 0
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for module in model.modules():
            w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
            if not (isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts)):
                continue
            key = (w13.shape, w2.shape, w13.dtype)
            if key in seen:
                continue
            seen.add(key)
            for n in warm_rows(limit):
                x = torch.randn(n, w13.shape[2], generator=gen).to(w13.dtype)
                swiglu_expert(x, w13[0], w2[0], PACKED_BACKEND)
                calls += 1
    return calls


MoeDispatch = Literal["auto", "host", "device"]
"""How :class:`MOEFeedForward` groups the slots: ``host`` (:func:`dispatch_experts`, the
counts read on the host once per layer; any device, oneDNN on the CPU), ``device``
(:func:`moe_device.device_dispatch`, no host read; needs ``F.grouped_mm``), or ``auto``
(default): ``device`` where :func:`moe_device.grouped_mm_available`, else ``host``."""
MOE_DISPATCHES: tuple[MoeDispatch, ...] = ("auto", "host", "device")


ONEDNN_CHUNK_TOKENS = 256
"""On the oneDNN path an expert's slice is processed at most this many token-slots at
a time (a tighter bound than ``expert_chunk_tokens``): oneDNN's own per-call
buffers grow with the rows, and at 4,096 tokens (D=1024, I=2816) chunks of 256
had the lowest peak (74 MB against 146 MB in chunks of 2048, whose temporaries
alone are 31 MB) and ran as fast as or faster than any larger chunk."""


def leave_onednn(model: object) -> int:
    """Switch every module of ``model`` whose ``matmul_backend`` uses ``onednn`` to ``torch``
    (``F.linear``, MKL on the CPU; in a :class:`KernelPlan`, the oneDNN buckets only), for the
    rest of the process; returns how many modules changed.

    The cure for oneDNN primitives that failed to be created under memory pressure: measured
    here, after an address-space limit (``prlimit --as``) was lifted, the prefills whose shapes
    had failed kept failing with "could not create a primitive" while other shapes ran, and
    torch exposes no way to reset oneDNN's caches (its ``dnnl_*`` symbols are hidden). A
    restart brings oneDNN back.

    Modules whose experts are packed (:class:`PackedExperts`) stay on oneDNN: no dense weight is
    left for ``F.linear``, and unpacking would take the memory whose lack failed the primitive (and
    oneDNN's reorder, which can fail the same way); their primitives were created at start-up
    (:func:`warm_packed`), so no step needs a new one."""
    changed = 0
    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(getattr(module, "w13", None), PackedExperts):
                continue
            backend = getattr(module, "matmul_backend", None)
            if backend in ("onednn", PACKED_BACKEND):
                setattr(module, "matmul_backend", "torch")  # noqa: B010 - nn.Module types attributes as tensors
                changed += 1
            elif isinstance(backend, KernelPlan) and {"onednn", PACKED_BACKEND} & set(backend.kernels):
                plan = backend.replacing("onednn", "torch").replacing(PACKED_BACKEND, "torch")
                setattr(module, "matmul_backend", plan)  # noqa: B010
                changed += 1
    return changed


def onednn_supports(x: torch.Tensor) -> bool:
    """Whether the ``onednn`` kernel runs on ``x``: CPU float32, or bfloat16 where oneDNN has it."""
    return _ONEDNN_LINEAR and x.device.type == "cpu" and (
        x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _ONEDNN_BF16))


def _onednn(x: torch.Tensor, backend: MatmulChoice, rows: int | None = None) -> bool:
    kernel = kernel_for(backend, x.shape[0] if rows is None else rows)
    return kernel in ("onednn", PACKED_BACKEND) and onednn_supports(x)


def padded_rows(n: int) -> int:
    """Row count ``n`` rounded up to a bucket: a power of two up to 32, then a multiple of 32.

    oneDNN builds and caches one primitive (with JIT code and scratchpad) per input
    shape; unpadded, every distinct chunk length of a serving worker adds one, and RSS
    grew by ~370 MB in a minute of prompts of varied lengths (the C6 scenario). With
    buckets there are at most 13 row counts per weight shape (chunks are <= 256 rows).
    """
    if n <= 32:
        return 1 << max(0, n - 1).bit_length()
    return -(-n // 32) * 32


def expert_linear(x: torch.Tensor, w: torch.Tensor,
                  backend: MatmulChoice = "onednn") -> torch.Tensor:
    """``x @ w.T`` (``x`` [n, in], ``w`` [out, in]) → [n, out]: with the ``onednn`` or ``onednn_packed``
    kernel (``backend``'s choice for ``n`` rows), oneDNN for CPU float32/bfloat16 (rows padded to
    :func:`padded_rows`, the padding sliced off), ``torch_t`` (``(w @ x.T).T``), ``stream``
    (:func:`stream_kernel.try_linear`, where it takes the tensors), else ``F.linear``. A packed
    ``w`` (an ``mkldnn`` tensor, :class:`PackedExperts`) always takes oneDNN, whatever ``backend`` says."""
    n = x.shape[0]
    if w.is_mkldnn:
        if n == 0:
            return x.new_empty(0, w.shape[0])
        return _onednn_linear(x, w)
    if n > 0 and _onednn(x, backend, n):
        return _onednn_linear(x, w)
    kernel = kernel_for(backend, n) if n > 0 else None
    if kernel == "torch_t" and x.dim() == 2:
        return torch.mm(w, x.T).T  # [n, out], a transposed view
    if kernel == "stream" and (y := stream_kernel.try_linear(x, w)) is not None:
        return y
    return F.linear(x, w)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's linear on ``n >= 1`` rows, padded to :func:`padded_rows` (the padding sliced off)."""
    n = x.shape[0]
    m = padded_rows(n)
    if m != n:
        x = F.pad(x, (0, 0, 0, m - n))
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return out if m == n else out[:n]


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  backend: MatmulChoice = "onednn") -> torch.Tensor:
    """One expert with fused gate/up weights: ``w2(silu(gate x) * up x)``.

    ``x`` [n, D]; ``w13`` [2I, D], the gate projection's rows then the up projection's;
    ``w2`` [D, I] → [n, D]. One matmul reads the gate and up weights together (once for all
    ``n`` rows, also at decode); the activation is computed in place in the ``[n, 2I]``
    result (vLLM's ``SiluAndMul`` on the two halves), so the only temporary is that result.
    Inference only.

    On ``torch_t`` (:data:`MatmulBackend`) the same in transposed form: ``h.T = w13 @ x.T`` ``[2I, n]``, the
    activation on its two row halves, ``w2 @ gate.T`` ``[D, n]``, returned as an ``[n, D]`` view."""
    inter = w2.shape[1]
    n = x.shape[0]
    if n > 0 and not w13.is_mkldnn and kernel_for(backend, n) == "torch_t":
        ht = torch.mm(w13, x.T)  # [2I, n]
        gate_t = ht[:inter]  # [I, n], contiguous
        F.silu(gate_t, inplace=True)
        gate_t.mul_(ht[inter:])
        return torch.mm(w2, gate_t).T  # [n, D] view of [D, n]
    h = expert_linear(x, w13, backend)  # [n, 2I]
    gate = h[:, :inter]  # [n, I] view, row stride 2I
    F.silu(gate, inplace=True)
    gate.mul_(h[:, inter:])
    return expert_linear(gate, w2, backend)  # [n, D]


def swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
               backend: MatmulChoice = "onednn") -> torch.Tensor:
    """A SwiGLU MLP with separate weights (HF ``gate_proj``/``up_proj``/``down_proj``, the shared
    experts): ``w2(silu(w1 x) * w3 x)``; ``x`` [n, D], ``w1``/``w3`` [I, D], ``w2`` [D, I] → [n, D]."""
    h = expert_linear(x, w1, backend)  # [n, I]
    F.silu(h, inplace=True)
    h.mul_(expert_linear(x, w3, backend))
    return expert_linear(h, w2, backend)  # [n, D]


def stack_gate_up(gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fused ``[E, 2I, D]`` weight from ``E`` gate and ``E`` up projections (``[I, D]`` each,
    HF ``w1``/``gate_proj`` and ``w3``/``up_proj``), copied once into one new tensor (the
    checkpoint's tensors may stay memory-mapped), in the first gate tensor's dtype."""
    if len(gate) != len(up) or not gate:
        raise ValueError(f"{len(gate)} gate and {len(up)} up projections")
    inter, dim = gate[0].shape
    out = torch.empty(len(gate), 2 * inter, dim, dtype=gate[0].dtype, device=gate[0].device)
    for e, (g, u) in enumerate(zip(gate, up, strict=True)):
        out[e, :inter].copy_(g)
        out[e, inter:].copy_(u)
    return out


def fuse_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """``[E, I, D]`` gate and up stacks → the fused ``[E, 2I, D]`` (a new tensor)."""
    return torch.cat([w1, w3], dim=1)


class GateUpViews:
    """``w1`` and ``w3`` (``[E, I, D]``) as views of a module's fused ``w13`` (``[E, 2I, D]``):
    for readers of the unfused layout (tests, the HF reference loop). Writing into them
    writes into ``w13``."""

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def w1(self) -> torch.Tensor:
        """``[E, I, D]`` gate projections (a view)."""
        return self.w13[:, :self.w2.shape[2]]

    @property
    def w3(self) -> torch.Tensor:
        """``[E, I, D]`` up projections (a view)."""
        return self.w13[:, self.w2.shape[2]:]


def slice_call(x: torch.Tensor, backend: MatmulChoice, rows: int, expert_chunk_tokens: int,
               packed: bool = False) -> tuple[MatmulBackend, int]:
    """How one expert's slice of ``rows`` token-slots runs: ``(kernel, chunk)``, the kernel of every call
    over the slice and the most rows one call takes.

    The kernel is ``backend``'s choice for the slice's first call (``min(rows, expert_chunk_tokens)`` rows;
    :data:`PACKED_BACKEND` for packed weights), decided once per slice, so a slice the plan gives to a
    oneDNN kernel runs on it in every chunk (:func:`moeguard_runtime.model.kernel_select.expert_timer` times
    a bucket the same way). A oneDNN call takes at most :data:`ONEDNN_CHUNK_TOKENS` rows (its per-call
    buffers grow with the rows); any other kernel ``expert_chunk_tokens``, the bound of the memory model
    (``moeguard_core.memory_model.Routing``)."""
    kernel: MatmulBackend = PACKED_BACKEND if packed else kernel_for(backend, min(rows, expert_chunk_tokens))
    if kernel in ("onednn", PACKED_BACKEND) and onednn_supports(x):
        return kernel, min(expert_chunk_tokens, ONEDNN_CHUNK_TOKENS)
    return kernel, expert_chunk_tokens


def host_expert_chunks(x: torch.Tensor, tokens_per_expert: Sequence[int], expert_chunk_tokens: int,
                       capacity: int | None = None, backend: MatmulChoice = "onednn",
                       packed: bool = False) -> int:
    """The most chunks :func:`dispatch_experts` splits one expert's token-slots into, for ``x`` and
    the layer's counts: the largest ``ceil(kept / chunk)`` over the experts, where ``kept`` is an
    expert's slots under ``capacity`` and ``chunk`` its slice's bound (:func:`slice_call`:
    :data:`ONEDNN_CHUNK_TOKENS` where the slice runs on oneDNN, else ``expert_chunk_tokens``).
    0 when nothing was routed."""
    most = 0
    for count in tokens_per_expert:
        kept = count if capacity is None else min(count, capacity)
        if kept > 0:
            chunk = slice_call(x, backend, kept, expert_chunk_tokens, packed)[1]
            most = max(most, -(-kept // chunk))
    return most


def fused_stream(x: torch.Tensor, kept: Sequence[int], backend: MatmulChoice, expert_chunk_tokens: int,
                 packed: bool = False) -> bool:
    """Whether :func:`dispatch_experts` runs a small batch's experts in one library call
    (:func:`stream_kernel.try_experts`): every expert with slots runs ``stream`` (:func:`slice_call`, the plan's
    choice for its row count) in one chunk (``kept[e] <= expert_chunk_tokens``), on dense weights, and some
    expert has slots. Pure logic: whether the library takes the tensors is :func:`stream_kernel.try_experts`'
    own check."""
    busy = [n for n in kept if n > 0]
    if packed or not busy:
        return False
    for n in busy:
        kernel, chunk = slice_call(x, backend, n, expert_chunk_tokens, packed)
        if kernel != "stream" or n > chunk:
            return False
    return True


def _stream_experts(x: torch.Tensor, bounds: Sequence[int], slot_token: torch.Tensor, slot_weight: torch.Tensor,
                    w13: ExpertWeights, w2: ExpertWeights, out: torch.Tensor) -> bool:
    """:func:`stream_kernel.try_experts` into ``out`` (``[T, D]`` zeros in ``x.dtype``), for ``x`` in the weights'
    dtype as :func:`expert_linear`'s ``stream`` takes it; bfloat16 through a float32 copy of ``x`` and a float32
    sum rounded once into ``out`` (the loop rounds ``h``, the activation and each expert's output to bfloat16).
    False, ``out`` untouched, where the library does not take the tensors."""
    if (not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or x.dtype != w13.dtype
            or x.dtype not in stream_kernel.DTYPES):
        return False
    if x.dtype == torch.float32:
        return stream_kernel.try_experts(x, bounds, slot_token, slot_weight, w13, w2, out)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    if not stream_kernel.try_experts(x.float(), bounds, slot_token, slot_weight, w13, w2, acc):
        return False
    out.copy_(acc)
    return True


def device_expert_chunks(slots: int, expert_chunk_tokens: int) -> int:
    """The grouped matmuls :func:`moe_device.device_dispatch` runs over ``slots`` token-slots:
    ``ceil(slots / expert_chunk_tokens)`` (no host read: ``slots`` is ``T * k``)."""
    return -(-slots // expert_chunk_tokens)


def dispatch_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
    capacity: int | None = None,
    backend: MatmulChoice = "onednn",
) -> tuple[torch.Tensor, list[int], int]:
    """Run the experts on their token-slots, grouped by expert.

    Args:
        x: ``[T, D]`` hidden states.
        weights: ``[T, k]`` router weights (float32).
        experts: ``[T, k]`` int64 expert indices.
        w13: ``[E, 2I, D]`` fused gate and up projections; w2: ``[E, D, I]`` (dense, or
            :class:`PackedExperts`).
        expert_chunk_tokens: most token-slots one expert processes at once.
        capacity: most token-slots per expert (None: dropless).
        backend: kernel of the expert matmuls (:data:`MatmulChoice`). A small batch (at most
            :data:`SMALL_BATCH_SLOTS` kept slots) whose every expert ``backend`` runs on ``stream`` in one chunk
            (:func:`fused_stream`) runs all its experts in one library call (:func:`stream_kernel.try_experts`,
            dense weights the library takes), else expert by expert.

    Returns:
        ``(out, tokens_per_expert, overflow)``: ``[T, D]`` in ``x.dtype`` (the
        weighted sum over each token's kept experts), ``E`` ints, the token-slot
        counts routed (before capacity; the layer's one host transfer), and the
        number of slots dropped.

    Raises:
        ValueError: ``expert_chunk_tokens < 1``.
    """
    if expert_chunk_tokens < 1:
        raise ValueError("expert_chunk_tokens must be >= 1")
    num_tokens, k = experts.shape
    num_experts = w13.shape[0]
    flat_experts = experts.reshape(-1)  # [T*k] token-major
    counts = torch.bincount(flat_experts, minlength=num_experts)  # [E]
    # The one host transfer of this layer: the slices' bounds are data-dependent
    # shapes; capacity, overflow and the routing statistics reuse these ints.
    host_counts: list[int] = counts.tolist()
    # Stable sort: within an expert the tokens stay in ascending order, which keeps
    # index_add_ on its fast path (unsorted indices make it ~100x slower on CPU).
    order = torch.argsort(flat_experts, stable=True)  # [T*k]
    slot_weight = weights.reshape(-1)[order]  # [T*k] float32
    kept = host_counts
    overflow = 0
    if capacity is not None and max(host_counts, default=0) > capacity:
        keep = capacity_keep(experts, counts, capacity)[order]  # [T*k] bool, sorted order
        kept = [min(c, capacity) for c in host_counts]
        overflow = sum(host_counts) - sum(kept)
        # the kept slots in their order; no boolean indexing (its size is read on the host)
        kept_idx = torch.argsort((~keep).to(torch.uint8), stable=True)[:sum(kept)]
        order, slot_weight = order[kept_idx], slot_weight[kept_idx]
        slot_token = order // k
        denom = torch.zeros(num_tokens, dtype=slot_weight.dtype,
                            device=slot_weight.device).index_add_(0, slot_token, slot_weight)
        slot_weight = slot_weight / denom[slot_token]  # renormalize what each token keeps
    slot_token = order // k  # [S] token of each sorted slot
    out = torch.zeros_like(x)  # [T, D]
    bounds = [0, *itertools.accumulate(kept)]
    # Small batches (decode): every expert writes its rows into one [S, D] buffer and
    # a single index_add_ combines them; eight small index_add_ calls cost more than
    # the buffer. Large batches add each chunk at once, so no [S, D] buffer exists.
    slots = bounds[-1]
    packed = isinstance(w13, PackedExperts)
    if (slots <= SMALL_BATCH_SLOTS and fused_stream(x, kept, backend, expert_chunk_tokens, packed)
            and _stream_experts(x, bounds, slot_token, slot_weight, w13, w2, out)):
        return out, host_counts, overflow
    gathered = x.new_empty(slots, x.shape[1]) if slots <= SMALL_BATCH_SLOTS else None
    for e in range(num_experts):
        if kept[e] == 0:
            continue
        kernel, chunk = slice_call(x, backend, kept[e], expert_chunk_tokens, packed)
        for c0 in range(bounds[e], bounds[e + 1], chunk):
            c1 = min(c0 + chunk, bounds[e + 1])
            tok = slot_token[c0:c1]  # [n], ascending
            y = swiglu_expert(x.index_select(0, tok), w13[e], w2[e], kernel)  # [n, D]
            if gathered is not None:
                torch.mul(y, slot_weight[c0:c1, None].to(y.dtype), out=gathered[c0:c1])
            else:
                y.mul_(slot_weight[c0:c1, None].to(y.dtype))
                out.index_add_(0, tok, y)
            del y, tok
    if gathered is not None:
        out.index_add_(0, slot_token, gathered)
    return out, host_counts, overflow


class ExpertDispatch(Protocol):
    """Runs a layer's routed experts somewhere else (expert parallelism,
    :class:`moeguard_runtime.parallel.expert_parallel.LayerDispatch`): ``x`` [T, D], ``weights`` [T, k] float32,
    ``experts`` [T, k] int64 → ``[T, D]`` in ``x.dtype``, the weighted sum over each token's experts."""

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor: ...


def ep_routing(dispatch: ExpertDispatch, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
               num_experts: int, t0: Mark, t1: Mark) -> tuple[torch.Tensor, RoutingStats]:
    """The layer's output through ``dispatch`` and its routing statistics (the router's full ``E`` counts,
    dropless; the experts' time includes the group's collectives)."""
    out = dispatch(x, weights, experts)
    counts: list[int] = torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    return out, routing_stats(counts, 0, (t0, t1, mark(x.device)), 1 if counts else 0)


class MOEFeedForward(GateUpViews, nn.Module):
    """Router plus stacked SwiGLU experts (gpt-fast ``MOEFeedForward``), gate and up fused
    (``w13`` ``[E, 2I, D]``; ``w1``/``w3`` are views of it).

    ``capacity_factor`` 0 (default) is dropless; above 0, DeepSpeed capacity.
    ``matmul_backend``: kernel of the expert matmuls (:data:`MatmulChoice`);
    ``dispatch``: see :data:`MoeDispatch`.
    """

    def __init__(self, dim: int, intermediate_size: int, num_experts: int, top_k: int,
                 expert_chunk_tokens: int = DEFAULT_EXPERT_CHUNK_TOKENS,
                 capacity_factor: float = 0.0, matmul_backend: MatmulChoice = "onednn",
                 dispatch: MoeDispatch = "auto") -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)  # weight [E, D]
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, dim))  # [E, 2I, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))  # [E, D, I]
        self.top_k = top_k
        self.num_experts = num_experts
        self.expert_chunk_tokens = expert_chunk_tokens
        self.capacity_factor = capacity_factor
        self.matmul_backend: MatmulChoice = matmul_backend
        self.dispatch: MoeDispatch = dispatch
        self.expert_parallel: ExpertDispatch | None = None
        """Set on an expert-parallel leader: the routed experts run across the group."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats | PendingRouting]:
        """``x`` [T, D] → ``([T, D], routing)``: :class:`RoutingStats` from the host
        dispatch, :class:`moe_device.PendingRouting` from the device one (read it with
        :func:`read_back`, together with the step's other results)."""
        t0 = mark(x.device)
        weights, experts = route(self.gate(x), self.top_k)  # [T, k] each
        t1 = mark(x.device)
        if self.expert_parallel is not None:
            return ep_routing(self.expert_parallel, x, weights, experts, self.num_experts, t0, t1)
        capacity = None
        if self.capacity_factor > 0:
            capacity = expert_capacity(x.shape[0], self.top_k, self.num_experts,
                                       self.capacity_factor)
        if self.dispatch == "device" or (self.dispatch == "auto" and grouped_mm_available(x)):
            out, pending, dropped = device_dispatch(x, weights, experts, self.w13, self.w2,
                                                    self.expert_chunk_tokens, capacity)
            return out, PendingRouting(pending, dropped, (t0, t1, mark(x.device)),
                                       device_expert_chunks(experts.numel(), self.expert_chunk_tokens))
        out, counts, overflow = dispatch_experts(
            x, weights, experts, self.w13, self.w2, self.expert_chunk_tokens, capacity,
            self.matmul_backend)
        t2 = mark(x.device)
        return out, routing_stats(counts, overflow, (t0, t1, t2), host_expert_chunks(
            x, counts, self.expert_chunk_tokens, capacity, self.matmul_backend, isinstance(self.w13, PackedExperts)))


def read_back(records: list[RoutingStats | PendingRouting],
              extra: torch.Tensor | None) -> tuple[list[RoutingStats], list[int]]:
    """Every pending layer's counts and overflow, and ``extra`` (``[n]`` integers, the
    sampled token ids), read in one host transfer.

    Returns:
        ``(stats per layer, extra as ints)``.
    """
    pending = [r for r in records if isinstance(r, PendingRouting)]
    parts = [p.counts.reshape(-1) for p in pending] + [p.overflow.reshape(1) for p in pending]
    if extra is not None:
        parts.append(extra.reshape(-1))
    if not parts:
        return [r for r in records if isinstance(r, RoutingStats)], []
    host: list[int] = torch.cat([p.to(torch.int64) for p in parts]).tolist()  # the one transfer
    at = 0
    counts: list[list[int]] = []
    for p in pending:
        counts.append(host[at:at + p.counts.numel()])
        at += p.counts.numel()
    overflow, at = host[at:at + len(pending)], at + len(pending)
    resolved = iter(routing_stats(c, o, p.marks, p.chunks)
                    for c, o, p in zip(counts, overflow, pending, strict=True))
    stats = [r if isinstance(r, RoutingStats) else next(resolved) for r in records]
    return stats, host[at:]
