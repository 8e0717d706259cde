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

Serving steps (chunked prefill, issue 13):

``chunks``: list of ``[prompt_len, start, n]``: the step runs prompt tokens ``start..start+n-1``
of a ``prompt_len``-token prompt. With ``start`` > 0 the sequence is added (its KV cache of
``prompt_len + max_new`` allocated) and its first ``start`` tokens prefilled, in steps of ``n``,
before the measured window, like the decode sequences; with ``start`` 0 it is added inside the
window (a new request: its KV counts in the step, as in the worker).

``retained``: ``N`` prompt tokens: after the warm-up and its ``malloc_trim``, one long request (a
fresh sequence of ``N`` tokens prefilled whole in one step, ``skewed`` as configured) runs and is
released, then ``gc``, and **no** ``malloc_trim``: glibc keeps the freed heap, as in a worker that
has served a long request. Both figures come back: ``measured`` = ``VmHWM`` − ``VmRSS`` just before
the step (the increment over current use, which the worker's admission adds to its current use)
and ``measured_from_idle`` = ``VmHWM`` − ``rss_idle``, the resident set after the warm-up's
``malloc_trim`` and before the long request (the peak over the idle process with the running
sequences' caches, the retained heap included). Without ``retained`` the two are the same step
(``rss_idle`` is read just before the reset).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "core"), str(ROOT)]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _tokens(n: int, skewed: bool, offset: int) -> list[int]:
    from harness.loadgen.text import prompt_of_length

    from moeguard_runtime.api.tokenizer import encode

    text = "a" * (n - 1) if skewed else prompt_of_length(n - 1, offset=offset * 7919)
    return encode(text)


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    import torch

    from moeguard_core.presets import get_preset
    from moeguard_runtime.engine.engine import Engine
    from moeguard_runtime.model.model import build_model
    from moeguard_runtime.model.serving import ServingModel

    torch.set_num_threads(int(cfg.get("threads", 1)))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.get("dtype", "float32")]
    model: ServingModel
    config_json = None
    if "hf_config" in cfg:  # a family's HF folder, loaded as the worker loads it
        from bench.family_checkpoints import checkpoint_folder, read_config
        from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint
        from moeguard_runtime.model.hf_config import BuildOptions

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
    ctx = int(cfg.get("decode_context", 64))
    whole = [int(n) for n in cfg.get("prefill", [])]
    chunks = [(int(length), int(start), int(n)) for length, start, n in cfg.get("chunks", [])]
    retained = int(cfg.get("retained", 0))

    def stage(prefix: str) -> list[str]:
        """Add and prefill the decode sequences, and add the chunked sequences that started before
        the step with their first ``start`` tokens prefilled (in steps of the chunk size, as
        served); returns the decode ids."""
        ids = []
        for i in range(int(cfg.get("decode", 0))):
            sid = f"{prefix}d{i}"
            engine.add(sid, _tokens(ctx, skewed, 500 + i), max_new)
            engine.step([(sid, ctx)], [])
            ids.append(sid)
        for i, (length, start, n) in enumerate(chunks):
            if start:
                engine.add(f"{prefix}c{i}", _tokens(length, skewed, 700 + i), max_new)
                for done in range(0, start, n):
                    engine.step([(f"{prefix}c{i}", min(n, start - done))], [])
        return ids

    def admit(prefix: str) -> list[tuple[str, int]]:
        """Add the sequences the step admits (KV allocated now: whole prompts and chunks at
        position 0); returns the step's prefill entries, whole prompts then chunks."""
        for i, n in enumerate(whole):
            engine.add(f"{prefix}p{i}", _tokens(n, skewed, i), max_new)
        for i, (length, start, _) in enumerate(chunks):
            if not start:
                engine.add(f"{prefix}c{i}", _tokens(length, skewed, 700 + i), max_new)
        return [(f"{prefix}p{i}", n) for i, n in enumerate(whole)] + \
            [(f"{prefix}c{i}", n) for i, (_, _, n) in enumerate(chunks)]

    def long_request(sid: str) -> None:
        """One whole-prompt prefill of ``retained`` tokens (a fresh sequence), then released."""
        engine.add(sid, _tokens(retained, skewed, 900), max_new)
        engine.step([(sid, retained)], [])
        engine.release(sid)

    # Warm-up: the whole scenario once (the long request included), then released, so one-time
    # work for these shapes (lazy initialisation, oneDNN primitives and JIT kernels, which a
    # serving worker keeps cached) is not counted in the step's peak.
    if retained:
        long_request("wlong")
    warm_decode = stage("w")
    engine.step(admit("w"), warm_decode)
    for sid in list(engine.sequences):
        engine.release(sid)
    decode_ids = stage("")
    import gc

    gc.collect()
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap pages, so the baseline is what is live
    rss_idle = _status("VmRSS")  # the idle process with the running sequences' caches, no freed heap
    if retained:  # a long request served and released earlier; glibc keeps its freed heap (no trim)
        long_request("long")
        gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    running = set(engine.sequences)
    prefill = admit("")
    kv_new = sum(seq.cache.nbytes for sid, seq in engine.sequences.items() if sid not in running)
    out = engine.step(prefill, decode_ids)
    hwm = _status("VmHWM")
    top = [r.top_expert_tokens for r in out.routing]
    slots = [r.routed_slots for r in out.routing]
    return {
        "rss_before": before, "rss_idle": rss_idle, "hwm": hwm, "measured": hwm - before,
        "measured_from_idle": hwm - rss_idle, "kv_new_bytes": kv_new,
        "top_expert_slots": top, "routed_slots": slots,
        "overflow": [r.overflow_tokens for r in out.routing],
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **({"config_json": config_json} if config_json is not None else {}),
    }


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
