#!/usr/bin/env bash
# The GPU checks, as one script for a short session on a GPU machine: build with CUDA, run the
# `gpu`-labelled tests (CUDA tier, CUDA kernels vs the scalar reference, the conformance suite's
# Cuda instantiation when present, the preload shim under a PyTorch training script) plus the
# CUDA no-GPU/status tests, then the GPU Adam benchmark (fused multi-tensor kernel vs device copy
# bandwidth). Logs go under $OUT; the preload step times go to $OUT/gpu_preload.json.
#
#   OUT=/some/dir scripts/gpu_check.sh          (default OUT=./out, git-ignored)
# Env: TIERMEM_JOBS (default nproc), GPU_BENCH_PARAMS (default 268435456 = 7 GiB of Adam state)
# Needs the Debian build packages of scripts/setup.sh and the CUDA toolkit (no network). The
# preload test needs a python3 with torch (TIERMEM_PY to pick one) and skips without it.
# Exits non-zero if the build or a test fails; a benchmark failure is logged and reported.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
JOBS="${TIERMEM_JOBS:-$(nproc)}"
BUILD=build-gpu
rc=0

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1 || true
  /usr/local/cuda/bin/nvcc --version 2>&1 | tail -1 || true
} | tee "$OUT/gpu_env.log"

echo "== configure + build ($BUILD)"
if ! { cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIERMEM_WITH_CUDA=ON \
         -DTIERMEM_BUILD_TORCH=OFF -DCMAKE_CUDA_ARCHITECTURES="80;90" &&
       targets=(kernels_cuda_test cuda_tier_test cuda_status_test kernels_cpu_test tiermem_bench_adam_cuda
                preload_gpu_test tiermem_cli tiermem_preload) &&
       { ! cmake --build "$BUILD" --target help | grep -q ' tier_conformance_test$' ||
         targets+=(tier_conformance_test); } &&
       cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}"; } > "$OUT/gpu_build.log" 2>&1; then
  echo "build FAILED (see $OUT/gpu_build.log)"; tail -30 "$OUT/gpu_build.log"; exit 1
fi

echo "== ctest: gpu label + CUDA status tests"
# -L gpu: device tests. The CUDA status tests (label cpu) check the no-GPU paths skip here.
# PreloadGpu.* runs tests/integrations/preload/gpu_train.py under `tiermem run` (record, offload
# with half the recorded peak, plain unified memory) and writes its step times here.
export TIERMEM_GPU_RESULTS="$OUT/gpu_preload.json"
ctest --test-dir "$BUILD" --output-on-failure -L gpu 2>&1 | tee "$OUT/gpu_ctest.log" || rc=1
ctest --test-dir "$BUILD" --output-on-failure -R "CudaStatus|CudaTierWithoutGpu|CudaTierConfigCheck" \
  2>&1 | tee -a "$OUT/gpu_ctest.log" || rc=1
if grep -q "Skipped" "$OUT/gpu_ctest.log" && nvidia-smi -L >/dev/null 2>&1; then
  echo "note: some gpu tests skipped although nvidia-smi sees a GPU" | tee -a "$OUT/gpu_ctest.log"
fi

echo "== GPU Adam benchmark"
timeout 300 "$BUILD/kernels/cuda/tiermem_bench_adam_cuda" --params "${GPU_BENCH_PARAMS:-268435456}" \
  --chunks 16 --reps 10 > "$OUT/gpu_bench_adam.json" 2> "$OUT/gpu_bench_adam.err"
brc=$?
cat "$OUT/gpu_bench_adam.json" "$OUT/gpu_bench_adam.err"
[ "$brc" -eq 0 ] || echo "benchmark exited $brc"

echo "== gpu_check: tests $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
