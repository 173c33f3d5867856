#!/usr/bin/env bash
# The GPU smoke (scripts/gpu_smoke.py): the bundled model deployed, chatted with, served, rolled,
# killed and replaced, placed, and both benchmarks, printed as one table.
#
#   scripts/gpu_smoke.sh [--device cuda|cpu] [--skip-benchmarks]      (default --device cuda)
#
# The interpreter: $PY if set, else .venv/bin/python where `make setup` made it, else python3
# (a GPU host's own environment, with vLLM's CUDA build installed into it). Whatever the run
# leaves, the exit trap stops: its private Ray head and everything on it (`atomr down`). A GPU
# host may need environment variables of its own, set by the caller (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
# Short: Ray puts unix sockets under its temp dir, and their paths must stay < 108 bytes.
workdir="$(mktemp -d /tmp/atomr-smoke-XXXXXX)"
cleanup() {
  "$PY" scripts/gpu_smoke.py --cleanup "$workdir" || true
  rmdir "$workdir" 2>/dev/null || true  # gone after a run that passed; kept, with its logs, after a failure
}
trap cleanup EXIT
"$PY" scripts/gpu_smoke.py --workdir "$workdir" "$@"
