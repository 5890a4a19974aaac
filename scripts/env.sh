#!/usr/bin/env bash
# Create (or refresh) a project environment; idempotent and quiet when it is current.
#   scripts/env.sh          .venv     Python 3.12, torch 2.13.0, megatron-core 0.19.2, Megatron-Bridge 0.6.2 (the main one)
#   scripts/env.sh compat   .venv311  Python 3.11, CPU torch 2.13.0, megatron-core 0.16.1 (compat tests)
# The main env gets the package editable (tests run the checkout); scripts/check_install.sh installs it
# non-editable into the compat env, as a user's `pip install .` would.
# Finds the interpreter via $PYTHON, pyenv, or python3.X on PATH.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
flavour="${1:-main}"
case "$flavour" in
  main)   minor=12; venv="${VENV:-$root/.venv}";    req="$root/requirements/py312.txt"
          nodeps="$root/requirements/py312-bridge.txt" ;;
  compat) minor=11; venv="${VENV311:-$root/.venv311}"; req="$root/requirements/py311-mcore016.txt"; nodeps= ;;
  *) echo "usage: $0 [main|compat]" >&2; exit 2 ;;
esac
stamp="$venv/.requirements.sha"
want="$(cat "$req" ${nodeps:+"$nodeps"} "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"

find_python() {
  if [ "$flavour" = main ] && [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v; v="$(pyenv versions --bare 2>/dev/null | grep -E "^3\.$minor(\.[0-9]+)?\$" | sort -V | tail -n1 || true)"
    if [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/python3.$minor" ]; then
      echo "$(pyenv root)/versions/$v/bin/python3.$minor"; return
    fi
  fi
  for c in "python3.$minor" python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys; sys.exit(sys.version_info[:2] != (3, $minor))" 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  echo "error: Python 3.$minor not found; install it (e.g. 'pyenv install 3.$minor') or set PYTHON" >&2
  exit 1
}

if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)"
  echo "creating $venv with $("$py" --version)" >&2
  "$py" -m venv "$venv"
fi
echo "installing $(basename "$req") into $venv (first time: torch is a large download)" >&2
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q -r "$req" >&2
if [ -n "$nodeps" ]; then  # Megatron-Bridge and what its import needs; its own dependency list has CUDA-only builds
  "$venv/bin/python" -m pip install -q --no-deps -r "$nodeps" >&2
fi
if [ "$flavour" = main ]; then
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2
fi
echo "$want" > "$stamp"
