// The per-call constants of the optimizer steps, derived from AdamConfig/SgdConfig in one
// place (bias corrections in double, then rounded to float) and shared by the CPU kernels and
// the CUDA kernels (kernels/cuda), so both compute from identical inputs. Plain structs of
// floats: safe to pass by value to a CUDA kernel.
#pragma once

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
  // CPU only: write param_out with non-temporal stores (large calls: the copy is headed for
  // another device, keeping it out of the cache saves the read-for-ownership traffic).
  bool stream_out = false;
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

AdamConsts MakeAdamConsts(const AdamConfig& config);
SgdConsts MakeSgdConsts(const SgdConfig& config);

}  // namespace tiermem::kernels::internal
