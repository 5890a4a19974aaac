#!/usr/bin/env bash
# The prepared GPU check (a few minutes on one H200, hard limit ~8.7): kernel accuracy per backend,
# virtual-rank mesh attention for n = 4 and 16, a block-time sweep alone and under concurrent
# copies, block-work efficiency, the executor on NCCL-like streams, warm-call hygiene, the host
# cost per kernel call, and calls of changing shapes as documents make them (kernel caches, cuDNN
# graph builds, memory). `--device cpu --quick` runs every section on CPU (CI does). Writes
# gpu_results.md and gpu_results.json into the directory
# given as the first argument, else $OUT, else ./gpu_check_out. Needs CUDA and torch; Transformer
# Engine and flash-attn are used when installed and reported as "not installed" otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-python3}"
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; nvidia-smi; } \
    > "$out/nvidia_smi.txt" 2>&1 || true
head -1 "$out/nvidia_smi.txt"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore "$py" scripts/gpu_check.py --out-dir "$out" "${@:2}" 2>&1 \
    | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
