// CUDA optimizer kernels. Chunks are launched in batches of up to kMaxChunks descriptors passed
// by value as a kernel parameter (no descriptor upload, no allocation): blockIdx.y picks the
// chunk, a grid-stride loop over x covers its elements. The per-call constants come from
// internal::MakeAdamConsts, the same function the CPU kernels use, and every float operation
// is an explicit _rn intrinsic, so a device step equals the CPU scalar reference bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/cpu/quant_tables.h"
#include "kernels/cpu/step_consts.h"
#include "kernels/cuda/optim_cuda.h"
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
__global__ void __launch_bounds__(kThreads)
    AdamKernel(AdamBatch batch, AdamConsts c, int out_dtype) {
  const AdamChunk& d = batch.chunk[blockIdx.y];
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d.n;
       i += stride) {
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

// ---- compressed state (the CPU scalar reference: optim_scalar.cc) ------------------------

using internal::QuantTables;
__device__ float g_code[2][256];                         // QuantTables::code
__device__ uint32_t g_bucket[2][QuantTables::kBuckets];  // QuantTables::bucket

// The update of one element on fp32 values (AdamElement).
__device__ __forceinline__ void AdamElement(const AdamConsts& c, float g, float& p, float& m,
                                            float& v) {
  g = __fmul_rn(g, c.inv_loss_scale);
  g = __fmul_rn(g, c.clip_factor);
  if (c.use_l2) g = __fmaf_rn(p, c.l2_decay, g);
  p = __fmul_rn(p, c.param_decay);
  m = __fmaf_rn(c.beta1_comp, __fsub_rn(g, m), m);
  v = __fmaf_rn(v, c.beta2, __fmul_rn(__fmul_rn(c.beta2_comp, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, denom), p);
}

// QuantizeScalar (quant_tables.h) on the device tables.
__device__ __forceinline__ uint8_t Quantize(float x, int is_signed) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t a = bits & 0x7FFFFFFFu;
  int b = static_cast<int>(a >> 16) - QuantTables::kBucketBase;
  b = b < 0 ? 0 : (b >= QuantTables::kBuckets ? QuantTables::kBuckets - 1 : b);
  const uint32_t e = g_bucket[is_signed][b];
  uint32_t k = (e >> 16) + ((a & 0xFFFFu) > (e & 0xFFFFu) ? 1u : 0u);
  if (!is_signed) return static_cast<uint8_t>(k);
  if (bits >> 31) return static_cast<uint8_t>(QuantTables::kZeroSigned - (k > 127 ? 127 : k));
  return static_cast<uint8_t>(QuantTables::kZeroSigned + k);
}

struct StateArgs {
  float* param;
  const void* grad;
  void* param_out;
  void* m;  // codes
  void* v;
  float* m_absmax;  // int8
  float* v_absmax;
  size_t n;
  uint32_t block;
  int out_dtype;  // -1: no copy
  bool stochastic;
};

// One thread block per quantization block: update every element (new m and v to shared
// memory), reduce the block's max |m|, max |v| and NaN flag, then requantize.
template <int G>
__global__ void __launch_bounds__(kThreads) AdamInt8Kernel(StateArgs a, AdamConsts c) {
  extern __shared__ float sh[];  // [block] m, then [block] v
  float* mb = sh;
  float* vb = sh + a.block;
  const size_t b0 = static_cast<size_t>(blockIdx.x) * a.block;
  const size_t n = min(static_cast<size_t>(a.block), a.n - b0);
  const float am = a.m_absmax[blockIdx.x], av = a.v_absmax[blockIdx.x];
  auto* mq = static_cast<uint8_t*>(a.m) + b0;
  auto* vq = static_cast<uint8_t*>(a.v) + b0;
  float mx_m = 0.0f, mx_v = 0.0f;
  int nan = 0;
  for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
    const size_t i = b0 + j;
    float p = a.param[i];
    float m = __fmul_rn(g_code[1][mq[j]], am), v = __fmul_rn(g_code[0][vq[j]], av);
    AdamElement(c, LoadAs<G>(a.grad, i), p, m, v);
    a.param[i] = p;
    if (a.out_dtype >= 0) StoreAs(a.param_out, a.out_dtype, i, p);
    mb[j] = m;
    vb[j] = v;
    nan |= isnan(m) || isnan(v);
    mx_m = fmaxf(mx_m, fabsf(m));  // exact; NaN is tracked by `nan`
    mx_v = fmaxf(mx_v, fabsf(v));
  }
  for (int off = 16; off > 0; off >>= 1) {
    mx_m = fmaxf(mx_m, __shfl_down_sync(0xffffffffu, mx_m, off));
    mx_v = fmaxf(mx_v, __shfl_down_sync(0xffffffffu, mx_v, off));
    nan |= __shfl_down_sync(0xffffffffu, nan, off);
  }
  __shared__ float warp_m[kThreads / 32], warp_v[kThreads / 32];
  __shared__ int warp_nan[kThreads / 32];
  __shared__ float inv_m, inv_v;
  if ((threadIdx.x & 31) == 0) {
    warp_m[threadIdx.x / 32] = mx_m;
    warp_v[threadIdx.x / 32] = mx_v;
    warp_nan[threadIdx.x / 32] = nan;
  }
  __syncthreads();  // also: every mb/vb written
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
      mx_m = fmaxf(mx_m, warp_m[w]);
      mx_v = fmaxf(mx_v, warp_v[w]);
      nan |= warp_nan[w];
    }
    const float am2 = nan ? __int_as_float(0x7FC00000) : mx_m;
    const float av2 = nan ? __int_as_float(0x7FC00000) : mx_v;
    a.m_absmax[blockIdx.x] = am2;
    a.v_absmax[blockIdx.x] = av2;
    inv_m = am2 > 0.0f ? __fdiv_rn(1.0f, am2) : 0.0f;
    inv_v = av2 > 0.0f ? __fdiv_rn(1.0f, av2) : 0.0f;
  }
  __syncthreads();
  for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
    mq[j] = Quantize(__fmul_rn(mb[j], inv_m), 1);
    vq[j] = Quantize(__fmul_rn(vb[j], inv_v), 0);
  }
}

