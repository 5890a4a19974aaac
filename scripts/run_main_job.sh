#!/usr/bin/env bash
# The main job: a tiny GPT trained on 4 CPU ranks (gloo) through Megatron's real training loop with
# --context-parallel-algo mesh --mesh-shape 2x2, on the Python standard library's own sources.
# Extra arguments go to the launcher, e.g. --plot-loss loss.png (adds a CP=1 run and plots both);
# relative paths in them are the caller's (the job runs in the directory it was started from).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh" main
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$root/.venv/bin/torchrun" --nproc_per_node 4 --master_port "${MASTER_PORT:-29517}" \
  "$root/scripts/pretrain_gpt_mesh.py" --config "$root/configs/gpt_tiny_cpu.yaml" "$@"
