"""Choose the expert-matmul kernel by measurement (issue 16).

A fixed kernel loses somewhere: oneDNN's linear primitive ran the float32 expert matmuls
about twice as fast as MKL (``F.linear``) on the AMD EPYC of the benchmarks and slower on
an Intel Xeon with AVX-512. So at start-up the worker times every candidate kernel
(:data:`moeguard_runtime.model.moe.MATMUL_BACKENDS` that run on the model's device and dtype)
on the model's own experts (one expert's slice, :func:`slice_seconds`, on layer 0's fused ``w13``
``[2I, D]`` and ``w2`` ``[D, I]``, the next expert at each call, so the weights
come from memory as in serving rather than from a cache that holds one expert) at each bucket of row counts
that the budgets produce (:func:`row_buckets`: :data:`ROW_BUCKETS` for decode steps and short prefill chunks,
and the rows per expert of a full prefill budget, ``maxPrefillTokens * k / E``, issue 31: a plan chosen on
decode buckets alone was applied to 1,024-row prefill slices, where it lost), and keeps the fastest per bucket:
a :class:`moe.KernelPlan`. A bucket is timed as the dispatch runs it (:func:`moe.slice_call`): a oneDNN
kernel in chunks of :data:`moe.ONEDNN_CHUNK_TOKENS` rows, ``F.linear`` in one call. A prefill bucket
(more than :data:`DECODE_MAX_ROWS` rows) is timed at the row counts of :func:`spread_rows`, itself and two
counts inside its range, each scaled to the bucket's rows, and its figure is their mean: a balanced prefill
gives each expert a count near, not at, ``T * k / E``, and some GEMMs are fastest at exactly a power of two
(MKL's transposed product, ``torch_t``, on the AMD EPYC of 2026-12-07: 0.97x ``F.linear``'s time at 1,024
rows, 1.07-1.27x at 835, 897, 961 and 1,030; chosen on the power of two alone, it made the 4,096-token
prefill 0.83x the HF loop instead of 0.98x).

Packed weights (``onednn_packed``, :class:`moe.PackedExperts`): the same oneDNN primitive on
weights reordered once into its blocked layout; they replace the dense ones, so no other kernel
can run beside them and a plan is either packed in every bucket or a per-bucket mix of the dense
kernels. The rule (:func:`packed_wins`): packed when the geometric mean over the buckets of
``packed seconds / the dense plan's seconds`` (the dense plan: the fastest dense kernel per bucket)
is at most ``1 - TIE_FRACTION``, and no bucket is more than :data:`MAX_PACKED_LOSS` slower. Each phase
weighs half (:func:`phase_weights`): the decode buckets (<= :data:`DECODE_MAX_ROWS` rows) share one half,
the prefill buckets the other, whatever their number. The
packed candidate is timed on packed copies of the first experts, as many as hold
:data:`PACKED_PROBE_BYTES` (at least two, at most all), taken in turn as the dense kernels take
all of them, so their weights come from memory, not from the cache (32 MiB of L3 on the EPYC of
the benchmarks). The copies are made for the measurement and dropped after it: a start-up
transient of 138 MB at D=1024, I=2816 (4 experts in fp32, 8 in bf16), two experts' weights
for larger experts.

Packing is not a candidate when its start-up transient (:func:`packing_transient_bytes`) exceeds the
memory left under the tightest limit (``select``'s ``headroom_bytes``): measuring must not OOM-kill the
worker it is meant to speed up.

Timing: one warm-up call per (kernel, rows) (oneDNN creates and caches its primitive on
the first call), then up to :data:`REPS` interleaved rounds (kernel A, kernel B, A, B, ...,
so drift on a shared machine hits both alike), each cell's figure the fastest of its
calls; the rounds stop early once :data:`BUDGET_S` seconds have passed (at least one
timed call per cell). A tie, within :data:`TIE_FRACTION`, keeps the earlier candidate
(``onednn``, the kernel used before the measurement existed), except that a decode bucket keeps ``stream``
within :data:`FUSED_PREFERENCE` (the one-call decode of :func:`moe.fused_stream` needs it in every decode bucket).

The choice is cached in a JSON file per CPU model, shape, dtype, thread count, torch
version and candidate set under ``MOEGUARD_KERNEL_CACHE_DIR`` (default
``~/.cache/moeguard/kernels``; the operator sets ``contract.POD_KERNEL_CACHE_DIR``, on the pod's ``/tmp`` emptyDir); a directory that cannot be written (the worker pod's
read-only root filesystem) means no cache, which the caller logs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeguard_core import contract
from moeguard_runtime.model import moe, stream_kernel
from moeguard_runtime.model.moe import (
    DENSE_BACKENDS,
    MATMUL_BACKENDS,
    PACKED_BACKEND,
    KernelPlan,
    MatmulBackend,
    MatmulChoice,
    PackedExperts,
    can_pack,
    onednn_supports,
    pack_experts,
    swiglu_expert,
    uses_packed,
)

ROW_BUCKETS = (1, 4, 16, 64, 256)
"""Row counts always timed (each already a :func:`moe.padded_rows` bucket): 1-16 cover decode steps
(a step of ``T`` tokens gives each touched expert about ``T * k / E`` rows), 64-256 prefill chunks;
:func:`row_buckets` adds a full prefill budget's rows per expert."""
DECODE_MAX_ROWS = 16
"""Buckets up to this many rows are decode's in :func:`phase_weights` (a decode step of 64 sequences gives
each of 8 experts 16 rows at k=2)."""
REPS = 5
"""Interleaved rounds at most."""
BUDGET_S = 3.0
"""Wall seconds after which no further round starts (the warm-up and one round always run)."""
TIE_FRACTION = 0.02
"""A later candidate must be this much faster than the earlier one to win its bucket (and packed
weights this much faster than the dense plan, in the geometric mean of the buckets)."""
MAX_PACKED_LOSS = 0.5
"""Packed weights are not chosen when any bucket runs more than this fraction slower than the dense
plan there: a guard against a pathological shape, not a tuning. Measured on the AMD EPYC of the
benchmarks, one expert call at 1 row ran 0-33 % slower packed than dense, at 16-64 rows 13-48 %
faster; the geometric mean takes that trade (a lone sequence's decode pays for the batches')."""
PACKED_PROBE_BYTES = 128 << 20
"""Packed copies made to time ``onednn_packed``: the fewest experts whose weights reach this many bytes
(at least two, at most all), so consecutive calls read their weights from memory as the dense
kernels' calls over all the experts do, not from a cache that holds one or two small experts."""
FUSED_PREFERENCE = 0.10
"""In a decode bucket (at most :data:`DECODE_MAX_ROWS` rows) ``stream`` is kept where it is at most this fraction
slower than the fastest kernel: only a plan that gives every decode bucket to ``stream`` runs a decode step's
experts in one library call (:func:`moe.fused_stream`), which saved 3.5 of a 21.2 ms layer (16 %) at 16 tokens
against the per-expert loop (fp32, D=1024, I=2816, issue 31), a saving the per-call timing of one expert does not
see. Without it, bfloat16 on the AMD EPYC of the benchmarks chose ``torch`` at 1 row by 4 % (1,238 against
1,293 us), so its 16-token decode ran the per-expert loop."""
SELECTION_RULE = 6
"""In the cache key: choices cached under an earlier rule (1: dense kernels only; 2: one call per bucket,
decode buckets three fifths of the packed rule; 3: a prefill bucket timed at its own row count only; 4: before
:data:`FUSED_PREFERENCE`; 5: the torch kernel's split gate/up products, reverted) are measured again."""
SPREAD_FRACTIONS = (13 / 16, 15 / 16)
"""Where :func:`spread_rows` times a prefill bucket besides its own row count: these fractions of it, plus
a few rows (off the powers of two)."""
ENV_KERNEL_CACHE_DIR = contract.ENV_KERNEL_CACHE_DIR
DEFAULT_CACHE_DIR = "~/.cache/moeguard/kernels"
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")
"""The ``/proc/cpuinfo`` flags that decide which matmul kernels are fast (reported, not used)."""

