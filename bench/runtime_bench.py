"""Runtime benchmarks: the MoE layer against HF's ``MixtralSparseMoeBlock`` algorithm,
decode against the memory-bandwidth bound, and the worker loop's own overhead.

``python -m bench.runtime_bench`` (``make bench-runtime``) writes
``bench/results/runtime.md`` and ``runtime.json``. All figures are medians of
interleaved repetitions (A, B, A, B, ...), so drift on a shared machine hits
both sides alike.

* **MoE layer**, D=1024, I=2816, E=8, k=2, the same seeded weights for both:
  moeguard's grouped dispatch (:func:`moeguard_runtime.moe.dispatch_experts`)
  against HF's expert loop (:func:`hf_expert_loop`, ``MixtralSparseMoeBlock.forward``
  of transformers 4.4x re-typed; transformers itself is not installed).
  - prefill of 4,096 tokens: throughput ratio (HF time / ours) and peak memory
    ratio (ours / HF). On CPU the peak is the rise of the process's peak RSS
    (``VmHWM``, reset through ``/proc/self/clear_refs``) over its RSS just before
    one forward, each in a fresh process; on CUDA, ``torch.cuda.max_memory_allocated`` over the allocated
    bytes before.
  - decode of 16 tokens: time / the time to read the touched experts' weights
    once, measured two ways: ``.sum()`` over exactly those weights, interleaved
    with the decode repetitions (the side-by-side figure the target is judged
    on), and their bytes over the machine's read bandwidth (median rate of
    ``tensor.sum()`` over 1 GiB, measured once).
  - a third column, ``moeguard_f_linear``: the same dispatch with ``F.linear``
    (MKL) for the expert matmuls instead of oneDNN, to show which part of the
    gain is the dispatch and which the matmul kernel.
  - ``OMP_WAIT_POLICY=PASSIVE`` unless set otherwise, as the worker sets it.
* **Worker overhead**: the ``small`` preset (99M parameters) serving 16
  requests through :class:`moeguard_runtime.service.Worker` driven by hand, on
  ``--device`` in ``--dtype`` (the engine places weights, KV caches, inputs and
  generators there, as the worker does with ``MOEGUARD_DEVICE``);
  overhead = (loop iteration time - engine step time) / iteration time, which
  counts the scheduler, metrics, rate-limited logfmt logging (to /dev/null),
  the memory checks and the leak-signal sampling.
"""

from __future__ import annotations

import os

# As the worker does (moeguard_runtime.__main__), before torch loads libgomp: OpenMP
# threads sleep at barriers instead of spinning. Both implementations run under it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.hf_reference import hf_expert_loop
from moeguard_runtime import moe
from moeguard_runtime.moe import MatmulBackend, dispatch_experts, route

D, I, E, K = 1024, 2816, 8, 2  # noqa: E741 - the field's names for the MoE sizes
PREFILL_TOKENS, DECODE_TOKENS = 4096, 16
RESULTS = Path(__file__).resolve().parent / "results"


