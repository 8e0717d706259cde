"""Compare the memory model with the measured peaks and write ``bench/results/memory_model.md``.

Reads ``bench/results/memory_measurements.json`` (``python -m bench.memory_run``). The model is
given what it would be given in production: the step's tokens, the shape, the dtype, the chunk
bound and capacity factor, and the **observed** skew: the top expert's share of token-slots,
from the step's own routing statistics (the largest over layers, the one that sets the peak).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "core")]

from bench.memory_configs import CONFIGS  # noqa: E402
from moeguard_core import memory_model as mm  # noqa: E402
from moeguard_core.family_shape import from_hf_config  # noqa: E402
from moeguard_core.presets import get_preset  # noqa: E402

MEASUREMENTS = ROOT / "bench" / "results" / "memory_measurements.json"
TABLE = ROOT / "bench" / "results" / "memory_model.md"
TOLERANCE = 0.20


def role_of(row: dict[str, Any]) -> str:
    """``fit`` or ``check``, from the current configuration list (not the stored row)."""
    return next(c["role"] for c in CONFIGS if c["name"] == row["name"])


def shape_of(row: dict[str, Any]) -> mm.ShapeLike:
    """A preset row's ``ModelArgs``, or a family row's shape from its saved ``config.json``."""
    if "hf_config" in row:
        return from_hf_config(row["config_json"])
    return dataclasses.replace(get_preset(row.get("preset", "tiny")), **row.get("shape", {}))


def family_of(row: dict[str, Any]) -> str:
    return str(row["hf_config"]["model_type"]) if "hf_config" in row else "preset"


def step_of(row: dict[str, Any]) -> mm.Step:
    """The step a configuration runs (:mod:`bench.memory_probe`): whole prompts ``(0, n)``, then the
    ``chunks`` ``(start, n)``, then the decode tokens. KV counts for the sequences the step admits:
    whole prompts and chunks at position 0 (``prompt_len + max_new`` each); a chunk further in
    belongs to a sequence whose cache was allocated at its admission, before the step."""
    max_new = int(row.get("max_new", 16))
    whole = [int(n) for n in row.get("prefill", [])]
    chunks = [(int(length), int(start), int(n)) for length, start, n in row.get("chunks", [])]
    return mm.Step(prefill=tuple((0, n) for n in whole) + tuple((start, n) for _, start, n in chunks),
                   decode_contexts=(int(row.get("decode_context", 64)),) * int(row.get("decode", 0)),
                   new_kv_tokens=sum(n + max_new for n in whole)
                   + sum(length + max_new for length, start, _ in chunks if start == 0))


def is_serving(row: dict[str, Any]) -> bool:
    """A chunked-prefill serving row (``SERVING_CHUNK_CONFIGS``), reported in its own section."""
    return "chunks" in row


def predict(row: dict[str, Any]) -> tuple[mm.Estimate, float]:
    shape = shape_of(row)
    step = step_of(row)
    share = max(t / s for t, s in zip(row["top_expert_slots"], row["routed_slots"], strict=True))
    routing = mm.Routing(top_share=share, expert_chunk_tokens=int(row.get("chunk", 2048)),
                         capacity_factor=float(row.get("capacity_factor", 0.0)))
    return mm.step_peak(shape, step, routing, row.get("dtype", "float32")), share


def error(predicted: int, measured: int) -> float:
    """``(predicted - measured) / measured``: negative is an under-prediction, the unsafe side."""
    return (predicted - measured) / measured if measured else float("inf")


def worst_under(errors: dict[str, float]) -> str:
    """The most negative error, in words."""
    name, err = min(errors.items(), key=lambda kv: kv[1])
    if err >= 0:
        return f"none: every row is over-predicted (the closest, {name}, by {err:+.1%})"
    return f"**{err:+.1%}** ({name})"


def serving_section(rows: list[dict[str, Any]]) -> list[str]:
    """The chunked-prefill serving rows: predicted against the peak over current use and over the
    idle process (retained heap included)."""
    if not rows:
        return []
    jobs = sorted({int(r.get("probe_jobs", 3)) for r in rows})
    out = [
        "## Serving chunks (chunked prefill, retained heap)",
        "",
        "`make bench-memory-serving` (`memory_run --serving-chunks`) re-measures these rows only"
        f" ({' or '.join(map(str, jobs))} probe{'' if jobs == [1] else 's'} at a time) and keeps the other"
        " rows' measurements."
        " Each is one step of the `small` preset in float32 (the worker's default) running a chunk"
        " `(start, n)` of a 2048-token prompt: a chunk at `start` > 0 belongs to a sequence admitted"
        " and prefilled up to `start` before the step (its KV cache was allocated then, so the"
        " prediction counts no KV for it); a chunk at 0 is a new request whose KV (2048 + 16 tokens)"
        " the step allocates. `retained 2048`: before the step the process served one 2048-token"
        " request and released it with no `malloc_trim`, so glibc keeps its freed heap.",
        "",
        "**Measured** = `VmHWM` − `VmRSS` just before the step (the increment over current use,"
        " retained heap in the baseline: what the worker's admission adds to its current use)."
        " **From idle** = `VmHWM` − the resident set of the trimmed idle process before the long"
        " request (running sequences' caches included; the retained heap counts in the peak: what the"
        " held-back test measured). **Retained** = the resident set before the step minus that idle"
        " resident set (the heap kept after the long request). Each figure is the median of its own runs,"
        " listed sorted in the last three columns (so one run's three figures need not share a column"
        " position)."
        " Error = (predicted − measured) / measured: **negative = under-prediction, the unsafe side**.",
        "",
        "| configuration | chunks (start+n) | top share | phase | predicted MiB | measured MiB | error |"
        " measured / predicted | from idle MiB | error from idle | retained MiB | runs MiB | runs from idle MiB |"
        " runs retained MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errs: dict[str, float] = {}
    errs_idle: dict[str, float] = {}
    ratios: dict[str, float] = {}
    run_ratios: dict[str, float] = {}
    for row in rows:
        est, share = predict(row)
        pred, measured = est.total_bytes, row["measured"]
        idle = row.get("measured_from_idle", measured)
        errs[row["name"]] = error(pred, measured)
        errs_idle[row["name"]] = error(pred, idle)
        ratios[row["name"]] = measured / pred if pred else float("inf")
        run_ratios[row["name"]] = max(row.get("measured_runs", [measured])) / pred if pred else float("inf")
        retained = row.get("retained_bytes", row["rss_before"] - row.get("rss_idle", row["rss_before"]))
        retained_runs = row.get("retained_runs", [retained])
        chunks = ", ".join(f"{s}+{n}" for _, s, n in row["chunks"])
        out.append(
            f"| {row['name']} | {chunks} | {share:.3f} | {est.phase} | {pred / mm.MiB:.1f} |"
            f" {measured / mm.MiB:.1f} | {errs[row['name']]:+.1%} | {ratios[row['name']]:.2f} |"
            f" {idle / mm.MiB:.1f} | {errs_idle[row['name']]:+.1%} | {retained / mm.MiB:.1f} |"
            f" {', '.join(f'{m / mm.MiB:.1f}' for m in row.get('measured_runs', [measured]))} |"
            f" {', '.join(f'{m / mm.MiB:.1f}' for m in row.get('measured_from_idle_runs', [idle]))} |"
            f" {', '.join(f'{m / mm.MiB:.1f}' for m in retained_runs)} |")
    ratio_name = max(ratios, key=lambda n: ratios[n])
    run_name = max(run_ratios, key=lambda n: run_ratios[n])
    within = sum(abs(e) <= TOLERANCE for e in errs.values())
    within_idle = sum(abs(e) <= TOLERANCE for e in errs_idle.values())
    out += [
        "",
        f"Rows: {len(rows)} (all `check`; none was used to fit a coefficient).",
        f"Worst under-prediction over current use: {worst_under(errs)}; within ±{TOLERANCE:.0%}:"
        f" {within} of {len(rows)}.",
        f"Worst under-prediction from idle (retained heap included): {worst_under(errs_idle)};"
        f" within ±{TOLERANCE:.0%}: {within_idle} of {len(rows)}.",
        f"Worst ratio measured / predicted over current use: **{ratios[ratio_name]:.2f}** ({ratio_name});"
        f" in a single run: {run_ratios[run_name]:.2f} ({run_name}).",
        "",
    ]
    return out


def main() -> int:
    all_rows = json.loads(MEASUREMENTS.read_text())
    for row in all_rows:
        row["role"] = role_of(row)
    rows = [r for r in all_rows if not is_serving(r)]
    out = [
        "# Memory model: predicted vs measured step peaks",
        "",
        "Generated by `make bench-memory-model` (`bench/memory_run.py` measures, `bench/memory_validate.py`"
        " compares); do not edit by hand. Model: `core/moeguard_core/memory_model.py`;"
        " explanation: `docs/memory-model.md`.",
        "",
        f"Machine: {platform.machine()}, {platform.system()} {platform.release()}, CPU only; torch worker code"
        " path (`moeguard_runtime.engine.engine.Engine.step`), one thread.",
        "",
        "**Measured** = resident-set high-water mark during one engine step minus the resident set before it"
        " (fresh process per run, `malloc_trim` before, `clear_refs` reset of `VmHWM`), KV caches of"
        f" the step's new sequences included; the median of {min(len(r.get('measured_runs', [0])) for r in rows)}"
        " runs per configuration (all runs in the last column; three probes ran at once on the 2-core"
        " machine, which other engineers' test runs shared: that changes the wall time, not a process's own"
        " high-water mark). **Predicted** = `memory_model.step_peak` with the step's tokens,"
        " shape, dtype, chunk bound, capacity factor and the observed top-expert share of token-slots.",
        " Role `fit`: the configurations the empirical coefficients were fitted to (`python -m bench.memory_fit`);"
        " `check`: all others, which played no part in the fit.",
        "",
        "| configuration | role | dtype | tokens | top share | busiest expert slots | phase | measured MiB (median) | predicted MiB | error | runs MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    worst_val = 0.0
    misses = []
    by_family: dict[str, list[float]] = {}
    for row in rows:
        est, share = predict(row)
        measured = row["measured"]
        err = error(est.total_bytes, measured)
        by_family.setdefault(family_of(row), []).append(err)
        worst = max(worst, abs(err))
        if row["role"] == "check":
            worst_val = max(worst_val, abs(err))
        if abs(err) > TOLERANCE:
            misses.append(row["name"])
        tokens = step_of(row).tokens
        out.append(f"| {row['name']} | {row['role']} | {row.get('dtype', 'float32')} | {tokens:,} | {share:.3f}"
                   f" | {est.busiest_expert_slots:,} | {est.phase} | {measured / mm.MiB:.1f} |"
                   f" {est.total_bytes / mm.MiB:.1f} | {err:+.1%} |"
                   f" {', '.join(f'{m / mm.MiB:.1f}' for m in row.get('measured_runs', [measured]))} |")
    out += [
        "",
        f"Configurations: {len(rows)} ({sum(r['role'] == 'fit' for r in rows)} fit,"
        f" {sum(r['role'] == 'check' for r in rows)} check,"
        f" {sum(r.get('skewed', False) for r in rows)} skewed).",
        f"Worst absolute error: {worst:.1%} overall, {worst_val:.1%} on the check set;"
        f" within ±{TOLERANCE:.0%}: {len(rows) - len(misses)} of {len(rows)};"
        f" target ±{TOLERANCE:.0%}: " + ("met on every configuration." if not misses else
                                        f"**missed** on {len(misses)}: {', '.join(misses)}."),
        *([f"The {len(all_rows) - len(rows)} chunked-prefill serving rows (whole prompts above; chunks"
           " of longer prompts, retained heap) are in their own section below, with their own summary."]
          if len(all_rows) > len(rows) else []),
        "",
        "Per family (the HF families are loaded from a `save_pretrained` folder by the worker's"
        " `load_hf_checkpoint`; shapes in `bench/memory_configs.py` `HF_FAMILIES`; none of their rows"
        " was used to fit a coefficient):",
        "",
        "`make bench-memory-families` (`memory_run --families`) re-measures the family rows only and keeps"
        " the other rows' earlier measurements (taken with the worker code of their own run); a positive"
        " error is an over-prediction (the safe side for `moeguard plan`).",
        "",
        "| family | configurations | worst error | mean absolute error | within ±20 % |",
        "|---|---|---|---|---|",
        *[f"| {fam} | {len(errs)} | {max(errs, key=abs):+.1%} | {sum(abs(e) for e in errs) / len(errs):.1%} |"
          f" {sum(abs(e) <= TOLERANCE for e in errs)} of {len(errs)} |" for fam, errs in by_family.items()],
        "",
        f"Coefficients: ATTN_STREAM={mm.ATTN_STREAM:g}, MOE_STREAM={mm.MOE_STREAM:g},"
        f" mask bytes per query-key pair={mm.mask_bytes_per_pair(4)} (float32),"
        f" UPCAST_STREAM={mm.UPCAST_STREAM:g}, LOWP_EXPERT_WEIGHT={mm.LOWP_EXPERT_WEIGHT:g},"
        f" STEP_CONSTANT={mm.STEP_CONSTANT / mm.MiB:g} MiB, MLA_MATH_SCORES={mm.MLA_MATH_SCORES:g}"
        " (measured alone, not fitted).",
        "",
    ]
    serving = serving_section([r for r in all_rows if is_serving(r)])
    out += serving
    TABLE.write_text("\n".join(out))
    print("\n".join(out[-6:] if not serving else serving[-5:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
