"""Where a family's prefill time goes, ours against ``transformers``: seconds in each layer's
attention and MLP (MoE or dense) module and in the rest (embeddings, norms, LM head, engine),
from forward hooks, medians of interleaved repetitions. Explains the ratios of
``bench.families_bench`` (same folders, same prompt).

``python -m bench.families_breakdown [--families qwen2_moe,qwen3_moe] [--prefill 1024] [--reps 3]``
prints a table (not committed as a result: a diagnosis aid).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.families_bench import SHAPES, Ours, Reference, folder_of, prompt


def hook_times(layers: list[nn.Module], parts: dict[str, str]) -> dict[str, float]:
    """Adds forward hooks that sum wall seconds per part (``attr name -> label``); returns the sums."""
    acc: dict[str, float] = {label: 0.0 for label in parts.values()}
    for layer in layers:
        for attr, label in parts.items():
            mod = getattr(layer, attr)
            start: list[float] = []

            def pre(_m: nn.Module, _a: Any, start: list[float] = start) -> None:
                start.append(time.perf_counter())

            def post(_m: nn.Module, _a: Any, _o: Any, start: list[float] = start, label: str = label) -> None:
                acc[label] += time.perf_counter() - start.pop()

            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
    return acc


def breakdown(family: str, n: int, reps: int) -> dict[str, dict[str, float]]:
    folder = folder_of(family)
    ours, ref = Ours(folder), Reference(folder)
    ours_layers = list(ours.engine.model.layers)  # type: ignore[attr-defined]
    ref_layers = list(ref.model.model.layers)
    parts = {"self_attn": "attention", "mlp": "mlp"}
    if not hasattr(ours_layers[0], "mlp"):  # the embedded Transformer (mixtral)
        parts_ours = {"attention": "attention", "feed_forward": "mlp"}
    else:
        parts_ours = parts
    acc = {"ours": hook_times(ours_layers, parts_ours), "transformers": hook_times(ref_layers, parts)}
    p = prompt(n, 1)
    fns: dict[str, Callable[[], None]] = {"ours": lambda: ours.prefill(p), "transformers": lambda: ref.prefill(p)}
    rows: dict[str, dict[str, list[float]]] = {k: {"total": [], "attention": [], "mlp": []} for k in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for _ in range(reps):
            for name, fn in fns.items():
                for k in acc[name]:
                    acc[name][k] = 0.0
                t0 = time.perf_counter()
                fn()
                rows[name]["total"].append(time.perf_counter() - t0)
                for k, v in acc[name].items():
                    rows[name][k].append(v)
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rows.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(SHAPES))
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| family | impl | total s | attention s | MLP s | rest s |")
    print("|---|---|---|---|---|---|")
    for family in filter(None, args.families.split(",")):
        r = breakdown(family, args.prefill, args.reps)
        for name, m in r.items():
            print(f"| {family} | {name} | {m['total']:.3f} | {m['attention']:.3f} | {m['mlp']:.3f} |"
                  f" {m['total'] - m['attention'] - m['mlp']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
