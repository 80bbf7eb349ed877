#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv, then measure the residency
# policy on a generated routing trace (~40% consecutive-token overlap, the
# figure reported for real MoE models) next to LRU and Belady's optimum.
# Until the end-to-end system lands, this replay is what moeslab runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
work="$root/.cache/demo"
mkdir -p "$work"
"$MOESLAB_PYTHON" "$root/scripts/make_trace.py" "$work/trace.txt" \
  --layers 16 --experts 128 --top-k 8 --tokens 1000 --overlap 0.4 --zipf 1.0 --seed 0 \
  --usage-out "$work/usage" --usage-tokens 1000
exec "$MOESLAB_PYTHON" "$root/scripts/replay.py" "$work/trace.txt" \
  --slots-per-layer 16 --working-slots 8 --pinned 64 --usage-file "$work/usage" "$@"
