"""Fit the memory model's empirical coefficients to the fit-set measurements (role ``fit``).

``python -m bench.memory_fit`` reads ``bench/results/memory_measurements.json`` and grid-searches
``ATTN_STREAM``, ``MOE_STREAM``, ``MASK_FACTOR`` and ``STEP_CONSTANT`` for the smallest worst relative
error on the float32 configurations of role ``fit``, then ``LOWP_EXPERT_WEIGHT`` on the bfloat16 ones;
only role ``fit`` is used; the check set (role ``check``) plays no part. It prints the
best values; ``core/moeguard_core/memory_model.py`` carries them (copied, then checked by
``bench.memory_validate``, which reports both sets separately).
"""

from __future__ import annotations

import itertools
import json
import sys

from bench.memory_validate import MEASUREMENTS, mm, predict, role_of

NAMES = ("ATTN_STREAM", "MOE_STREAM", "MASK_FACTOR", "STEP_CONSTANT", "LOWP_EXPERT_WEIGHT")


def worst_error(rows: list[dict], **coef: float) -> float:
    saved = {n: getattr(mm, n) for n in coef}
    for n, v in coef.items():
        setattr(mm, n, v)
    try:
        return max(abs(predict(r)[0].total_bytes - r["measured"]) / r["measured"] for r in rows)
    finally:
        for n, v in saved.items():
            setattr(mm, n, v)


def main() -> int:
    rows = [r for r in json.loads(MEASUREMENTS.read_text()) if role_of(r) == "fit"]
    f32 = [r for r in rows if r.get("dtype", "float32") == "float32"]
    low = [r for r in rows if r.get("dtype", "float32") != "float32"]
    grid = itertools.product([x / 2 for x in range(8, 25)], [x / 2 for x in range(8, 25)],
                             [1 + x / 8 for x in range(0, 9)], [int(c * mm.MiB / 4) for c in range(0, 13)])
    best = min(grid, key=lambda g: (round(worst_error(f32, **dict(zip(NAMES, g, strict=False))), 4), g))
    coef = dict(zip(NAMES, best, strict=False))
    lowp = min([x / 8 for x in range(0, 25)],
               key=lambda v: round(worst_error(low, **coef, LOWP_EXPERT_WEIGHT=v), 4)) if low else mm.LOWP_EXPERT_WEIGHT
    coef["LOWP_EXPERT_WEIGHT"] = lowp
    print(f"fit set: {len(f32)} float32 + {len(low)} 2-byte configurations")
    for n, v in coef.items():
        print(f"{n} = {v / mm.MiB:g} MiB" if n == "STEP_CONSTANT" else f"{n} = {v:g}")
    print(f"worst relative error on the fit set: {worst_error(rows, **coef):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
