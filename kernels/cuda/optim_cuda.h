// CUDA optimizer kernels: the CPU kernels' fused step (kernels/cpu/optim.h) as one multi-tensor
// launch over a list of device chunks, plus the grad-norm/overflow reduction and the casts.
// No CUDA types here: `stream` is a cudaStream_t passed as void* (nullptr = the legacy
// default stream). All pointers are device (or managed) memory.
//
// The element-wise math is the scalar reference's, written with round-to-nearest intrinsics
// (__fmaf_rn, __fdiv_rn, __fsqrt_rn, ...) so nvcc cannot contract or approximate it: results
// equal the CPU kernels bit for bit. The sum of squares is accumulated in double with atomics
// (order varies run to run: equal to the CPU value within rounding of the sum).
//
// Errors: launch/configuration failures and bad arguments come back as a Status
// (kInvalidArgument for bad arguments, the CUDA error otherwise, converted in
// tiers/cuda/cuda_status). Asynchronous unless stated.
#pragma once

#include <cstddef>

#include "base/status.h"
#include "kernels/cpu/optim.h"

namespace tiermem::kernels::cuda {

struct AdamChunk {
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // amsgrad only
  const void* grad = nullptr;       // grad_dtype
  void* param_out = nullptr;        // out_dtype copy of the updated param, or nullptr
  size_t n = 0;
};

// One fused AdamW/Adam step over every chunk (all with the same config and dtypes), enqueued
// on `stream`. `chunks` is host memory and may be reused as soon as this returns.
Status AdamStepMulti(const AdamConfig& config, const AdamChunk* chunks, size_t count,
                     DType grad_dtype, DType out_dtype, void* stream);

// One fused step over `spans` with compressed m and v (spans.state: bf16, or int8 codes with
// one absmax per block; kernels/cpu/optim.h "Compressed state"), enqueued on `stream`: the CPU
// scalar reference's results bit for bit (one thread block per quantization block: the block's
// new m and v in shared memory, its absmax reduced there, then requantized). All pointers in
// `spans` are device memory; in place only (no *_in), no amsgrad (ValidateAdam says so). The
// code tables are copied to the device at the first call.
Status AdamStepCompressed(const AdamConfig& config, const AdamSpans& spans, void* stream);

// Sum of squares (double) and NaN/Inf detection over several device grad buffers. Waits for
// `stream` (the result is needed on the host to decide the step).
StatusOr<GradStats> GradNormAndOverflowMulti(const void* const* grads, const size_t* ns,
                                             size_t count, DType dtype, void* stream);

// fp32 <-> bf16/fp16, round-to-nearest-even (the CPU casts' results).
Status CastFromF32(const float* src, void* dst, DType dst_dtype, size_t n, void* stream);
Status CastToF32(const void* src, DType src_dtype, float* dst, size_t n, void* stream);

}  // namespace tiermem::kernels::cuda
