// The optimizer kernels for chunk groups the session steps on the device tier (session.h,
// "optimizer placement"). On SimDevice the device's memory is host memory, so the CPU kernels
// (kernels/cpu) run on it in place — the twin CI tests. On the CUDA tier the CUDA kernels
// (kernels/cuda) are enqueued on the compute stream; they equal the CPU kernels bit for bit
// (kernels/cuda/optim_cuda.h), except the grad-norm sum, which is accumulated in a different
// order (equal within the rounding of a double sum).
//
// The stream orders the kernels with the binding's device work: on CUDA a cudaStream_t; on
// SimDevice kHostStream runs the CPU kernel now, on the calling thread, and a SimStream
// (tests, tiers/fake/sim_stream.h) gets the kernel as queued work, like CUDA.
//
// No CUDA types here; with `cuda` false nothing CUDA is called (and a build without CUDA
// returns kUnavailable for `cuda` true).
// Thread-safety: stateless; the caller orders the spans' memory (the engine's pins).
#pragma once

#include <cstddef>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/optim.h"
#include "tiers/tier.h"

namespace tiermem::session {

// One fused AdamW step over `spans` (validated first: kInvalidArgument changes nothing).
// CPU: runs now. CUDA: enqueued on `stream`.
Status DeviceAdamStep(bool cuda, const kernels::AdamConfig& config, const kernels::AdamSpans& spans,
                      ComputeStream stream);

struct GradSpan {
  const void* grad = nullptr;
  size_t n = 0;
};
// Sum of squares (double) and NaN/Inf over device grad spans of one dtype. CUDA: waits for
// `stream` (the host needs the result).
StatusOr<kernels::GradStats> DeviceGradStats(bool cuda, const std::vector<GradSpan>& spans,
                                             kernels::DType dtype, ComputeStream stream);

}  // namespace tiermem::session
