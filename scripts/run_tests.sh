#!/usr/bin/env bash
# The project's test command: make sure the environment exists, then run the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q tests "$@"
