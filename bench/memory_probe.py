"""Measure one engine step's peak memory in a fresh process (used by ``bench.memory_validate``).

Run as ``python -m bench.memory_probe '<json config>'``; prints one JSON line.

The figure measured is the process's resident-set high-water mark (``VmHWM`` in
``/proc/self/status``) during the step, minus the resident set just before the
step's sequences were added (``VmRSS``, after ``malloc_trim(0)`` has returned the pages glibc
held freed, so the baseline is the live memory and not what earlier work left behind). The high-water mark is reset with
``echo 5 > /proc/self/clear_refs`` after the model is built and warmed up, so
model loading never counts. Sequences' KV caches are allocated inside the
measured window (``Engine.add``), as in the worker.

Config keys: ``shape`` (ModelArgs fields), ``dtype`` ("float32"/"bfloat16"),
``prefill`` (list of prompt lengths, each prefilled whole in the one step),
``decode`` (number of sequences decoding one token in the same step, each with
``decode_context`` tokens already in its cache, prefilled before the window),
``decode_context``, ``max_new`` (max_new_tokens of every sequence, KV capacity),
``skewed`` (repetitive one-letter prompts instead of real text),
``chunk`` (expert chunk bound), ``capacity_factor`` (0: dropless), ``threads``;
``hf_config`` (a family's ``config.json`` fields, ``model_type`` included) instead of
``preset``/``shape``: the folder :func:`bench.family_checkpoints.checkpoint_folder` writes
with ``transformers``, loaded by the worker's ``load_hf_checkpoint``; the saved
``config.json`` comes back in the result (``config_json``) for the memory model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT)]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _tokens(n: int, skewed: bool, offset: int) -> list[int]:
    from bench.loadgen.text import prompt_of_length
    from moeguard_runtime.tokenizer import encode

    text = "a" * (n - 1) if skewed else prompt_of_length(n - 1, offset=offset * 7919)
    return encode(text)


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    import torch

    from moeguard_runtime.engine import Engine
    from moeguard_runtime.model import build_model
    from moeguard_runtime.presets import get_preset
    from moeguard_runtime.serving import ServingModel

    torch.set_num_threads(int(cfg.get("threads", 1)))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.get("dtype", "float32")]
    model: ServingModel
    config_json = None
    if "hf_config" in cfg:  # a family's HF folder, loaded as the worker loads it
        from bench.family_checkpoints import checkpoint_folder, read_config
        from moeguard_runtime.hf_checkpoint import BuildOptions, load_hf_checkpoint

        folder = checkpoint_folder(cfg["hf_config"])
        config_json = read_config(folder)
        model = load_hf_checkpoint(folder, dtype, options=BuildOptions(
            int(cfg.get("chunk", 2048)), float(cfg.get("capacity_factor", 0.0)))).model
    else:
        args = dataclasses.replace(get_preset(cfg.get("preset", "tiny")), **cfg.get("shape", {}))
        model = build_model(args, seed=0, dtype=dtype, expert_chunk_tokens=int(cfg.get("chunk", 2048)),
                            capacity_factor=float(cfg.get("capacity_factor", 0.0)))
    engine = Engine(model)
    skewed = bool(cfg.get("skewed", False))
    max_new = int(cfg.get("max_new", 16))
    # Warm-up: the whole scenario once, then released, so one-time work for these shapes (lazy
    # initialisation, oneDNN primitives and JIT kernels, which a serving worker keeps cached) is not
    # counted in the step's peak.
    ctx = int(cfg.get("decode_context", 64))

    def stage(prefix: str) -> list[str]:
        """Add and prefill the decode sequences; returns their ids."""
        ids = []
        for i in range(int(cfg.get("decode", 0))):
            sid = f"{prefix}d{i}"
            engine.add(sid, _tokens(ctx, skewed, 500 + i), max_new)
            engine.step([(sid, ctx)], [])
            ids.append(sid)
        return ids

    warm_decode = stage("w")
    warm_prefill = []
    for i, n in enumerate(cfg.get("prefill", [])):
        engine.add(f"wp{i}", _tokens(int(n), skewed, i), max_new)
        warm_prefill.append((f"wp{i}", int(n)))
    engine.step(warm_prefill, warm_decode)
    for sid in [*warm_decode, *(s for s, _ in warm_prefill)]:
        engine.release(sid)
    decode_ids = stage("")
    import gc

    gc.collect()
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap pages, so the baseline is what is live
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    prefill = []
    for i, n in enumerate(cfg.get("prefill", [])):
        sid = f"p{i}"
        engine.add(sid, _tokens(int(n), skewed, i), max_new)
        prefill.append((sid, int(n)))
    kv_new = sum(engine.sequences[s].cache.nbytes for s, _ in prefill)
    out = engine.step(prefill, decode_ids)
    hwm = _status("VmHWM")
    top = [r.top_expert_tokens for r in out.routing]
    slots = [r.routed_slots for r in out.routing]
    return {
        "rss_before": before, "hwm": hwm, "measured": hwm - before, "kv_new_bytes": kv_new,
        "top_expert_slots": top, "routed_slots": slots,
        "overflow": [r.overflow_tokens for r in out.routing],
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **({"config_json": config_json} if config_json is not None else {}),
    }


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
