#!/usr/bin/env bash
# The prepared GPU check (< 8 minutes on one H200): kernel accuracy per backend, virtual-rank mesh
# attention for n = 4 and 16, and block-work efficiency; writes docs/gpu_results.md.
# Needs a CUDA machine with torch (and optionally Transformer Engine / flash-attn) installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec "$py" scripts/gpu_check.py --out "${OUT_MD:-docs/gpu_results.md}" "$@"