__device__ __forceinline__ uint16_t StochasticBf16(float f, uint32_t r16) {
  if (isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((__float_as_uint(f) + r16) >> 16);
}

template <int G>
__global__ void __launch_bounds__(kThreads) AdamBf16StateKernel(StateArgs a, AdamConsts c) {
  auto* mq = static_cast<uint16_t*>(a.m);
  auto* vq = static_cast<uint16_t*>(a.v);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n;
       i += stride) {
    float p = a.param[i];
    float m = __uint_as_float(static_cast<uint32_t>(mq[i]) << 16);
    float v = __uint_as_float(static_cast<uint32_t>(vq[i]) << 16);
    AdamElement(c, LoadAs<G>(a.grad, i), p, m, v);
    if (a.stochastic) {
      const uint32_t r = internal::NoiseBits(c.rounding_key, static_cast<uint32_t>(i));
      mq[i] = StochasticBf16(m, r & 0xFFFFu);
      vq[i] = StochasticBf16(v, r >> 16);
    } else {
      mq[i] = ToBf16(m);
      vq[i] = ToBf16(v);
    }
    a.param[i] = p;
    if (a.out_dtype >= 0) StoreAs(a.param_out, a.out_dtype, i, p);
  }
}

// The code tables on the device, copied once per process (one device).
Status UploadTables() {
  static std::once_flag once;
  static cudaError_t err = cudaSuccess;
  std::call_once(once, [] {
    const QuantTables& t = internal::GetQuantTables();
    err = cudaMemcpyToSymbol(g_code, t.code, sizeof(t.code));
    if (err == cudaSuccess) err = cudaMemcpyToSymbol(g_bucket, t.bucket, sizeof(t.bucket));
  });
  return CudaErrorToStatus(err, "AdamStepCompressed: code tables");
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
void LaunchAdam(DType g, dim3 grid, cudaStream_t s, const AdamBatch& b, const AdamConsts& c,
                int out) {
  switch (g) {
    case DType::kF32:
      AdamKernel<0, kAms><<<grid, kThreads, 0, s>>>(b, c, out);
      break;
    case DType::kBF16:
      AdamKernel<1, kAms><<<grid, kThreads, 0, s>>>(b, c, out);
      break;
    case DType::kF16:
      AdamKernel<2, kAms><<<grid, kThreads, 0, s>>>(b, c, out);
      break;
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
    AdamSpans s{ch.param,     ch.exp_avg, ch.exp_avg_sq, ch.max_exp_avg_sq, ch.grad, grad_dtype,
                ch.param_out, out_dtype,  ch.n};
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

Status AdamStepCompressed(const AdamConfig& config, const AdamSpans& spans, void* stream) {
  TIERMEM_RETURN_IF_ERROR(ValidateAdam(config, spans));
  if (!spans.state.compressed()) {
    return InvalidArgumentError("AdamStepCompressed: fp32 state goes through AdamStepMulti");
  }
  if (spans.param_in != nullptr) {
    return InvalidArgumentError("AdamStepCompressed: out-of-place spans (CPU kernels only)");
  }
  if (spans.n == 0) return OkStatus();
  TIERMEM_RETURN_IF_ERROR(UploadTables());
  AdamConsts c = internal::MakeAdamConsts(config);
  StateArgs a{spans.param,
              spans.grad,
              spans.param_out,
              spans.exp_avg_q.data,
              spans.exp_avg_sq_q.data,
              spans.exp_avg_q.absmax,
              spans.exp_avg_sq_q.absmax,
              spans.n,
              spans.state.block,
              spans.param_out != nullptr ? static_cast<int>(spans.out_dtype) : -1,
              spans.state.stochastic};
  const auto s = static_cast<cudaStream_t>(stream);
  if (spans.state.dtype == StateDType::kInt8) {
    const unsigned blocks =
        static_cast<unsigned>((spans.n + spans.state.block - 1) / spans.state.block);
    const size_t shared = 2 * spans.state.block * sizeof(float);
    if (shared > 48 * 1024) {
      TIERMEM_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(AdamInt8Kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared)),
          "AdamStepCompressed");
      TIERMEM_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(AdamInt8Kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared)),
          "AdamStepCompressed");
      TIERMEM_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(AdamInt8Kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared)),
          "AdamStepCompressed");
    }
    switch (spans.grad_dtype) {
      case DType::kF32:
        AdamInt8Kernel<0><<<blocks, kThreads, shared, s>>>(a, c);
        break;
      case DType::kBF16:
        AdamInt8Kernel<1><<<blocks, kThreads, shared, s>>>(a, c);
        break;
      case DType::kF16:
        AdamInt8Kernel<2><<<blocks, kThreads, shared, s>>>(a, c);
        break;
    }
  } else {
    TIERMEM_ASSIGN_OR_RETURN(const unsigned bx, BlocksX(spans.n, 1));
    switch (spans.grad_dtype) {
      case DType::kF32:
        AdamBf16StateKernel<0><<<bx, kThreads, 0, s>>>(a, c);
        break;
      case DType::kBF16:
        AdamBf16StateKernel<1><<<bx, kThreads, 0, s>>>(a, c);
        break;
      case DType::kF16:
        AdamBf16StateKernel<2><<<bx, kThreads, 0, s>>>(a, c);
        break;
    }
  }
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "AdamStepCompressed: launch");
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
  Status status =
      CudaErrorToStatus(cudaMemsetAsync(sum, 0, sizeof(double), s), "GradNormAndOverflowMulti");
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
      case DType::kF32:
        SqSumKernel<0><<<grid, kThreads, 0, s>>>(batch, sum);
        break;
      case DType::kBF16:
        SqSumKernel<1><<<grid, kThreads, 0, s>>>(batch, sum);
        break;
      case DType::kF16:
        SqSumKernel<2><<<grid, kThreads, 0, s>>>(batch, sum);
        break;
    }
    status = CudaErrorToStatus(cudaGetLastError(), "GradNormAndOverflowMulti: launch");
  }
  double host = 0;
  if (status.ok()) {
    status =
        CudaErrorToStatus(cudaMemcpyAsync(&host, sum, sizeof(double), cudaMemcpyDeviceToHost, s),
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
    case DType::kF32:
      CastFromKernel<0><<<bx, kThreads, 0, s>>>(src, dst, n);
      break;
    case DType::kBF16:
      CastFromKernel<1><<<bx, kThreads, 0, s>>>(src, dst, n);
      break;
    case DType::kF16:
      CastFromKernel<2><<<bx, kThreads, 0, s>>>(src, dst, n);
      break;
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
    case DType::kF32:
      CastToKernel<0><<<bx, kThreads, 0, s>>>(src, dst, n);
      break;
    case DType::kBF16:
      CastToKernel<1><<<bx, kThreads, 0, s>>>(src, dst, n);
      break;
    case DType::kF16:
      CastToKernel<2><<<bx, kThreads, 0, s>>>(src, dst, n);
      break;
  }
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "cuda CastToF32: launch");
  return OkStatus();
}

}  // namespace tiermem::kernels::cuda
