#!/usr/bin/env bash
# The GPU checks, as one script for a short session on a GPU machine that has the CUDA driver
# and a Python with torch, but no packages, no compiler and no network. It runs what
# scripts/gpu_bundle.sh built on a development machine (gpu-bundle/, carried with the source
# tree; see docs/gpu.md):
#   1. the GPU tests: the CUDA tier (incl. the ordering conformance cases on a real stream), the
#      CUDA kernels vs the CPU reference, the engine's ordering tests, the preload shim under a
#      PyTorch training script;
#   2. the `gpu`-marked pytest (training on the CUDA tier vs plain torch, device-placed
#      optimizer groups, a many-step stress run on a side stream);
#   3. the GPU benchmarks: fused CUDA AdamW vs torch's AdamW(fused=True) and the D2D copy rate;
#      pinned host<->device copies vs cudaMemcpy; GPT at 25% HBM vs plain torch.
# Everything lands in $OUT (default ./out): logs, and one results file, gpu_results.json.
#
#   OUT=/some/dir scripts/gpu_check.sh
# Env: TIERMEM_PY (default python3), TIERMEM_GPU_BUNDLE (default ./gpu-bundle),
#      GPU_CHECK_QUICK=1 (smaller benchmarks).
# Without a bundle, and with cmake + nvcc at hand, it builds one first (scripts/gpu_bundle.sh).
# Exits non-zero if a test failed; benchmark failures are reported in the results file.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
B="${TIERMEM_GPU_BUNDLE:-$ROOT/gpu-bundle}"
PY="${TIERMEM_PY:-python3}"
rc=0

if [ ! -d "$B" ]; then
  if command -v cmake >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "== no bundle: building one (scripts/gpu_bundle.sh)"
    scripts/gpu_bundle.sh > "$OUT/gpu_bundle.log" 2>&1 || { tail -30 "$OUT/gpu_bundle.log"; exit 1; }
  else
    echo "gpu_check: no $B and no build tools here: run scripts/gpu_bundle.sh on a development" \
         "machine and carry gpu-bundle/ with the source tree" >&2
    exit 2
  fi
fi

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  echo "python: $($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1)"
  echo "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)"
  echo "glibc: $(ldd --version 2>&1 | head -1)"
  echo "-- bundle"
  cat "$B/MANIFEST"
} | tee "$OUT/gpu_env.log"

want_glibc="$(sed -n 's/^glibc_needed: //p' "$B/MANIFEST")"
have_glibc="$(ldd --version 2>&1 | head -1 | grep -o '[0-9]*\.[0-9]*$')"
if [ -n "$want_glibc" ] && [ -n "$have_glibc" ] &&
   [ "$(printf '%s\n%s\n' "$want_glibc" "$have_glibc" | sort -V | head -1)" != "$want_glibc" ]; then
  echo "gpu_check: the bundle needs glibc $want_glibc, this machine has $have_glibc: binaries" \
       "may fail to load (build the bundle on an older distribution)" | tee -a "$OUT/gpu_env.log"
fi
want_py="$(sed -n 's/^python: //p' "$B/MANIFEST")"
have_py="$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"
PY_OK=1
if [ "$want_py" != "$have_py" ]; then
  echo "gpu_check: the bundle's extension is for Python $want_py, this is $have_py: the Python" \
       "parts are skipped (rebuild the bundle with a $have_py venv)" | tee -a "$OUT/gpu_env.log"
  PY_OK=0
fi

