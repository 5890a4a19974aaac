#!/usr/bin/env bash
# The project's test command: make sure both environments exist, then run the suite in each.
#   main   (.venv,    Python 3.12, megatron-core 0.19.2): every test
#   compat (.venv311, Python 3.11, megatron-core 0.16.1): the core-attention/spec tests on GPTModel,
#   then compileall over megatron_mesh_cp, scripts and tests (quiet; fails on a syntax error),
#   then the package installed there non-editable and run from outside the checkout (check_install.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/env.sh main
bash scripts/env.sh compat
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
"$root/.venv/bin/python" -m pytest -q tests "$@"
echo "--- megatron-core 0.16.1 (Python 3.11) ---"
"$root/.venv311/bin/python" -m pytest -q tests/test_megatron_core_direct.py
echo "--- every module, script and test compiles on Python 3.11 (the oldest requires-python claims) ---"
"$root/.venv311/bin/python" -m compileall -q megatron_mesh_cp scripts tests
echo "--- installed package (non-editable, offline, Python 3.11), run from outside the checkout ---"
bash scripts/check_install.sh
