#!/usr/bin/env bash
# Submit a job script so that it resumes and chains: creates runs/<config>/logs before sbatch (SLURM cannot
# create it and fails the job with no log), names the job after its config (the scripts'
# --dependency=singleton then chains submissions of one config, not of different ones) and submits it
# --chain N times; each job resumes from runs/<config>/checkpoints.
#   bash scripts/slurm/submit.sh pretrain_256gpu.sbatch [--chain 3] [other sbatch options]
#   CONFIG=llama3_8b_1m_256gpu_ring bash scripts/slurm/submit.sh pretrain_256gpu.sbatch
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 JOB.sbatch [--chain N] [sbatch options]" >&2; exit 2; }
script="$1"; shift
[ -f "$script" ] || script="$root/scripts/slurm/$script"
[ -f "$script" ] || { echo "error: no job script $script" >&2; exit 2; }
chain=1
opts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --chain) chain="$2"; shift 2 ;;
    --chain=*) chain="${1#*=}"; shift ;;
    *) opts+=("$1"); shift ;;
  esac
done
[[ "$chain" =~ ^[1-9][0-9]*$ ]] || { echo "error: --chain takes a positive count, not '$chain'" >&2; exit 2; }
config="${CONFIG:-$(sed -n 's/^: "${CONFIG:=\(.*\)}"$/\1/p' "$script" | head -n1)}"
if [ ! -f "$root/configs/$config.yaml" ]; then
  echo "error: no config '$config' in configs/ (set CONFIG=); choose one of: $(cd "$root/configs" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
  exit 2
fi
logs="${RUNS_DIR:-$root/runs}/$config/logs"
mkdir -p "$logs"
for _ in $(seq "$chain"); do
  CONFIG="$config" "${SBATCH:-sbatch}" --chdir="$root" --job-name="mesh-cp-$config" --output="$logs/slurm-%j.out" \
    ${opts[@]+"${opts[@]}"} "$script"
done
