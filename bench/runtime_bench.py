"""Runtime benchmarks: the MoE layer's kernels side by side against HF's
``MixtralSparseMoeBlock`` algorithm, decode against the memory-bandwidth bound in the
dtype served, and the worker loop's own overhead.

``python -m bench.runtime_bench`` (``make bench-runtime``) writes
``bench/results/runtime.md`` and ``runtime.json`` in under 5 minutes. All times are
medians of interleaved repetitions (A, B, C, A, B, C, ...), so drift on a shared
machine hits every candidate alike.

* **Machine**: CPU model and the ISA flags that decide the kernels (``/proc/cpuinfo``).
* **Kernel choice** (:mod:`moeguard_runtime.model.kernel_select`, as the worker does at start-up
  with ``MOEGUARD_MATMUL_BACKEND=auto``): every candidate timed on one expert of the
  benchmark's shape at each row bucket, fresh (no cache), in each dtype; the table gives
  microseconds per expert call, the weight-read rate (GB/s) and GFLOP/s, and the winner.
* **MoE layer**, D=1024, I=2816, E=8, k=2, the same seeded weights for all:
  ``moeguard_auto`` (the grouped dispatch, :func:`moe.dispatch_experts`, with the measured
  plan), ``moeguard_onednn``, ``moeguard_onednn_packed`` and ``moeguard_torch`` (the same
  dispatch with one kernel fixed: oneDNN's linear primitive on the dense weights, the same on
  weights packed once into oneDNN's blocked layout (:class:`moe.PackedExperts`, a copy here;
  the worker keeps only the packed ones), ``F.linear``), ``moeguard_grouped_mm`` (the
  no-host-read dispatch of :mod:`moeguard_runtime.model.moe_device`, ``F.grouped_mm`` on the CPU:
  what torch offers for grouped GEMMs), and ``hf`` (:func:`bench.hf_reference.hf_expert_loop`,
  ``MixtralSparseMoeBlock.forward`` of transformers 4.4x re-typed, unfused weights), in
  float32 and bfloat16.
  - prefill of 4,096 tokens: throughput ratio (HF time / ours) and, in float32, peak
    memory ratio (ours / HF). On CPU the peak is the rise of the process's peak RSS
    (``VmHWM``, reset through ``/proc/self/clear_refs``) over its RSS just before one
    forward, each in a fresh process; on CUDA, ``torch.cuda.max_memory_allocated`` over
    the allocated bytes before.
  - decode of 16 tokens: time / the time to read the touched experts' weights once, in
    the same dtype, measured two ways: reading exactly those bytes (``w13[e]`` and
    ``w2[e]`` viewed as float32 and summed, so bf16 bytes stream at the same rate as
    fp32 ones), interleaved with the decode repetitions (the figure the target is judged
    on), and their bytes over the machine's read bandwidth (median rate of
    ``tensor.sum()`` over 1 GiB, measured once).
  - agreement: ``max|ours - hf| / max|hf|`` at prefill against HF's loop in the same dtype
    (:data:`TOLERANCE`: float32 within 1e-5, round-off; bfloat16 within 2e-2); the error
    against the float32 loop is shown beside it.
  - the arithmetic ceiling: GFLOP/s of one ``[1024, D] x [D, 2I]`` matmul per kernel, the rate
    that bounds any prefill's speed-up over HF's loop in the same dtype.
  - ``OMP_WAIT_POLICY=PASSIVE`` unless set otherwise, as the worker sets it.
* **Worker overhead**: the ``small`` preset (99M parameters) serving 16 requests through
  :class:`moeguard_runtime.engine.service.Worker` driven by hand, the kernel chosen as the worker
  chooses it (``__main__.choose_matmul_kernel``); overhead = (loop iteration time - engine
  step time) / iteration time, which counts the scheduler, metrics, rate-limited logfmt
  logging (to /dev/null), the memory checks and the leak-signal sampling.
"""

from __future__ import annotations

import os

# As the worker does (moeguard_runtime.__main__), before torch loads libgomp: OpenMP
# threads sleep at barriers instead of spinning. Every implementation runs under it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.hf_reference import hf_expert_loop
from moeguard_runtime.model import kernel_select, moe, stream_kernel
from moeguard_runtime.model.moe import KernelPlan, MatmulChoice, dispatch_experts, route
from moeguard_runtime.model.moe_device import device_dispatch

D, I, E, K = 1024, 2816, 8, 2  # noqa: E741 - the field's names for the MoE sizes
PREFILL_TOKENS, DECODE_TOKENS = 4096, 16
DECODE_FLOP = 2 * DECODE_TOKENS * K * D * 3 * I
"""A decode step's expert matmul work: ``2·T·k·D·3I`` for its 16 tokens."""
PREFILL_FLOP = 2 * PREFILL_TOKENS * K * D * 3 * I
"""The prefill's expert matmul work, fixed (dropless): ``2·T·k·D·3I``."""
RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("moeguard_auto", "moeguard_onednn", "moeguard_onednn_packed", "moeguard_torch", "moeguard_torch_t",
         "moeguard_stream", "moeguard_grouped_mm", "hf")
