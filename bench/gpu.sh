#!/usr/bin/env bash
# The runtime benchmarks in bf16 on one CUDA GPU, within 8 minutes.
#
# Usage (repository root, on a machine with a GPU and the project's venv):
#   bench/gpu.sh            # writes bench/results/runtime-gpu-bf16.{md,json}
#
# Same sizes as the CPU run (D=1024, I=2816, E=8, k=2; prefill 4,096 tokens,
# decode 16), moeguard's grouped dispatch against HF's expert loop on the same
# weights, bf16. Peak memory is torch.cuda.max_memory_allocated over one
# forward in a fresh process; the decode bound uses the GPU's measured read
# bandwidth (tensor.sum() over 1 GiB). The worker-overhead benchmark is
# skipped (--overhead-reps 0): the worker's engine runs on the CPU.
# Written without a GPU to run it on; checked by reading only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD/runtime:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# 8 minutes in all: the run itself takes well under a minute on a data-centre GPU.
timeout 480 "$PY" -m bench.runtime_bench --device cuda --dtype bf16 --threads 2 \
  --reps 20 --overhead-reps 0 --out bench/results/runtime-gpu-bf16
