#!/usr/bin/env bash
# Create (or refresh) the project's Python 3.12 environment in .venv; idempotent and quiet when current.
# Finds Python 3.12 via $PYTHON, python3.12 on PATH, or pyenv's 3.12.x.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
req="$root/requirements/py312.txt"
stamp="$venv/.requirements.sha"
want="$(cat "$req" "$root/setup.py" | sha256sum | cut -d' ' -f1)"

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v; v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n1 || true)"
    if [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/python3.12" ]; then
      echo "$(pyenv root)/versions/$v/bin/python3.12"; return
    fi
  fi
  for c in python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  echo "error: Python 3.12 not found; install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
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
echo "installing requirements into $venv (first time: torch is a large download)" >&2
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q -r "$req" >&2
"$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2
echo "$want" > "$stamp"
