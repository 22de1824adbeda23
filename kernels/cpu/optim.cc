// Dispatch and threading for the CPU optimizer kernels.
//
// The ISA is chosen once (TIERMEM_KERNEL_ISA at first use, else the best CPUID allows) and may
// be changed by SetKernelIsa; a request for an ISA this CPU lacks is refused, so a table is
// only ever called on a CPU that runs it. Work is split into fixed tiles of kTile elements
// (cache-sized: 4 streams x 128 KiB); a call with more than one tile runs them in a oneTBB
// arena of KernelThreads() threads with a static partition (each thread streams one
// contiguous run of tiles, the same run every call, which keeps first-touched pages local).
// Reductions sum per-tile partial sums in tile order, so GradNormAndOverflow's result does not
// depend on the thread count. Element-wise kernels are independent of tiling by construction.
//
// Thread-safety: the ISA choice is an atomic; the thread count and arena are guarded by a
// mutex, and each call holds a shared_ptr to the arena it started on, so SetKernelThreads may
// race with running steps.
#include "kernels/cpu/optim.h"

#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifdef TIERMEM_KERNELS_X86
#include <cpuid.h>
#endif

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include "base/env.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/sanitizers.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quant_tables.h"

namespace tiermem::kernels {
namespace {

using internal::KernelTable;

// Elements; a multiple of every vector width and of every state block (kMaxStateBlock).
constexpr size_t kTile = 32768;
static_assert(kTile % kMaxStateBlock == 0);
constexpr size_t kStreamOutBytes = 8u << 20;  // param_out at least this big: streaming stores

#ifdef TIERMEM_KERNELS_X86
// CPU features read with CPUID, and XGETBV for whether the OS saves the vector state (XCR0):
// a CPU can report AVX-512 while the OS (or the hypervisor) leaves the ZMM/opmask state off,
// and then every AVX-512 instruction faults. __builtin_cpu_supports checks CPUID only.
struct CpuFeatures {
  bool avx2 = false, avx512 = false;
};

CpuFeatures DetectCpu() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = (c & bit_FMA) != 0, f16c = (c & bit_F16C) != 0;
  if ((c & bit_OSXSAVE) == 0 || (c & bit_AVX) == 0) return f;
  unsigned xlo = 0, xhi = 0;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool os_avx = (xlo & 0x6) == 0x6;       // XMM and YMM state
  const bool os_avx512 = (xlo & 0xe6) == 0xe6;  // and opmask, ZMM_Hi256, Hi16_ZMM
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b & bit_AVX2) != 0;
  const bool avx512 = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL);
  f.avx2 = os_avx && avx2 && fma && f16c;
  f.avx512 = f.avx2 && os_avx512 && avx512;
  return f;
}

const CpuFeatures& Cpu() {
  static const CpuFeatures f = DetectCpu();
  return f;
}
#endif

// TIERMEM_KERNELS_X86 is defined when the AVX2/AVX-512 TUs are built (x86-64 only).
bool CpuHas(Isa isa) {
#ifndef TIERMEM_KERNELS_X86
  return isa == Isa::kScalar;
#else
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return Cpu().avx2;
    case Isa::kAvx512:
      return Cpu().avx512;
  }
  return false;
#endif
}

const KernelTable& TableFor(Isa isa) {
#ifdef TIERMEM_KERNELS_X86
  switch (isa) {
    case Isa::kAvx2:
      return internal::Avx2Table();
    case Isa::kAvx512:
      return internal::Avx512Table();
    case Isa::kScalar:
      break;
  }
#endif
  return internal::ScalarTable();
}

Isa InitialIsa() {
  const char* env = ProcessEnv()("TIERMEM_KERNEL_ISA");
  if (env == nullptr || *env == '\0') return BestSupportedIsa();
  StatusOr<Isa> isa = ParseIsa(env);
  if (!isa.ok()) {
    TIERMEM_LOG(kWarn) << "TIERMEM_KERNEL_ISA: " << isa.status().message() << "; using "
                       << IsaName(BestSupportedIsa());
    return BestSupportedIsa();
  }
  if (!CpuHas(*isa)) {
    TIERMEM_LOG(kWarn) << "TIERMEM_KERNEL_ISA=" << env << ": this CPU lacks it; using "
                       << IsaName(BestSupportedIsa());
    return BestSupportedIsa();
  }
  return *isa;
}

std::atomic<Isa>& IsaChoice() {
  static std::atomic<Isa> isa{InitialIsa()};
  return isa;
}

const KernelTable& Table() { return TableFor(IsaChoice().load(std::memory_order_relaxed)); }

int HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

