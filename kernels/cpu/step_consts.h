// The per-call constants of the optimizer steps, derived from AdamConfig/SgdConfig in one
// place (bias corrections in double, then rounded to float) and shared by the CPU kernels and
// the CUDA kernels (kernels/cuda), so both compute from identical inputs. Plain structs of
// floats: safe to pass by value to a CUDA kernel.
#pragma once

#include "kernels/cpu/optim.h"

// Helpers both the CPU and the CUDA kernels call.
#ifdef __CUDACC__
#define TIERMEM_HOST_DEVICE __host__ __device__
#else
#define TIERMEM_HOST_DEVICE
#endif

namespace tiermem::kernels::internal {

struct QuantTables;

// AdamStep's constants, computed once per call by optim.cc (in double, then rounded to float).
struct AdamConsts {
  float inv_loss_scale;  // g *= this
  float clip_factor;     // g *= this
  float l2_decay;        // Adam (L2): g = fma(p, l2_decay, g) when use_l2
  bool use_l2;
  float param_decay;  // AdamW: p *= (1 - lr * wd); 1 otherwise (exact no-op)
  float beta1_comp;   // 1 - beta1
  float beta2;
  float beta2_comp;  // 1 - beta2
  float bc2_sqrt;    // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  // CPU only: write param_out with non-temporal stores (large calls: the copy is headed for
  // another device, keeping it out of the cache saves the read-for-ownership traffic).
  bool stream_out = false;
  // Compressed state: the stochastic-rounding key (RoundingKey(rounding_seed)) and, on the
  // CPU, the code tables (quant_tables.h; the CUDA kernels use their device copy).
  uint32_t rounding_key = 0;
  const QuantTables* tables = nullptr;
};

// bf16 stochastic rounding's noise: the 32 bits of element i (16 for m, 16 for v) are
// Hash32(i ^ key), a counter-based hash (lowbias32), so every variant draws the same bits;
// the per-call key hashes the seed, so calls with nearby seeds draw unrelated noise.
TIERMEM_HOST_DEVICE inline uint32_t Hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
inline uint32_t RoundingKey(uint64_t seed) {
  return Hash32(static_cast<uint32_t>(seed) ^ Hash32(static_cast<uint32_t>(seed >> 32) + 1u));
}
TIERMEM_HOST_DEVICE inline uint32_t NoiseBits(uint32_t key, uint32_t i) { return Hash32(i ^ key); }

struct SgdConsts {
  float inv_loss_scale;
  float clip_factor;
  float weight_decay;  // g = fma(p, wd, g) when use_wd
  bool use_wd;
  float momentum;   // buf = fma(buf, momentum, (1 - dampening) * g)
  float damp_comp;  // 1 - dampening
  bool use_momentum;
  bool first_step;  // buf = g (torch clones d_p on the first step)
  bool nesterov;    // d = fma(buf, momentum, g)
  float neg_lr;     // p = fma(d, -lr, p)
};

AdamConsts MakeAdamConsts(const AdamConfig& config);
SgdConsts MakeSgdConsts(const SgdConfig& config);

}  // namespace tiermem::kernels::internal
