"""Per-family benchmark: the worker's HF-family models against ``transformers``' own forward
on the same weights (issue 10, "Performance and memory").

``python -m bench.families_bench`` (``make bench-families``) writes ``bench/results/families.md``
and ``families.json``. For each family (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v3``,
``olmoe``): a tiny-but-realistic configuration (:data:`SHAPES`: hidden 1024, 8-16 experts, 2
layers, vocabulary 32,000, float32), ``transformers``' model class built with a fixed seed and
saved with ``save_pretrained``; the same folder is loaded by the worker
(:func:`moeguard_runtime.model.hf_checkpoint.load_hf_checkpoint`) and by
``AutoModelForCausalLM.from_pretrained`` (its default attention and experts implementations,
named in the results). Both run on the CPU with ``--threads`` threads (default 2).

* **Prefill**: one sequence of ``--prefill`` tokens (default 1,024). Ours: ``Engine.add`` +
  ``Engine.step`` (the worker's path: KV cache allocated and filled, last-token logits, sampling).
  transformers: ``model(ids, use_cache=True, logits_to_keep=1)``, what ``generate`` runs at
  prefill (the last token's logits only, as ours). Tokens per second, median.
* **Decode**: ``--batch`` sequences (default 8) of ``--context`` tokens (default 256), prefilled
  once, then one token each per step. Ours: ``Engine.step([], ids)``; transformers: ``model(ids
  [B, 1], past_key_values=cache)`` on a ``DynamicCache`` filled by one batched prefill. Step
  time, median; both caches grow by one token per repetition, in lockstep.
* Timing: :func:`bench.runtime_bench.side_by_side` (one warm-up each, then interleaved
  repetitions A, B, A, B, ...); medians and ratios (transformers time / ours).
* **Peak memory** (the project's method, :mod:`bench.memory_probe`): in a fresh process per
  measurement, the model is loaded and the prefill run once (warm-up), freed heap pages are
  returned (``malloc_trim``), ``VmHWM`` is reset (``clear_refs``), then one prefill runs; the
  step peak is ``VmHWM - VmRSS before``. The same child reports the process's peak RSS over the
  load (``VmHWM`` before the reset), the load's own high-water mark. Medians of ``--mem-reps``.

Targets (issue 10): prefill throughput >= 1.5x transformers; peak memory <= 1.0x.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker and bench.runtime_bench

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.family_checkpoints import checkpoint_folder
from bench.memory_probe import _status
from bench.runtime_bench import machine, side_by_side

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 32_000
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=2,
                              num_attention_heads=16, max_position_embeddings=4096,
                              tie_word_embeddings=False)
SHAPES: dict[str, dict[str, Any]] = {
    # model_type -> config.json fields (transformers' names) beside COMMON
    "mixtral": dict(num_key_value_heads=4, intermediate_size=2816, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_key_value_heads=16, intermediate_size=2816, moe_intermediate_size=704,
                      shared_expert_intermediate_size=2816, num_experts=16, num_experts_per_tok=4,
                      norm_topk_prob=False),
    "qwen3_moe": dict(num_key_value_heads=4, head_dim=64, intermediate_size=2816, moe_intermediate_size=768,
                      num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    "deepseek_v3": dict(num_key_value_heads=16, intermediate_size=2816, moe_intermediate_size=512,
                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                        kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=64, qk_rope_head_dim=32,
                        v_head_dim=64, first_k_dense_replace=1, routed_scaling_factor=2.5),
    "olmoe": dict(num_key_value_heads=16, intermediate_size=512, num_experts=16, num_experts_per_tok=4),
}


def folder_of(family: str) -> Path:
    """The family's checkpoint folder, written once (seed 0) by ``transformers``' ``save_pretrained``."""
    return checkpoint_folder({"model_type": family, **COMMON, **SHAPES[family]})


class Ours:
    """The worker's model behind :class:`moeguard_runtime.engine.engine.Engine`."""

    def __init__(self, folder: Path) -> None:
        from moeguard_runtime.engine.engine import Engine
        from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint

        self.engine = Engine(load_hf_checkpoint(folder, torch.float32).model)
        self.n = 0

    def prefill(self, prompt: list[int]) -> None:
        self.n += 1
        sid = f"p{self.n}"
        self.engine.add(sid, prompt, 1)
        self.engine.step([(sid, len(prompt))], [])
        self.engine.release(sid)

    def start_decode(self, prompts: list[list[int]], steps: int) -> list[str]:
        ids = [f"d{i}" for i in range(len(prompts))]
        for sid, p in zip(ids, prompts, strict=True):
            self.engine.add(sid, p, steps)
        self.engine.step([(sid, len(p)) for sid, p in zip(ids, prompts, strict=True)], [])
        return ids

    def decode(self, ids: list[str]) -> None:
        self.engine.step([], ids)


