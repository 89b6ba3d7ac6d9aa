#!/usr/bin/env bash
# Unpacks a GPU-run bundle (scripts/gpu_bundle.sh) for one interpreter with no network: its wheels installed with
# `pip install --no-index` into WORK/site, the Mooncake engine (with its .dist-info) beside them, the Debian
# packages unpacked into WORK/debs, and of their libraries (and the bundle's lib/) only those the engine cannot find
# on this machine linked into WORK/libs (ldd lists a library's own needs once it is found, so a few passes reach
# them). Writes WORK/env.sh (PYTHONPATH, LD_LIBRARY_PATH) for the caller to source, and says what it linked and what
# is still missing. Used by scripts/gpu_run.sh and tests/test_gpu_bundle.py.
# Usage: scripts/gpu_unpack.sh BUNDLE WORK PYTHON ROOT
set -uo pipefail
BUNDLE=$1 WORK=$2 PY=$3 ROOT=$4
SITE=$WORK/site
LIBS=$WORK/libs
mkdir -p "$SITE" "$LIBS" "$WORK/debs"
PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
  "$BUNDLE"/wheels/*.whl || echo "gpu_unpack: pip could not install the bundle's wheels (see above)"
tar xzf "$BUNDLE/mooncake.tgz" -C "$SITE"
for deb in "$BUNDLE"/debs/*.deb; do dpkg -x "$deb" "$WORK/debs"; done
for pass in 1 2 3 4 5; do
  missing=$(LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$SITE/mooncake/engine.so" 2>/dev/null \
            | awk '/not found/ {print $1}')
  [ -z "$missing" ] && break
  for lib in $missing; do
    found=$(find "$WORK/debs" "$BUNDLE/lib" -name "$lib" \( -type f -o -type l \) 2>/dev/null | head -1)
    [ -n "$found" ] && ln -sf "$(readlink -f "$found")" "$LIBS/$lib"
  done
done
echo "gpu_unpack: linked in $(ls "$LIBS" | tr '\n' ' ')"
still=$(LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$SITE/mooncake/engine.so" 2>/dev/null \
        | awk '/not found/ {print $1}' | tr '\n' ' ')
[ -n "$still" ] && echo "gpu_unpack: the Mooncake engine still lacks: $still(device-direct rows will fail and say so)"
cat > "$WORK/env.sh" <<END
export PYTHONPATH="$ROOT:$SITE"
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
END
exit 0