def weights(device: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(t.to(device, dtype) for t in (
        torch.randn(E, D, generator=g) / D**0.5, torch.randn(E, I, D, generator=g) / D**0.5,
        torch.randn(E, D, I, generator=g) / I**0.5, torch.randn(E, I, D, generator=g) / D**0.5))


def ours(x: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
         w3: torch.Tensor, backend: MatmulBackend = "onednn") -> torch.Tensor:
    w, e = route(x @ gate.T, K)
    return dispatch_experts(x, w, e, moe.fuse_gate_up(w1, w3), w2, backend=backend)[0]


def ours_f_linear(x: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """moeguard's dispatch with ``F.linear`` (MKL on CPU) instead of oneDNN for the
    expert matmuls: splits the gain between the dispatch and the matmul kernel."""
    return ours(x, gate, w1, w2, w3, backend="torch")


def hf(x: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
       w3: torch.Tensor) -> torch.Tensor:
    return hf_expert_loop(x, gate, w1, w2, w3, K)


IMPLS: dict[str, Callable[..., torch.Tensor]] = {"moeguard": ours, "moeguard_f_linear": ours_f_linear,
                                                 "hf": hf}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def side_by_side(fns: dict[str, Callable[[], Any]], reps: int, device: str) -> dict[str, list[float]]:
    """Interleaved repetitions after one warm-up each; seconds per call."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name].append(timed(fn, device))
    return out


def read_bandwidth(device: str, dtype: torch.dtype, reps: int = 7) -> float:
    """Bytes per second of ``tensor.sum()`` over 1 GiB (a read-only stream)."""
    n = (1 << 30) // torch.finfo(dtype).bits * 8
    t = torch.ones(n, dtype=dtype, device=device)
    t.sum()
    times = [timed(t.sum, device) for _ in range(reps)]
    return t.nbytes / statistics.median(times)


def peak_child(impl: str, device: str, dtype: torch.dtype) -> int:
    """Peak memory of one prefill forward, bytes, measured in this (fresh) process."""
    gate, w1, w2, w3 = weights(device, dtype)
    x = torch.randn(PREFILL_TOKENS, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with torch.inference_mode():
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            IMPLS[impl](x, gate, w1, w2, w3)
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - base)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
        rss = _status_kib("VmRSS:")
        IMPLS[impl](x, gate, w1, w2, w3)
        return (_status_kib("VmHWM:") - rss) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_memory(impl: str, device: str, dtype_name: str, reps: int) -> list[int]:
    cmd = [sys.executable, "-m", "bench.runtime_bench", "--peak-child", impl, "--device", device,
           "--dtype", dtype_name, "--threads", str(torch.get_num_threads())]
    out = []
    for _ in range(reps):
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
        out.append(int(res.stdout.strip().splitlines()[-1]))
    return out


def moe_benchmarks(device: str, dtype: torch.dtype, dtype_name: str, reps: int) -> dict[str, Any]:
    gate, w1, w2, w3 = weights(device, dtype)
    gen = torch.Generator().manual_seed(1)
    x_pre = torch.randn(PREFILL_TOKENS, D, generator=gen).to(device, dtype)
    x_dec = torch.randn(DECODE_TOKENS, D, generator=gen).to(device, dtype)
    with torch.inference_mode():
        diff = float((ours(x_pre, gate, w1, w2, w3) - hf(x_pre, gate, w1, w2, w3)).abs().max())
        pre = side_by_side({n: (lambda f=f: f(x_pre, gate, w1, w2, w3)) for n, f in IMPLS.items()},
                           reps, device)
        touched_ids = route(x_dec @ gate.T, K)[1].unique().tolist()
        touched = len(touched_ids)

        def read_touched() -> None:
            """Read the touched experts' weights once (the decode bound, measured)."""
            for e in touched_ids:
                w1[e].sum()
                w3[e].sum()
                w2[e].sum()

        dec = side_by_side({**{n: (lambda f=f: f(x_dec, gate, w1, w2, w3))
                               for n, f in IMPLS.items()}, "read_touched": read_touched},
                           reps * 6, device)
    bw = read_bandwidth(device, dtype)
    expert_bytes = 3 * D * I * torch.finfo(dtype).bits // 8
    bound_s = touched * expert_bytes / bw
    peaks = {impl: peak_memory(impl, device, dtype_name, 3) for impl in IMPLS}
    med = {k: statistics.median(v) for k, v in pre.items()}
    dmed = {k: statistics.median(v) for k, v in dec.items()}
    read_s = dmed.pop("read_touched")
    pmed = {k: statistics.median(v) for k, v in peaks.items()}
    return {
        "max_abs_diff_prefill": diff,
        "prefill_seconds": pre, "prefill_median_s": med,
        "prefill_tokens_per_s": {k: PREFILL_TOKENS / v for k, v in med.items()},
        "prefill_speedup": med["hf"] / med["moeguard"],
        "prefill_speedup_f_linear": med["hf"] / med["moeguard_f_linear"],
        "prefill_peak_bytes": peaks, "prefill_peak_median_bytes": pmed,
        "prefill_peak_ratio": pmed["moeguard"] / pmed["hf"],
        "decode_seconds": dec, "decode_median_s": dmed,
        "read_bandwidth_bytes_per_s": bw, "decode_touched_experts": touched,
        "decode_bound_s": bound_s, "decode_ratio_to_bound": dmed["moeguard"] / bound_s,
        "decode_hf_ratio_to_bound": dmed["hf"] / bound_s,
        "decode_read_touched_median_s": read_s,
        "decode_ratio_to_read": dmed["moeguard"] / read_s,
        "decode_hf_ratio_to_read": dmed["hf"] / read_s,
        "decode_f_linear_ratio_to_read": dmed["moeguard_f_linear"] / read_s,
    }


def overhead_benchmark(reps: int, device: str = "cpu", dtype_name: str = "fp32") -> dict[str, Any]:
    """Worker loop overhead over engine step time, ``small`` preset, 16 requests, the
    model, caches and sampling on ``device`` (the worker's ``MOEGUARD_DEVICE``)."""
    import structlog

    from moeguard_runtime import presets
    from moeguard_runtime.config import load_settings
    from moeguard_runtime.engine import Engine
    from moeguard_runtime.model import build_model
    from moeguard_runtime.service import GenerationRequest, Worker
    from moeguard_runtime.telemetry import RateLimitedLog, Telemetry

    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                                    structlog.processors.LogfmtRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(devnull))
    settings = load_settings({"MOEGUARD_MAX_PREFILL_TOKENS": "512", "MOEGUARD_DEVICE": device,
                              "MOEGUARD_DTYPE": dtype_name})
    engine = Engine(build_model(presets.get_preset("small"), seed=0, dtype=settings.torch_dtype,
                                device=settings.torch_device))
    worker = Worker(settings, engine, Telemetry({"moeis": "b", "namespace": "b", "pod": "b"}, 8),
                    RateLimitedLog(1.0))
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
            "steps_per_rep": len(step_s)}


