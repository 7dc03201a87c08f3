#!/usr/bin/env bash
# The prepared GPU check (see scripts/gpu_check.py): on a machine with one CUDA GPU and its own
# torch and transformers, no network. Installs minihf without dependencies or build isolation
# (nothing to download), falls back to the source tree on PYTHONPATH, then runs the check.
#   bash scripts/gpu_check.sh OUTDIR            # the report: OUTDIR/gpu_check.md
#   bash scripts/gpu_check.sh --dry-run OUTDIR  # CPU, tiny model, seconds
#   bash scripts/gpu_check.sh OUTDIR --sections bench tests   # some sections (gpu_check.py --help)
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3 || command -v python)}
dry=()
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); shift; fi
out=${1:?usage: scripts/gpu_check.sh [--dry-run] OUTDIR [gpu_check.py options]}
shift
if [ ${#dry[@]} -eq 0 ]; then
  "$python" -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 \
    || { echo "[gpu_check] pip install -e . failed; using src/ on PYTHONPATH"; export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; }
fi
exec "$python" scripts/gpu_check.py "${dry[@]}" "$out" "$@"
