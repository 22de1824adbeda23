// CPU optimizer kernels: the C++ API over raw spans (no torch types). The engine and the
// Python package call these; every ISA variant (scalar reference, AVX2+FMA, AVX-512) sits
// behind the same functions and is picked at run time by CPUID (override: TIERMEM_KERNEL_ISA
// via Options, or SetKernelIsa for tests).
//
// Semantics are exactly torch.optim.AdamW / Adam (bias correction, eps outside the sqrt,
// decoupled decay for AdamW, L2 for Adam, optional amsgrad, maximize=False) and torch.optim.SGD
// (momentum, dampening, nesterov, weight decay).
//
// One fused pass per call: read grad (fp32/bf16/fp16) -> g *= inv_loss_scale (if != 1) ->
// g *= clip_factor (if != 1) -> update m, v, the fp32 master param -> optionally write the
// low-precision copy (round-to-nearest-even) into param_out.
//
// Threading: calls are thread-safe on disjoint spans; each call may use up to
// KernelThreads() threads internally (oneTBB).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "runtime/base/status.h"

namespace tiermem::kernels {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

std::string_view IsaName(Isa isa);
Isa BestSupportedIsa();                  // by CPUID
Status SetKernelIsa(Isa isa);            // kUnavailable if the CPU lacks it
Isa KernelIsa();                         // current choice
void SetKernelThreads(int threads);      // 0 = all cores
int KernelThreads();

struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled = true;  // true: AdamW; false: Adam (L2 added to the grad)
  bool amsgrad = false;
  int64_t step = 1;       // 1-based step number after increment (torch's state['step'])
  float inv_loss_scale = 1.0f;  // grads are multiplied by this first (1 = skip)
  float clip_factor = 1.0f;     // then by this (global-norm clip coefficient; 1 = skip)
};

struct AdamSpans {
  float* param = nullptr;        // fp32 master params, updated in place
  float* exp_avg = nullptr;      // m
  float* exp_avg_sq = nullptr;   // v
  float* max_exp_avg_sq = nullptr;  // amsgrad only, else nullptr
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* param_out = nullptr;     // optional low-precision copy of the updated param
  DType out_dtype = DType::kBF16;
  size_t n = 0;
};

void AdamStep(const AdamConfig& config, const AdamSpans& spans);

struct GradStats {
  double sq_norm = 0;   // sum of squares of the grads (as fp32 values, accumulated in double)
  bool overflow = false;  // any NaN/Inf
};
// The cheap separate reduction used for overflow detection and global-norm clipping.
GradStats GradNormAndOverflow(const void* grad, DType dtype, size_t n);

// fp32 <-> bf16/fp16 casts (round-to-nearest-even).
void CastFromF32(const float* src, void* dst, DType dst_dtype, size_t n);
void CastToF32(const void* src, DType src_dtype, float* dst, size_t n);

}  // namespace tiermem::kernels
