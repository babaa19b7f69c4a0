#!/usr/bin/env bash
# On a machine with a CUDA GPU and cachecraft installed, from the repository root: the
# CUDA tests, then `cachecraft bench gpu`, each writing its log and results into OUT.
#
#   benchmarks/gpu.sh OUT DATASET [more `bench gpu` options]
#
# The chunk-caches of a 32k-token prompt of an 8B model take 4.3 GB: give the memory
# tiers room (CACHECRAFT_GPU_BUDGET_BYTES, CACHECRAFT_CPU_BUDGET_BYTES) before running.
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUT DATASET [bench gpu options]}
dataset=${2:?usage: benchmarks/gpu.sh OUT DATASET [bench gpu options]}
shift 2
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__)' | tee -a "$out/device.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_store.py \
    2>&1 | tee "$out/gpu_tests.log" | tail -25
cachecraft bench gpu --dataset "$dataset" --out "$out/gpu.json" "$@" 2>&1 | tee "$out/gpu_bench.log" | tail -60
