#!/usr/bin/env bash
# Builds the timeline reader fuzzer with clang (libFuzzer + ASan + UBSan) in build-fuzz/ and
# runs it for a bounded time. Seeds: timelines written by `tiermem prof synth` are not needed;
# the corpus starts from a few small valid files made by the harness build's own tests.
#
#   scripts/fuzz_timeline.sh            60 s
#   FUZZ_SECONDS=600 scripts/fuzz_timeline.sh
# Exits non-zero if the fuzzer finds a crash (the reproducer is left in build-fuzz/crashes/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_TO_RUN="${FUZZ_SECONDS:-60}"
CXX_BIN="${FUZZ_CXX:-$(command -v clang++-14 || command -v clang++)}"
CC_BIN="${FUZZ_CC:-$(command -v clang-14 || command -v clang)}"
if [ -z "$CXX_BIN" ]; then
  echo "fuzz_timeline: clang++ not found (apt-get install -y clang libclang-rt-14-dev)" >&2
  exit 2
fi
cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER="$CXX_BIN" -DCMAKE_C_COMPILER="$CC_BIN" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIERMEM_BUILD_FUZZERS=ON -DTIERMEM_BUILD_TESTS=OFF \
      -DTIERMEM_BUILD_BENCHMARKS=OFF -DTIERMEM_WITH_CUDA=OFF -DTIERMEM_BUILD_TORCH=OFF \
      -DTIERMEM_SANITIZE=address >/dev/null
# The seeds are written by the CLI: the main build's when there is one (scripts/test.sh builds
# it first), else this build's own.
SEED_CLI=build/tools/tiermem
TARGETS=(timeline_reader_fuzzer)
if [ ! -x "$SEED_CLI" ]; then
  SEED_CLI=build-fuzz/tools/tiermem
  TARGETS+=(tiermem_cli)
fi
cmake --build build-fuzz -j "${TIERMEM_JOBS:-2}" --target "${TARGETS[@]}"
CORPUS=build-fuzz/corpus
mkdir -p "$CORPUS" build-fuzz/crashes
# Seed corpus: small valid timelines (a complete one and a truncated one).
if [ -z "$(ls -A "$CORPUS")" ]; then
  "$SEED_CLI" prof synth --events 300 -o "$CORPUS/synth.tmt" >/dev/null
  head -c 3000 "$CORPUS/synth.tmt" > "$CORPUS/synth-truncated.tmt"
fi
build-fuzz/tests/fuzz/timeline_reader_fuzzer "$CORPUS" -max_total_time="$SECONDS_TO_RUN" \
  -max_len=65536 -timeout=10 -rss_limit_mb=2048 -artifact_prefix=build-fuzz/crashes/ -print_final_stats=1
