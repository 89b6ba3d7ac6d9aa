#!/usr/bin/env bash
# Prepares .gpu-bundle/ (git-ignored, about 20 MB): what scripts/gpu_run.sh needs on a GPU machine that has
# python3 with a CUDA torch but no network (the device machines of this workplace: Python 3.12, torch 2.11+cu130).
# Run it here, where PyPI and Debian's archive are reachable, then carry .gpu-bundle with the tree.
#   * wheels/  pydantic, pydantic-core, annotated-types, typing-inspection, tomli-w (requirements-lock.txt versions,
#              CPython 3.12 manylinux) and typing-extensions 4.16.0 (pydantic 2.14 needs >= 4.16; torch pulls it in
#              here, so the lock file does not pin it, and the GPU image's may be older);
#   * mooncake.tgz  the Mooncake CUDA wheel's transfer engine alone (the wheel is 98 MB, above the 64 MiB a call may
#              carry; device-direct needs only mooncake/engine.so, the two libraries beside it and four of the
#              wheel's bundled ones);
#   * lib/libcudart.so.12  the engine links CUDA 12's runtime (nvidia-cuda-runtime-cu12), which a cu13 torch lacks;
#   * debs/    Debian packages of the system libraries the engine links (libibverbs, libnuma, libmlx5, libcurl and
#              its own needs); gpu_run.sh unpacks them and puts on the library path only those the machine lacks.
# Usage: scripts/gpu_bundle.sh   (PYTHON=... to use another interpreter's pip; MOONCAKE=version)
set -euo pipefail
cd "$(dirname "$0")/.."
B=.gpu-bundle
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MOONCAKE=${MOONCAKE:-0.3.13.post1}
rm -rf "$B"
mkdir -p "$B/wheels" "$B/debs" "$B/lib" "$B/tmp"
plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
pins=()
for name in pydantic pydantic_core annotated-types typing-inspection tomli-w; do
  pin=$(grep -iE "^${name//[-_]/[-_]}==" requirements-lock.txt | head -1)
  [ -n "$pin" ] || { echo "gpu_bundle: $name is not pinned in requirements-lock.txt" >&2; exit 2; }
  pins+=("$pin")
done
"$PY" -m pip download -q "${plat[@]}" -d "$B/wheels" "${pins[@]}" typing-extensions==4.16.0
"$PY" -m pip download -q "${plat[@]}" -d "$B/tmp" "mooncake-transfer-engine==$MOONCAKE" "nvidia-cuda-runtime-cu12<13"
(
  cd "$B/tmp"
  unzip -q mooncake_transfer_engine-*.whl 'mooncake/__init__.py' 'mooncake/buffer_pool.py' 'mooncake/engine.so' \
    'mooncake/libasio.so' 'mooncake/libetcd_wrapper.so' 'mooncake_transfer_engine.libs/libglog-*' \
    'mooncake_transfer_engine.libs/libgflags-*' 'mooncake_transfer_engine.libs/libyaml-cpp-*' \
    'mooncake_transfer_engine.libs/libjsoncpp-*'
  tar czf ../mooncake.tgz mooncake mooncake_transfer_engine.libs
  unzip -q -j nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d ../lib
)
rm -rf "$B/tmp"
# libcurl4's own needs are listed too: on a machine without libcurl they are usually missing as well
(cd "$B/debs" && apt-get download -q libibverbs1 ibverbs-providers libnuma1 libcurl4 libnghttp2-14 librtmp1 \
  libssh2-1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 \
  libkeyutils1 2>&1 | grep -v "^Get:" || true)
ls "$B/debs"/*.deb >/dev/null
echo "gpu_bundle: $(du -sh "$B" | cut -f1) in $B (wheels: $(ls "$B/wheels" | wc -l), debs: $(ls "$B/debs" | wc -l))"
