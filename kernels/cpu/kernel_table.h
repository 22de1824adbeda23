// Private to kernels/cpu: the per-ISA kernel table and the precomputed step constants.
//
// Each ISA translation unit (optim_scalar.cc, optim_avx2.cc, optim_avx512.cc) is compiled with
// its own -m flags and exports exactly one function returning its table; optim.cc picks a
// table by CPUID and splits the work into tiles across threads. Table entries work on one
// contiguous range [begin, end) of one call's spans on the calling thread; they never
// allocate, never block, and touch nothing outside that range.
//
// Every entry computes exactly the element-wise operation sequence written in
// optim_scalar.cc (same products, same fused multiply-adds, IEEE sqrt and division), so the
// SIMD variants are bit-identical to the scalar reference; only the sum of squares (a
// reduction, summed in a different order) may differ in the last bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/optim.h"

namespace tiermem::kernels::internal {

// AdamStep's constants, computed once per call by optim.cc (in double, then rounded to float).
struct AdamConsts {
  float inv_loss_scale;  // g *= this
  float clip_factor;     // g *= this
  float l2_decay;        // Adam (L2): g = fma(p, l2_decay, g) when use_l2
  bool use_l2;
  float param_decay;     // AdamW: p *= (1 - lr * wd); 1 otherwise (exact no-op)
  float beta1_comp;      // 1 - beta1
  float beta2;
  float beta2_comp;      // 1 - beta2
  float bc2_sqrt;        // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;   // -lr / (1 - beta1^step)
};

struct SgdConsts {
  float inv_loss_scale;
  float clip_factor;
  float weight_decay;  // g = fma(p, wd, g) when use_wd
  bool use_wd;
  float momentum;      // buf = fma(buf, momentum, (1 - dampening) * g)
  float damp_comp;     // 1 - dampening
  bool use_momentum;
  bool first_step;     // buf = g (torch clones d_p on the first step)
  bool nesterov;       // d = fma(buf, momentum, g)
  float neg_lr;        // p = fma(d, -lr, p)
};

struct KernelTable {
  Isa isa;
  void (*adam)(const AdamConsts& c, const AdamSpans& s, size_t begin, size_t end);
  void (*sgd)(const SgdConsts& c, const SgdSpans& s, size_t begin, size_t end);
  // Sum of squares of grad[begin, end) as fp32 values, accumulated in double.
  double (*sq_sum)(const void* grad, DType dtype, size_t begin, size_t end);
  void (*cast_from_f32)(const float* src, void* dst, DType dst_dtype, size_t begin, size_t end);
  void (*cast_to_f32)(const void* src, DType src_dtype, float* dst, size_t begin, size_t end);
  // Bandwidth probe with Adam's access pattern: reads a, b, c, d; writes a, b, c.
  void (*probe)(float* a, float* b, float* c, const float* d, size_t begin, size_t end);
};

const KernelTable& ScalarTable();
const KernelTable& Avx2Table();
const KernelTable& Avx512Table();

}  // namespace tiermem::kernels::internal
