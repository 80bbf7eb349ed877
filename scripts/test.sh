#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv, check lint and formatting (ruff), then run every test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
"$(dirname "$MOESLAB_PYTHON")/ruff" check .
"$(dirname "$MOESLAB_PYTHON")/ruff" format --check .
exec "$MOESLAB_PYTHON" -m pytest "$@"
