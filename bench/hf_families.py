"""Each HF family served by the worker against ``transformers``' own forward, same weights.

``python -m bench.hf_families`` writes ``bench/results/hf_families.md`` and ``.json``.
Per family (mixtral, qwen3_moe, qwen2_moe, deepseek_v3, olmoe), a random model of
D=1024, E=8 routed experts, k=2, 2 layers, vocabulary 32,000 (transformers' class,
seeded, ``save_pretrained``, loaded by :func:`moeguard_runtime.hf_checkpoint.load_hf_checkpoint`):

* prefill: one prompt of ``--prefill`` tokens; ours is one engine forward of the whole
  prompt (last-token logits), transformers' is ``model(ids, logits_to_keep=1)`` with
  its default (SDPA) attention. Tokens per second, median of interleaved repetitions.
* decode: one token after that prompt; ours through the per-sequence cache, theirs
  through its ``DynamicCache`` (copied per repetition outside the timing).
* peak memory of the prefill: the rise of the peak RSS (``VmHWM``, reset through
  ``/proc/self/clear_refs``) over the RSS before one forward, each in a fresh process
  (``--peak-child``), so neither side inherits the other's freed heap. The weights are
  read once before (ours are memory-mapped from the safetensors file: their pages would
  otherwise count as the forward's).

CPU, float32, ``OMP_WAIT_POLICY=PASSIVE`` as the worker sets it. transformers is a
test/bench dependency only.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.runtime_bench import side_by_side

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "olmoe")
D, E, K, LAYERS, VOCAB = 1024, 8, 2, 2, 32_000
RESULTS = Path(__file__).parent / "results"


def hf_model(family: str) -> Any:
    """transformers' model of ``family`` at the benchmark shape, seeded."""
    import transformers

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                  num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=4096, num_experts_per_tok=K)
    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=2816, num_local_experts=E))
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=128, intermediate_size=2816, moe_intermediate_size=1408,
            num_experts=E, norm_topk_prob=True))
    if family == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=2816, moe_intermediate_size=1408,
            shared_expert_intermediate_size=2816, num_experts=E))
    if family == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, intermediate_size=1408, num_experts=E, eos_token_id=2))
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**common, "num_key_value_heads": 8}, intermediate_size=2816,
        moe_intermediate_size=1408, n_routed_experts=E, n_group=4, topk_group=2,
        n_shared_experts=1, kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=1, num_mtp_layers=0))


def setup(family: str, folder: Path, prefill: int) -> tuple[Any, Any, torch.Tensor]:
    """``(hf model, our loaded checkpoint, prompt [1, prefill])``; saves the folder once."""
    from moeguard_runtime.hf_checkpoint import load_hf_checkpoint

    hf = hf_model(family).eval()
    if not (folder / "config.json").exists():
        hf.save_pretrained(folder)
    ours = load_hf_checkpoint(folder)
    prompt = torch.randint(0, VOCAB, (1, prefill), generator=torch.Generator().manual_seed(1))
    return hf, ours, prompt


def bench_family(family: str, folder: Path, prefill: int, reps: int) -> dict[str, Any]:
    from moeguard_runtime.model import Segment

    hf, ours, prompt = setup(family, folder, prefill)
    ids = prompt[0]
    positions = torch.arange(prefill)

    def ours_prefill() -> None:
        cache = ours.model.new_cache(prefill + 1, torch.float32, "cpu")
        ours.model(ids, positions, [Segment(cache, 0, prefill)])

    def hf_prefill() -> None:
        hf(prompt, logits_to_keep=1)

    our_cache = ours.model.new_cache(prefill + 1, torch.float32, "cpu")
    hf_past: Any = None
    with torch.inference_mode():
        ours.model(ids, positions, [Segment(our_cache, 0, prefill)])
        hf_past = hf(prompt, use_cache=True, logits_to_keep=1).past_key_values
        nxt = torch.tensor([7])
        pos = torch.tensor([prefill])

        def ours_decode() -> None:
            ours.model(nxt, pos, [Segment(our_cache, prefill, 1)])

        pasts = [copy.deepcopy(hf_past) for _ in range(reps + 1)]

        def hf_decode() -> None:
            hf(nxt[None], past_key_values=pasts.pop(), use_cache=True, logits_to_keep=1)

        pre = side_by_side({"moeguard": ours_prefill, "transformers": hf_prefill}, reps, "cpu")
        dec = side_by_side({"moeguard": ours_decode, "transformers": hf_decode}, reps, "cpu")
    peaks = {impl: _peak(family, impl, folder, prefill) for impl in ("moeguard", "transformers")}
    med = {k: statistics.median(v) for k, v in pre.items()}
    med_dec = {k: statistics.median(v) for k, v in dec.items()}
    return {"family": family,
            "parameters": sum(p.numel() for p in hf.parameters()),
            "prefill_tokens_per_s": {k: prefill / v for k, v in med.items()},
            "prefill_speedup": med["transformers"] / med["moeguard"],
            "decode_step_ms": {k: v * 1e3 for k, v in med_dec.items()},
            "decode_speedup": med_dec["transformers"] / med_dec["moeguard"],
            "prefill_peak_bytes": peaks,
            "peak_ratio": peaks["moeguard"] / max(peaks["transformers"], 1)}


