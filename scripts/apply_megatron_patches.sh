#!/usr/bin/env bash
# Apply megatron-mesh-cp's patches to a Megatron-LM checkout (tag core_v0.19.x; they also apply to main as of
# 0.20.0, d98e8a6), so that stock
# pretrain_gpt.py accepts --context-parallel-algo mesh --mesh-shape AxB|auto.
#   scripts/apply_megatron_patches.sh /path/to/Megatron-LM
# Every patch is checked before anything is written; a patch already applied is skipped; a patch
# that does not apply stops the script with the file it failed on and the tag it targets.
set -euo pipefail
dir="${1:-}"
if [ -z "$dir" ] || [ ! -d "$dir" ]; then
  echo "usage: $0 MEGATRON_LM_DIR   (a Megatron-LM checkout at tag core_v0.19.x, or main at 0.20)" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
patches=("$here"/patches/core_v0.19.x/*.patch)
for f in megatron/training/arguments.py megatron/training/models/gpt.py; do
  if [ ! -f "$dir/$f" ]; then
    echo "error: $dir/$f not found; $dir is not a Megatron-LM checkout of core_v0.19.x (megatron/training/models/gpt.py first appears in core_v0.19.0)" >&2
    exit 1
  fi
done
# check everything first, so a mismatch leaves the checkout untouched
todo=()
for p in "${patches[@]}"; do
  name="$(basename "$p")"
  if patch -d "$dir" -p1 --fuzz=0 --dry-run --reverse --force --silent < "$p" >/dev/null 2>&1; then
    echo "already applied: $name"
  elif out="$(patch -d "$dir" -p1 --fuzz=0 --dry-run --forward --silent < "$p" 2>&1)"; then
    todo+=("$p")
  else
    echo "error: $name does not apply to $dir; these patches target Megatron-LM core_v0.19.x." >&2
    echo "$out" | sed 's/^/  /' >&2
    ver="$(grep -Eo "MAJOR = [0-9]+|MINOR = [0-9]+|PATCH = [0-9]+" "$dir/megatron/core/package_info.py" 2>/dev/null | tr '\n' ' ' || true)"
    [ -n "$ver" ] && echo "  (found megatron-core $ver)" >&2
    exit 1
  fi
done
for p in "${todo[@]}"; do
  patch -d "$dir" -p1 --fuzz=0 --no-backup-if-mismatch --forward --silent < "$p"
  echo "applied: $(basename "$p")"
done
echo "done: run pretrain_gpt.py with --context-parallel-algo mesh --mesh-shape AxB|auto (megatron_mesh_cp must be importable)"
