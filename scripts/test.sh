#!/usr/bin/env bash
# The full test suite: set-up, then every check, each build defined once in CMakePresets.json:
#   build/       gcc RelWithDebInfo: ctest (gpu-labelled tests skip without a GPU), the
#                LibTorch example out of tree, and the Python package of this same build
#                (build/python-tree) under pytest -n 2
#   build-asan/  clang ASan+UBSan at -O1: ctest, and the timeline fuzzer (bounded)
#   build-tsan/  clang TSan with -Werror=thread-safety: ctest over the concurrent components
# Ninja everywhere, ccache when installed (scripts/setup.sh installs it). Exits non-zero on
# any failure.
#
#   scripts/test.sh          everything but the benchmark-sized tests
#   scripts/test.sh --all    also the `slow` ones (pytest -m slow, ctest label slow under
#                            ASan): run it before every update of docs/benchmarks.md
#   scripts/test.sh --fast   skip the sanitizer builds and the fuzzer (TIERMEM_TEST_FAST=1 too)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ALL=0
FAST="${TIERMEM_TEST_FAST:-0}"
for arg in "$@"; do
  case "$arg" in
    --all) ALL=1 ;;
    --fast) FAST=1 ;;
    *) echo "usage: scripts/test.sh [--all] [--fast]" >&2; exit 2 ;;
  esac
done
source scripts/setup.sh
JOBS="${TIERMEM_JOBS:-$(nproc)}"
export PATH="$TIERMEM_VENV/bin:$PATH"   # cmake finds the venv's torch
if command -v ccache >/dev/null; then
  # One cache for every clone: paths under the clone are hashed relative to it, so a second
  # clean clone (CI's) hits what the first compiled.
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
  export CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
fi
t0=$SECONDS
step() { echo "== $1  [$((SECONDS - t0)) s]"; }

# configure PRESET [ARGS]: a tree made by another generator or compiler cannot be reconfigured
# in place (CMake refuses), so such a tree starts afresh.
configure() {
  local preset="$1"; shift
  local dir=build
  case "$preset" in asan|tsan) dir="build-$preset" ;; esac   # as CMakePresets.json says
  if [ -f "$dir/CMakeCache.txt" ] &&
     { ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$dir/CMakeCache.txt" ||
       { [ "$preset" != default ] && ! grep -q '^CMAKE_CXX_COMPILER:.*clang' "$dir/CMakeCache.txt"; }; }; then
    echo "   ($dir/ was made by another generator or compiler: starting it afresh)"
    rm -rf "$dir"
  fi
  cmake --preset "$preset" "$@" >/dev/null
}

step "format check (clang-format, .clang-format; the library's C++ files, tests excepted)"
scripts/check_format.sh

step "C++ build (build/)"
configure default -DPython3_EXECUTABLE="$TIERMEM_PY"
cmake --build --preset default -j "$JOBS"
step "ctest (build/)"
ctest --preset default -j "$JOBS"

if grep -q "TIERMEM_BUILD_LIBTORCH:BOOL=ON" build/CMakeCache.txt && [ -d build/integrations/torch ]; then
  step "LibTorch example out of tree, against the installed package (find_package(tiermem))"
  rm -rf build/install build/example
  cmake --install build --prefix build/install >/dev/null
  TORCH_PREFIX="$("$TIERMEM_PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S integrations/torch/examples -B build/example -G Ninja \
        -DCMAKE_PREFIX_PATH="$PWD/build/install;$TORCH_PREFIX" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/example -j "$JOBS"
  build/example/tiermem_train_gpt --steps 2 --n-layer 2 --n-embd 64 --budget-fraction 0.5 \
        --timeline build/example/example.tmt
fi

if [ -d build/python-tree/tiermem ]; then
  step "pytest (tests/python, against build/python-tree: the extension ctest's build made)"
  markers="not slow"; [ "$ALL" = 1 ] && markers=""
  # Models are built from configs: nothing may be downloaded (HF offline).
  PYTHONPATH="$PWD/build/python-tree" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$TIERMEM_PY" -m pytest -q -n "${TIERMEM_PYTEST_WORKERS:-$JOBS}" -p no:cacheprovider \
    -m "$markers" tests/python
fi

if [ "$FAST" != 1 ]; then
  step "ASan+UBSan build (build-asan/, clang -O1, with the fuzzer)"
  configure asan
  cmake --build --preset asan -j "$JOBS"
  step "ctest (build-asan/)"
  if [ "$ALL" = 1 ]; then
    ASAN_OPTIONS=detect_leaks=1 HWLOC_COMPONENTS=-pci \
      ctest --test-dir build-asan --output-on-failure -j "$JOBS" -LE gpu
  else
    # HWLOC_COMPONENTS=-pci (in the preset): hwloc's pci plugin leaks its scan state from a
    # dlclose'd module, which LeakSanitizer reports and cannot attribute; ours leak nothing.
    ctest --preset asan -j "$JOBS"
  fi
  step "libFuzzer: timeline reader (bounded)"
  FUZZ_SECONDS="${TIERMEM_FUZZ_SECONDS:-30}" scripts/fuzz_timeline.sh
  step "TSan build (build-tsan/, clang with -Werror=thread-safety)"
  configure tsan
  cmake --build --preset tsan -j "$JOBS"
  step "ctest (build-tsan/, label concurrent)"
  ctest --preset tsan -j "$JOBS"
fi
step "all tests passed"