DECODE_ONLY = ("moeguard_stream",)
"""Fixed-kernel rows timed at decode only: the ``stream`` kernel is built for a few rows (its prefill buckets are in
the kernel-choice table, where ``auto`` decides); a whole 4,096-token prefill on it would take seconds of the
prefill's time budget from the judged rows. Its agreement with HF's loop is measured on the decode batch."""
PREFILL_BUDGET_S = 60.0
"""Seconds of interleaved prefill repetitions per dtype at most: ``reps`` is cut to what fits (at least one), so
the benchmark ends in under 5 minutes also on a CPU where a prefill takes seconds (issue 31: on the 2-core AMD
EPYC an fp32 prefill of 4,096 tokens took 2.2 s, a bf16 one, emulated without native bf16, 17 s)."""
JUDGED = ("moeguard_auto", "hf")
"""The implementations the targets judge: the only ones timed at prefill, and measured for peak memory more than
once, where the dtype is emulated (bf16 on a CPU without oneDNN's bf16)."""
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
"""Largest ``max|ours - hf| / max|hf|`` accepted at prefill, per dtype, against HF's loop in the same
dtype (whose router then picks the same experts: against the float32 loop, a bfloat16 router flips
near-tied experts of some tokens, and those tokens differ by O(1))."""
Weights = dict[str, Any]


def weights(device: str, dtype: torch.dtype, seed: int = 0, packed: bool = True) -> Weights:
    """Router ``gate`` [E, D], unfused ``w1``/``w3`` [E, I, D] (HF's loop), fused ``w13``
    [E, 2I, D] (moeguard's), ``w2`` [E, D, I]; seeded, in ``dtype`` on ``device``; with
    ``packed`` (and where oneDNN packs), ``p13``/``p2``: ``w13``/``w2`` as :class:`moe.PackedExperts`
    (a copy here, to run side by side; the worker keeps the packed ones only)."""
    g = torch.Generator().manual_seed(seed)
    gate, w1 = torch.randn(E, D, generator=g) / D**0.5, torch.randn(E, I, D, generator=g) / D**0.5
    w2, w3 = torch.randn(E, D, I, generator=g) / I**0.5, torch.randn(E, I, D, generator=g) / D**0.5
    out: Weights = {k: v.to(device, dtype) for k, v in
                    {"gate": gate, "w1": w1, "w2": w2, "w3": w3, "w13": moe.fuse_gate_up(w1, w3)}.items()}
    if packed and moe.can_pack(out["w13"]):
        out |= {"p13": moe.PackedExperts.pack(out["w13"]), "p2": moe.PackedExperts.pack(out["w2"])}
    return out


def impl(name: str, plan: MatmulChoice) -> Callable[[torch.Tensor, Weights], torch.Tensor]:
    """The forward of implementation ``name`` (``moeguard_auto`` runs ``plan``)."""
    def grouped(x: torch.Tensor, w: Weights, backend: MatmulChoice) -> torch.Tensor:
        rw, ex = route(x @ w["gate"].T, K)
        w13, w2 = (w["p13"], w["p2"]) if moe.uses_packed(backend) else (w["w13"], w["w2"])
        return dispatch_experts(x, rw, ex, w13, w2, backend=backend)[0]

    if name == "hf":
        return lambda x, w: hf_expert_loop(x, w["gate"], w["w1"], w["w2"], w["w3"], K)
    if name == "moeguard_grouped_mm":
        def gmm(x: torch.Tensor, w: Weights) -> torch.Tensor:
            rw, ex = route(x @ w["gate"].T, K)
            return device_dispatch(x, rw, ex, w["w13"], w["w2"], moe.DEFAULT_EXPERT_CHUNK_TOKENS)[0]
        return gmm
    backend: MatmulChoice = {"moeguard_auto": plan, "moeguard_onednn": "onednn", "moeguard_torch": "torch",
                             "moeguard_torch_t": "torch_t", "moeguard_onednn_packed": "onednn_packed",
                             "moeguard_stream": "stream"}[name]
    return lambda x, w: grouped(x, w, backend)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def side_by_side(fns: dict[str, Callable[[], Any]], reps: int, device: str, warm: bool = True
                 ) -> dict[str, list[float]]:
    """Interleaved repetitions after one warm-up each (``warm=False``: the caller has run each once); seconds
    per call."""
    if warm:
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name].append(timed(fn, device))
    return out


def read_bandwidth(device: str, dtype: torch.dtype = torch.float32, reps: int = 7) -> float:
    """Bytes per second of ``tensor.sum()`` over 1 GiB (a read-only stream)."""
    n = (1 << 30) // torch.finfo(dtype).bits * 8
    t = torch.ones(n, dtype=dtype, device=device)
    t.sum()
    times = [timed(t.sum, device) for _ in range(reps)]
    return t.nbytes / statistics.median(times)


def plan_json(plan: MatmulChoice) -> str:
    if isinstance(plan, KernelPlan):
        return json.dumps({"bounds": list(plan.bounds), "kernels": list(plan.kernels)})
    return json.dumps(plan)


def plan_from_json(text: str) -> MatmulChoice:
    data = json.loads(text)
    if isinstance(data, str):
        return next((k for k in moe.MATMUL_BACKENDS if k == data), "onednn")
    return KernelPlan(tuple(data["bounds"]), tuple(data["kernels"]))


def peak_child(name: str, plan: MatmulChoice, device: str, dtype: torch.dtype) -> int:
    """Peak memory of one prefill forward, bytes, measured in this (fresh) process (packed
    weights made only for the implementations that run on them)."""
    w = weights(device, dtype, packed=name == "moeguard_onednn_packed"
                or (name == "moeguard_auto" and moe.uses_packed(plan)))
    x = torch.randn(PREFILL_TOKENS, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    fn = impl(name, plan)
    with torch.inference_mode():
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn(x, w)
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - base)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
        rss = _status_kib("VmRSS:")
        fn(x, w)
        return (_status_kib("VmHWM:") - rss) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_memory(name: str, plan: MatmulChoice, device: str, dtype_name: str, reps: int) -> list[int]:
    cmd = [sys.executable, "-m", "bench.runtime_bench", "--peak-child", name, "--plan", plan_json(plan),
           "--device", device, "--dtype", dtype_name, "--threads", str(torch.get_num_threads())]
    out = []
    for _ in range(reps):
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
        out.append(int(res.stdout.strip().splitlines()[-1]))
    return out