def machine(device: str) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "device": device, "load_average": os.getloadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "onednn_linear_available": moe._ONEDNN_LINEAR,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def render(r: dict[str, Any]) -> str:
    m, moe_r = r["machine"], r["moe"]
    pm, dm = moe_r["prefill_median_s"], moe_r["decode_median_s"]
    peak = moe_r["prefill_peak_median_bytes"]
    tps = moe_r["prefill_tokens_per_s"]
    onednn = m.get("onednn_linear_available") and m["device"] == "cpu" and r["dtype"] == "fp32"
    yes = {True: "yes", False: "no"}
    lines = [
        "# Runtime benchmarks", "",
        f"Regenerate: `make bench-runtime` ({r['command']}). Medians of interleaved repetitions.", "",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['memory_gib']} GiB, device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "") + f"; torch {m['torch']}, "
        f"{m['torch_threads']} threads, OMP_WAIT_POLICY={m.get('omp_wait_policy')}, Python "
        f"{m['python']}; dtype {r['dtype']}. Load average at the start "
        f"{', '.join(f'{v:.1f}' for v in m['load_average'])}: a shared machine, other engineers' "
        "suites ran alongside, so absolute times are noisy; every ratio is from side-by-side "
        "(interleaved) repetitions.", "",
        f"## MoE layer: D={D}, I={I}, E={E}, k={K}, same weights; moeguard grouped dispatch vs "
        "HF MixtralSparseMoeBlock's expert loop", "",
        f"Outputs agree: max |difference| {moe_r['max_abs_diff_prefill']:.2e} at prefill. "
        + ("moeguard's expert matmuls run on oneDNN (`torch.ops.mkldnn._linear_pointwise` on the "
           "dense weights); the column `moeguard, F.linear` is the same dispatch with `F.linear` "
           "(MKL sgemm, as HF's loop uses), which separates the dispatch's share from the "
           "matmul kernel's." if onednn else
           "Expert matmuls: `F.linear` (oneDNN is used for CPU float32 only)."), "",
        "| measure | moeguard | moeguard, F.linear | HF loop | ratio (moeguard) | target | met |",
        "|---|---|---|---|---|---|---|",
        f"| prefill {PREFILL_TOKENS} tokens, median s | {pm['moeguard']:.3f} | "
        f"{pm['moeguard_f_linear']:.3f} | {pm['hf']:.3f} | "
        f"{moe_r['prefill_speedup']:.2f}x throughput (F.linear: "
        f"{moe_r['prefill_speedup_f_linear']:.2f}x) | >= 1.5x | "
        f"{yes[moe_r['prefill_speedup'] >= 1.5]} |",
        f"| prefill tokens/s | {tps['moeguard']:.0f} | {tps['moeguard_f_linear']:.0f} | "
        f"{tps['hf']:.0f} | | | |",
        f"| prefill peak memory, MB | {peak['moeguard'] / 1e6:.1f} | "
        f"{peak['moeguard_f_linear'] / 1e6:.1f} | {peak['hf'] / 1e6:.1f} | "
        f"{moe_r['prefill_peak_ratio']:.2f}x | <= 1.0x | {yes[moe_r['prefill_peak_ratio'] <= 1.0]} |",
        f"| decode {DECODE_TOKENS} tokens, median ms | {dm['moeguard'] * 1e3:.2f} | "
        f"{dm['moeguard_f_linear'] * 1e3:.2f} | {dm['hf'] * 1e3:.2f} | "
        f"{moe_r['decode_ratio_to_read']:.2f}x of reading the touched weights, side by side "
        f"(F.linear {moe_r['decode_f_linear_ratio_to_read']:.2f}x, HF "
        f"{moe_r['decode_hf_ratio_to_read']:.2f}x) | <= 1.2x | "
        f"{yes[moe_r['decode_ratio_to_read'] <= 1.2]} |",
        f"| decode, against the 1 GiB bandwidth figure | | | | "
        f"{moe_r['decode_ratio_to_bound']:.2f}x (HF {moe_r['decode_hf_ratio_to_bound']:.2f}x) | "
        f"<= 1.2x | {yes[moe_r['decode_ratio_to_bound'] <= 1.2]} |", "",
        f"Decode bound, two measurements of the same quantity: (1) reading the "
        f"{moe_r['decode_touched_experts']} touched experts' weights once (`w1[e]`, `w3[e]`, "
        f"`w2[e]` `.sum()`, {moe_r['decode_touched_experts'] * 3 * D * I * 4 / 1e6:.0f} MB in "
        f"fp32), timed interleaved with the decode repetitions: median "
        f"{moe_r['decode_read_touched_median_s'] * 1e3:.2f} ms; (2) the same bytes at the "
        f"machine's read bandwidth measured once before or after (`tensor.sum()` over 1 GiB, "
        f"{moe_r['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s) = "
        f"{moe_r['decode_bound_s'] * 1e3:.2f} ms. On this shared machine the bandwidth moves with "
        "the neighbours' load, so (1), taken side by side, is the figure the target is judged on; "
        "(2) is shown as measured.", "",
    ]
    if "overhead" in r:
        o = r["overhead"]
        lines += ["## Worker loop overhead (scheduler, metrics, logging, memory checks)", "",
                  f"`small` preset on {m['device']} in {r['dtype']}, 16 requests of 64 prompt + 24 generated tokens, "
                  f"{o['steps_per_rep']} steps per repetition: overhead median "
                  f"**{o['overhead_median'] * 100:.2f} %** of step time (target <= 3 %: "
                  f"{'met' if o['overhead_median'] <= 0.03 else 'not met'}); per repetition: "
                  + ", ".join(f"{f * 100:.2f} %" for f in o["overhead_fraction"]) + ".", ""]
    lines += ["Raw samples: `runtime.json` beside this file.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="prefill repetitions (decode: 6x)")
    p.add_argument("--overhead-reps", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "runtime"), help="path stem of .md/.json")
    p.add_argument("--peak-child", choices=list(IMPLS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    if a.peak_child:
        print(peak_child(a.peak_child, a.device, dtype))
        return 0
    result: dict[str, Any] = {"machine": machine(a.device), "dtype": a.dtype,
                              "command": " ".join(["python -m bench.runtime_bench", *(argv or sys.argv[1:])])}
    result["moe"] = moe_benchmarks(a.device, dtype, a.dtype, a.reps)
    if a.overhead_reps > 0:
        result["overhead"] = overhead_benchmark(a.overhead_reps, a.device, a.dtype)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
