"""Structured outputs' cost (issue 32): decode with and without a JSON schema on the same prompts, and the
grammar's compile time.

``python -m bench.structured_output_bench`` (``make bench-structured``) writes ``bench/results/structured_output.md``
and ``.json``:

* **TPOT at batch 8**: the ``small`` preset (99M parameters, float32, byte tokenizer), eight sequences of real-text
  prompts prefilled, then :data:`DECODE_STEPS` decode steps of all eight through :class:`Engine`; each step's time
  is one TPOT sample. Arms: ``free`` text; ``any_text``, every sequence under the grammar ``(?s:.*)`` (any valid
  UTF-8: the grammar's mask computed and applied every step, the tokens still random bytes, so the MoE routing is
  like free text's); ``schema``, every sequence under :data:`LONG_SCHEMA` (an array of at least 64 integers, so no
  sequence completes its grammar within the steps). Repetitions interleave the arms, the same prompts and seeds;
  the figures are ratios of the medians, the target <= 1.10 for ``schema`` / ``free`` (issue 32: at most 10 % TPOT
  overhead at batch 8). The schema's tokens are digits and commas, which route differently from random bytes (a
  tiny random model's few experts take them), so that ratio mixes the grammar's cost with a cheaper routing;
  ``any_text`` / ``free`` is the grammar machinery's own cost. tokens/s = 8 / TPOT.
* **Mask cost**: per constrained sequence and step, :meth:`Constraint.allowed` (llguidance's mask on the host,
  unpacked to a ``[V]`` boolean tensor) and :meth:`Constraint.advance`, timed alone.
* **Compile time** of a 20-field schema (strings, integers with bounds, enums, booleans, a nested object, an
  array): building the tokenizer for llguidance once (:func:`structured_output.compiler_for`), then
  :func:`grammar.grammar_of` + :meth:`GrammarCompiler.compile` per request, for the byte tokenizer and a 1,000-token
  BPE ``tokenizer.json`` (trained on the project's docs, as the unit tests do). A 150k-token vocabulary is not
  measured here: none is on this machine without the network.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker sets it, before torch loads libgomp

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import llguidance
import torch
from harness.loadgen.text import prompt_of_length

from bench.control_latency import machine_line
from moeguard_core import presets
from moeguard_runtime.api.checkpoint_tokenizer import CheckpointTokenizer
from moeguard_runtime.api.structured_output import compiler_for
from moeguard_runtime.api.tokenizer import ByteTokenizer
from moeguard_runtime.engine.engine import Engine
from moeguard_runtime.engine.grammar import GrammarCompiler, grammar_of
from moeguard_runtime.model.model import build_model

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 8
PROMPT_TOKENS = 64
DECODE_STEPS = 32
REPS = 7
TARGET_RATIO = 1.10
LONG_SCHEMA: dict[str, Any] = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64}}}
FIELDS_20: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        **{f"name_{i}": {"type": "string", "maxLength": 40} for i in range(5)},
        **{f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 10_000} for i in range(5)},
        **{f"flag_{i}": {"type": "boolean"} for i in range(3)},
        **{f"kind_{i}": {"enum": ["alpha", "beta", "gamma", "delta"]} for i in range(3)},
        "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                  "required": ["id", "email"], "additionalProperties": False},
        "note": {"type": ["string", "null"]}},
}
FIELDS_20["required"] = sorted(FIELDS_20["properties"])
assert len(FIELDS_20["properties"]) == 20


ANY_TEXT = llguidance.LLMatcher.grammar_from_regex(r"(?s:.*)")
"""Any valid UTF-8 text: a grammar whose mask is computed every step and removes only invalid byte sequences."""


def grammars() -> dict[str, str | None]:
    """Each arm's grammar (None: free text)."""
    return {"free": None, "any_text": ANY_TEXT, "schema": grammar_of(LONG_SCHEMA)}