PREFILL_ROWS = kernel_select.prefill_rows(PREFILL_TOKENS, K, E)
"""Rows per expert of the benchmark's prefill (1,024), the bucket the worker times for a 4,096-token budget."""


def kernel_choice(w: Weights) -> dict[str, Any]:
    """The worker's start-up measurement on this shape (fresh, no cache, the buckets of a
    ``PREFILL_TOKENS`` budget), with rates. One candidate (a dtype oneDNN lacks here): nothing measured,
    ``by_rows`` empty."""
    with tempfile.TemporaryDirectory() as tmp:
        sel = kernel_select.select(w["w13"], w["w2"], tmp, prefill_rows=PREFILL_ROWS)
    bytes_per_expert = (w["w13"][0].nbytes + w["w2"][0].nbytes)
    rows: dict[str, Any] = {}
    for r, by_kernel in sel.seconds.items():
        rows[str(r)] = {k: {"us": s * 1e6, "gb_per_s": bytes_per_expert / s / 1e9,
                            "gflop_per_s": 2 * r * D * 3 * I / s / 1e9} for k, s in by_kernel.items()}
    out = {"plan": {"bounds": list(sel.plan.bounds), "kernels": list(sel.plan.kernels)},
           "buckets": list(sel.key["buckets"]),
           "label": sel.plan.label, "measure_s": sel.measure_s, "candidates": list(sel.key["kernels"]),
           "by_rows": rows, "_plan": sel.plan}
    dense = [k for k in sel.key["kernels"] if k != moe.PACKED_BACKEND]
    if moe.PACKED_BACKEND in sel.key["kernels"] and len(dense) > 0:
        seconds = sel.seconds
        dense_plan, _ = kernel_select.choose(dense, lambda k, r: seconds[r][k], buckets=list(seconds), reps=1)
        ratios = {str(r): seconds[r][moe.PACKED_BACKEND] / seconds[r][dense_plan.kernel_for(r)] for r in seconds}
        out["packed_vs_dense"] = {"dense_plan": dense_plan.label, "ratios": ratios,
                                  "geomean": kernel_select.packed_ratio(seconds, dense_plan),
                                  "packed_wins": kernel_select.packed_wins(seconds, dense_plan)}
    return out


