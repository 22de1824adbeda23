// CUDA optimizer kernels. Chunks are launched in batches of up to kMaxChunks descriptors passed
// by value as a kernel parameter (no descriptor upload, no allocation): blockIdx.y picks the
// chunk, a grid-stride loop over x covers its elements. The per-call constants come from
// internal::MakeAdamConsts, the same function the CPU kernels use, and every float operation
// is an explicit _rn intrinsic, so a device step equals the CPU scalar reference bit for bit.
#include "kernels/cuda/optim_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cpu/step_consts.h"
#include "tiers/cuda/cuda_status.h"

namespace tiermem::kernels::cuda {
namespace {

using internal::AdamConsts;

constexpr int kMaxChunks = 32;  // 32 x 56-byte descriptors: well inside the 4 KiB param limit
constexpr int kThreads = 256;

struct AdamBatch {
  AdamChunk chunk[kMaxChunks];
};

struct GradBatch {
  const void* grad[kMaxChunks];
  size_t n[kMaxChunks];
};

template <int G>
__device__ __forceinline__ float LoadAs(const void* p, size_t i) {
  if constexpr (G == static_cast<int>(DType::kF32)) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (G == static_cast<int>(DType::kBF16)) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  } else {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
}

__device__ __forceinline__ uint16_t ToBf16(float f) {
  if (isnan(f)) return 0x7FC0;
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ uint16_t ToF16(float f) {
  if (isnan(f)) return static_cast<uint16_t>(((__float_as_uint(f) >> 16) & 0x8000u) | 0x7E00u);
  return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ void StoreAs(void* p, int dtype, size_t i, float v) {
  if (dtype == static_cast<int>(DType::kF32)) {
    static_cast<float*>(p)[i] = v;
  } else if (dtype == static_cast<int>(DType::kBF16)) {
    static_cast<uint16_t*>(p)[i] = ToBf16(v);
  } else {
    static_cast<uint16_t*>(p)[i] = ToF16(v);
  }
}

template <int G, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads) AdamKernel(AdamBatch batch, AdamConsts c, int out_dtype) {
  const AdamChunk& d = batch.chunk[blockIdx.y];
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d.n; i += stride) {
    float g = LoadAs<G>(d.grad, i);
    g = __fmul_rn(g, c.inv_loss_scale);
    g = __fmul_rn(g, c.clip_factor);
    float p = d.param[i];
    if (c.use_l2) g = __fmaf_rn(p, c.l2_decay, g);
    p = __fmul_rn(p, c.param_decay);
    float m = d.exp_avg[i];
    m = __fmaf_rn(c.beta1_comp, __fsub_rn(g, m), m);
    float v = d.exp_avg_sq[i];
    v = __fmaf_rn(v, c.beta2, __fmul_rn(__fmul_rn(c.beta2_comp, g), g));
    float v_hat = v;
    if constexpr (kAmsgrad) {
      const float vm = d.max_exp_avg_sq[i];
      v_hat = vm > v ? vm : v;
      d.max_exp_avg_sq[i] = v_hat;
    }
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_hat), c.bc2_sqrt), c.eps);
    p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, denom), p);
    d.exp_avg[i] = m;
    d.exp_avg_sq[i] = v;
    d.param[i] = p;
    if (d.param_out != nullptr) StoreAs(d.param_out, out_dtype, i, p);
  }
}

template <int G>
__global__ void __launch_bounds__(kThreads) SqSumKernel(GradBatch batch, double* out) {
  const void* g = batch.grad[blockIdx.y];
  const size_t n = batch.n[blockIdx.y];
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  double s = 0;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double x = LoadAs<G>(g, i);
    s = fma(x, x, s);  // a float squared is exact in double
  }
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  __shared__ double warp_sums[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
    if (threadIdx.x == 0) atomicAdd(out, s);
  }
}

template <int O>
__global__ void CastFromKernel(const float* src, void* dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    StoreAs(dst, O, i, src[i]);
  }
}

