#!/usr/bin/env bash
# The GPU run (issue 31): the GPU check and the GPU ladder in one call on a machine with one GPU, each part under
# its own time limit, about 6 minutes on one H100 (at most 9.5: every limit spent). Writes to $OUT (default
# runs/gpu-run), at most 6 files, as the device tool brings back:
#   gpu_run.txt      what ran where: GPU, Python, torch, the bundle's libraries, each part's time and exit status
#   gpu_check.md     the check's table (and gpu_check.json)
#   gpu_ladder.md    the ladder's tables (and gpu_ladder.json)
#   logs.tar.gz      every log and rank record of both parts
# Python: $PYTHON, else .venv/bin/python when its torch sees a GPU, else python3 (the GPU machines' own, with
# CUDA torch). bimetal runs from this checkout (PYTHONPATH). What that Python lacks comes from .gpu-bundle/
# (scripts/gpu_bundle.sh makes it where PyPI is reachable): the wheels go to a temporary folder, the Mooncake
# engine beside them, and of the bundled system libraries only those the engine cannot find go on the library path.
# Usage: scripts/gpu_run.sh [both|check|ladder]
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PART=${1:-both}
case "$PART" in both|check|ladder) ;; *) echo "gpu_run: unknown part '$PART'; use both, check or ladder" >&2; exit 2;; esac
OUT=${OUT:-$ROOT/runs/gpu-run}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/bimetal-gpu-run.XXXXXX)
T0=$(date +%s)
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
  SITE=$WORK/site
  LIBS=$WORK/libs
  mkdir -p "$SITE" "$LIBS" "$WORK/debs"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu-bundle/wheels/*.whl \
    >>"$REPORT" 2>&1 || say "pip could not install the bundle's wheels (see above)"
  tar xzf .gpu-bundle/mooncake.tgz -C "$SITE"
  export PYTHONPATH="$ROOT:$SITE"
  for deb in .gpu-bundle/debs/*.deb; do dpkg -x "$deb" "$WORK/debs"; done
  # Only what the engine cannot find on this machine is linked in (ldd lists a library's own needs once it is
  # found, so a few passes reach them).
  for pass in 1 2 3 4 5; do
    missing=$(LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$SITE/mooncake/engine.so" 2>/dev/null \
              | awk '/not found/ {print $1}')
    [ -z "$missing" ] && break
    for lib in $missing; do
      found=$(find "$WORK/debs" .gpu-bundle/lib -name "$lib" \( -type f -o -type l \) 2>/dev/null | head -1)
      [ -n "$found" ] && ln -sf "$(readlink -f "$found")" "$LIBS/$lib"
    done
  done
  export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "bundle: linked in $(ls "$LIBS" | tr '\n' ' ')"
  still=$(ldd "$SITE/mooncake/engine.so" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
  [ -n "$still" ] && say "the Mooncake engine still lacks: $still(device-direct rows will fail and say so)"
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
EOF
} | tee -a "$REPORT"

# --- the parts -------------------------------------------------------------------------------------------------
rc=0
if [ "$PART" != ladder ]; then
  say "GPU check (limit 240 s; 90 s per step)"
  timeout -k 10 240 "$PY" scripts/gpu_check.py --out "$WORK/check" --timeout 90 >"$WORK/check.txt" 2>&1
  code=$?
  say "GPU check exit status $code"
  [ $code -eq 0 ] || rc=1
  cp "$WORK/check/gpu_check.json" "$WORK/check/gpu_check.md" "$OUT/" 2>/dev/null || say "the check wrote no table"
  tail -n 40 "$WORK/check.txt"
fi
if [ "$PART" != check ]; then
  say "GPU ladder (limit 300 s)"
  timeout -k 10 300 "$PY" -m bimetal.cli bench gpu-ladder --out "$WORK/ladder" --profile --timeout 280 \
    >"$WORK/ladder.txt" 2>&1
  code=$?
  say "GPU ladder exit status $code"
  [ $code -eq 0 ] || rc=1
  cp "$WORK/ladder/gpu_ladder.json" "$WORK/ladder/gpu_ladder.md" "$OUT/" 2>/dev/null || say "the ladder wrote no table"
  tail -n 60 "$WORK/ladder.txt"
fi
tar czf "$OUT/logs.tar.gz" -C "$WORK" --exclude=checkpoints --exclude=site --exclude=debs --exclude=libs . 2>/dev/null
say "done, exit status $rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
