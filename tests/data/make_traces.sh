#!/usr/bin/env bash
# Regenerates the canonical planner traces in tests/data/ from their model shapes
# (planners/model_traces.cc: CanonicalShape + ModelTrace) with the built CLI. Run after
# changing the generator or the trace format; tests/planners/trace_test.cc checks that the
# files are byte-identical to what the generator makes.
#
#   tests/data/make_traces.sh [path/to/tiermem]     (default: build/tools/tiermem)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
TIERMEM="${1:-../../build/tools/tiermem}"
for model in gpt gpt-ckpt gpt-tied moe; do
  "$TIERMEM" plan synth "$model" -o "$model.tmtrace"
done
