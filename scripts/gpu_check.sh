#!/usr/bin/env bash
# The GPU check (issue 20): cpu-forward's GPU path right and fast, in one table (and JSON), in < 8 minutes.
# Usage: scripts/gpu_check.sh [--cpu] [--out DIR] [--timeout S]   (--cpu: CPU tensors, staging forced; what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
