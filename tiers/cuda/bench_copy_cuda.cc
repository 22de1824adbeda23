// tiermem_bench_copy_cuda: host <-> device copies through the CUDA tier, from and into a host
// tier whose slabs are registered with cudaHostRegister (the engine's path), against
// cudaMemcpyAsync between cudaMallocHost memory and a cudaMalloc buffer (the best a user gets),
// measured alternately in the same run: round r runs baseline H2D, tier H2D, baseline D2H,
// tier D2H before round r+1. Prints one JSON object (median GB/s, 1e9 bytes/s, and the tier /
// baseline ratios); exits 77 (skip) without a GPU. Run by scripts/gpu_check.sh.
//
//   tiermem_bench_copy_cuda [--size BYTES] [--rounds R]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tiers/cuda/cuda_status.h"
#include "tiers/cuda/cuda_tier.h"
#include "tiers/host/host_tier.h"

namespace {

using tiermem::Bytes;

#define CHECK_CUDA TIERMEM_CUDA_CHECK_OR_DIE
#define CHECK_OK TIERMEM_OK_OR_DIE

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Bytes size = Bytes{1} << 30;
  int rounds = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--size")) size = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
  }
  if (!tiermem::CudaDeviceCount().ok()) {
    std::fprintf(stderr, "no GPU: skipped\n");
    return 77;
  }
  // The engine's path: a pinned host tier (slabs registered once) and the CUDA tier.
  std::unique_ptr<tiermem::HostPinner> pinner = tiermem::NewCudaHostPinner();
  tiermem::HostTierConfig hc;
  hc.capacity = tiermem::AlignUp(size, 2 * tiermem::kMiB);
  hc.slot_bytes = hc.capacity;
  hc.slab_bytes = hc.capacity;
  hc.pinner = pinner.get();
  auto host = tiermem::NewHostTier(hc);
  CHECK_OK(host.status());
  auto hregion = (*host)->Allocate(size);
  CHECK_OK(hregion.status());
  tiermem::CudaTierConfig cc;
  cc.capacity = tiermem::AlignUp(size, 256);
  auto dev = tiermem::NewCudaTier(cc);
  CHECK_OK(dev.status());
  auto dregion = (*dev)->Allocate(size);
  CHECK_OK(dregion.status());
  std::memset(hregion->addr, 7, size);

  // The baseline: cudaMallocHost + cudaMalloc + cudaMemcpyAsync on a stream of its own.
  void* pinned = nullptr;
  void* dbuf = nullptr;
  cudaStream_t s;
  CHECK_CUDA(cudaMallocHost(&pinned, size));
  CHECK_CUDA(cudaMalloc(&dbuf, size));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::memset(pinned, 7, size);

  auto base = [&](cudaMemcpyKind kind) {
    const double t0 = NowS();
    if (kind == cudaMemcpyHostToDevice) {
      CHECK_CUDA(cudaMemcpyAsync(dbuf, pinned, size, kind, s));
    } else {
      CHECK_CUDA(cudaMemcpyAsync(pinned, dbuf, size, kind, s));
    }
    CHECK_CUDA(cudaStreamSynchronize(s));
    return size / (NowS() - t0) / 1e9;
  };
  auto tier = [&](tiermem::CopyDir dir) {
    const double t0 = NowS();
    CHECK_OK((*dev)->Copy({*dregion, 0, hregion->addr, size, dir})->Wait());
    return size / (NowS() - t0) / 1e9;
  };
  base(cudaMemcpyHostToDevice);  // warm-up
  tier(tiermem::CopyDir::kToTier);
  std::vector<double> bh, th, bd, td;
  for (int r = 0; r < rounds; ++r) {
    bh.push_back(base(cudaMemcpyHostToDevice));
    th.push_back(tier(tiermem::CopyDir::kToTier));
    bd.push_back(base(cudaMemcpyDeviceToHost));
    td.push_back(tier(tiermem::CopyDir::kFromTier));
  }
  const double mbh = Median(bh), mth = Median(th), mbd = Median(bd), mtd = Median(td);
  std::printf(
      "{\"bench\": \"copy_cuda\", \"bytes\": %llu, \"rounds\": %d, "
      "\"h2d_cudaMemcpy_pinned_GBps\": %.2f, \"h2d_tier_GBps\": %.2f, \"h2d_ratio\": %.3f, "
      "\"d2h_cudaMemcpy_pinned_GBps\": %.2f, \"d2h_tier_GBps\": %.2f, \"d2h_ratio\": %.3f}\n",
      static_cast<unsigned long long>(size), rounds, mbh, mth, mth / mbh, mbd, mtd, mtd / mbd);
  CHECK_OK((*dev)->Free(*dregion));
  CHECK_OK((*host)->Free(*hregion));
  cudaFreeHost(pinned);
  cudaFree(dbuf);
  cudaStreamDestroy(s);
  return 0;
}
