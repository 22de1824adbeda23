// A "CUDA program" for the preload tests: linked against the fake CUDA runtime (as a real
// program is against libcudart), it runs one scenario of runtime calls and prints what it got
// ("name=value" lines) so the test can compare it with the fake's call log and the timeline.
//
//   preload_probe basic | threads N M | vmm | offload | offload_full | kernels | sleep | killself
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "integrations/preload/fake/fake_cudart.h"

namespace {

using tiermem::preload::CuMemHandle;
using tiermem::preload::CuDevicePtr;

constexpr size_t kKiB = 1024, kMiB = 1024 * kKiB;

CudaStream Stream(uintptr_t v) { return reinterpret_cast<CudaStream>(v); }

void Kernel1() {}
void Kernel2() {}
void Kernel3() {}

void Launch(const void* k, void** args, CudaStream s) {
  cudaLaunchKernel(k, Dim3{1, 1, 1}, Dim3{32, 1, 1}, args, 0, s);
}

void LaunchN(int n) {
  for (int i = 0; i < n; ++i) Launch(reinterpret_cast<const void*>(&Kernel1), nullptr, nullptr);
}

int Basic() {
  void *a, *b, *c, *h, *h2, *m, *p;
  static char reg[64 * kKiB];
  std::printf("a_rc=%d\n", cudaMalloc(&a, 1 * kMiB));
  cudaMalloc(&b, 3 * kMiB);
  cudaMallocAsync(&c, 2 * kMiB, Stream(0x5100));
  LaunchN(3);
  cudaMallocHost(&h, 512 * kKiB);
  cudaHostAlloc(&h2, 256 * kKiB, 4);
  cudaHostRegister(reg, sizeof(reg), 2);
  cudaMallocManaged(&m, 128 * kKiB, 1);
  cudaMallocFromPoolAsync(&p, 4 * kMiB, reinterpret_cast<CudaMemPool>(0x77), Stream(0x5200));
  std::printf("a=%p\nb=%p\nc=%p\nh=%p\nh2=%p\nm=%p\np=%p\n", a, b, c, h, h2, m, p);
  LaunchN(10);
  cudaFree(a);
  cudaFreeAsync(c, Stream(0x5100));
  LaunchN(5);
  cudaFreeHost(h);
  cudaHostUnregister(reg);
  cudaFree(b);
  cudaFree(m);
  cudaFreeAsync(p, Stream(0x5200));
  // Errors of the runtime come back unchanged.
  void* big = nullptr;
  std::printf("oom_rc=%d\n", cudaMalloc(&big, (size_t{1} << 40)));
  std::printf("bad_free_rc=%d\n", cudaFree(reinterpret_cast<void*>(0x1234500)));
  size_t free = 0, total = 0;
  std::printf("meminfo_rc=%d free=%zu total=%zu\n", cudaMemGetInfo(&free, &total), free, total);
  return 0;  // h2 stays live
}

int Threads(int nthreads, int iters) {
  std::vector<std::thread> pool;
  std::atomic<int> failures{0};
  for (int t = 0; t < nthreads; ++t) {
    pool.emplace_back([t, iters, &failures] {
      for (int i = 0; i < iters; ++i) {
        void *p, *q;
        if (cudaMalloc(&p, 256 * (t + 1)) != 0) ++failures;
        if (cudaMallocAsync(&q, 512 * (t + 1), Stream(0x6000 + t)) != 0) ++failures;
        Launch(reinterpret_cast<const void*>(&Kernel1), nullptr, Stream(0x6000 + t));
        if (cudaFreeAsync(q, Stream(0x6000 + t)) != 0) ++failures;
        if (cudaFree(p) != 0) ++failures;
      }
    });
  }
  for (auto& th : pool) th.join();
  std::printf("failures=%d\n", failures.load());
  return failures.load() == 0 ? 0 : 1;
}

template <typename Fn>
Fn Entry(const char* name, int how) {
  void* fn = nullptr;
  int status = -1;
  if (how == 0) cudaGetDriverEntryPoint(name, &fn, 0, &status);
  if (how == 1) cudaGetDriverEntryPointByVersion(name, &fn, 12000, 0, &status);
  if (how == 2) cuGetProcAddress_v2(name, &fn, 12000, 0, &status);
  if (how == 3) cuGetProcAddress(name, &fn, 12000, 0);
  return reinterpret_cast<Fn>(fn);
}

int Vmm() {
  using namespace tiermem::preload;  // NOLINT
  auto create = Entry<CuMemCreateFn>("cuMemCreate", 0);
  auto release = Entry<CuMemReleaseFn>("cuMemRelease", 1);
  auto map = Entry<CuMemMapFn>("cuMemMap", 2);
  auto unmap = Entry<CuMemUnmapFn>("cuMemUnmap", 3);
  auto reserve = Entry<CuMemAddressReserveFn>("cuMemAddressReserve", 0);
  if (!create || !release || !map || !unmap || !reserve) {
    std::printf("missing driver entry point\n");
    return 1;
  }
  CuDevicePtr va = 0;
  reserve(&va, 8 * kMiB, 0, 0, 0);
  CuMemHandle h[3];
  for (int i = 0; i < 3; ++i) {
    if (create(&h[i], 2 * kMiB, nullptr, 0) != 0) return 1;
    map(va + i * 2 * kMiB, 2 * kMiB, 0, h[i], 0);
    std::printf("handle%d=0x%llx\n", i, h[i]);
  }
  for (int i = 0; i < 3; ++i) unmap(va + i * 2 * kMiB, 2 * kMiB);
  for (int i = 0; i < 3; ++i) release(h[i]);
  std::printf("release_unknown_rc=%d\n", release(0xdead0));
  return 0;
}

void PrintInfo(const char* when) {
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  std::printf("%s free=%zu total=%zu\n", when, free, total);
}

// Run with a 3 MiB device budget.
int Offload() {
  void *a, *b, *c, *d, *e;
  cudaMalloc(&a, 2 * kMiB);  // device (2 of 3 MiB)
  cudaMalloc(&b, 2 * kMiB);  // past the budget: managed
  PrintInfo("after_b");
  cudaMallocAsync(&c, 1 * kMiB, Stream(0x5100));  // device (3 of 3)
  PrintInfo("after_c");
  cudaFree(a);                                     // device 1 of 3
  cudaMallocAsync(&d, 2 * kMiB, Stream(0x5100));  // device (3 of 3)
  cudaFreeAsync(b, Stream(0x5300));               // managed: stream sync + cudaFree
  cudaMalloc(&e, 8 * kMiB);                        // managed
  std::printf("a=%p\nb=%p\nc=%p\nd=%p\ne=%p\n", a, b, c, d, e);
  cudaFree(e);
  cudaFreeAsync(d, Stream(0x5100));
  cudaFree(c);
  PrintInfo("end");
  return 0;
}

// Run with FAKE_CUDART_TOTAL = 4 MiB and a large budget: the device fills first.
int OffloadFull() {
  void *a, *b;
  std::printf("a_rc=%d\n", cudaMalloc(&a, 3 * kMiB));
  std::printf("b_rc=%d\n", cudaMalloc(&b, 2 * kMiB));
  std::printf("last_error=%d\n", cudaGetLastError());
  std::printf("a=%p\nb=%p\n", a, b);
  return 0;
}

// Run with a 1 MiB budget: a on the device, b, c, d managed; three iterations of k1(b+4K),
// k2(c), k3(d) on stream 0x5100.
int Kernels() {
  const size_t sizes[2] = {8, 4};
  fake_cudart_register_kernel(reinterpret_cast<const void*>(&Kernel1), 2, sizes);
  fake_cudart_register_kernel(reinterpret_cast<const void*>(&Kernel2), 2, sizes);
  fake_cudart_register_kernel(reinterpret_cast<const void*>(&Kernel3), 2, sizes);
  void *a, *b, *c, *d;
  cudaMalloc(&a, 1 * kMiB);
  cudaMalloc(&b, 1 * kMiB);
  cudaMalloc(&c, 1 * kMiB);
  cudaMalloc(&d, 1 * kMiB);
  std::printf("a=%p\nb=%p\nc=%p\nd=%p\n", a, b, c, d);
  void* b4k = static_cast<char*>(b) + 4096;
  int n = 7;
  void* args1[2] = {&b4k, &n};
  void* args2[2] = {&c, &n};
  void* args3[2] = {&d, &n};
  for (int iter = 0; iter < 3; ++iter) {
    Launch(reinterpret_cast<const void*>(&Kernel1), args1, Stream(0x5100));
    Launch(reinterpret_cast<const void*>(&Kernel2), args2, Stream(0x5100));
    Launch(reinterpret_cast<const void*>(&Kernel3), args3, Stream(0x5100));
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(d);
  return 0;
}

volatile sig_atomic_t g_sigint = 0;

int Sleep() {
  signal(SIGINT, [](int) { g_sigint = 1; });
  void* a;
  cudaMalloc(&a, 1 * kMiB);
  std::printf("ready\n");
  std::fflush(stdout);
  for (int i = 0; i < 10000 && !g_sigint; ++i) usleep(1000);
  if (!g_sigint) return 1;
  std::printf("got SIGINT\n");
  cudaFree(a);
  return 42;
}

int KillSelf() {
  void* p[5];
  for (void*& x : p) cudaMalloc(&x, 1 * kMiB);
  LaunchN(3);
  usleep(300 * 1000);  // > TIERMEM_PRELOAD_FLUSH_MS: the events reach the file
  raise(SIGKILL);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string s = argc > 1 ? argv[1] : "";
  if (s == "basic") return Basic();
  if (s == "threads" && argc == 4) return Threads(std::atoi(argv[2]), std::atoi(argv[3]));
  if (s == "vmm") return Vmm();
  if (s == "offload") return Offload();
  if (s == "offload_full") return OffloadFull();
  if (s == "kernels") return Kernels();
  if (s == "sleep") return Sleep();
  if (s == "killself") return KillSelf();
  std::fprintf(stderr, "usage: %s basic|threads N M|vmm|offload|offload_full|kernels|sleep|killself\n",
               argv[0]);
  return 2;
}