Timer = Callable[[MatmulBackend, int], float]
"""``timer(kernel, rows)``: seconds of one expert's slice of ``rows`` rows on ``kernel``."""


def row_buckets(prefill_rows: int | None = None,
                expert_chunk_tokens: int = moe.DEFAULT_EXPERT_CHUNK_TOKENS) -> tuple[int, ...]:
    """The row counts to time: :data:`ROW_BUCKETS`, and ``prefill_rows`` (a full prefill budget's rows per
    expert, ``ceil(max_prefill_tokens * top_k / num_experts)``: :func:`prefill_rows`) rounded up to its
    :func:`moe.padded_rows` bucket and at most ``expert_chunk_tokens`` (no call takes more), where that is
    above the last of them. A skewed prefill's busier experts take the last bucket's kernel."""
    if prefill_rows is None:
        return ROW_BUCKETS
    rows = min(moe.padded_rows(max(1, prefill_rows)), max(1, expert_chunk_tokens))
    return ROW_BUCKETS if rows <= ROW_BUCKETS[-1] else (*ROW_BUCKETS, rows)


def spread_rows(rows: int) -> tuple[int, ...]:
    """The row counts that time a bucket of ``rows`` rows: ``rows`` alone for a decode bucket (at most
    :data:`DECODE_MAX_ROWS`: a pass over the weights, whatever the count), else ``rows`` and
    ``rows * f`` plus 3 rows for each of :data:`SPREAD_FRACTIONS` (1,024: 1,024, 835 and 963; 64: 64, 55
    and 63): counts a slice of the bucket's range really has, not only its power of two."""
    if rows <= DECODE_MAX_ROWS:
        return (rows,)
    return (rows, *sorted({min(rows - 1, int(rows * f) + 3) for f in SPREAD_FRACTIONS}))


