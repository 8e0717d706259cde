"""Run every configuration of ``bench.memory_configs`` through ``bench.memory_probe``, each in
a fresh process, ``REPEATS`` times, and write the measurements to
``bench/results/memory_measurements.json`` (the median run of each configuration, and every run).

``python -m bench.memory_run [--jobs N] [--only NAME,...] [--families] [--serving-chunks]``. Probes run ``--jobs`` at a time (default 3):
each measures its own process's high-water mark, so concurrent probes do not change one another's
figure (the machine has memory to spare), only the wall time. Each measured row records the
``--jobs`` it ran under (``probe_jobs``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.memory_configs import CONFIGS, FAMILY_CONFIGS, SERVING_CHUNK_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3
"""Fresh processes per configuration; the median is kept (issue 6: at least 3)."""
OUT = ROOT / "bench" / "results" / "memory_measurements.json"


def _probe(cfg: dict[str, Any]) -> dict[str, Any]:
    probe_cfg = {k: v for k, v in cfg.items() if k not in ("name", "role")}
    proc = subprocess.run([sys.executable, "-m", "bench.memory_probe", json.dumps(probe_cfg)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg['name']}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_row(cfg: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The configuration with its median run (by measured peak) and every run's figure; where the
    runs carry ``measured_from_idle`` (:mod:`bench.memory_probe`), its own median and runs too, and
    those of the heap retained before the step (``rss_before - rss_idle``)."""
    runs = sorted(runs, key=lambda m: m["measured"])
    row = {**cfg, **runs[len(runs) // 2], "measured_runs": [r["measured"] for r in runs]}
    if all("measured_from_idle" in r for r in runs):
        idle = sorted(r["measured_from_idle"] for r in runs)
        kept = sorted(r["rss_before"] - r["rss_idle"] for r in runs)
        row |= {"measured_from_idle": idle[len(idle) // 2], "measured_from_idle_runs": idle,
                "retained_bytes": kept[len(kept) // 2], "retained_runs": kept}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--only", default="", help="re-measure these configurations, keep the others' rows")
    ap.add_argument("--families", action="store_true",
                    help="re-measure the HF family configurations only (bench.memory_configs.FAMILY_CONFIGS)")
    ap.add_argument("--serving-chunks", action="store_true",
                    help="re-measure the chunked-prefill serving rows only (bench.memory_configs.SERVING_CHUNK_CONFIGS)")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    if args.families:
        only |= {c["name"] for c in FAMILY_CONFIGS}
    if args.serving_chunks:
        only |= {c["name"] for c in SERVING_CHUNK_CONFIGS}
    configs = [c for c in CONFIGS if not only or c["name"] in only]
    if any("hf_config" in c for c in configs):  # write the families' folders once, before the probes
        from bench.family_checkpoints import checkpoint_folder

        for c in configs:
            if "hf_config" in c:
                checkpoint_folder(c["hf_config"])
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {c["name"]: [pool.submit(_probe, c) for _ in range(REPEATS)] for c in configs}
        done = {}
        for c in configs:
            done[c["name"]] = {**median_row(c, [f.result() for f in futures[c["name"]]]), "probe_jobs": args.jobs}
            runs = ", ".join(f"{m / 2**20:.1f}" for m in done[c["name"]]["measured_runs"])
            print(f"{c['name']:<40} {done[c['name']]['measured'] / 2**20:8.1f} MiB  ({runs})", flush=True)
    old = {r["name"]: r for r in json.loads(OUT.read_text())} if only and OUT.exists() else {}
    rows = [done.get(c["name"]) or old[c["name"]] for c in CONFIGS if c["name"] in done or c["name"] in old]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