struct ThreadState {
  Mutex mu;
  int requested TIERMEM_GUARDED_BY(mu) = -1;                      // -1 = not yet read from the env
  std::shared_ptr<tbb::task_arena> arena TIERMEM_GUARDED_BY(mu);  // null until first parallel call
};

ThreadState& Threads() {
  static ThreadState state;
  return state;
}

int RequestedLocked(ThreadState& st) TIERMEM_REQUIRES(st.mu) {
  if (st.requested < 0) {
    st.requested = 0;
    if (const char* env = ProcessEnv()("TIERMEM_CPU_THREADS"); env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (*end == '\0' && v >= 0 && v <= 4096) {
        st.requested = static_cast<int>(v);
      } else {
        TIERMEM_LOG(kWarn) << "TIERMEM_CPU_THREADS=" << env << " is not an integer >= 0; using 0";
      }
    }
  }
  return st.requested;
}

std::shared_ptr<tbb::task_arena> Arena() {
  ThreadState& st = Threads();
  MutexLock lock(st.mu);
  if (!st.arena) {
    const int r = RequestedLocked(st);
    // More threads than cores only oversubscribes (and oneTBB caps its workers there anyway).
    st.arena = std::make_shared<tbb::task_arena>(r == 0 ? HardwareThreads()
                                                        : std::min(r, HardwareThreads()));
  }
  return st.arena;
}

thread_local const ParallelFor* tls_parallel_for = nullptr;  // ScopedParallelFor

// Runs fn(begin, end) over [0, n) in tiles, in parallel when there is more than one tile.
template <typename Fn>
void ForTiles(size_t n, const Fn& fn) {
  if (n == 0) return;
  const size_t tiles = (n + kTile - 1) / kTile;
  if (tiles == 1) {
    fn(0, n);
    return;
  }
  // Tiles [b, e): element ranges of kTile, the last one cut at n. Every path below runs these.
  const auto run_tiles = [&](size_t b, size_t e) {
    for (size_t t = b; t < e; ++t) fn(t * kTile, std::min(n, (t + 1) * kTile));
  };
  if (const ParallelFor* pf = tls_parallel_for; pf != nullptr) {
    int hb = 0;  // as below: the caller's pool is not TSan-instrumented either
    TsanRelease(&hb);
    pf->Run(tiles, [&](size_t b, size_t e) {
      TsanAcquire(&hb);
      run_tiles(b, e);
      TsanRelease(&hb);
    });
    TsanAcquire(&hb);
    return;
  }
  if (KernelThreads() == 1) {
    run_tiles(0, tiles);
    return;
  }
  std::shared_ptr<tbb::task_arena> arena = Arena();
  int hb = 0;        // TSan happens-before token (base/sanitizers.h): libtbb is not
  TsanRelease(&hb);  // instrumented; the caller's data -> the tiles -> the caller again
  arena->execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          TsanAcquire(&hb);
          run_tiles(r.begin(), r.end());
          TsanRelease(&hb);
        },
        tbb::static_partitioner());
  });
  TsanAcquire(&hb);
}

bool ValidDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "unknown";
}

StatusOr<Isa> ParseIsa(std::string_view name) {
  if (name == "auto") return BestSupportedIsa();
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  return InvalidArgumentError("unknown kernel ISA '" + std::string(name) +
                              "' (expected auto, scalar, avx2 or avx512)");
}

