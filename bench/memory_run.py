"""Run every configuration of ``bench.memory_configs`` through ``bench.memory_probe``, each in
a fresh process, and write the measurements to ``bench/results/memory_measurements.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.memory_configs import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 1
"""Fresh processes per configuration (the median is kept); 1 to fit in the time budget: runs of one configuration differed by up to ~8 % here."""
OUT = ROOT / "bench" / "results" / "memory_measurements.json"


def main() -> int:
    rows = []
    for cfg in CONFIGS:
        probe_cfg = {k: v for k, v in cfg.items() if k not in ("name", "role")}
        runs = []
        for _ in range(REPEATS):
            proc = subprocess.run([sys.executable, "-m", "bench.memory_probe", json.dumps(probe_cfg)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        runs.sort(key=lambda m: m["measured"])
        m = runs[len(runs) // 2]  # the median run
        rows.append({**cfg, **m, "measured_runs": [r["measured"] for r in runs]})
        print(f"{cfg['name']:<40} {m['measured'] / 2**20:8.1f} MiB", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
