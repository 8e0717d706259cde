"""A worker's start stays cheap: building the model imports neither ``torch._dynamo`` (with ``torch._inductor``)
nor sympy. nn.Embedding's ``normal_`` and ``Module.to_empty`` on the meta device ran torch's Python references,
which import both: 3.3 s of the 5.8 s of CPU that a ``tiny`` worker took to start (AMD EPYC, 2026-12-06), in
every one of the suite's several hundred worker starts (model.embedding and model.materialise)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness.stack import ROOT

PROBE = """
import json, sys
from moeguard_core.presets import PRESETS
from moeguard_runtime.model.model import build_model
build_model(PRESETS[sys.argv[1]], seed=0)
print(json.dumps({m: m in sys.modules for m in ("torch._dynamo", "torch._inductor", "sympy")}))
"""


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_building_a_preset_imports_no_compiler_and_no_sympy(preset: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, preset], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={"PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'core'}", "PATH": "/usr/bin:/bin",
                                         "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "torch._dynamo": False, "torch._inductor": False, "sympy": False}