Isa BestSupportedIsa() {
  if (CpuHas(Isa::kAvx512)) return Isa::kAvx512;
  if (CpuHas(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

Status SetKernelIsa(Isa isa) {
  if (isa != Isa::kScalar && isa != Isa::kAvx2 && isa != Isa::kAvx512) {
    return InvalidArgumentError("unknown kernel ISA value " +
                                std::to_string(static_cast<int>(isa)));
  }
  if (!CpuHas(isa)) {
    return UnavailableError("this CPU does not support the " + std::string(IsaName(isa)) +
                            " kernels");
  }
  IsaChoice().store(isa, std::memory_order_relaxed);  // tables are immutable; no ordering needed
  return OkStatus();
}

Isa KernelIsa() { return IsaChoice().load(std::memory_order_relaxed); }

ScopedParallelFor::ScopedParallelFor(const ParallelFor* pf) : prev_(tls_parallel_for) {
  tls_parallel_for = pf;
}

ScopedParallelFor::~ScopedParallelFor() { tls_parallel_for = prev_; }

void SetKernelThreads(int threads) {
  ThreadState& st = Threads();
  MutexLock lock(st.mu);
  st.requested = threads < 0 ? 0 : threads;
  st.arena.reset();  // running calls keep their own reference
}

int KernelThreads() {
  ThreadState& st = Threads();
  MutexLock lock(st.mu);
  const int r = RequestedLocked(st);
  return r == 0 ? HardwareThreads() : r;
}

Status ValidateAdam(const AdamConfig& c, const AdamSpans& s) {
  if (s.n == 0) return OkStatus();
  if (s.param == nullptr || s.grad == nullptr ||
      (!s.state.compressed() && (s.exp_avg == nullptr || s.exp_avg_sq == nullptr))) {
    return InvalidArgumentError("AdamStep: param, exp_avg, exp_avg_sq and grad must be non-null");
  }
  if (c.amsgrad && s.max_exp_avg_sq == nullptr) {
    return InvalidArgumentError("AdamStep: amsgrad needs max_exp_avg_sq");
  }
  if (c.step < 1) {
    return InvalidArgumentError("AdamStep: step must be >= 1 (got " + std::to_string(c.step) + ")");
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f) || !(c.beta2 >= 0.0f && c.beta2 < 1.0f)) {
    return InvalidArgumentError("AdamStep: betas must be in [0, 1) (got " +
                                std::to_string(c.beta1) + ", " + std::to_string(c.beta2) + ")");
  }
  if (!(c.eps > 0.0f) || !(c.lr >= 0.0f) || !(c.weight_decay >= 0.0f)) {
    return InvalidArgumentError("AdamStep: need eps > 0, lr >= 0, weight_decay >= 0");
  }
  if (!ValidDType(s.grad_dtype) || (s.param_out != nullptr && !ValidDType(s.out_dtype))) {
    return InvalidArgumentError("AdamStep: unknown dtype");
  }
  if (s.max_exp_avg_sq_in != nullptr && s.max_exp_avg_sq == nullptr) {
    return InvalidArgumentError("AdamStep: max_exp_avg_sq_in without max_exp_avg_sq");
  }
  if (s.state.compressed()) {
    TIERMEM_RETURN_IF_ERROR(ValidateStateFormat(s.state).WithContext("AdamStep"));
    const bool int8 = s.state.dtype == StateDType::kInt8;
    if (s.exp_avg_q.data == nullptr || s.exp_avg_sq_q.data == nullptr ||
        (int8 && (s.exp_avg_q.absmax == nullptr || s.exp_avg_sq_q.absmax == nullptr))) {
      return InvalidArgumentError(
          std::string("AdamStep: ") + std::string(StateDTypeName(s.state.dtype)) +
          " state needs exp_avg_q and exp_avg_sq_q" + (int8 ? " with their absmax" : ""));
    }
    if (c.amsgrad) return InvalidArgumentError("AdamStep: amsgrad needs fp32 state");
    if (s.exp_avg_in != nullptr || s.exp_avg_sq_in != nullptr) {
      return InvalidArgumentError("AdamStep: compressed state is updated in place only");
    }
  }
  return OkStatus();
}

void AdamStep(const AdamConfig& config, const AdamSpans& spans) {
  assert(ValidateAdam(config, spans).ok());
  if (spans.n == 0) return;
  AdamSpans s = spans;
  if (!config.amsgrad) {
    s.max_exp_avg_sq = nullptr;
    s.max_exp_avg_sq_in = nullptr;
  }
  internal::AdamConsts k = internal::MakeAdamConsts(config);
  // Non-temporal stores for the low-precision copy once it cannot stay in cache anyway.
  k.stream_out = s.param_out != nullptr && s.n * DTypeSize(s.out_dtype) >= kStreamOutBytes;
  if (s.state.compressed()) k.tables = &internal::GetQuantTables();
  const KernelTable& t = Table();
  ForTiles(s.n, [&](size_t b, size_t e) { t.adam(k, s, b, e); });
}

void QuantizeState(const StateFormat& format, bool is_signed, const float* src, StateRef out,
                   size_t n, uint64_t seed) {
  assert(ValidateStateFormat(format).ok());
  const uint32_t key = internal::RoundingKey(seed);
  ForTiles(n, [&](size_t b, size_t e) {
    internal::QuantizeStateRange(format, is_signed, src, out, key, b, e);
  });
}

void DequantizeState(const StateFormat& format, bool is_signed, StateRef in, float* dst, size_t n) {
  assert(ValidateStateFormat(format).ok());
  ForTiles(n, [&](size_t b, size_t e) {
    internal::DequantizeStateRange(format, is_signed, in, dst, b, e);
  });
}

GradStats AdamStepUnlessOverflow(const AdamConfig& config, const AdamSpans& spans) {
  GradStats stats = GradNormAndOverflow(spans.grad, spans.grad_dtype, spans.n);
  if (!stats.overflow) AdamStep(config, spans);
  return stats;
}

Status ValidateSgd(const SgdConfig& c, const SgdSpans& s) {
  if (s.n == 0) return OkStatus();
  if (s.param == nullptr || s.grad == nullptr) {
    return InvalidArgumentError("SgdStep: param and grad must be non-null");
  }
  if (c.momentum != 0.0f && s.momentum_buf == nullptr) {
    return InvalidArgumentError("SgdStep: momentum != 0 needs momentum_buf");
  }
  if (c.nesterov && (c.momentum <= 0.0f || c.dampening != 0.0f)) {
    return InvalidArgumentError("SgdStep: nesterov needs momentum > 0 and dampening = 0");
  }
  if (!(c.lr >= 0.0f) || !(c.momentum >= 0.0f) || !(c.weight_decay >= 0.0f)) {
    return InvalidArgumentError("SgdStep: need lr, momentum, weight_decay >= 0");
  }
  if (!ValidDType(s.grad_dtype) || (s.param_out != nullptr && !ValidDType(s.out_dtype))) {
    return InvalidArgumentError("SgdStep: unknown dtype");
  }
  return OkStatus();
}

void SgdStep(const SgdConfig& config, const SgdSpans& spans) {
  assert(ValidateSgd(config, spans).ok());
  if (spans.n == 0) return;
  const internal::SgdConsts k = internal::MakeSgdConsts(config);
  const KernelTable& t = Table();
  ForTiles(spans.n, [&](size_t b, size_t e) { t.sgd(k, spans, b, e); });
}

GradStats GradNormAndOverflow(const void* grad, DType dtype, size_t n) {
  GradStats stats;
  if (n == 0) return stats;
  const KernelTable& t = Table();
  const size_t tiles = (n + kTile - 1) / kTile;
  std::vector<double> partial(tiles, 0.0);
  ForTiles(n, [&](size_t b, size_t e) { partial[b / kTile] = t.sq_sum(grad, dtype, b, e); });
  double sum = 0;
  for (double p : partial) sum += p;
  // A finite float squared is at most ~1.2e77, so a double sum of finite grads is finite:
  // the sum is non-finite exactly when some grad is NaN or Inf.
  stats.sq_norm = sum;
  stats.overflow = !std::isfinite(sum);
  return stats;
}

void CastFromF32(const float* src, void* dst, DType dst_dtype, size_t n) {
  const KernelTable& t = Table();
  ForTiles(n, [&](size_t b, size_t e) { t.cast_from_f32(src, dst, dst_dtype, b, e); });
}

void CastToF32(const void* src, DType src_dtype, float* dst, size_t n) {
  const KernelTable& t = Table();
  ForTiles(n, [&](size_t b, size_t e) { t.cast_to_f32(src, src_dtype, dst, b, e); });
}

void BandwidthProbe(float* a, float* b, float* c, const float* d, size_t n) {
  const KernelTable& t = Table();
  ForTiles(n, [&](size_t lo, size_t hi) { t.probe(a, b, c, d, lo, hi); });
}

}  // namespace tiermem::kernels

namespace tiermem::kernels::internal {

AdamConsts MakeAdamConsts(const AdamConfig& c) {
  AdamConsts k{};
  const double step = static_cast<double>(c.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(c.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(c.beta2), step);
  k.inv_loss_scale = c.inv_loss_scale;
  k.clip_factor = c.clip_factor;
  k.use_l2 = !c.decoupled && c.weight_decay != 0.0f;
  k.l2_decay = c.weight_decay;
  k.param_decay = c.decoupled ? static_cast<float>(1.0 - static_cast<double>(c.lr) *
                                                             static_cast<double>(c.weight_decay))
                              : 1.0f;
  k.beta1_comp = static_cast<float>(1.0 - static_cast<double>(c.beta1));
  k.beta2 = c.beta2;
  k.beta2_comp = static_cast<float>(1.0 - static_cast<double>(c.beta2));
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = c.eps;
  k.neg_step_size = static_cast<float>(-(static_cast<double>(c.lr) / bc1));
  k.rounding_key = RoundingKey(c.rounding_seed);
  return k;
}

SgdConsts MakeSgdConsts(const SgdConfig& c) {
  SgdConsts k{};
  k.inv_loss_scale = c.inv_loss_scale;
  k.clip_factor = c.clip_factor;
  k.weight_decay = c.weight_decay;
  k.use_wd = c.weight_decay != 0.0f;
  k.momentum = c.momentum;
  k.damp_comp = static_cast<float>(1.0 - static_cast<double>(c.dampening));
  k.use_momentum = c.momentum != 0.0f;
  k.first_step = c.first_step;
  k.nesterov = c.nesterov;
  k.neg_lr = -c.lr;
  return k;
}

}  // namespace tiermem::kernels::internal
