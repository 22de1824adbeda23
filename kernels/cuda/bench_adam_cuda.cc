// tiermem_bench_adam_cuda: the fused multi-tensor Adam kernel against the device's own copy
// bandwidth, measured in the same run (run by scripts/gpu_check.sh on a GPU machine).
//
//   tiermem_bench_adam_cuda [--params N] [--chunks K] [--reps R]
//
// Baseline: cudaMemcpyAsync device->device of N*4 bytes, counted as read + write.
// Kernel bytes per param: f32 grads 28 (read p, m, v, g; write p, m, v); bf16 grads with a
// bf16 copy out 28 (2 + 12 read, 12 + 2 written). Prints one JSON object; exits 77 (skip)
// without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/optim_cuda.h"
#include "tiers/cuda/cuda_status.h"

namespace {

namespace k = tiermem::kernels;

#define CHECK_CUDA TIERMEM_CUDA_CHECK_OR_DIE
#define CHECK_OK TIERMEM_OK_OR_DIE

// Median milliseconds of `reps` runs of fn() on `s`, after one warm-up.
template <typename Fn>
float MedianMs(cudaStream_t s, int reps, const Fn& fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  fn();
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(a, s));
    fn();
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{1} << 28;  // 256 Mi params: 7 GiB of state, far beyond any cache
  size_t chunks = 16;
  int reps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--params")
      n = std::strtoull(argv[i + 1], nullptr, 10);
    else if (flag == "--chunks")
      chunks = std::strtoull(argv[i + 1], nullptr, 10);
    else if (flag == "--reps")
      reps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--params N] [--chunks K] [--reps R]\n", argv[0]);
      return 2;
    }
  }
  if (n == 0 || chunks == 0 || reps <= 0 || chunks > n) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("{\"skipped\": \"no CUDA device\"}\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  float *p, *m, *v, *g;
  uint16_t *gb, *out;
  CHECK_CUDA(cudaMalloc(&p, n * 4));
  CHECK_CUDA(cudaMalloc(&m, n * 4));
  CHECK_CUDA(cudaMalloc(&v, n * 4));
  CHECK_CUDA(cudaMalloc(&g, n * 4));
  CHECK_CUDA(cudaMalloc(&gb, n * 2));
  CHECK_CUDA(cudaMalloc(&out, n * 2));
  CHECK_CUDA(cudaMemsetAsync(p, 0, n * 4, s));
  CHECK_CUDA(cudaMemsetAsync(m, 0, n * 4, s));
  CHECK_CUDA(cudaMemsetAsync(v, 0, n * 4, s));
  CHECK_CUDA(cudaMemsetAsync(g, 0x3c, n * 4, s));  // 0x3c3c3c3c ~ 0.0115
  CHECK_OK(k::cuda::CastFromF32(g, gb, k::DType::kBF16, n, s));

  // Baseline: device-to-device copy of n floats (p -> m is overwritten before the Adam runs).
  const float copy_ms = MedianMs(
      s, reps, [&] { CHECK_CUDA(cudaMemcpyAsync(m, g, n * 4, cudaMemcpyDeviceToDevice, s)); });
  const double copy_gbps = 2.0 * n * 4 / (copy_ms * 1e-3) / 1e9;
  CHECK_CUDA(cudaMemsetAsync(m, 0, n * 4, s));

  std::printf("{\"device\": \"%s\", \"params\": %zu, \"chunks\": %zu, \"reps\": %d,\n", prop.name,
              n, chunks, reps);
  std::printf(" \"copy_GBps\": %.1f,\n \"results\": [\n", copy_gbps);
  const struct {
    const char* name;
    k::DType grad;
    bool out;
  } variants[] = {{"adamw f32 grad", k::DType::kF32, false},
                  {"adamw f32 grad + bf16 copy", k::DType::kF32, true},
                  {"adamw bf16 grad + bf16 copy", k::DType::kBF16, true}};
  bool first = true;
  for (const auto& var : variants) {
    std::vector<k::cuda::AdamChunk> list(chunks);
    const size_t per = n / chunks;
    for (size_t c = 0; c < chunks; ++c) {
      const size_t off = c * per;
      const size_t len = c + 1 == chunks ? n - off : per;
      auto& ch = list[c];
      ch.param = p + off;
      ch.exp_avg = m + off;
      ch.exp_avg_sq = v + off;
      ch.grad = var.grad == k::DType::kF32 ? static_cast<const void*>(g + off)
                                           : static_cast<const void*>(gb + off);
      ch.param_out = var.out ? out + off : nullptr;
      ch.n = len;
    }
    k::AdamConfig cfg;
    cfg.weight_decay = 0.01f;
    int64_t step = 0;
    const float ms = MedianMs(s, reps, [&] {
      cfg.step = ++step;
      CHECK_OK(k::cuda::AdamStepMulti(cfg, list.data(), list.size(), var.grad, k::DType::kBF16, s));
    });
    const double bpp = (var.grad == k::DType::kF32 ? 4.0 : 2.0) + 24.0 + (var.out ? 2.0 : 0.0);
    const double gbps = bpp * n / (ms * 1e-3) / 1e9;
    std::printf(
        "%s  {\"variant\": \"%s\", \"ms\": %.3f, \"Gparams_per_s\": %.2f, \"bytes_per_param\": "
        "%.0f, "
        "\"GBps\": %.1f, \"fraction_of_copy\": %.3f}",
        first ? "" : ",\n", var.name, ms, n / (ms * 1e-3) / 1e9, bpp, gbps, gbps / copy_gbps);
    first = false;
  }
  const void* grads[] = {g};
  const size_t ns[] = {n};
  auto t0 = MedianMs(s, reps, [&] {
    auto st = k::cuda::GradNormAndOverflowMulti(grads, ns, 1, k::DType::kF32, s);
    CHECK_OK(st.status());
  });
  std::printf(
      ",\n  {\"variant\": \"grad norm f32\", \"ms\": %.3f, \"GBps\": %.1f, \"fraction_of_copy\": "
      "%.3f}\n ]}\n",
      t0, 4.0 * n / (t0 * 1e-3) / 1e9, 4.0 * n / (t0 * 1e-3) / 1e9 / copy_gbps);
  cudaFree(p);
  cudaFree(m);
  cudaFree(v);
  cudaFree(g);
  cudaFree(gb);
  cudaFree(out);
  cudaStreamDestroy(s);
  return 0;
}
