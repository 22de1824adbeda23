#!/usr/bin/env bash
# The full test suite: set-up, then every check, each build defined once in CMakePresets.json:
#   build/       gcc RelWithDebInfo: ctest (gpu-labelled tests skip without a GPU), the
#                LibTorch example out of tree, and the Python package of this same build
#                (build/python-tree) under pytest -n 2
#   build-asan/  clang ASan+UBSan at -O1, -Werror=thread-safety: ctest, and the timeline
#                fuzzer (bounded)
#   build-tsan/  clang TSan with -Werror=thread-safety: ctest over the concurrent components
#                (the only tests that tree defines: TIERMEM_TEST_LABEL in CMakePresets.json)
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
  # A tree this same configure already made is not configured again (warm runs: the default
  # preset's configure probes torch and nvcc for seconds). Its build.ninja re-runs CMake by
  # itself when a CMakeLists.txt or a .cmake file it read changes; the stamp covers what
  # build.ninja cannot see: the presets, these arguments, the cmake, the launchers, the venv.
  # A cache written after the stamp (`cmake -D...` by hand, or such a re-run) means one
  # configure more, which re-applies the preset's variables as before.
  local stamp="$dir/.tiermem-configure" want
  want="$({ cat CMakePresets.json requirements.txt; echo "$preset $* ${CMAKE_CXX_COMPILER_LAUNCHER:-}"
            cmake --version | head -1; } | sha256sum | cut -d' ' -f1)"
  if [ -f "$dir/build.ninja" ] && [ "$stamp" -nt "$dir/CMakeCache.txt" ] &&
     [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  rm -f "$stamp"
  cmake --preset "$preset" "$@" >/dev/null
  echo "$want" > "$stamp"
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
  # A fresh install each time (a file the package no longer installs must not linger), into
  # which `cmake --install` copies each file with its build-tree time: build/example's own
  # build.ninja then rebuilds, and re-runs its CMake, only for what changed since its last
  # build. It is configured once (finding torch there costs seconds).
  rm -rf build/install
  cmake --install build --prefix build/install >/dev/null
  if [ ! -f build/example/build.ninja ]; then
    rm -rf build/example
    TORCH_PREFIX="$("$TIERMEM_PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
    cmake -S integrations/torch/examples -B build/example -G Ninja \
          -DCMAKE_PREFIX_PATH="$PWD/build/install;$TORCH_PREFIX" -DCMAKE_BUILD_TYPE=Release >/dev/null
  fi
  cmake --build build/example -j "$JOBS"
  build/example/tiermem_train_gpt --steps 2 --n-layer 2 --n-embd 64 --budget-fraction 0.5 \
        --timeline build/example/example.tmt
fi

if [ -d build/python-tree/tiermem ]; then
  step "pytest (tests/python, against build/python-tree: the extension ctest's build made)"
  markers="not slow"; [ "$ALL" = 1 ] && markers=""
  # Models are built from configs: nothing may be downloaded (HF offline). --dist worksteal:
  # a worker that runs out of tests takes tests queued at the other, so the run does not end
  # with one worker idle while the other works through the long tests queued ahead at it
  # (`load` keeps a queue per worker and moves nothing between them). --durations: the ten
  # slowest tests close the output, the place to look when pytest's stage grows.
  PYTHONPATH="$PWD/build/python-tree" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$TIERMEM_PY" -m pytest -q -n "${TIERMEM_PYTEST_WORKERS:-$JOBS}" --dist worksteal \
    -p no:cacheprovider --durations=10 -m "$markers" tests/python
fi

if [ "$FAST" != 1 ]; then
  step "ASan+UBSan build (build-asan/, clang -O1, with the fuzzer)"
  configure asan
  cmake --build --preset asan -j "$JOBS"
  # The fuzzer runs for a fixed time on one core: alone it would leave the other core idle
  # for those seconds, so it runs beside the ASan ctest and the TSan stage and is waited for
  # (and fails the run as before) at the end.
  step "libFuzzer: timeline reader (bounded, ${TIERMEM_FUZZ_SECONDS:-30} s), in the background"
  mkdir -p build-asan/fuzz
  FUZZ_SECONDS="${TIERMEM_FUZZ_SECONDS:-30}" scripts/fuzz_timeline.sh >build-asan/fuzz/log 2>&1 &
  fuzz_pid=$!
  trap 'kill "$fuzz_pid" 2>/dev/null || true' EXIT  # a failed stage below ends the fuzzer too
  step "ctest (build-asan/)"
  if [ "$ALL" = 1 ]; then
    ASAN_OPTIONS=detect_leaks=1 HWLOC_COMPONENTS=-pci \
      ctest --test-dir build-asan --output-on-failure -j "$JOBS" -LE gpu
  else
    # HWLOC_COMPONENTS=-pci (in the preset): hwloc's pci plugin leaks its scan state from a
    # dlclose'd module, which LeakSanitizer reports and cannot attribute; ours leak nothing.
    ctest --preset asan -j "$JOBS"
  fi
  step "TSan build (build-tsan/, clang with -Werror=thread-safety)"
  configure tsan
  cmake --build --preset tsan -j "$JOBS"
  step "ctest (build-tsan/, label concurrent)"
  ctest --preset tsan -j "$JOBS"
  step "libFuzzer: waiting for it (build-asan/fuzz/log)"
  fuzz_rc=0
  wait "$fuzz_pid" || fuzz_rc=$?
  trap - EXIT
  tail -n 15 build-asan/fuzz/log
  if [ "$fuzz_rc" != 0 ]; then
    echo "libFuzzer failed (exit $fuzz_rc): build-asan/fuzz/log, reproducers in build-asan/fuzz/crashes/" >&2
    exit 1
  fi
fi
step "all tests passed"
