#!/usr/bin/env bash
# A user's install, checked: copy the files git tracks (no build/ leftovers); an editable install of the copy
# (pip install -e, as older instructions say; setup.py defers to pyproject.toml) must import that copy; then
# install it non-editable and offline (--no-index: anything it needed beyond torch, megatron-core's numpy and
# PyYAML would fail here) into the compat env, replacing the editable one, and run the simulate CLI and a
# 4-rank demo of mesh_attention from a directory outside the checkout, so only the installed package (and
# its shipped presets) is used.
#   bash scripts/check_install.sh            # uses .venv311 (scripts/env.sh compat); VENV311=... to override
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV311:-$root/.venv311}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/elsewhere"
git -C "$root" ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$root/$f" ] && printf '%s\0' "$f"; done \
  | tar -C "$root" --null -T - -cf - | tar -xf - -C "$work/src"
log="$work/pip.log"
offline() { env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null "$@"; }
# first the older instructions' editable install (setup.py defers to pyproject.toml): it must import the
# copied checkout itself; the non-editable install below then replaces it
if ! offline "$venv/bin/python" -m pip install --no-deps --no-build-isolation -e "$work/src" >"$log" 2>&1; then
  cat "$log" >&2
  echo "error: editable install failed" >&2
  exit 1
fi
(cd "$work/elsewhere" && "$venv/bin/python" -c 'import sys, megatron_mesh_cp as m; sys.exit(m.__file__ != sys.argv[1])' \
  "$work/src/megatron_mesh_cp/__init__.py") || { echo "error: the editable install does not import the checkout" >&2; exit 1; }
echo "editable install imports the checkout ($(basename "$venv"))"
# no index, no find-links, no pip.conf: an offline machine; the build backend is the env's own setuptools
if ! offline "$venv/bin/python" -m pip install --no-index --no-build-isolation "$work/src" >"$log" 2>&1; then
  cat "$log" >&2
  echo "error: offline non-editable install failed" >&2
  exit 1
fi
installed="$(grep '^Successfully installed' "$log" || true)"
if ! [[ "$installed" =~ ^Successfully\ installed\ megatron-mesh-cp-[0-9.]+$ ]]; then
  echo "error: pip installed more than the package: '$installed'" >&2
  exit 1
fi
echo "$installed (offline, non-editable, into $(basename "$venv"))"
cd "$work/elsewhere"
export OMP_NUM_THREADS=1 PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
"$venv/bin/python" - "$root" <<'PY'
import sys, megatron_mesh_cp
where = megatron_mesh_cp.__file__
# the venv may live inside the checkout (CI's .venv311): what must not be imported is the source tree
assert "site-packages" in where and not where.startswith(sys.argv[1] + "/megatron_mesh_cp/"), \
    f"imported from {where}, not the installed copy"
print(f"import megatron_mesh_cp: {where}")
PY
"$venv/bin/mesh-cp-simulate" --cp 16 --seq 128K --heads 32 --kv-heads 8 --algos ring,mesh
"$venv/bin/mesh-cp-demo" --ranks 4 --seq 256 --heads 4 --kv-heads 2 --head-dim 16 | tee "$work/demo.log"
# the entry point configures logging: the kernel choice is logged, once (rank 0)
[ "$(grep -c 'mesh attention kernel:' "$work/demo.log")" = 1 ] || { echo "error: kernel choice not logged once" >&2; exit 1; }
echo "installed package OK: simulate CLI and 4-rank demo ran outside the checkout"
