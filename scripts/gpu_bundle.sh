#!/usr/bin/env bash
# Prepares .gpu-bundle/ (git-ignored, about 20 MB): what scripts/gpu_run.sh needs on a GPU machine that has
# python3 with a CUDA torch but no network (the device machines of this workplace: Python 3.12, torch 2.11+cu130).
# Run it here, where PyPI and Debian's archive are reachable, then carry .gpu-bundle with the tree.
#   * wheels/  pydantic, pydantic-core, annotated-types, typing-inspection, tomli-w (requirements-lock.txt versions,
#              CPython $PYVER manylinux) and typing-extensions 4.16.0 (pydantic 2.14 needs >= 4.16; torch pulls it in
#              here, so the lock file does not pin it, and the GPU image's may be older);
#   * mooncake.tgz  the Mooncake wheel's transfer engine alone, with the wheel's .dist-info (importlib.metadata and
#              the build check see the engine): the package's top-level Python files, mooncake/engine.so and the
#              wheel's libraries it needs, found by scripts/elf_needs.py (the CUDA wheel is 98 MB, above the 64 MiB a
#              call may carry);
#   * lib/libcudart.so.12  the CUDA engine links CUDA 12's runtime (nvidia-cuda-runtime-cu12), which a cu13 torch lacks;
#   * debs/    Debian packages of the system libraries the engine links (libibverbs1 and what it links: libnl-3-200,
#              libnl-route-3-200, the providers; libnuma1; libcurl4 and its own needs); gpu_run.sh unpacks them and
#              puts on the library path only those the machine lacks.
# tests/test_gpu_bundle.py builds one for this machine's Python and the CPU engine and checks it installs with no
# network and that nothing the engine links is missing.
# Usage: scripts/gpu_bundle.sh   (PYTHON=... to use another interpreter's pip; MOONCAKE=version; BUNDLE=folder;
#        PYVER=3.12; ENGINE=mooncake-transfer-engine (ENGINE=mooncake-transfer-engine-non-cuda: no libcudart))
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUNDLE:-.gpu-bundle}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MOONCAKE=${MOONCAKE:-0.3.13.post1}
PYVER=${PYVER:-3.12}
ENGINE=${ENGINE:-mooncake-transfer-engine}
rm -rf "$B"
mkdir -p "$B/wheels" "$B/debs" "$B/lib" "$B/tmp"
plat=(--no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
pins=()
for name in pydantic pydantic_core annotated-types typing-inspection tomli-w; do
  pin=$(grep -iE "^${name//[-_]/[-_]}==" requirements-lock.txt | head -1)
  [ -n "$pin" ] || { echo "gpu_bundle: $name is not pinned in requirements-lock.txt" >&2; exit 2; }
  pins+=("$pin")
done
"$PY" -m pip download -q "${plat[@]}" -d "$B/wheels" "${pins[@]}" typing-extensions==4.16.0
"$PY" -m pip download -q "${plat[@]}" -d "$B/tmp" "$ENGINE==$MOONCAKE"
"$PY" scripts/elf_needs.py engine "$B"/tmp/mooncake_transfer_engine*.whl "$B/tmp/engine" >/dev/null
tar czf "$B/mooncake.tgz" -C "$B/tmp/engine" .
if [ "$ENGINE" = mooncake-transfer-engine ]; then
  "$PY" -m pip download -q "${plat[@]}" -d "$B/tmp" "nvidia-cuda-runtime-cu12<13"
  (cd "$B/tmp" && unzip -q -j nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d ../lib)
fi
rm -rf "$B/tmp"
# an image whose package lists were cleaned knows no package until they are fetched again (as root, as make test does)
if ! apt-cache show libnl-3-200 >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then apt-get update -qq; fi
# libibverbs1 links libnl-3 and libnl-route-3; libcurl4's own needs are listed too: on a machine without libcurl
# they are usually missing as well
(cd "$B/debs" && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 ibverbs-providers libnuma1 libcurl4 \
  libnghttp2-14 librtmp1 libssh2-1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3 \
  libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 2>&1 | grep -v -e "^Get:" -e "unsandboxed" \
  || true)
ls "$B/debs"/*.deb >/dev/null
echo "gpu_bundle: $(du -sh "$B" | cut -f1) in $B (wheels: $(ls "$B/wheels" | wc -l), debs: $(ls "$B/debs" | wc -l))"
