#!/usr/bin/env bash
# The full test suite: set-up, C++ build + ctest (gpu-labelled tests skip without a GPU),
# sanitizer builds (ASan+UBSan over everything; TSan over the concurrent parts, built with
# clang and its -Wthread-safety analysis as an error), then the Python package (pip install .)
# and pytest. Exits non-zero on any failure.
#
#   scripts/test.sh            everything
#   TIERMEM_TEST_FAST=1 scripts/test.sh   skip the sanitizer builds
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
JOBS="${TIERMEM_JOBS:-$(nproc)}"
export PATH="$TIERMEM_VENV/bin:$PATH"   # cmake finds the venv's torch

echo "== C++ build (build/)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$TIERMEM_PY" >/dev/null
cmake --build build -j "$JOBS"
echo "== ctest"
ctest --test-dir build --output-on-failure -j "$JOBS"

if [ -d build/integrations/torch ] && grep -q "TIERMEM_BUILD_LIBTORCH:BOOL=ON" build/CMakeCache.txt; then
  echo "== LibTorch example out of tree, against the installed package (find_package(tiermem))"
  rm -rf build/install build/example
  cmake --install build --prefix build/install >/dev/null
  TORCH_PREFIX="$("$TIERMEM_PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S integrations/torch/examples -B build/example \
        -DCMAKE_PREFIX_PATH="$PWD/build/install;$TORCH_PREFIX" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/example -j "$JOBS"
  build/example/tiermem_train_gpt --steps 2 --n-layer 2 --n-embd 64 --budget-fraction 0.5 \
        --timeline build/example/example.tmt
fi

if [ "${TIERMEM_TEST_FAST:-0}" != 1 ]; then
  echo "== ASan+UBSan build (build-asan/)"
  cmake -S . -B build-asan -DTIERMEM_SANITIZE=address -DTIERMEM_WITH_CUDA=OFF \
        -DTIERMEM_BUILD_TORCH=OFF -DTIERMEM_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build-asan -j "$JOBS"
  # HWLOC_COMPONENTS=-pci: hwloc's pci plugin (libpciaccess) leaks its scan state from a
  # dlclose'd module, which LeakSanitizer reports and cannot attribute; ours leak nothing.
  HWLOC_COMPONENTS=-pci ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j "$JOBS" -LE "gpu|slow"
  echo "== TSan build (build-tsan/, clang with -Werror=thread-safety): concurrent components"
  # A build-tsan/ configured with gcc before the switch to clang: CMake cannot change the
  # compiler of an existing build tree, so start it afresh.
  if [ -f build-tsan/CMakeCache.txt ] &&
     ! grep -q '^CMAKE_CXX_COMPILER:.*clang' build-tsan/CMakeCache.txt; then
    rm -rf build-tsan
  fi
  cmake -S . -B build-tsan -DTIERMEM_SANITIZE=thread -DTIERMEM_WITH_CUDA=OFF \
        -DTIERMEM_BUILD_TORCH=OFF -DTIERMEM_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
        -DTIERMEM_THREAD_SAFETY=ON >/dev/null
  cmake --build build-tsan -j "$JOBS"
  TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan --output-on-failure -j "$JOBS" -L concurrent
  echo "== libFuzzer: timeline reader (bounded)"
  FUZZ_SECONDS="${TIERMEM_FUZZ_SECONDS:-30}" scripts/fuzz_timeline.sh
fi

if [ -f pyproject.toml ]; then
  echo "== Python package (pip install .) + pytest"
  "$TIERMEM_PY" -m pip install -q --no-build-isolation . 
  # Models are built from configs: nothing may be downloaded (HF offline).
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$TIERMEM_PY" -m pytest -q tests/python
fi
