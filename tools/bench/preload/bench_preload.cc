// tiermem_bench_preload [--pairs N] [--rounds R] [--threads T] [--size BYTES] [--json]
//
// Interposition overhead of libtiermem_preload.so per cudaMalloc/cudaFree pair, against the
// fake CUDA runtime called directly, in the same process and run. The binary links the shim
// before the fake (libcudart.so.12), so its plain calls go through the shim exactly as an
// LD_PRELOADed application's do (the shim forwards with dlsym(RTLD_NEXT)); the direct calls
// use the fake's own symbols (dlsym on the fake's handle). Rounds alternate which side runs
// first. The shim records into a real timeline file (in $TMPDIR or /tmp, deleted afterwards):
// every pair is two recorded events, so "events/s" is the recording rate through the shim.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "integrations/preload/fake/fake_cudart.h"

namespace {

using tiermem::preload::CudaFreeFn;
using tiermem::preload::CudaMallocFn;

struct Args {
  long pairs = 200000;
  int rounds = 10;
  int threads = 1;
  size_t size = 4096;
  bool json = false;
};

// Runs `pairs` malloc/free pairs on each of `threads` threads; returns wall ns divided by all
// pairs of all threads.
double TimePairs(const Args& a, CudaMallocFn do_malloc, CudaFreeFn do_free) {
  std::vector<std::thread> pool;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < a.threads; ++t) {
    pool.emplace_back([&] {
      for (long i = 0; i < a.pairs; ++i) {
        void* p = nullptr;
        if (do_malloc(&p, a.size) != 0 || do_free(p) != 0) std::abort();
      }
    });
  }
  for (auto& th : pool) th.join();
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  return ns / (static_cast<double>(a.pairs) * a.threads);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&] {
      return i + 1 < argc
                 ? argv[++i]
                 : (std::fprintf(stderr, "%s needs a value\n", s.c_str()), std::exit(2), argv[0]);
    };
    if (s == "--pairs")
      a.pairs = std::atol(next());
    else if (s == "--rounds")
      a.rounds = std::atoi(next());
    else if (s == "--threads")
      a.threads = std::atoi(next());
    else if (s == "--size")
      a.size = std::strtoull(next(), nullptr, 10);
    else if (s == "--json")
      a.json = true;
    else {
      std::fprintf(stderr, "usage: %s [--pairs N] [--rounds R] [--threads T] [--size B] [--json]\n",
                   argv[0]);
      return 2;
    }
  }
  if (a.pairs <= 0 || a.rounds <= 0 || a.threads <= 0) return 2;
  const char* tmp = std::getenv("TMPDIR");
  const std::string timeline = std::string(tmp ? tmp : "/tmp") + "/tiermem_bench_preload_" +
                               std::to_string(::getpid()) + ".tmt";
  // Read by the shim at its first call, below.
  setenv("TIERMEM_PRELOAD_TIMELINE", timeline.c_str(), 1);
  setenv("TIERMEM_PRELOAD_QUIET", "1", 1);

  void* fake = dlopen("libcudart.so.12", RTLD_LAZY | RTLD_NOLOAD);
  if (fake == nullptr) {
    std::fprintf(stderr, "the fake runtime is not loaded: %s\n", dlerror());
    return 1;
  }
  auto direct_malloc = reinterpret_cast<CudaMallocFn>(dlsym(fake, "cudaMalloc"));
  auto direct_free = reinterpret_cast<CudaFreeFn>(dlsym(fake, "cudaFree"));
  CudaMallocFn shim_malloc = &cudaMalloc;  // resolved to the shim (linked first)
  CudaFreeFn shim_free = &cudaFree;
  if (direct_malloc == nullptr || direct_free == nullptr ||
      reinterpret_cast<void*>(direct_malloc) == reinterpret_cast<void*>(shim_malloc)) {
    std::fprintf(stderr, "could not tell the shim's cudaMalloc from the fake's\n");
    return 1;
  }
  Args warm = a;
  warm.pairs = std::min(a.pairs, 20000L);
  TimePairs(warm, shim_malloc, shim_free);  // activates the shim, faults the buffers in
  TimePairs(warm, direct_malloc, direct_free);

  std::vector<double> direct, shim, added;
  for (int r = 0; r < a.rounds; ++r) {
    double d, s;
    if (r % 2 == 0) {
      d = TimePairs(a, direct_malloc, direct_free);
      s = TimePairs(a, shim_malloc, shim_free);
    } else {
      s = TimePairs(a, shim_malloc, shim_free);
      d = TimePairs(a, direct_malloc, direct_free);
    }
    direct.push_back(d);
    shim.push_back(s);
    added.push_back((s - d) / 2);  // two calls per pair
  }
  unlink(timeline.c_str());
  const double md = Median(direct), ms = Median(shim), madd = Median(added);
  // ms is wall time per pair over all threads; two recorded events per pair.
  const double events_per_s = 2e9 / ms;
  if (a.json) {
    std::printf(
        "{\"benchmark\":\"preload\",\"pairs\":%ld,\"rounds\":%d,\"threads\":%d,\"size\":%zu,"
        "\"direct_ns_per_pair\":%.1f,\"shim_ns_per_pair\":%.1f,\"added_ns_per_call\":%.1f,"
        "\"ratio\":%.3f,\"recorded_events_per_s\":%.0f,\"added_ns_per_call_rounds\":[",
        a.pairs, a.rounds, a.threads, a.size, md, ms, madd, ms / md, events_per_s);
    for (size_t i = 0; i < added.size(); ++i) std::printf("%s%.1f", i ? "," : "", added[i]);
    std::printf("]}\n");
  } else {
    std::printf(
        "preload shim vs fake runtime, %ld cudaMalloc/cudaFree pairs of %zu B x %d thread(s), "
        "%d rounds (median)\n",
        a.pairs, a.size, a.threads, a.rounds);
    std::printf("  direct      %8.1f ns/pair\n", md);
    std::printf("  via shim    %8.1f ns/pair  (ratio %.2fx)\n", ms, ms / md);
    std::printf("  added       %8.1f ns per call   rounds:", madd);
    for (double x : added) std::printf(" %.0f", x);
    std::printf("\n  recorded    %8.2f M events/s through the shim\n", events_per_s / 1e6);
  }
  return 0;
}
