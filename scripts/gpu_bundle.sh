#!/usr/bin/env bash
# Builds, on a development machine (CUDA toolkit, no GPU needed), everything scripts/gpu_check.sh
# runs on a GPU machine that has a driver and a Python with torch but no packages and no
# compiler, and gathers it in gpu-bundle/ (git-ignored; carry it with the source tree):
#
#   gpu-bundle/bin/        the GPU tests (gtest binaries) and GPU benchmarks, stripped
#   gpu-bundle/python/     the tiermem package (extension built against this machine's torch,
#                          the CLI in tiermem/bin, the preload shim in tiermem/lib) and pytest
#   gpu-bundle/lib/        every shared library those need beyond glibc, the driver and torch
#                          (oneTBB, hwloc, libnuma, liburing, libcudart, libstdc++, ...)
#   gpu-bundle/MANIFEST    what was built, with which python / torch / CUDA / glibc
#
# It then checks the bundle: every ELF file's libraries resolve inside the bundle or to the
# allowed system set (glibc, libcuda, torch's own), and the whole fits the device tool's 64 MiB.
#
#   scripts/gpu_bundle.sh            (then: device run with carry ["gpu-bundle"]:
#                                     scripts/gpu_check.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export PATH="$TIERMEM_VENV/bin:$PATH"
JOBS="${TIERMEM_JOBS:-$(nproc)}"
BUILD=build-gpu
B=gpu-bundle
TESTS=(cuda_tier_test cuda_status_test kernels_cuda_test tier_conformance_test engine_ordering_test
       preload_gpu_test)
BENCHES=(tiermem_bench_adam_cuda tiermem_bench_copy_cuda)

echo "== configure + build ($BUILD, Release, CUDA sm_80/sm_90)"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTIERMEM_WITH_CUDA=ON -DTIERMEM_BUILD_TORCH=ON \
      -DTIERMEM_BUILD_LIBTORCH=OFF -DCMAKE_CUDA_ARCHITECTURES="80;90" \
      -DPython3_EXECUTABLE="$TIERMEM_PY" >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target "${TESTS[@]}" "${BENCHES[@]}" tiermem_cli tiermem_preload \
      tiermem_torch_ext

echo "== gather $B/"
rm -rf "$B"
mkdir -p "$B/bin" "$B/lib" "$B/python/tiermem/bin" "$B/python/tiermem/lib"
for t in "${TESTS[@]}" "${BENCHES[@]}"; do
  f="$(find "$BUILD" -name "$t" -type f -perm -u+x | head -1)"
  [ -n "$f" ] || { echo "gpu_bundle: $t was not built" >&2; exit 1; }
  cp "$f" "$B/bin/"
done
cp -r integrations/torch/python/tiermem/. "$B/python/tiermem/"
find "$B/python" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$B/python/tiermem"/_C*.so
cp "$(find "$BUILD/integrations/torch" -name '_C*.so' | head -1)" "$B/python/tiermem/"
cp "$BUILD/tools/tiermem" "$B/python/tiermem/bin/"
cp "$(find "$BUILD/integrations/preload" -name 'libtiermem_preload.so' | head -1)" "$B/python/tiermem/lib/"
# pytest and its pure-Python dependencies, in case the GPU machine has none.
SITE="$("$TIERMEM_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for pkg in pytest _pytest pluggy iniconfig packaging py.py; do
  [ -e "$SITE/$pkg" ] && cp -r "$SITE/$pkg" "$B/python/"
done
find "$B/python" -name __pycache__ -prune -exec rm -rf {} +
strip --strip-unneeded "$B"/bin/* "$B/python/tiermem/bin/tiermem" "$B"/python/tiermem/_C*.so \
      "$B/python/tiermem/lib/libtiermem_preload.so"

# Libraries: whatever ldd resolves outside the allowed system set is copied into lib/ — except
# what torch's own wheels provide (resolved under site-packages: torch, nvidia/*), which the
# GPU machine's torch brings.
ALLOWED='^(linux-vdso|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|ld-linux|libcuda\.so|libtorch|libc10|libshm|libgomp)'
SITE_PKGS="$(dirname "$("$TIERMEM_PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')")"
elfs=("$B"/bin/* "$B/python/tiermem/bin/tiermem" "$B"/python/tiermem/_C*.so
      "$B/python/tiermem/lib/libtiermem_preload.so")
copy_deps() {
  ldd "$1" 2>/dev/null | awk '/=>/ {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $ALLOWED ]] && continue
    [ "$path" = "not" ] && continue
    [[ "$(realpath "$path")" == "$(realpath "$SITE_PKGS")"/* ]] && continue
    [ -e "$B/lib/$name" ] || cp -L "$path" "$B/lib/$name"
  done
}
for f in "${elfs[@]}"; do copy_deps "$f"; done
for round in 1 2; do for f in "$B"/lib/*; do copy_deps "$f"; done; done
strip --strip-unneeded "$B"/lib/* 2>/dev/null || true

echo "== check the bundle resolves on its own"
bad=0
for f in "${elfs[@]}" "$B"/lib/*; do
  while read -r name path; do
    [[ "$name" =~ $ALLOWED ]] && continue
    [[ "$(realpath "$path" 2>/dev/null)" == "$(realpath "$SITE_PKGS")"/* ]] && continue
    case "$path" in
      "$PWD/$B/lib/"*|"$B/lib/"*) ;;
      *) echo "gpu_bundle: $f needs $name from $path (outside the bundle)" >&2; bad=1 ;;
    esac
  done < <(LD_LIBRARY_PATH="$PWD/$B/lib" ldd "$f" 2>/dev/null | awk '/=>/ {print $1, $3}')
done
[ "$bad" -eq 0 ] || exit 1
glibc_max="$(for f in "${elfs[@]}" "$B"/lib/*; do objdump -T "$f" 2>/dev/null; done |
             grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
size_kib="$(du -sk "$B" | cut -f1)"
{
  echo "built: $(date -u +%FT%TZ) on $(hostname)"
  echo "git: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "python: $("$TIERMEM_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  echo "torch: $("$TIERMEM_PY" -c 'import torch; print(torch.__version__)')"
  echo "cuda: $(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*' | cut -d' ' -f2)"
  echo "glibc_needed: ${glibc_max#GLIBC_}"
  echo "size_kib: $size_kib"
} > "$B/MANIFEST"
cat "$B/MANIFEST"
if [ "$size_kib" -gt $((64 * 1024)) ]; then
  echo "gpu_bundle: $size_kib KiB is over the device tool's 64 MiB carry limit" >&2
  exit 1
fi
echo "gpu_bundle: ready ($B/, ${size_kib} KiB)"