template <int G>
__global__ void CastToKernel(const void* src, float* dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = LoadAs<G>(src, i);
  }
}

// Blocks along x for `chunks` chunks of at most max_n elements: enough to fill the GPU
// (~8 blocks of 256 threads per SM in total), no more than the work needs.
StatusOr<unsigned> BlocksX(size_t max_n, size_t chunks) {
  int device = 0, sms = 0;
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cuda kernels");
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                               "cuda kernels");
  const size_t want = (static_cast<size_t>(sms) * 8 + chunks - 1) / chunks;
  const size_t need = (max_n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<size_t>(1, std::min({want, need, size_t{65535}})));
}

bool ValidDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

template <bool kAms>
void LaunchAdam(DType g, dim3 grid, cudaStream_t s, const AdamBatch& b, const AdamConsts& c, int out) {
  switch (g) {
    case DType::kF32: AdamKernel<0, kAms><<<grid, kThreads, 0, s>>>(b, c, out); break;
    case DType::kBF16: AdamKernel<1, kAms><<<grid, kThreads, 0, s>>>(b, c, out); break;
    case DType::kF16: AdamKernel<2, kAms><<<grid, kThreads, 0, s>>>(b, c, out); break;
  }
}

}  // namespace

Status AdamStepMulti(const AdamConfig& config, const AdamChunk* chunks, size_t count,
                     DType grad_dtype, DType out_dtype, void* stream) {
  if (count > 0 && chunks == nullptr) return InvalidArgumentError("AdamStepMulti: null chunk list");
  if (!ValidDType(grad_dtype) || !ValidDType(out_dtype)) {
    return InvalidArgumentError("AdamStepMulti: unknown dtype");
  }
  for (size_t i = 0; i < count; ++i) {
    const AdamChunk& ch = chunks[i];
    AdamSpans s{ch.param, ch.exp_avg, ch.exp_avg_sq, ch.max_exp_avg_sq, ch.grad, grad_dtype,
                ch.param_out, out_dtype, ch.n};
    TIERMEM_RETURN_IF_ERROR(ValidateAdam(config, s).WithContext("chunk " + std::to_string(i)));
  }
  const AdamConsts c = internal::MakeAdamConsts(config);
  const auto s = static_cast<cudaStream_t>(stream);
  for (size_t base = 0; base < count; base += kMaxChunks) {
    AdamBatch batch{};
    size_t used = 0, max_n = 0;
    for (size_t i = base; i < count && used < static_cast<size_t>(kMaxChunks); ++i) {
      if (chunks[i].n == 0) continue;  // gridDim.y counts only non-empty chunks
      batch.chunk[used++] = chunks[i];
      max_n = std::max(max_n, chunks[i].n);
    }
    if (used == 0) continue;
    TIERMEM_ASSIGN_OR_RETURN(const unsigned bx, BlocksX(max_n, used));
    const dim3 grid(bx, static_cast<unsigned>(used));
    if (config.amsgrad) {
      LaunchAdam<true>(grad_dtype, grid, s, batch, c, static_cast<int>(out_dtype));
    } else {
      LaunchAdam<false>(grad_dtype, grid, s, batch, c, static_cast<int>(out_dtype));
    }
    TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "AdamStepMulti: launch");
  }
  return OkStatus();
}

