#!/usr/bin/env bash
# Runs the timeline reader fuzzer (libFuzzer + ASan + UBSan) for a bounded time. The harness
# lives in the ASan+UBSan tree (CMakePresets.json `asan`, build-asan/), which scripts/test.sh
# builds anyway: one clang build serves the sanitizer tests and the fuzzer.
#
#   scripts/fuzz_timeline.sh            60 s
#   FUZZ_SECONDS=600 scripts/fuzz_timeline.sh
# Exits non-zero if the fuzzer finds a crash (the reproducer is left in build-asan/fuzz/crashes/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_TO_RUN="${FUZZ_SECONDS:-60}"
if ! command -v clang++-14 >/dev/null; then
  echo "fuzz_timeline: clang++-14 not found (apt-get install -y clang libclang-rt-14-dev)" >&2
  exit 2
fi
[ -f build-asan/CMakeCache.txt ] || cmake --preset asan >/dev/null
# The seeds are written by the CLI: the main build's when there is one, else this tree's.
SEED_CLI=build/tools/tiermem
TARGETS=(timeline_reader_fuzzer)
if [ ! -x "$SEED_CLI" ]; then
  SEED_CLI=build-asan/tools/tiermem
  TARGETS+=(tiermem_cli)
fi
cmake --build build-asan -j "${TIERMEM_JOBS:-2}" --target "${TARGETS[@]}"
CORPUS=build-asan/fuzz/corpus
CRASHES=build-asan/fuzz/crashes
mkdir -p "$CORPUS" "$CRASHES"
# Seed corpus: small valid timelines (a complete one and a truncated one).
if [ -z "$(ls -A "$CORPUS")" ]; then
  "$SEED_CLI" prof synth --events 300 -o "$CORPUS/synth.tmt" >/dev/null
  head -c 3000 "$CORPUS/synth.tmt" > "$CORPUS/synth-truncated.tmt"
fi
exec build-asan/tests/fuzz/timeline_reader_fuzzer "$CORPUS" -max_total_time="$SECONDS_TO_RUN" \
  -max_len=65536 -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$CRASHES/" -print_final_stats=1