def decode_steps(engine: Engine, prompts: list[list[int]], compiler: GrammarCompiler,
                 grammar: str | None) -> list[float]:
    """Prefill ``prompts`` (one step), then :data:`DECODE_STEPS` decode steps of all of them; each step's seconds."""
    ids = [f"s{i}" for i in range(len(prompts))]
    for i, (sid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        constraint = None if grammar is None else compiler.compile(grammar)
        engine.add(sid, prompt, DECODE_STEPS + 1, 1.0, i, constraint=constraint)
    engine.step([(sid, len(p)) for sid, p in zip(ids, prompts, strict=True)], [])
    times = []
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        out = engine.step([], ids)
        times.append(time.perf_counter() - t0)
        assert not out.finished or len(times) == DECODE_STEPS, out.finished  # every sequence decodes throughout
    for sid in ids:
        engine.release(sid)
    return times


def mask_cost(compiler: GrammarCompiler, steps: int = 200) -> dict[str, float]:
    """Median seconds of one constrained sequence's per-step grammar work (mask, then advance)."""
    constraint = compiler.compile(grammar_of(LONG_SCHEMA))
    masks, advances = [], []
    text = b"[" + b",".join(str(i % 1000).encode() for i in range(steps)) + b"]"
    for byte in text[:steps]:
        t0 = time.perf_counter()
        constraint.allowed(torch.device("cpu"))
        t1 = time.perf_counter()
        assert constraint.advance(byte)
        masks.append(t1 - t0)
        advances.append(time.perf_counter() - t1)
    return {"mask_s": statistics.median(masks), "advance_s": statistics.median(advances)}


def compile_times(make: Any, reps: int = 20) -> dict[str, float]:
    """Seconds to build the tokenizer for llguidance (``make()``), and the median (and first) per-request compile of
    :data:`FIELDS_20`."""
    t0 = time.perf_counter()
    compiler = make()
    build = time.perf_counter() - t0
    fmt = {"type": "json_schema", "json_schema": {"name": "twenty", "schema": FIELDS_20}}
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiler.compile(grammar_of(fmt))
        times.append(time.perf_counter() - t0)
    return {"tokenizer_build_s": build, "first_compile_s": times[0], "median_compile_s": statistics.median(times),
            "vocab": compiler.vocab}


def run(reps: int = REPS) -> dict[str, Any]:
    torch.set_num_threads(int(os.environ.get("MOEGUARD_TORCH_THREADS", "1")))
    started = time.time()
    model = build_model(presets.get_preset("small"), seed=0)
    engine = Engine(model, eos_ids=frozenset())  # no end of sequence: every sequence decodes all the steps
    tok = ByteTokenizer()
    compiler = compiler_for(tok, engine.args.vocab_size)
    prompts = [tok.encode(prompt_of_length(PROMPT_TOKENS, offset=i * 997))[:PROMPT_TOKENS] for i in range(BATCH)]
    by_arm = grammars()
    arms: dict[str, list[float]] = {arm: [] for arm in by_arm}
    per_rep: list[dict[str, float]] = []
    decode_steps(engine, prompts, compiler, None)  # warm-up
    for _ in range(reps):
        rep = {}
        for arm in arms:
            times = decode_steps(engine, prompts, compiler, by_arm[arm])
            arms[arm] += times
            rep[arm] = statistics.median(times)
        per_rep.append(rep)
    tpot = {arm: statistics.median(t) for arm, t in arms.items()}
    with tempfile.TemporaryDirectory() as tmp:
        from tests.unit.runtime.bpe_folder import write_bpe_tokenizer

        vocab = write_bpe_tokenizer(Path(tmp) / "bpe")
        bpe = CheckpointTokenizer(Path(tmp) / "bpe")
        compile_bpe = compile_times(lambda: compiler_for(bpe, vocab))
    return {
        "machine": machine_line(), "threads": torch.get_num_threads(), "batch": BATCH, "prompt_tokens": PROMPT_TOKENS,
        "decode_steps": DECODE_STEPS, "reps": reps, "tpot_s": tpot, "per_rep_tpot_s": per_rep,
        "tokens_per_s": {arm: BATCH / t for arm, t in tpot.items()}, "ratio": tpot["schema"] / tpot["free"],
        "ratio_any_text": tpot["any_text"] / tpot["free"],
        "target_ratio": TARGET_RATIO, "mask_cost": mask_cost(compiler),
        "compile": {"byte": compile_times(lambda: compiler_for(tok, presets.VOCAB_SIZE)), "bpe_1000": compile_bpe},
        "elapsed_s": time.time() - started,
    }


def render(r: dict[str, Any]) -> str:
    ok = "met" if r["ratio"] <= r["target_ratio"] else "**missed**"
    ms = 1e3
    lines = [
        "# Structured outputs: decode with and without a JSON schema, and compile time",
        "",
        "Generated by `make bench-structured` (`bench/structured_output_bench.py`); no result is edited by hand.",
        "",
        f"- **Machine:** {r['machine']}; {r['threads']} torch thread(s).",
        f"- **Decode:** preset `small` (float32, byte tokenizer), batch {r['batch']}, prompts of {r['prompt_tokens']} "
        f"tokens of real text, {r['decode_steps']} decode steps per repetition, {r['reps']} repetitions "
        "interleaved (free, any_text, schema, ...); TPOT = one decode step of all eight; medians over every step.",
        "",
        "| arm | TPOT median ms | tokens/s |",
        "|---|---|---|",
        *[f"| {arm} | {r['tpot_s'][arm] * ms:.2f} | {r['tokens_per_s'][arm]:.1f} |" for arm in r["tpot_s"]],
        "",
        f"**TPOT with the schema / without: {r['ratio']:.3f}** (target <= {r['target_ratio']:.2f}: {ok}); "
        f"the grammar machinery alone (any_text / free): **{r['ratio_any_text']:.3f}**. The schema's digits and "
        "commas route differently from random bytes, which can make its steps cheaper than free text's.",
        "",
        "Per repetition (median TPOT ms, " + " / ".join(r["tpot_s"]) + "): "
        + "; ".join(" / ".join(f"{p[arm] * ms:.2f}" for arm in r["tpot_s"]) for p in r["per_rep_tpot_s"]) + ".",
        "",
        f"Grammar work per constrained sequence and step (byte tokenizer): mask {r['mask_cost']['mask_s'] * 1e6:.0f} us, "
        f"advance {r['mask_cost']['advance_s'] * 1e6:.0f} us (medians of 200 steps).",
        "",
        "## Compile time of a 20-field schema",
        "",
        "| tokenizer | vocabulary | tokenizer build ms (once per worker) | first compile ms | median compile ms |",
        "|---|---|---|---|---|",
        *[f"| {name} | {c['vocab']:,} | {c['tokenizer_build_s'] * ms:.1f} | {c['first_compile_s'] * ms:.2f} | "
          f"{c['median_compile_s'] * ms:.2f} |" for name, c in r["compile"].items()],
        "",
        "Not measured: a 150k-token vocabulary (none on this machine without the network); llguidance builds its "
        "tokenizer once per worker, \"an expensive operation (~1s)\" for a Hugging Face one by its own "
        "documentation (`llguidance.hf.from_tokenizer`).",
        "",
        f"Whole run: {r['elapsed_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS / "structured_output"), help="path stem of .md/.json")
    p.add_argument("--reps", type=int, default=REPS, help="interleaved repetitions")
    args = p.parse_args(argv)
    result = run(args.reps)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