StatusOr<GradStats> GradNormAndOverflowMulti(const void* const* grads, const size_t* ns,
                                             size_t count, DType dtype, void* stream) {
  if (count > 0 && (grads == nullptr || ns == nullptr)) {
    return InvalidArgumentError("GradNormAndOverflowMulti: null list");
  }
  if (!ValidDType(dtype)) return InvalidArgumentError("GradNormAndOverflowMulti: unknown dtype");
  const auto s = static_cast<cudaStream_t>(stream);
  double* sum = nullptr;
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaMallocAsync(reinterpret_cast<void**>(&sum), sizeof(double), s),
                               "GradNormAndOverflowMulti: scratch");
  Status status = CudaErrorToStatus(cudaMemsetAsync(sum, 0, sizeof(double), s), "GradNormAndOverflowMulti");
  for (size_t base = 0; status.ok() && base < count; base += kMaxChunks) {
    GradBatch batch{};
    size_t used = 0, max_n = 0;
    for (size_t i = base; i < count && used < static_cast<size_t>(kMaxChunks); ++i) {
      if (ns[i] == 0) continue;
      if (grads[i] == nullptr) {
        status = InvalidArgumentError("GradNormAndOverflowMulti: null grad " + std::to_string(i));
        break;
      }
      batch.grad[used] = grads[i];
      batch.n[used++] = ns[i];
      max_n = std::max(max_n, ns[i]);
    }
    if (!status.ok() || used == 0) continue;
    StatusOr<unsigned> bx = BlocksX(max_n, used);
    if (!bx.ok()) {
      status = bx.status();
      break;
    }
    const dim3 grid(*bx, static_cast<unsigned>(used));
    switch (dtype) {
      case DType::kF32: SqSumKernel<0><<<grid, kThreads, 0, s>>>(batch, sum); break;
      case DType::kBF16: SqSumKernel<1><<<grid, kThreads, 0, s>>>(batch, sum); break;
      case DType::kF16: SqSumKernel<2><<<grid, kThreads, 0, s>>>(batch, sum); break;
    }
    status = CudaErrorToStatus(cudaGetLastError(), "GradNormAndOverflowMulti: launch");
  }
  double host = 0;
  if (status.ok()) {
    status = CudaErrorToStatus(cudaMemcpyAsync(&host, sum, sizeof(double), cudaMemcpyDeviceToHost, s),
                               "GradNormAndOverflowMulti: read back");
  }
  const cudaError_t free_err = cudaFreeAsync(sum, s);
  const cudaError_t sync_err = cudaStreamSynchronize(s);
  if (status.ok()) status = CudaErrorToStatus(free_err, "GradNormAndOverflowMulti: free");
  if (status.ok()) status = CudaErrorToStatus(sync_err, "GradNormAndOverflowMulti: sync");
  if (!status.ok()) return status;
  GradStats st;
  st.sq_norm = host;
  st.overflow = !std::isfinite(host);  // finite floats cannot overflow the double sum
  return st;
}

Status CastFromF32(const float* src, void* dst, DType dst_dtype, size_t n, void* stream) {
  if (n == 0) return OkStatus();
  if (src == nullptr || dst == nullptr || !ValidDType(dst_dtype)) {
    return InvalidArgumentError("cuda CastFromF32: null pointer or unknown dtype");
  }
  TIERMEM_ASSIGN_OR_RETURN(const unsigned bx, BlocksX(n, 1));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dst_dtype) {
    case DType::kF32: CastFromKernel<0><<<bx, kThreads, 0, s>>>(src, dst, n); break;
    case DType::kBF16: CastFromKernel<1><<<bx, kThreads, 0, s>>>(src, dst, n); break;
    case DType::kF16: CastFromKernel<2><<<bx, kThreads, 0, s>>>(src, dst, n); break;
  }
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "cuda CastFromF32: launch");
  return OkStatus();
}

Status CastToF32(const void* src, DType src_dtype, float* dst, size_t n, void* stream) {
  if (n == 0) return OkStatus();
  if (src == nullptr || dst == nullptr || !ValidDType(src_dtype)) {
    return InvalidArgumentError("cuda CastToF32: null pointer or unknown dtype");
  }
  TIERMEM_ASSIGN_OR_RETURN(const unsigned bx, BlocksX(n, 1));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (src_dtype) {
    case DType::kF32: CastToKernel<0><<<bx, kThreads, 0, s>>>(src, dst, n); break;
    case DType::kBF16: CastToKernel<1><<<bx, kThreads, 0, s>>>(src, dst, n); break;
    case DType::kF16: CastToKernel<2><<<bx, kThreads, 0, s>>>(src, dst, n); break;
  }
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "cuda CastToF32: launch");
  return OkStatus();
}

}  // namespace tiermem::kernels::cuda
