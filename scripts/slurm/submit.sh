#!/usr/bin/env bash
# Submit a job script so that it resumes and chains: creates $RUNS_DIR/<config>/logs before sbatch (SLURM cannot
# create it and fails the job with no log), names the job after its config (the scripts'
# --dependency=singleton then chains submissions of one config, not of different ones) and submits it
# --chain N times; each job resumes from $RUNS_DIR/<config>/checkpoints (default $SCRATCH/mesh-cp-runs, else
# $HOME/mesh-cp-runs); a job of the chain starts only when the previous one exited 0 (afterok), so a failure stops it.
# The job finds the checkout through MESH_CP_ROOT and --chdir (sbatch runs a copy of the script).
#   bash scripts/slurm/submit.sh pretrain_256gpu.sbatch [--chain 3] [other sbatch options]
#   CONFIG=llama31_8b_1m_ring bash scripts/slurm/submit.sh pretrain_256gpu.sbatch
#   SBATCH=echo bash scripts/slurm/submit.sh pretrain_256gpu.sbatch --chain 2   # print the sbatch lines, submit nothing
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
if grep -q 'scripts/slurm/job.py --config' "$script"; then  # a training job: it runs configs/<config>.yaml
  if [ ! -f "$root/configs/$config.yaml" ]; then
    echo "error: no config '$config' in configs/ (set CONFIG=); choose one of: $(cd "$root/configs" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
    exit 2
  fi
else  # e.g. bench_ab.sbatch: named after the script
  config="$(basename "$script" .sbatch)"
fi
runs="${RUNS_DIR:-${SCRATCH:-$HOME}/mesh-cp-runs}"  # as job.py: never inside the checkout
logs="$runs/$config/logs"
mkdir -p "$logs"
# Each chained job runs only after the previous one exited 0: a planned stop (the time-limit margin, SIGTERM) exits 0
# after saving; any failure exits non-zero and afterok cancels the rest of the chain (--kill-on-invalid-dep=yes)
# instead of starting a job that would fail the same way. The first keeps the script's --dependency=singleton.
previous=""
for i in $(seq "$chain"); do
  dep=()
  [ -z "$previous" ] || dep=("--dependency=afterok:$previous" "--kill-on-invalid-dep=yes")
  out="$(CONFIG="$config" RUNS_DIR="$runs" MESH_CP_ROOT="$root" "${SBATCH:-sbatch}" --parsable ${dep[@]+"${dep[@]}"} \
    --chdir="$root" --job-name="mesh-cp-$config" --output="$logs/slurm-%j.out" ${opts[@]+"${opts[@]}"} "$script")"
  echo "$out"
  previous="${out%%;*}"  # --parsable: "jobid" or "jobid;cluster"
  if ! [[ "$previous" =~ ^[0-9]+$ ]]; then
    [ -n "${SBATCH:-}" ] || { echo "error: sbatch printed '$out', not a job id; stopping the chain after job $i" >&2; exit 1; }
    previous="JOB$i"  # a stand-in sbatch (SBATCH=echo): show the chain's dependencies
  fi
done