def matmul_ceiling(device: str, dtype: torch.dtype, reps: int = 5) -> dict[str, float]:
    """GFLOP/s of one ``[1024, D] x [D, 2I]`` matmul (a prefill chunk's gate/up projection) per kernel (every
    kernel of the worker that runs the dtype, moeguard's ``stream`` included), median of ``reps`` (as the
    prefill's figures are medians): the machine's arithmetic rate that bounds any prefill's speed-up."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1024, D, generator=g).to(device, dtype)
    w = (torch.randn(2 * I, D, generator=g) / D**0.5).to(device, dtype)
    fns: dict[str, Callable[[], Any]] = {"F.linear": lambda: torch.nn.functional.linear(x, w)}
    if moe.onednn_supports(w):
        fns["onednn"] = lambda: moe.expert_linear(x, w, "onednn")
    if moe.can_pack(w):
        p = moe.PackedExperts.pack(w[None])[0]
        fns["onednn_packed"] = lambda: moe.expert_linear(x, p, "onednn_packed")
    if stream_kernel.supports(x, w):
        fns["stream"] = lambda: stream_kernel.linear(x, w)
    with torch.inference_mode():
        times = side_by_side(fns, reps, device)
    return {k: 2 * 1024 * D * 2 * I / statistics.median(v) / 1e9 for k, v in times.items()}


def null_expert(x: torch.Tensor, w13: Any, w2: Any, backend: Any = None) -> torch.Tensor:
    """An expert that does no arithmetic: ``[n, D]`` uninitialised, as :func:`moe.swiglu_expert` returns."""
    return torch.empty_like(x)


def dispatch_overhead(x: torch.Tensor, w: Weights, plan: MatmulChoice, reps: int, device: str) -> dict[str, Any]:
    """Seconds of the prefill's dispatch without the experts' matmuls, side by side: moeguard's (router,
    counts, sort, gather, weighting, ``index_add_``, chunking as ``plan`` chunks) and HF's loop (router,
    ``one_hot``/``where``, gather, weighting, ``index_add_``), each with every expert call replaced by
    :func:`null_expert` (HF's ``silu(x w1) * (x w3) @ w2`` by an uninitialised ``[n, D]``, no arithmetic)."""
    import torch.nn.functional as F

    def hf_null(x: torch.Tensor, gate_w: torch.Tensor, w1: Any, w2: Any, w3: Any, top_k: int) -> torch.Tensor:
        router_logits = x @ gate_w.T
        rw = F.softmax(router_logits, dim=1, dtype=torch.float)
        rw, sel = torch.topk(rw, top_k, dim=-1)
        rw = (rw / rw.sum(dim=-1, keepdim=True)).to(x.dtype)
        final = torch.zeros_like(x)
        mask = F.one_hot(sel, num_classes=w1.shape[0]).permute(2, 1, 0)
        for e in range(w1.shape[0]):
            idx, top_x = torch.where(mask[e])
            current = x[None, top_x].reshape(-1, x.shape[-1])
            final.index_add_(0, top_x, torch.empty_like(current) * rw[top_x, idx, None])
        return final

    real = moe.swiglu_expert
    ours = impl("moeguard_auto", plan)
    moe.swiglu_expert = null_expert  # type: ignore[assignment]
    try:
        with torch.inference_mode():
            t = side_by_side({"moeguard": lambda: ours(x, w),
                              "hf": lambda: hf_null(x, w["gate"], w["w1"], w["w2"], w["w3"], K)}, reps, device)
    finally:
        moe.swiglu_expert = real  # type: ignore[assignment]
    return {"seconds": t, "median_s": {k: statistics.median(v) for k, v in t.items()}}


def moe_benchmarks(device: str, dtype_name: str, reps: int, peak_reps: int, bandwidth: float) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    w = weights(device, dtype)
    choice = kernel_choice(w)
    plan: MatmulChoice = choice.pop("_plan")
    ceiling = matmul_ceiling(device, dtype)
    emulated = device == "cpu" and dtype == torch.bfloat16 and not moe._ONEDNN_BF16
    decode_reps = reps * 6
    fns = {name: impl(name, plan) for name in IMPLS if (name != "moeguard_onednn_packed" or "p13" in w)
           and (not emulated or name in JUDGED)}
    gen = torch.Generator().manual_seed(1)
    x_pre32 = torch.randn(PREFILL_TOKENS, D, generator=gen)
    x_dec = torch.randn(DECODE_TOKENS, D, generator=gen).to(device, dtype)
    x_pre = x_pre32.to(device, dtype)
    with torch.inference_mode():
        w32 = weights("cpu", torch.float32, packed=False)  # HF's loop in float32: the reference of both batches
        hf32 = [w32[k] for k in ("gate", "w1", "w2", "w3")]
        del w32
        ref32 = hf_expert_loop(x_pre32, *hf32, K)
        outs, first_s = {}, {}
        for name, fn in fns.items():  # each once: the agreement, the warm-up and the time of one call
            if name in DECODE_ONLY:
                continue
            t0 = time.perf_counter()
            outs[name] = fn(x_pre, w).float().cpu()
            first_s[name] = time.perf_counter() - t0
        ref = outs["hf"]
        rel32 = {n: float((o - ref32).abs().max()) / float(ref32.abs().max()) for n, o in outs.items()}
        rel = {n: float((o - ref).abs().max()) / float(ref.abs().max()) for n, o in outs.items()}
        decode_only = [n for n in DECODE_ONLY if n in fns]
        if decode_only:  # their agreement on the decode batch
            dec32 = hf_expert_loop(x_dec.float().cpu(), *hf32, K)
            dec_ref = fns["hf"](x_dec, w).float().cpu()
            for name in decode_only:
                o = fns[name](x_dec, w).float().cpu()
                rel[name] = float((o - dec_ref).abs().max()) / float(dec_ref.abs().max())
                rel32[name] = float((o - dec32).abs().max()) / float(dec32.abs().max())
        del ref, ref32, outs, hf32
        reps = max(1, min(reps, int(PREFILL_BUDGET_S // sum(first_s.values()))))
        pre = side_by_side({n: (lambda f=f: f(x_pre, w)) for n, f in fns.items() if n not in DECODE_ONLY}, reps,
                           device, warm=False)
        overhead = dispatch_overhead(x_pre, w, plan, reps, device)
        touched_ids = route(x_dec @ w["gate"].T, K)[1].unique().tolist()

        def read_touched() -> None:
            """Read the touched experts' weights once (the decode bound, measured): the same
            bytes viewed as float32, so any dtype streams at the same rate."""
            for e in touched_ids:
                w["w13"][e].view(torch.float32).sum()
                w["w2"][e].view(torch.float32).sum()

        dec = side_by_side({**{n: (lambda f=f: f(x_dec, w)) for n, f in fns.items()},
                            "read_touched": read_touched}, decode_reps, device)
    touched_bytes = len(touched_ids) * (w["w13"][0].nbytes + w["w2"][0].nbytes)
    bound_s = touched_bytes / bandwidth
    med = {k: statistics.median(v) for k, v in pre.items()}
    dmed = {k: statistics.median(v) for k, v in dec.items()}
    read_s = dmed.pop("read_touched")
    out: dict[str, Any] = {
        "kernel_choice": choice, "rel_err_vs_hf": rel, "rel_err_vs_hf_fp32": rel32,
        "prefill_dispatch_overhead": overhead,
        "matmul_1024_rows_gflop_per_s": ceiling,
        "prefill_seconds": pre, "prefill_median_s": med,
        "prefill_tokens_per_s": {k: PREFILL_TOKENS / v for k, v in med.items()},
        "prefill_speedup": {k: med["hf"] / v for k, v in med.items()},
        "decode_seconds": dec, "decode_median_s": dmed,
        "decode_touched_experts": len(touched_ids), "decode_touched_bytes": touched_bytes,
        "decode_read_touched_median_s": read_s, "decode_bound_s": bound_s,
        "decode_ratio_to_read": {k: v / read_s for k, v in dmed.items()},
        "decode_ratio_to_bound": {k: v / bound_s for k, v in dmed.items()},
    }
    out["prefill_reps"], out["emulated_dtype"] = reps, emulated
    if peak_reps > 0:
        peaks = {name: peak_memory(name, plan, device, dtype_name, peak_reps if name in JUDGED else 1) for name in fns
                 if name not in DECODE_ONLY}
        pmed = {k: statistics.median(v) for k, v in peaks.items()}
        out |= {"prefill_peak_bytes": peaks, "prefill_peak_median_bytes": pmed,
                "prefill_peak_ratio": {k: v / pmed["hf"] for k, v in pmed.items()}}
    return out


def overhead_benchmark(reps: int, device: str = "cpu", dtype_name: str = "fp32") -> dict[str, Any]:
    """Worker loop overhead over engine step time, ``small`` preset, 16 requests, the
    model, caches and sampling on ``device`` (the worker's ``MOEGUARD_DEVICE``), the expert
    kernel chosen as the worker chooses it."""
    import structlog

    from moeguard_core import presets
    from moeguard_runtime import __main__ as entry
    from moeguard_runtime.config import load_settings
    from moeguard_runtime.engine.engine import Engine
    from moeguard_runtime.engine.service import GenerationRequest, Worker
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.telemetry.telemetry import RateLimitedLog, Telemetry

    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                                    structlog.processors.LogfmtRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(devnull))
    settings = load_settings({"MOEGUARD_MAX_PREFILL_TOKENS": "512", "MOEGUARD_DEVICE": device,
                              "MOEGUARD_DTYPE": dtype_name})
    engine = Engine(build_model(presets.get_preset("small"), seed=0, dtype=settings.torch_dtype,
                                device=settings.torch_device))
    telemetry = Telemetry({"moeis": "b", "namespace": "b", "pod": "b"}, 8)
    log = RateLimitedLog(1.0)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[kernel_select.ENV_KERNEL_CACHE_DIR] = tmp
        t0 = time.perf_counter()
        kernel = entry.choose_matmul_kernel(settings, engine.model, telemetry, log)
        select_s = time.perf_counter() - t0
        del os.environ[kernel_select.ENV_KERNEL_CACHE_DIR]
    worker = Worker(settings, engine, telemetry, log)
    step_s: list[float] = []
    real_step = engine.step

    def step(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_step(*a, **k)
        finally:
            step_s.append(time.perf_counter() - t0)

    engine.step = step  # type: ignore[method-assign]
    fractions = []
    for rep in range(reps):
        done: list[int] = []
        for i in range(16):
            prompt = [(i * 31 + j) % 256 for j in range(64)]
            worker.submit(GenerationRequest(f"r{rep}-{i}", prompt, 24, 0.0),
                          lambda e, d=done: d.append(1) if e.kind in ("finish", "error") else None)
        step_s.clear()
        t0 = time.perf_counter()
        while len(done) < 16:
            worker._iteration()
        total = time.perf_counter() - t0
        fractions.append((total - sum(step_s)) / total)
        worker._iteration()  # release
    return {"overhead_fraction": fractions, "overhead_median": statistics.median(fractions),
            "steps_per_rep": len(step_s), "kernel": kernel, "kernel_select_s": select_s}


def machine(device: str) -> dict[str, Any]:
    info = {"cpu": kernel_select.cpu_model(), "isa": list(kernel_select.isa_flags()),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "device": device, "load_average": os.getloadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "onednn_linear_available": moe._ONEDNN_LINEAR, "onednn_bf16": moe._ONEDNN_BF16,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _yes(ok: bool) -> str:
    return "**yes**" if ok else "**no (missed)**"


def _label(name: str) -> str:
    return {"moeguard_auto": "moeguard, auto", "moeguard_onednn": "moeguard, oneDNN",
            "moeguard_onednn_packed": "moeguard, oneDNN packed",
            "moeguard_torch": "moeguard, F.linear", "moeguard_torch_t": "moeguard, F.linear transposed",
            "moeguard_stream": "moeguard, stream", "moeguard_grouped_mm": "moeguard, F.grouped_mm",
            "hf": "HF loop"}[name]


def render_choice(dtype_name: str, c: dict[str, Any], bandwidth: float) -> list[str]:
    kernels = c["candidates"]
    lines = [f"### Kernel choice, {dtype_name} ({c['measure_s']:.2f} s of measurement, as at worker start-up): "
             f"**{c['label']}**", "",
             "One expert (`w13` [2I, D] and `w2` [D, I], one `swiglu_expert` call) per row bucket; fastest "
             "of the rounds; a bucket above 16 rows is the mean of its calls at `kernel_select.spread_rows` (its "
             "own rows and two counts inside its range, each scaled to its rows); GB/s = the expert's weight "
             "bytes / time, GFLOP/s = 2·rows·D·3I / time.", "",
             "| rows | " + " | ".join(f"{k}: µs (GB/s, GFLOP/s)" for k in kernels) + " | chosen | margin |",
             "|---" * (len(kernels) + 3) + "|"]
    plan = KernelPlan(tuple(c["plan"]["bounds"]), tuple(c["plan"]["kernels"]))
    for r, by_kernel in c["by_rows"].items():
        cells = [f"{by_kernel[k]['us']:.0f} ({by_kernel[k]['gb_per_s']:.1f}, {by_kernel[k]['gflop_per_s']:.0f})"
                 for k in kernels]
        chosen = plan.kernel_for(int(r))
        others = [by_kernel[k]["us"] for k in kernels if k != chosen]
        margin = f"{min(others) / by_kernel[chosen]['us']:.2f}x" if others else ""
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {chosen} | {margin} |")
    lines.append("")
    pv = c.get("packed_vs_dense")
    if pv is not None:
        lines += [f"Packed or dense (the rule of kernel_select.py: packed when the geometric mean over the buckets of "
                  f"packed time / the dense plan's time is <= {1 - kernel_select.TIE_FRACTION:g} and no bucket is "
                  f"more than {kernel_select.MAX_PACKED_LOSS:.0%} slower): dense plan `{pv['dense_plan']}`; "
                  "packed / dense per bucket "
                  + ", ".join(f"{r} rows {v:.2f}" for r, v in pv["ratios"].items())
                  + f"; geometric mean {pv['geomean']:.2f}: **{'packed' if pv['packed_wins'] else 'dense'}**.", ""]
    by_rows = c["by_rows"]
    if not by_rows:
        return [*lines, f"One candidate kernel ({', '.join(kernels)}) runs this dtype on this device: nothing "
                "was measured or chosen.", ""]
    small, large = min(by_rows, key=int), max(by_rows, key=int)
    if len(kernels) > 1:
        win_s, win_l = plan.kernel_for(int(small)), plan.kernel_for(int(large))
        lines += [f"Why: at {small} row(s) an expert call is a pass over its weights (about "
                  f"{2 * int(small) / (4 if dtype_name == 'fp32' else 2):g} flop per byte), so the kernel that "
                  f"streams them faster wins: {win_s} at {by_rows[small][win_s]['gb_per_s']:.1f} GB/s, "
                  f"{by_rows[small][win_s]['gb_per_s'] * 1e9 / bandwidth * 100:.0f} % of the machine's "
                  f"{bandwidth / 1e9:.1f} GB/s read rate; at {large} rows the call is bound by arithmetic and "
                  f"{win_l} wins at {by_rows[large][win_l]['gflop_per_s']:.0f} GFLOP/s against "
                  + ", ".join(f"{k}'s {by_rows[large][k]['gflop_per_s']:.0f}" for k in kernels if k != win_l)
                  + ".", ""]
    return lines


def render_moe(dtype_name: str, m: dict[str, Any]) -> list[str]:
    pm, dm, sp = m["prefill_median_s"], m["decode_median_s"], m["prefill_speedup"]
    rr, rb, rel = m["decode_ratio_to_read"], m["decode_ratio_to_bound"], m["rel_err_vs_hf"]
    rel32 = m["rel_err_vs_hf_fp32"]
    peak, pratio = m.get("prefill_peak_median_bytes"), m.get("prefill_peak_ratio")
    lines = [f"### MoE layer, {dtype_name}", "",
             "| implementation | prefill 4096, s | prefill vs HF | peak MB | peak vs HF | decode 16, ms | "
             f"decode / read touched | decode / bandwidth bound | rel. error vs HF {dtype_name} | "
             "rel. error vs HF fp32 loop |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in (n for n in IMPLS if n in dm):
        pk = f"{peak[name] / 1e6:.1f}" if peak and name in peak else ""
        pr = f"{pratio[name]:.2f}x" if pratio and name in pratio else ""
        pre = f"{pm[name]:.3f} | {sp[name]:.2f}x" if name in pm else "(decode only) | "
        lines.append(f"| {_label(name)} | {pre} | {pk} | {pr} | "
                     f"{dm[name] * 1e3:.2f} | {rr[name]:.2f}x | {rb[name]:.2f}x | {rel[name]:.1e} | {rel32[name]:.1e} |")
    flop = PREFILL_FLOP
    ceil = m["matmul_1024_rows_gflop_per_s"]
    top = max(ceil, key=ceil.get)
    hf_rate = flop / pm["hf"] / 1e9
    small = m["kernel_choice"]["by_rows"].get("4")
    lines += ["", f"Prefill work is fixed: {flop / 1e9:.0f} GFLOP of expert matmuls (2·T·k·D·3I, dropless); "
              f"the HF loop ran it at {flop / pm['hf'] / 1e9:.0f} GFLOP/s, moeguard at "
              f"{flop / pm['moeguard_auto'] / 1e9:.0f} GFLOP/s, so the throughput ratio is the ratio of these "
              "rates: no dispatch can beat HF by more than the machine's arithmetic ceiling over HF's rate. "
              f"The fastest 1024-row matmul measured here ([1024, D] x [D, 2I], {dtype_name}) ran at "
              f"{ceil[top]:.0f} GFLOP/s ({top}; "
              + ", ".join(f"{k} {v:.0f}" for k, v in ceil.items())
              + f"), so HF's loop already runs at {hf_rate / ceil[top] * 100:.0f} % of it and no kernel of "
              f"this dtype can make the prefill more than {ceil[top] / hf_rate:.2f}x faster than HF here. "
              + (f"Decode: at 4 rows per expert the fastest kernel streamed the weights at "
                 f"{max(c['gb_per_s'] for c in small.values()):.1f} GB/s (kernel choice table, one expert per "
                 "call) against the read rate below." if small else "")]
    if "prefill_reps" in m:
        lines += ["", f"Prefill: {m['prefill_reps']} interleaved repetition(s) after one call each (as many as fit "
                  f"{PREFILL_BUDGET_S:.0f} s)"
                  + (f"; {dtype_name} is emulated on this CPU (oneDNN has no native {dtype_name} here), so only "
                     f"{' and '.join(_label(n) for n in JUDGED)} were run." if m.get("emulated_dtype") else ".")]
    ov = m.get("prefill_dispatch_overhead")
    if ov is not None:
        om = ov["median_s"]
        lines += ["", f"Dispatch at prefill without the experts' arithmetic (every expert call replaced by an "
                  f"uninitialised `[n, D]`, `dispatch_overhead`): moeguard {om['moeguard'] * 1e3:.1f} ms "
                  f"({om['moeguard'] / pm['moeguard_auto'] * 100:.1f} % of its prefill: router, counts, sort, "
                  f"gather, weighting, `index_add_`), HF's loop {om['hf'] * 1e3:.1f} ms "
                  f"({om['hf'] / pm['hf'] * 100:.1f} % of its prefill)."]
    label = m["kernel_choice"]["label"]
    same = {"onednn": "moeguard_onednn", "onednn_packed": "moeguard_onednn_packed", "torch": "moeguard_torch",
            "torch_t": "moeguard_torch_t", "stream": "moeguard_stream"}.get(label)
    if same in pm:
        lines += ["", f"`moeguard, auto` ran the same code as `{_label(same)}` here (plan `{label}`, the same "
                  f"weights): the gap between their rows (prefill {pm['moeguard_auto']:.3f} vs {pm[same]:.3f} s, "
                  f"decode {dm['moeguard_auto'] * 1e3:.2f} vs {dm[same] * 1e3:.2f} ms) is this run's noise between "
                  "positions in the interleaved rounds, a measure of how far any single figure here can be trusted."]
    if dtype_name == "bf16":
        lines += ["", "bf16 errors against the fp32 loop are large because the bf16 router (`x @ gate.T` in bf16) "
                  "picks a different expert for tokens whose top experts nearly tie; against the HF loop in "
                  "bf16, which routes the same tokens the same way, the outputs agree."]
    lines += ["", f"Decode bound: the {m['decode_touched_experts']} touched experts' weights, "
              f"{m['decode_touched_bytes'] / 1e6:.0f} MB in {dtype_name}, read once: "
              f"{m['decode_read_touched_median_s'] * 1e3:.2f} ms measured side by side (the judged figure), "
              f"{m['decode_bound_s'] * 1e3:.2f} ms at the 1 GiB read bandwidth. "
              f"Its arithmetic, {DECODE_FLOP / 1e6:.0f} MFLOP (2·16·k·D·3I), takes "
              f"{DECODE_FLOP / (ceil[top] * 1e9) * 1e3:.2f} ms at the fastest 1024-row matmul rate above "
              f"({ceil[top]:.0f} GFLOP/s, {top}), "
              f"{DECODE_FLOP / (ceil[top] * 1e9) / m['decode_read_touched_median_s']:.2f}x the read: where that "
              "is near or above the target ratio, this CPU's arithmetic, not its memory, bounds the decode.", ""]
    return lines


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        "# Runtime benchmarks", "",
        f"Regenerate: `make bench-runtime` ({r['command']}); took {r['wall_s']:.0f} s. Medians of interleaved "
        "repetitions.", "",
        f"Machine: **{m['cpu']}**, {m['cpu_count']} CPUs, {m['memory_gib']} GiB, device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "") + f"; ISA flags: {', '.join(m['isa']) or 'none of interest'}"
        f" (torch CPU capability {m['torch_cpu_capability']}); torch {m['torch']}, {m['torch_threads']} threads, "
        f"OMP_WAIT_POLICY={m.get('omp_wait_policy')}, Python {m['python']}. Load average at the start "
        f"{', '.join(f'{v:.1f}' for v in m['load_average'])}: a shared machine, so absolute times are noisy; "
        "every ratio is from side-by-side (interleaved) repetitions.", "",
    ]
    lines += _targets(r)
    lines += [f"## MoE layer: D={D}, I={I}, E={E}, k={K}, same weights", "",
              "Candidates: `moeguard, auto` is the grouped dispatch with the kernel plan measured below (what the "
              "worker runs by default); `oneDNN`, `oneDNN packed` and `F.linear` fix one kernel (oneDNN's linear "
              "primitive on the dense weight; the same on the weights reordered once into oneDNN's blocked layout, "
              "which replace the dense ones in the worker; `F.linear`: MKL sgemm in fp32, oneDNN's matmul in bf16; "
              "`F.linear transposed`: the same product as `(w @ x.T).T`, the weight as the GEMM's left operand; "
              "`stream`: moeguard's own few-row kernel, a C++ library built with this machine's compiler, "
              "timed at decode only); "
              "`F.grouped_mm` is torch's "
              "grouped GEMM (the no-host-read dispatch of moe_device.py, run on the CPU); HF loop: "
              "MixtralSparseMoeBlock's expert loop with unfused weights. moeguard's experts are fused (`w13`).", ""]
    for dtype_name, moe_r in r["moe"].items():
        lines += render_choice(dtype_name, moe_r["kernel_choice"], r["read_bandwidth_bytes_per_s"])
        lines += render_moe(dtype_name, moe_r)
    if "overhead" in r:
        o = r["overhead"]
        lines += ["## Worker loop overhead (scheduler, metrics, logging, memory checks)", "",
                  f"`small` preset on {m['device']} in fp32, kernel `{o['kernel']}` (chosen at start-up in "
                  f"{o['kernel_select_s']:.2f} s), 16 requests of 64 prompt + 24 generated tokens, "
                  f"{o['steps_per_rep']} steps per repetition: overhead median "
                  f"**{o['overhead_median'] * 100:.2f} %** of step time; per repetition: "
                  + ", ".join(f"{f * 100:.2f} %" for f in o["overhead_fraction"]) + ".", ""]
    lines += ["Raw samples: `runtime.json` beside this file.", ""]
    return "\n".join(lines)


PREFILL_CEILING_FRACTION = 0.90
"""Issue 31: the served prefill runs at >= 90 % of the fastest same-dtype 1,024-row matmul rate of the run."""
DECODE_READ_BOUND = 1.3
"""Issue 31: decode of 16 tokens takes <= 1.3x the measured time to read the touched experts' weights."""


def prefill_ceiling_fraction(m: dict[str, Any], name: str = "moeguard_auto") -> float:
    """``name``'s prefill rate (the fixed expert FLOPs / its median seconds) over the fastest kernel's
    median rate of the 1,024-row matmul (:func:`matmul_ceiling`), in the same run and dtype."""
    return PREFILL_FLOP / m["prefill_median_s"][name] / 1e9 / max(m["matmul_1024_rows_gflop_per_s"].values())


def _targets(r: dict[str, Any]) -> list[str]:
    """Issue 31's targets, each met or missed, from this run."""
    rows = []
    for dtype_name, moe_r in r["moe"].items():
        sp = moe_r["prefill_speedup"]["moeguard_auto"]
        rows.append(f"| prefill {PREFILL_TOKENS} tokens, {dtype_name} (served) | >= 1.0x HF throughput | {sp:.2f}x | "
                    f"{_yes(sp >= 1.0)} |")
        frac = prefill_ceiling_fraction(moe_r)
        rows.append(f"| prefill {PREFILL_TOKENS} tokens, {dtype_name} | >= {PREFILL_CEILING_FRACTION:.0%} of the "
                    f"fastest 1,024-row {dtype_name} matmul rate | {frac:.0%} | "
                    f"{_yes(frac >= PREFILL_CEILING_FRACTION)} |")
        pr = moe_r.get("prefill_peak_ratio", {}).get("moeguard_auto")
        if pr is not None:
            rows.append(f"| prefill peak memory, {dtype_name} | <= 1.0x HF | {pr:.2f}x | {_yes(pr <= 1.0)} |")
        ratio = moe_r["decode_ratio_to_read"]["moeguard_auto"]
        rows.append(f"| decode {DECODE_TOKENS} tokens, {dtype_name} | <= {DECODE_READ_BOUND}x reading the touched "
                    f"weights in {dtype_name} | {ratio:.2f}x | {_yes(ratio <= DECODE_READ_BOUND)} |")
        err, tol = moe_r["rel_err_vs_hf"]["moeguard_auto"], TOLERANCE[dtype_name]
        rows.append(f"| outputs, {dtype_name} | max abs. difference from the HF loop in {dtype_name} <= {tol:g} "
                    f"x its max abs. output | {err:.1e} | {_yes(err <= tol)} |")
        choice = moe_r["kernel_choice"]
        timed = [int(b) for b in choice["by_rows"]]
        if len(choice["candidates"]) > 1:
            rows.append(f"| kernel choice, {dtype_name} | times the prefill's {PREFILL_ROWS} rows per expert | "
                        f"buckets {', '.join(map(str, timed))} | {_yes(PREFILL_ROWS in timed)} |")
        else:
            rows.append(f"| kernel choice, {dtype_name} | times the prefill's {PREFILL_ROWS} rows per expert | "
                        f"one candidate ({choice['candidates'][0]}): nothing to choose | n/a |")
    if "overhead" in r:
        o = r["overhead"]["overhead_median"]
        rows.append(f"| worker-loop overhead | <= 3 % | {o * 100:.2f} % | {_yes(o <= 0.03)} |")
    rows.append(f"| benchmark wall time | < 5 min | {r['wall_s']:.0f} s | {_yes(r['wall_s'] < 300)} |")
    return ["## Targets (issue 31), this run", "", "| target | bound | measured (moeguard, auto) | met |",
            "|---|---|---|---|", *rows, ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="both", choices=["fp32", "bf16", "both"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="prefill repetitions (decode: 6x)")
    p.add_argument("--peak-reps", type=int, default=3, help="fresh processes per implementation (first dtype)")
    p.add_argument("--overhead-reps", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "runtime"), help="path stem of .md/.json")
    p.add_argument("--peak-child", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--plan", default='"onednn"', help=argparse.SUPPRESS)
    p.add_argument("--render", metavar="JSON", help="only rewrite the .md beside JSON from its results")
    a = p.parse_args(argv)
    if a.render:
        path = Path(a.render)
        path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
        return 0
    torch.set_num_threads(a.threads)
    if a.peak_child:
        print(peak_child(a.peak_child, plan_from_json(a.plan), a.device, DTYPES[a.dtype]))
        return 0
    t0 = time.perf_counter()
    result: dict[str, Any] = {"machine": machine(a.device),
                              "command": " ".join(["python -m bench.runtime_bench", *(argv or sys.argv[1:])])}
    bandwidth = read_bandwidth(a.device)
    result["read_bandwidth_bytes_per_s"] = bandwidth
    dtypes = ["fp32", "bf16"] if a.dtype == "both" else [a.dtype]
    result["moe"] = {d: moe_benchmarks(a.device, d, a.reps, a.peak_reps if i == 0 else 0, bandwidth)
                     for i, d in enumerate(dtypes)}
    if a.overhead_reps > 0:
        result["overhead"] = overhead_benchmark(a.overhead_reps, a.device, "fp32" if a.device == "cpu" else dtypes[0])
    result["wall_s"] = time.perf_counter() - t0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
