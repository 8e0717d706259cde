#!/usr/bin/env bash
# The runtime checks and benchmarks in bf16 on one CUDA GPU, in one script, within
# 8 minutes (budget: 1 min tests, 6 min benchmarks, the rest start-up).
#
# Usage (repository root, on a machine with a GPU and the project's venv):
#   bench/gpu.sh            # writes bench/results/runtime-gpu-bf16.{md,json}
#
# 1. tests/unit/runtime/test_device.py: on CUDA its test_cuda_end_to_end runs (it
#    is skipped on the CPU): MOEGUARD_DEVICE/DTYPE auto resolve to cuda/bfloat16,
#    weights, KV caches, token tensors and generators are on the GPU, no factory
#    call in a step leaves its device to the default, the router softmax stays
#    float32, and the memory guard reads the worker's own device (mem_get_info,
#    allocated, reserved).
# 2. bench.runtime_bench --device cuda --dtype bf16: the same sizes as the CPU run
#    (D=1024, I=2816, E=8, k=2; prefill 4,096 tokens, decode 16), moeguard's
#    grouped dispatch against HF's expert loop on the same weights; peak memory is
#    torch.cuda.max_memory_allocated over one forward in a fresh process; the
#    decode bound uses the GPU's measured read bandwidth (tensor.sum() over 1 GiB);
#    and the worker-loop overhead with the small preset served on the GPU in bf16.
# Written on a machine without a GPU; checked by reading only until a GPU run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD/runtime:$PWD/core:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/unit/runtime/test_device.py \
  -k "cuda or every_tensor or settings_default"
timeout 360 "$PY" -m bench.runtime_bench --device cuda --dtype bf16 --threads 2 \
  --reps 20 --overhead-reps 3 --out bench/results/runtime-gpu-bf16