class Reference:
    """``transformers``' own model, as ``from_pretrained`` loads it."""

    def __init__(self, folder: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model.eval()
        self.cache: Any = None
        self.next: torch.Tensor | None = None

    @property
    def implementations(self) -> dict[str, Any]:
        cfg = self.model.config
        return {"attention": cfg._attn_implementation,
                "experts": getattr(cfg, "_experts_implementation", None)}

    def prefill(self, prompt: list[int]) -> None:
        self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    def start_decode(self, prompts: list[list[int]], steps: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        out = self.model(torch.tensor(prompts), cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]

    def decode(self) -> None:
        out = self.model(self.next, cache=self.cache, use_cache=True)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timing(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode, both implementations side by side in this process."""
    folder = folder_of(family)
    ours, ref = Ours(folder), Reference(folder)
    p = prompt(args.prefill, 1)
    with torch.inference_mode():
        pre = side_by_side({"ours": lambda: ours.prefill(p), "transformers": lambda: ref.prefill(p)},
                           args.reps, "cpu")
        prompts = [prompt(args.context, 100 + i) for i in range(args.batch)]
        ids = ours.start_decode(prompts, args.decode_reps + 4)
        ref.start_decode(prompts, args.decode_reps + 4)
        dec = side_by_side({"ours": lambda: ours.decode(ids), "transformers": ref.decode},
                           args.decode_reps, "cpu")
    return {"prefill_s": pre, "decode_s": dec, "implementations": ref.implementations,
            "parameters": sum(t.numel() for t in ref.model.parameters())}


def peak_child(impl: str, family: str, n: int) -> dict[str, int]:
    """One prefill's step peak (bytes above the loaded, warmed process) and the load's peak RSS."""
    folder = folder_of(family)
    model: Ours | Reference = Ours(folder) if impl == "ours" else Reference(folder)
    p = prompt(n, 1)
    with torch.inference_mode():
        model.prefill(p)  # warm-up: one-time kernel setup is not a step's memory
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        load_hwm = _status("VmHWM")
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
        model.prefill(p)
        step = _status("VmHWM") - before
    return {"step_peak": step, "load_hwm": load_hwm, "rss_loaded": before}


def peak_memory(impl: str, family: str, args: argparse.Namespace) -> list[dict[str, int]]:
    cmd = [sys.executable, "-m", "bench.families_bench", "--peak-child", impl, "--family", family,
           "--prefill", str(args.prefill), "--threads", str(args.threads)]
    runs = []
    for _ in range(args.mem_reps):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if res.returncode:
            raise RuntimeError(f"{family} {impl}: {res.stderr[-2000:]}")
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return runs


def summarize(family: str, t: dict[str, Any], mem: dict[str, list[dict[str, int]]],
              args: argparse.Namespace) -> dict[str, Any]:
    med = statistics.median

    def m(key: str, impl: str) -> float:
        return float(med(r[key] for r in mem[impl]))

    pre_ours, pre_hf = med(t["prefill_s"]["ours"]), med(t["prefill_s"]["transformers"])
    dec_ours, dec_hf = med(t["decode_s"]["ours"]), med(t["decode_s"]["transformers"])
    return {
        "family": family, "shape": SHAPES[family], "parameters": t["parameters"],
        "implementations": t["implementations"],
        "prefill_tok_s": {"ours": args.prefill / pre_ours, "transformers": args.prefill / pre_hf},
        "prefill_speedup": pre_hf / pre_ours,
        "decode_ms": {"ours": dec_ours * 1e3, "transformers": dec_hf * 1e3},
        "decode_speedup": dec_hf / dec_ours,
        "step_peak_mib": {i: m("step_peak", i) / 2**20 for i in mem},
        "step_peak_ratio": m("step_peak", "ours") / m("step_peak", "transformers"),
        "load_hwm_mib": {i: m("load_hwm", i) / 2**20 for i in mem},
        "load_hwm_ratio": m("load_hwm", "ours") / m("load_hwm", "transformers"),
        "raw": {"timing": t, "memory": mem},
    }


def render(rows: list[dict[str, Any]], info: dict[str, Any], args: argparse.Namespace) -> str:
    out = [
        "# Per-family benchmark: the worker against transformers, same weights",
        "",
        "Generated by `make bench-families` (`bench/families_bench.py`); do not edit by hand.",
        "",
        f"Machine: {info['cpu']}, {info['cpu_count']} CPUs (shared with other engineers' jobs; load"
        f" average at the start {info['load_average'][0]:.1f}), torch {info['torch']},"
        f" transformers {info['transformers']}, {args.threads} threads, float32,"
        f" OMP_WAIT_POLICY={info['omp_wait_policy']}.",
        "",
        f"Prefill: 1 sequence of {args.prefill:,} tokens, {args.reps} interleaved repetitions after one"
        f" warm-up each. Decode: {args.batch} sequences of {args.context} tokens, one token each per step,"
        f" {args.decode_reps} interleaved repetitions. Medians; speed-up = transformers time / ours."
        f" Peak memory: medians of {args.mem_reps} fresh processes per implementation; **step** = one"
        " prefill's RSS high-water mark above the loaded, warmed process (ours / transformers);"
        " **load** = the process's RSS high-water mark after loading and one warm-up prefill.",
        "",
        "| family | params | transformers impl. (attn / experts) | prefill tok/s ours | transformers |"
        " speed-up (≥ 1.5) | decode ms ours | transformers | speed-up | step peak MiB ours / hf |"
        " ratio (≤ 1.0) | load peak MiB ours / hf | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        imp = r["implementations"]
        out.append(
            f"| {r['family']} | {r['parameters'] / 1e6:.0f} M | {imp['attention']} / {imp['experts']} |"
            f" {r['prefill_tok_s']['ours']:,.0f} | {r['prefill_tok_s']['transformers']:,.0f} |"
            f" {r['prefill_speedup']:.2f}x {'met' if r['prefill_speedup'] >= 1.5 else '**missed**'} |"
            f" {r['decode_ms']['ours']:.1f} | {r['decode_ms']['transformers']:.1f} | {r['decode_speedup']:.2f}x |"
            f" {r['step_peak_mib']['ours']:.0f} / {r['step_peak_mib']['transformers']:.0f} |"
            f" {r['step_peak_ratio']:.2f} {'met' if r['step_peak_ratio'] <= 1.0 else '**missed**'} |"
            f" {r['load_hwm_mib']['ours']:.0f} / {r['load_hwm_mib']['transformers']:.0f} |"
            f" {r['load_hwm_ratio']:.2f} |")
    out += ["", "Shapes (hidden 1024, 2 layers, 16 heads, vocabulary 32,000, untied embeddings; the"
            " `transformers` config fields):", ""]
    out += [f"- `{r['family']}`: {', '.join(f'{k}={v}' for k, v in r['shape'].items())}" for r in rows]
    out += ["", "Every repetition's seconds and every process's bytes: `bench/results/families.json`.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(SHAPES))
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-reps", type=int, default=15)
    ap.add_argument("--mem-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-child", choices=("ours", "transformers"))
    ap.add_argument("--family", default="mixtral")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.peak_child:
        print(json.dumps(peak_child(args.peak_child, args.family, args.prefill)))
        return 0
    import transformers

    info = {**machine("cpu"), "transformers": transformers.__version__}
    rows = []
    for family in filter(None, args.families.split(",")):
        folder_of(family)
        t = timing(family, args)
        gc.collect()
        mem = {impl: peak_memory(impl, family, args) for impl in ("ours", "transformers")}
        rows.append(summarize(family, t, mem, args))
        r = rows[-1]
        print(f"{family}: prefill {r['prefill_speedup']:.2f}x, decode {r['decode_speedup']:.2f}x,"
              f" step peak {r['step_peak_ratio']:.2f}, load peak {r['load_hwm_ratio']:.2f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "families.json").write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows},
                                                      indent=1) + "\n")
    (RESULTS / "families.md").write_text(render(rows, info, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
