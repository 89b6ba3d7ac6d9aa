#!/usr/bin/env bash
# The GPU run (issue 31): the GPU check and the GPU ladder in one call on a machine with one GPU, about 6 minutes on
# one H100. One budget for the whole call (BUDGET, default 570 s: a 590 s call less the tool's margin): the check
# gets at most 240 s of it, each of its steps at most 90 s inside that, and writes each row as it finishes; the
# ladder gets what is left (at most 300 s) less 15 s for the logs. A step that runs out of time is ended with
# every process it started (bimetal.bench.steps), so nothing holds the GPU into the next step or the ladder.
# Writes to $OUT (default runs/gpu-run), at most 6 files, as the device tool brings back:
#   gpu_run.txt      what ran where: GPU, Python, torch, the bundle's libraries, each part's time and exit status
#   gpu_check.md     the check's table (and gpu_check.json)
#   gpu_ladder.md    the ladder's tables (and gpu_ladder.json)
#   logs.tar.gz      every log and rank record of both parts
# Python: $PYTHON, else .venv/bin/python when its torch sees a GPU, else python3 (the GPU machines' own, with
# CUDA torch). bimetal runs from this checkout (PYTHONPATH). What that Python lacks comes from .gpu-bundle/
# (scripts/gpu_bundle.sh makes it where PyPI is reachable; scripts/gpu_unpack.sh unpacks it): the wheels go to a
# temporary folder, the Mooncake engine and its metadata beside them, and of the bundled system libraries only those
# the engine cannot find go on the library path.
# Usage: scripts/gpu_run.sh [both|check|ladder]   (GPU_CHECK_ARGS, GPU_LADDER_ARGS: more options for either part, as
# tests/test_gpu_check.py rehearses the run on the CPU: "--cpu --only transport,trainer --test-hang transport")
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PART=${1:-both}
case "$PART" in both|check|ladder) ;; *) echo "gpu_run: unknown part '$PART'; use both, check or ladder" >&2; exit 2;; esac
OUT=${OUT:-$ROOT/runs/gpu-run}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/bimetal-gpu-run.XXXXXX)
T0=$(date +%s)
BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
REPORT="$OUT/gpu_run.txt"
: > "$REPORT"
say() { echo "[gpu_run $(( $(date +%s) - T0 )) s] $*" | tee -a "$REPORT"; }
export PYTHONUNBUFFERED=1

# --- the interpreter and what it lacks -------------------------------------------------------------------------
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
      2>/dev/null; then PY=.venv/bin/python; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu-bundle ]; then
  scripts/gpu_unpack.sh .gpu-bundle "$WORK" "$PY" "$ROOT" 2>&1 | tee -a "$REPORT"
  # shellcheck disable=SC1091
  source "$WORK/env.sh"
else
  say "no .gpu-bundle: using what $PY has (scripts/gpu_bundle.sh makes the bundle)"
fi
{
  nvidia-smi -L 2>&1 || true
  "$PY" - <<'EOF' 2>&1
import sys, torch
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
      f"cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
import bimetal
print(f"bimetal from {bimetal.__file__}")
try:
    from mooncake import engine
    print(f"mooncake engine: {engine.__file__}")
except Exception as exc:
    print(f"mooncake engine not importable: {type(exc).__name__}: {exc}")
from bimetal.topology import versions
print(f"engine distribution seen by the build check: {versions.local_versions()['engine'] or 'none'}")
EOF
} | tee -a "$REPORT"

# --- the parts -------------------------------------------------------------------------------------------------
rc=0
if [ "$PART" != ladder ]; then
  reserve=15  # the logs; with the ladder to come, its 240 s too
  [ "$PART" = both ] && reserve=255
  check_s=$(( $(left) - reserve ))
  [ "$check_s" -gt 240 ] && check_s=240
  say "GPU check (budget $check_s s; 90 s per step; rows in $OUT/gpu_check.md as they finish)"
  # the table goes straight to $OUT, row by row, so a call cut short still brings back what was measured; the check
  # ends itself within its budget, the outer limit is the backstop (SIGTERM: it ends its step and keeps its rows)
  timeout -k 10 $(( check_s + 20 )) "$PY" scripts/gpu_check.py --out "$WORK/check" --md "$OUT/gpu_check.md" \
    --timeout 90 --budget "$check_s" ${GPU_CHECK_ARGS:-} >"$WORK/check.txt" 2>&1
  code=$?
  say "GPU check exit status $code"
  [ $code -eq 0 ] || rc=1
  cp "$WORK/check/gpu_check.json" "$OUT/" 2>/dev/null || say "the check wrote no table"
  tail -n 40 "$WORK/check.txt"
  held=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null | tr '\n' ' ')
  say "processes on the GPU after the check: ${held:-none}"
fi
if [ "$PART" != check ]; then
  ladder_s=$(( $(left) - 15 ))
  [ "$ladder_s" -gt 300 ] && ladder_s=300
  say "GPU ladder (limit $ladder_s s)"
  timeout -k 10 "$ladder_s" "$PY" -m bimetal.cli bench gpu-ladder --out "$WORK/ladder" --profile \
    --timeout $(( ladder_s - 20 )) ${GPU_LADDER_ARGS:-} >"$WORK/ladder.txt" 2>&1
  code=$?
  say "GPU ladder exit status $code"
  [ $code -eq 0 ] || rc=1
  cp "$WORK/ladder/gpu_ladder.json" "$WORK/ladder/gpu_ladder.md" "$OUT/" 2>/dev/null || say "the ladder wrote no table"
  tail -n 60 "$WORK/ladder.txt"
fi
tar czf "$OUT/logs.tar.gz" -C "$WORK" --exclude=checkpoints --exclude=site --exclude=debs --exclude=libs . 2>/dev/null
rm -rf "$WORK"  # everything worth keeping is in logs.tar.gz
say "done, exit status $rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