def _peak(family: str, impl: str, folder: Path, prefill: int) -> int:
    cmd = [sys.executable, "-m", "bench.hf_families", "--peak-child", family, impl, str(folder),
           "--prefill", str(prefill), "--threads", str(torch.get_num_threads())]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return int(res.stdout.strip().splitlines()[-1])


def peak_child(family: str, impl: str, folder: Path, prefill: int) -> int:
    """Peak RSS rise of one prefill forward of ``impl``, bytes, in this fresh process."""
    from moeguard_runtime.model import Segment

    hf, ours, prompt = setup(family, folder, prefill)
    if impl == "moeguard":
        del hf
        cache = ours.model.new_cache(prefill + 1, torch.float32, "cpu")

        def run() -> None:
            ours.model(prompt[0], torch.arange(prefill), [Segment(cache, 0, prefill)])
    else:
        del ours

        def run() -> None:
            hf(prompt, use_cache=True, logits_to_keep=1)
    with torch.inference_mode():
        for t in [*ours.model.parameters()] if impl == "moeguard" else [*hf.parameters()]:
            t.sum()  # fault in memory-mapped weights: count the forward's memory, not the load's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
        rss = _status_kib("VmRSS:")
        run()
        return (_status_kib("VmHWM:") - rss) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def render(rows: list[dict[str, Any]], prefill: int, threads: int) -> str:
    mib = 1 << 20
    lines = [
        "# HF families: moeguard against transformers (same weights)", "",
        f"Generated by `python -m bench.hf_families`. CPU, float32, {threads} torch threads; "
        f"D={D}, E={E}, k={K}, {LAYERS} layers, vocabulary {VOCAB}; prefill of {prefill} tokens "
        f"in one forward; decode of one token at context {prefill}. Medians of interleaved "
        "repetitions; peak = rise of peak RSS during one prefill, each side in a fresh process.",
        "Targets (issue 10): prefill >= 1.5x transformers, peak memory <= 1.0x.", "",
        "| family | params | prefill tok/s (ours / HF) | prefill speed-up | decode ms (ours / HF) "
        "| decode speed-up | prefill peak MiB (ours / HF) | peak ratio |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, d, m = r["prefill_tokens_per_s"], r["decode_step_ms"], r["prefill_peak_bytes"]
        lines.append(
            f"| {r['family']} | {r['parameters'] / 1e6:.0f}M | {p['moeguard']:.0f} / "
            f"{p['transformers']:.0f} | {r['prefill_speedup']:.2f}x | {d['moeguard']:.1f} / "
            f"{d['transformers']:.1f} | {r['decode_speedup']:.2f}x | {m['moeguard'] / mib:.0f} / "
            f"{m['transformers'] / mib:.0f} | {r['peak_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--peak-child", nargs=3, metavar=("FAMILY", "IMPL", "FOLDER"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.peak_child:
        family, impl, folder = a.peak_child
        print(peak_child(family, impl, Path(folder), a.prefill))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            rows.append(bench_family(family, Path(tmp) / family, a.prefill, a.reps))
            print(json.dumps(rows[-1]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hf_families.json").write_text(json.dumps(rows, indent=2) + "\n")
    (a.out / "hf_families.md").write_text(render(rows, a.prefill, a.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
