// DeviceAdamStep / DeviceGradStats (see device_kernels.h): the one place the session reaches
// the CUDA kernels, behind the session's single CUDA compile definition.
#include "runtime/device_kernels.h"

#include <memory>

#include "tiers/fake/sim_stream.h"

#ifdef TIERMEM_SESSION_WITH_CUDA
#include "kernels/cuda/optim_cuda.h"
#endif

namespace tiermem::session {

Status DeviceAdamStep(bool cuda, const kernels::AdamConfig& config, const kernels::AdamSpans& spans,
                      ComputeStream stream) {
  TIERMEM_RETURN_IF_ERROR(kernels::ValidateAdam(config, spans));
  if (!cuda) {
    if (stream == kHostStream) {
      kernels::AdamStep(config, spans);
      return OkStatus();
    }
    // SimDevice with a simulated compute stream: the kernel is device work like the binding's.
    SimStream* s = SimStream::FromHandle(stream);
    if (s == nullptr) return InvalidArgumentError("optimizer step: not a live SimStream handle");
    s->Enqueue([config, spans] { kernels::AdamStep(config, spans); });
    return OkStatus();
  }
  if (spans.param_in != nullptr || spans.exp_avg_in != nullptr || spans.exp_avg_sq_in != nullptr ||
      spans.max_exp_avg_sq_in != nullptr) {
    return InvalidArgumentError(
        "optimizer step: out-of-place spans on the CUDA kernels (the "
        "CPU kernels only take them)");
  }
#ifdef TIERMEM_SESSION_WITH_CUDA
  if (spans.state.compressed()) {
    return kernels::cuda::AdamStepCompressed(config, spans, reinterpret_cast<void*>(stream.handle));
  }
  kernels::cuda::AdamChunk c;
  c.param = spans.param;
  c.exp_avg = spans.exp_avg;
  c.exp_avg_sq = spans.exp_avg_sq;
  c.max_exp_avg_sq = spans.max_exp_avg_sq;
  c.grad = spans.grad;
  c.param_out = spans.param_out;
  c.n = spans.n;
  // Without a low-precision copy the out dtype is unused; any valid one will do.
  const kernels::DType out = spans.param_out != nullptr ? spans.out_dtype : kernels::DType::kF32;
  return kernels::cuda::AdamStepMulti(config, &c, 1, spans.grad_dtype, out,
                                      reinterpret_cast<void*>(stream.handle));
#else
  return UnavailableError("optimizer step on a CUDA device: this build has no CUDA support");
#endif
}

StatusOr<kernels::GradStats> DeviceGradStats(bool cuda, const std::vector<GradSpan>& spans,
                                             kernels::DType dtype, ComputeStream stream) {
  kernels::GradStats total;
  if (!cuda) {
    auto reduce = [spans, dtype](kernels::GradStats* out) {
      for (const GradSpan& s : spans) {
        const kernels::GradStats st = kernels::GradNormAndOverflow(s.grad, dtype, s.n);
        out->sq_norm += st.sq_norm;
        out->overflow = out->overflow || st.overflow;
      }
    };
    if (stream == kHostStream) {
      reduce(&total);
      return total;
    }
    // On a simulated compute stream, after the work queued so far (like the CUDA kernel).
    SimStream* s = SimStream::FromHandle(stream);
    if (s == nullptr) return InvalidArgumentError("grad norm: not a live SimStream handle");
    auto out = std::make_shared<kernels::GradStats>();
    s->Enqueue([reduce, out] { reduce(out.get()); });
    TIERMEM_RETURN_IF_ERROR(s->Synchronize());
    return *out;
  }
#ifdef TIERMEM_SESSION_WITH_CUDA
  if (spans.empty()) return total;
  std::vector<const void*> ptrs;
  std::vector<size_t> ns;
  for (const GradSpan& s : spans) {
    ptrs.push_back(s.grad);
    ns.push_back(s.n);
  }
  return kernels::cuda::GradNormAndOverflowMulti(ptrs.data(), ns.data(), ptrs.size(), dtype,
                                                 reinterpret_cast<void*>(stream.handle));
#else
  return UnavailableError("grad norm on a CUDA device: this build has no CUDA support");
#endif
}

}  // namespace tiermem::session