def prefill_rows(max_prefill_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per expert of a balanced prefill of ``max_prefill_tokens`` tokens: ``ceil(T * k / E)``
    (4,096 tokens, k=2, E=8: 1,024)."""
    return -(-max_prefill_tokens * top_k // max(1, num_experts))


def phase_weights(buckets: Sequence[int]) -> dict[int, float]:
    """Weights summing to 1 over ``buckets``: the decode buckets (``<= DECODE_MAX_ROWS``) share one half and
    the prefill buckets the other, equally within a phase (all of it to one phase when the other has none)."""
    decode = [b for b in buckets if b <= DECODE_MAX_ROWS]
    prefill = [b for b in buckets if b > DECODE_MAX_ROWS]
    halves = [g for g in (decode, prefill) if g]
    return {b: 1.0 / len(halves) / len(g) for g in halves for b in g}


def cpu_model(cpuinfo: str | None = None) -> str:
    """The ``model name`` of ``/proc/cpuinfo`` (or ``cpuinfo``'s text), else ``platform.processor()``."""
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def isa_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """Which of :data:`ISA_FLAGS` the CPU has (from ``/proc/cpuinfo``'s first ``flags`` line)."""
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                  if line.startswith("flags")), set[str]())
    return tuple(f for f in ISA_FLAGS if f in flags)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def candidates(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[MatmulBackend, ...]:
    """The kernels that run on ``device`` in ``dtype``: ``onednn``, ``torch``, ``torch_t`` and ``onednn_packed``
    on the CPU in float32 (and bfloat16 where oneDNN has it; packed where oneDNN's reorder exists), else ``torch``
    alone; ``stream`` besides, in float32 and bfloat16, where :func:`stream_kernel.runs` (an AVX2 CPU, the library
    built). Not ``torch_t`` where oneDNN lacks the dtype: on the AMD EPYC (no native bf16) its emulated bfloat16
    ran 1.4-9x slower than ``F.linear`` at every row count, and timing it added 42 s to the worker's start-up
    (``bench/results/runtime.md``)."""
    probe = torch.empty(0, dtype=dtype, device=device)
    stream = stream_kernel.runs(dtype, device)
    if not onednn_supports(probe):
        return ("torch", "stream") if stream else ("torch",)
    dense = tuple(k for k in DENSE_BACKENDS if k != "stream" or stream)
    return (*dense, PACKED_BACKEND) if can_pack(probe) else dense


def packed_wins(seconds: Mapping[int, Mapping[str, float]], dense: KernelPlan) -> bool:
    """Whether packed weights beat the ``dense`` plan (the module docstring's rule): the weighted geometric
    mean (:func:`phase_weights`) over the buckets of ``seconds[rows]["onednn_packed"] / seconds[rows][dense
    kernel]`` is at most ``1 - TIE_FRACTION``, and no ratio exceeds ``1 + MAX_PACKED_LOSS``. False when a
    bucket lacks a packed time."""
    return packed_ratio(seconds, dense) <= 1 - TIE_FRACTION


def packed_ratio(seconds: Mapping[int, Mapping[str, float]], dense: KernelPlan) -> float:
    """The weighted geometric mean of :func:`packed_wins` (packed seconds / the dense plan's, per bucket,
    :func:`phase_weights`); ``inf`` when a bucket lacks a packed time or loses by more than
    :data:`MAX_PACKED_LOSS`."""
    ratios: dict[int, float] = {}
    for rows in dense.bounds:
        packed = seconds.get(rows, {}).get(PACKED_BACKEND)
        if packed is None:
            return math.inf
        ratios[rows] = packed / seconds[rows][dense.kernel_for(rows)]
    if not ratios or max(ratios.values()) > 1 + MAX_PACKED_LOSS:
        return math.inf
    weights = phase_weights(list(ratios))
    return math.exp(sum(weights[r] * math.log(v) for r, v in ratios.items()))


def choose(kernels: Sequence[MatmulBackend], timer: Timer, buckets: Sequence[int] = ROW_BUCKETS,
           reps: int = REPS, budget_s: float = BUDGET_S,
           clock: Callable[[], float] = time.perf_counter) -> tuple[KernelPlan, dict[int, dict[str, float]]]:
    """The fastest of ``kernels`` per bucket of ``buckets`` rows, by ``timer``; with
    ``onednn_packed`` among them, packed in every bucket when :func:`packed_wins` over the plan
    of the others.

    Returns:
        ``(plan, seconds)``: the plan, and ``seconds[rows][kernel]``, the fastest call of each cell.
    """
    if not kernels:
        raise ValueError("no candidate kernel")
    start = clock()
    for rows in buckets:
        for kernel in kernels:
            timer(kernel, rows)  # warm-up: oneDNN primitive creation, first-touch
    best: dict[int, dict[str, float]] = {rows: {} for rows in buckets}
    for rep in range(max(1, reps)):
        if rep > 0 and clock() - start > budget_s:
            break
        for rows in buckets:
            for kernel in kernels:
                t = timer(kernel, rows)
                best[rows][kernel] = min(t, best[rows].get(kernel, t))
    dense = [k for k in kernels if k != PACKED_BACKEND]
    chosen: list[MatmulBackend] = []
    for rows in buckets:
        winner = dense[0] if dense else PACKED_BACKEND
        for kernel in dense[1:]:
            if best[rows][kernel] < best[rows][winner] * (1 - TIE_FRACTION):
                winner = kernel
        if (rows <= DECODE_MAX_ROWS and "stream" in dense
                and best[rows]["stream"] <= best[rows][winner] * (1 + FUSED_PREFERENCE)):
            winner = "stream"
        chosen.append(winner)
    plan = KernelPlan(tuple(buckets), tuple(chosen))
    if dense and PACKED_BACKEND in kernels and packed_wins(best, plan):
        plan = KernelPlan(tuple(buckets), tuple(PACKED_BACKEND for _ in buckets))
    return plan, best


def probe_experts(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """How many experts' packed copies time ``onednn_packed``: the fewest that hold :data:`PACKED_PROBE_BYTES`,
    at least two, at most all ``E``."""
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size() if w13.shape[0] else 1
    return min(int(w13.shape[0]), max(2, -(-PACKED_PROBE_BYTES // per_expert)))


def packing_transient_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Bytes the ``onednn_packed`` candidate needs at start-up above the dense weights (``w13`` ``[E, 2I, D]``,
    ``w2`` ``[E, D, I]``, one layer): the larger of the probe's packed copies (:func:`probe_experts` experts'
    ``w13`` and ``w2``, held while measuring) and one layer's ``w13`` (held twice while that layer packs:
    :func:`moe.pack_experts` frees each dense tensor once its packed copy exists). They never overlap: the
    probe's copies are dropped before packing. Mixtral-8x7B in float32: 1.41 GB (2 experts) vs 3.76 GB."""
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size() if w13.shape[0] else 0
    return max(probe_experts(w13, w2) * per_expert, w13.numel() * w13.element_size())


def slice_seconds(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kernel: MatmulBackend,
                  expert_chunk_tokens: int = moe.DEFAULT_EXPERT_CHUNK_TOKENS) -> float:
    """Seconds of one expert's slice of ``x`` ``[n, D]`` as :func:`moe.dispatch_experts` runs it on
    ``kernel``: :func:`moe.swiglu_expert` over chunks of :func:`moe.slice_call`'s bound (``w13`` ``[2I, D]``
    and ``w2`` ``[D, I]``, dense or packed)."""
    n = x.shape[0]
    chunk = moe.slice_call(x, kernel, n, expert_chunk_tokens, kernel == PACKED_BACKEND)[1]
    with torch.inference_mode():
        t0 = time.perf_counter()
        for c0 in range(0, n, chunk):
            swiglu_expert(x[c0:c0 + chunk], w13, w2, kernel)
        return time.perf_counter() - t0


def expert_timer(w13: torch.Tensor, w2: torch.Tensor, seed: int = 0,
                 expert_chunk_tokens: int = moe.DEFAULT_EXPERT_CHUNK_TOKENS) -> Timer:
    """Times one expert's slice (:func:`slice_seconds`) on the experts ``w13`` ``[E, 2I, D]`` and ``w2``
    ``[E, D, I]`` (the model's own weights, no copy; one expert per call, the next one each
    time) with ``rows`` random rows in their dtype and device: seconds of a bucket of ``rows`` rows, the mean
    over :func:`spread_rows` of each count's call scaled by ``rows / count``. ``onednn_packed`` runs on packed
    copies of the first :func:`probe_experts` experts, made at its first call and freed with the timer."""
    gen = torch.Generator().manual_seed(seed)
    dim = w13.shape[-1]
    inputs: dict[int, torch.Tensor] = {}
    calls = [0]
    packed: list[tuple[torch.Tensor, torch.Tensor]] = []
    packed_calls = [0]

    def call(kernel: MatmulBackend, rows: int) -> float:
        x = inputs.get(rows)
        if x is None:
            x = inputs[rows] = torch.randn(rows, dim, generator=gen).to(w13.device, w13.dtype)
        if kernel == PACKED_BACKEND:
            if not packed:
                n = probe_experts(w13, w2)
                p13, p2 = PackedExperts.pack(w13[:n]), PackedExperts.pack(w2[:n])
                packed.extend((p13[e], p2[e]) for e in range(n))
            e = packed_calls[0] % len(packed)
            packed_calls[0] += 1
            a13, a2 = packed[e]
        else:
            e = calls[0] % w13.shape[0]
            calls[0] += 1
            a13, a2 = w13[e], w2[e]
        return slice_seconds(x, a13, a2, kernel, expert_chunk_tokens)

    def timer(kernel: MatmulBackend, rows: int) -> float:
        counts = spread_rows(rows)
        return sum(call(kernel, n) * rows / n for n in counts) / len(counts)

    return timer


@dataclass(frozen=True)
class Selection:
    """A measured (or cached) choice.

    Attributes:
        plan: the kernel per row bucket.
        seconds: ``seconds[rows][kernel]``, one expert call (fastest of the rounds).
        cpu: the CPU model; key: the cache key's fields.
        cached: read from the cache (no measurement this time).
        measure_s: wall seconds spent measuring (0 when cached).
        cache_file: where the choice was read or written; None: no cache.
        cache_error: why there is no cache (unwritable directory ...), or None.
        packed_skipped: why ``onednn_packed`` was not a candidate (its start-up transient,
            :func:`packing_transient_bytes`, exceeds the memory left under the limit), or None.
    """

    plan: KernelPlan
    seconds: Mapping[int, Mapping[str, float]]
    cpu: str
    key: Mapping[str, Any]
    cached: bool
    measure_s: float
    cache_file: str | None
    cache_error: str | None = None
    packed_skipped: str | None = None


def cache_key(w13: torch.Tensor, w2: torch.Tensor, kernels: Sequence[MatmulBackend],
              threads: int | None = None, cpu: str | None = None,
              buckets: Sequence[int] = ROW_BUCKETS) -> dict[str, Any]:
    """The fields a cached choice must match: CPU model, ``D``, ``I``, dtype, device type,
    torch threads, torch version, candidates, row buckets, :data:`SELECTION_RULE` and, where ``stream`` is a
    candidate, the digest of its source (:func:`stream_kernel.source_digest`: a new kernel is measured anew, as
    the bfloat16 path's rewrite of 2026-12-07 was)."""
    return {"cpu": cpu if cpu is not None else cpu_model(), "dim": int(w13.shape[-1]), "inter": int(w2.shape[-1]),
            "dtype": str(w13.dtype).removeprefix("torch."), "device": w13.device.type,
            "threads": threads if threads is not None else torch.get_num_threads(),
            "torch": torch.__version__, "kernels": list(kernels), "buckets": list(buckets),
            "rule": SELECTION_RULE, "stream": stream_kernel.source_digest() if "stream" in kernels else None}


def cache_path(directory: str, key: Mapping[str, Any]) -> Path:
    """``directory``/``<sha1 of the key, 16 hex>.json``."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory).expanduser() / f"{digest}.json"


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """``MOEGUARD_KERNEL_CACHE_DIR``, else :data:`DEFAULT_CACHE_DIR`."""
    env = os.environ if env is None else env
    return env.get(ENV_KERNEL_CACHE_DIR) or DEFAULT_CACHE_DIR


def _read_cache(path: Path, key: Mapping[str, Any]) -> tuple[KernelPlan, dict[int, dict[str, float]]] | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") != dict(key):
            return None
        plan = KernelPlan(tuple(int(b) for b in data["bounds"]),
                          tuple(k for k in data["kernels"] if k in MATMUL_BACKENDS))
        seconds = {int(r): {str(k): float(v) for k, v in ks.items()} for r, ks in data["seconds"].items()}
        return plan, seconds
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def select(w13: torch.Tensor, w2: torch.Tensor, directory: str | None = None, *,
           threads: int | None = None, timer: Timer | None = None,
           cpu: str | None = None, headroom_bytes: int | None = None,
           prefill_rows: int | None = None,
           expert_chunk_tokens: int = moe.DEFAULT_EXPERT_CHUNK_TOKENS) -> Selection:
    """The kernel plan for the experts ``w13`` ``[E, 2I, D]`` / ``w2`` ``[E, D, I]`` on this machine:
    from the cache under ``directory`` (default :func:`cache_dir`) when its key matches,
    else measured (:func:`choose` with ``timer``, default :func:`expert_timer`) and written
    there (a failure to write is returned as ``cache_error``, not raised).

    ``headroom_bytes``: memory left under the tightest limit (:func:`memory.start_headroom`); when
    the packed candidate's start-up transient (:func:`packing_transient_bytes`) exceeds it,
    ``onednn_packed`` is neither timed nor chosen (``Selection.packed_skipped`` says why): the
    measurement must not be what OOM-kills the worker. None: no limit known.

    ``prefill_rows``: a full prefill budget's rows per expert (:func:`prefill_rows`), timed as a bucket of its
    own (:func:`row_buckets`); None: :data:`ROW_BUCKETS` only. ``expert_chunk_tokens``: the layers' setting
    (the most rows of one call off oneDNN)."""
    kernels = candidates(w13.dtype, w13.device)
    skipped = None
    if headroom_bytes is not None and PACKED_BACKEND in kernels:
        need = packing_transient_bytes(w13, w2)
        if need > headroom_bytes:
            kernels = tuple(k for k in kernels if k != PACKED_BACKEND)
            skipped = (f"packing needs {need} bytes at start-up; {max(0, headroom_bytes)} left under the "
                       f"memory limit")
    buckets = row_buckets(prefill_rows, expert_chunk_tokens)
    key = cache_key(w13, w2, kernels, threads, cpu, buckets)
    directory = cache_dir() if directory is None else directory
    path = cache_path(directory, key)
    hit = _read_cache(path, key)
    if hit is not None:
        return Selection(hit[0], hit[1], key["cpu"], key, True, 0.0, str(path), packed_skipped=skipped)
    if len(kernels) == 1:  # nothing to measure, nothing to cache
        return Selection(KernelPlan((buckets[-1],), (kernels[0],)), {}, key["cpu"], key, False, 0.0, None,
                         packed_skipped=skipped)
    t0 = time.perf_counter()
    plan, seconds = choose(kernels, timer or expert_timer(w13, w2, expert_chunk_tokens=expert_chunk_tokens),
                           buckets)
    measure_s = time.perf_counter() - t0
    error = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "bounds": list(plan.bounds), "kernels": list(plan.kernels),
                                   "seconds": {str(r): ks for r, ks in seconds.items()},
                                   "measure_s": round(measure_s, 3)}, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Selection(plan, seconds, key["cpu"], key, False, measure_s,
                     None if error else str(path), error, skipped)


def first_experts(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(w13, w2)`` (``[E, 2I, D]``, ``[E, D, I]``) of the first module holding fused experts,
    or None (no MoE layer)."""
    for module in model.modules():
        w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
        if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3:
            return w13.detach(), w2.detach()
    return None


def model_prefill_rows(model: nn.Module, max_prefill_tokens: int) -> int | None:
    """:func:`prefill_rows` of ``max_prefill_tokens`` for the first module of ``model`` with routed experts
    (``top_k`` and ``num_experts``, the router's global count also on an expert-parallel shard), or None."""
    for module in model.modules():
        top_k, experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
        if isinstance(top_k, int) and isinstance(experts, int) and hasattr(module, "w13"):
            return prefill_rows(max_prefill_tokens, top_k, experts)
    return None


def apply_plan(model: nn.Module, plan: MatmulChoice) -> int:
    """Set ``matmul_backend`` of every module of ``model`` that has one (MoE layers, shared
    experts) to ``plan``, after packing the experts' weights (:func:`moe.pack_experts`, which frees
    the dense ones) when the plan is packed; returns how many modules got the plan.

    Call it after loading and expert-parallel sharding, and drop your own references to the dense
    weights first (:func:`first_experts`' result), or they stay allocated beside the packed ones."""
    if uses_packed(plan):
        pack_experts(model)
    changed = 0
    for module in model.modules():
        if hasattr(module, "matmul_backend"):
            setattr(module, "matmul_backend", plan)  # noqa: B010 - nn.Module types attributes as tensors
            changed += 1
    return changed
