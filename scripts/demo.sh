#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv, build the demo model once
# (its experts are 4x the memory budget), launch moeslab under that budget,
# stream one generation job with its stats, and shut down cleanly.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
exec "$MOESLAB_PYTHON" "$root/scripts/demo.py" "$@"