export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TIERMEM_TEST_CLI="$B/python/tiermem/bin/tiermem"
export TIERMEM_TEST_SHIM="$B/python/tiermem/lib/libtiermem_preload.so"
export TIERMEM_TEST_SOURCE_DIR="$ROOT"
export TIERMEM_PY="$PY"
export TIERMEM_GPU_RESULTS="$OUT/gpu_preload.json"
export PYTHONPATH="$B/python${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== GPU tests (gtest)"
: > "$OUT/gpu_tests.log"
run_test() {  # binary [gtest filter]
  local bin="$1" filter="${2:-*}"
  echo "-- $bin ($filter)" | tee -a "$OUT/gpu_tests.log"
  timeout 600 "$B/bin/$bin" --gtest_filter="$filter" > "$OUT/gpu_test_$bin.log" 2>&1
  local r=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) \]|^\[==========\]' "$OUT/gpu_test_$bin.log" | tail -4 |
    tee -a "$OUT/gpu_tests.log"
  echo "exit $r" | tee -a "$OUT/gpu_tests.log"
  [ "$r" -eq 0 ] || rc=1
}
run_test cuda_status_test
run_test cuda_tier_test
run_test kernels_cuda_test
run_test tier_conformance_test 'Cuda/*'
run_test engine_ordering_test
[ "$PY_OK" = 1 ] && run_test preload_gpu_test
if nvidia-smi -L >/dev/null 2>&1 && grep -q '^\[  SKIPPED \]' "$OUT"/gpu_test_cuda_tier_test.log; then
  echo "note: CUDA tier tests skipped although nvidia-smi sees a GPU" | tee -a "$OUT/gpu_tests.log"
  rc=1
fi

if [ "$PY_OK" = 1 ]; then
  echo "== gpu-marked pytest"
  timeout 900 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/python > "$OUT/gpu_pytest.log" 2>&1 || rc=1
  tail -15 "$OUT/gpu_pytest.log"
fi

echo "== GPU benchmarks"
quick="${GPU_CHECK_QUICK:-0}"
params=$([ "$quick" = 1 ] && echo 67108864 || echo 268435456)
timeout 300 "$B/bin/tiermem_bench_adam_cuda" --params "$params" --chunks 16 --reps 10 \
  > "$OUT/gpu_bench_adam.json" 2> "$OUT/gpu_bench_adam.err"
echo "bench_adam_cuda: exit $?"; cat "$OUT/gpu_bench_adam.json"
timeout 300 "$B/bin/tiermem_bench_copy_cuda" --size $([ "$quick" = 1 ] && echo 268435456 || echo 1073741824) \
  > "$OUT/gpu_bench_copy.json" 2> "$OUT/gpu_bench_copy.err"
echo "bench_copy_cuda: exit $?"; cat "$OUT/gpu_bench_copy.json"
if [ "$PY_OK" = 1 ]; then
  extra=$([ "$quick" = 1 ] && echo "--layers 4 --width 512 --rounds 2" || echo "")
  timeout 900 "$PY" -m benchmarks.bench_gpu --json --params "$params" $extra \
    > "$OUT/gpu_bench_python.json" 2> "$OUT/gpu_bench_python.err"
  echo "bench_gpu: exit $?"; cat "$OUT/gpu_bench_python.json"
fi

# One results file.
"$PY" - "$OUT" "$rc" <<'PYEOF' || python3 - "$OUT" "$rc" <<'PYEOF2'
import json, os, re, sys
out, rc = sys.argv[1], int(sys.argv[2])
def read(name):
    p = os.path.join(out, name)
    return open(p).read() if os.path.exists(p) else None
def js(name):
    t = read(name)
    try:
        return json.loads(t.strip().splitlines()[-1]) if t and t.strip() else None
    except Exception:
        return {"unparsed": t}
tests = {}
for f in sorted(os.listdir(out)):
    m = re.match(r"gpu_test_(.*)\.log$", f)
    if m:
        counts = {}
        for kind, n in re.findall(r"^\[\s+(PASSED|FAILED|SKIPPED)\s+\] (\d+) tests?", read(f), re.M):
            counts[kind.lower()] = int(n)
        tests[m.group(1)] = counts
py = read("gpu_pytest.log")
res = {"ok": rc == 0, "env": read("gpu_env.log"), "gtest": tests,
       "pytest": py.strip().splitlines()[-1] if py else None,
       "preload": js("gpu_preload.json"), "bench_adam_cuda": js("gpu_bench_adam.json"),
       "bench_copy_cuda": js("gpu_bench_copy.json"), "bench_gpu": js("gpu_bench_python.json")}
json.dump(res, open(os.path.join(out, "gpu_results.json"), "w"), indent=2)
print("results:", os.path.join(out, "gpu_results.json"))
PYEOF
print("gpu_check: could not write gpu_results.json")
PYEOF2

echo "== gpu_check: tests $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
