// CUDA ComputeHarness (see cuda_compute_harness.h). The delay is a one-thread kernel spinning
// on the global nanosecond timer, queued before the work on the same stream, so the work runs
// late on the device while the host goes on.
#include "tests/tiers/cuda_compute_harness.h"

#include <cuda_runtime.h>

#include "tiers/cuda/cuda_status.h"

namespace tiermem::testing {
namespace {

__global__ void Spin(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

__global__ void FillKernel(unsigned char* dst, size_t n, unsigned char v) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = v;
  }
}

__global__ void CopyKernel(unsigned char* dst, const unsigned char* src, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

class CudaComputeHarness final : public ComputeHarness {
 public:
  explicit CudaComputeHarness(cudaStream_t s) : s_(s) {}
  ~CudaComputeHarness() override {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
  ComputeStream stream() override { return ComputeStream{reinterpret_cast<uintptr_t>(s_)}; }
  void Fill(void* dst, Bytes n, uint8_t value, uint64_t delay_us) override {
    if (delay_us) Spin<<<1, 1, 0, s_>>>(delay_us * 1000ull);
    FillKernel<<<256, 256, 0, s_>>>(static_cast<unsigned char*>(dst), n, value);
  }
  void CopyWithin(void* dst, const void* src, Bytes n, uint64_t delay_us) override {
    if (delay_us) Spin<<<1, 1, 0, s_>>>(delay_us * 1000ull);
    CopyKernel<<<256, 256, 0, s_>>>(static_cast<unsigned char*>(dst),
                                    static_cast<const unsigned char*>(src), n);
  }
  Status Synchronize() override {
    TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "harness kernel launch");
    TIERMEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s_), "harness stream");
    return OkStatus();
  }

 private:
  cudaStream_t s_;
};

}  // namespace

std::unique_ptr<ComputeHarness> NewCudaComputeHarness() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return nullptr;
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return nullptr;
  return std::make_unique<CudaComputeHarness>(s);
}

}  // namespace tiermem::testing
