// A C ABI over the CPU kernels for tests/python/test_kernels_vs_torch.py (loaded with ctypes),
// so the comparison with torch needs neither the tiermem Python package nor pybind11.
// Test-only: not installed, not part of the library's API.
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/optim.h"

using tiermem::kernels::AdamConfig;
using tiermem::kernels::AdamSpans;
using tiermem::kernels::DType;

extern "C" {

// Returns 0 on success, -1 if the ISA name is unknown or this CPU lacks it.
int tm_set_isa(const char* name) noexcept {
  auto isa = tiermem::kernels::ParseIsa(name);
  if (!isa.ok()) return -1;
  return tiermem::kernels::SetKernelIsa(*isa).ok() ? 0 : -1;
}

void tm_set_threads(int threads) noexcept { tiermem::kernels::SetKernelThreads(threads); }

// Returns 0, or -1 if ValidateAdam refuses the arguments. out_dtype < 0: no copy.
int tm_adam_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                 int decoupled, int amsgrad, int64_t step, float inv_loss_scale,
                 float clip_factor, float* param, float* exp_avg, float* exp_avg_sq,
                 float* max_exp_avg_sq, const void* grad, int grad_dtype, void* param_out,
                 int out_dtype, size_t n) noexcept {
  AdamConfig c;
  c.lr = lr;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.decoupled = decoupled != 0;
  c.amsgrad = amsgrad != 0;
  c.step = step;
  c.inv_loss_scale = inv_loss_scale;
  c.clip_factor = clip_factor;
  AdamSpans s;
  s.param = param;
  s.exp_avg = exp_avg;
  s.exp_avg_sq = exp_avg_sq;
  s.max_exp_avg_sq = max_exp_avg_sq;
  s.grad = grad;
  s.grad_dtype = static_cast<DType>(grad_dtype);
  s.param_out = out_dtype < 0 ? nullptr : param_out;
  s.out_dtype = static_cast<DType>(out_dtype < 0 ? 0 : out_dtype);
  s.n = n;
  if (!tiermem::kernels::ValidateAdam(c, s).ok()) return -1;
  tiermem::kernels::AdamStep(c, s);
  return 0;
}

// Returns 1 on overflow, else 0; writes the squared norm.
int tm_grad_norm(const void* grad, int dtype, size_t n, double* sq_norm) noexcept {
  const auto st = tiermem::kernels::GradNormAndOverflow(grad, static_cast<DType>(dtype), n);
  *sq_norm = st.sq_norm;
  return st.overflow ? 1 : 0;
}

void tm_cast_from_f32(const float* src, void* dst, int dtype, size_t n) noexcept {
  tiermem::kernels::CastFromF32(src, dst, static_cast<DType>(dtype), n);
}

}  // extern "C"
