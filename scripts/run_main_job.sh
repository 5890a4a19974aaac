#!/usr/bin/env bash
# The main job: a tiny GPT trained on 4 CPU ranks (gloo) through Megatron's real training loop with
# --context-parallel-algo mesh --mesh-shape 2x2, on the Python standard library's own sources.
# Extra arguments go to the launcher, e.g. --plot-loss loss.png (adds a CP=1 run and plots both);
# relative paths in them are the caller's (the job runs in the directory it was started from).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh" main
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The arguments checked in one process first (the launcher's --dry-run, about 5 s): a refusal then ends here
# with its one message and exit code 2, not printed by each of 4 ranks under torchrun's ChildFailedError (exit 1).
WORLD_SIZE=4 "$root/.venv/bin/python" "$root/scripts/pretrain_gpt_mesh.py" --config "$root/configs/gpt_tiny_cpu.yaml" \
  "$@" --dry-run > /dev/null
exec "$root/.venv/bin/torchrun" --nproc_per_node 4 --master_port "${MASTER_PORT:-29517}" \
  "$root/scripts/pretrain_gpt_mesh.py" --config "$root/configs/gpt_tiny_cpu.yaml" "$@"
