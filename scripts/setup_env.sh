#!/usr/bin/env bash
# Create .venv from nothing (or reuse it) and install moeslab with its test
# extra. `pip install -e .` also compiles the native reader: no compiler, no
# install. Sourced by demo.sh and test.sh so both set up the same way.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MOESLAB_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "moeslab needs Python >= 3.11; $python is $("$python" --version 2>&1)" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
# plot: matplotlib, the standard for the replay tool's --plot figure, so its test runs too.
"$venv/bin/python" -m pip install -q -e "$root[test,plot]"
export MOESLAB_PYTHON="$venv/bin/python"
