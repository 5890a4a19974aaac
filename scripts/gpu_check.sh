#!/usr/bin/env bash
# The prepared GPU check (a few minutes on one H200, hard limit ~8.7): kernel accuracy per backend,
# virtual-rank mesh attention for n = 4 and 16, a block-time sweep alone and under concurrent
# copies, block-work efficiency, the executor on NCCL-like streams, warm-call hygiene, the host
# cost per kernel call, and calls of changing shapes as documents make them (kernel caches, cuDNN
# graph builds, memory), and what one more kernel call costs (one varlen call vs one per document). `--device cpu --quick` runs every section on CPU (CI does). Writes
# gpu_results.md and gpu_results.json into the directory
# given as the first argument, else $OUT, else ./gpu_check_out. Needs CUDA and torch; Transformer
# Engine and flash-attn are used when installed and reported as "not installed" otherwise. Runs $PYTHON,
# else .venv/bin/python where it exists, else python3.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# the interpreter: $PYTHON, else the repository's .venv (scripts/env.sh makes it), else python3
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; nvidia-smi; } \
    > "$out/nvidia_smi.txt" 2>&1 || true
head -1 "$out/nvidia_smi.txt"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore "$py" scripts/gpu_check.py --out-dir "$out" "${@:2}" 2>&1 \
    | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
