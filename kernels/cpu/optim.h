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
// Compressed optimizer state (AdamSpans::state, "Compressed state" below): m and v stored in
// bf16 or as 8-bit blockwise dynamic codes, dequantized, updated and requantized in the same
// one pass; the fp32 master params stay fp32.
//
// Threading: calls are thread-safe on disjoint spans; each call may use up to
// KernelThreads() threads internally (oneTBB), or the caller's own parallel loop while a
// ScopedParallelFor is alive on the calling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

#include "base/status.h"

namespace tiermem::kernels {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

std::string_view IsaName(Isa isa);
// "auto" (= BestSupportedIsa), "scalar", "avx2", "avx512"; else kInvalidArgument.
StatusOr<Isa> ParseIsa(std::string_view name);
Isa BestSupportedIsa();              // by CPUID
Status SetKernelIsa(Isa isa);        // kUnavailable if the CPU lacks it
Isa KernelIsa();                     // current choice
void SetKernelThreads(int threads);  // 0 = all cores
int KernelThreads();

// A parallel loop a front-end brings for the calls its own thread makes: the torch binding
// passes torch's intra-op pool (at::parallel_for), so a step that follows torch's ops runs on
// the threads those ops just used (libgomp keeps them spinning for a while after each op)
// instead of waking oneTBB's workers to compete with them for the same cores. Run must call
// body over disjoint [begin, end) ranges covering [0, n) and return when all are done; the
// kernels give it the same tiles as oneTBB, so results are identical either way.
class ParallelFor {
 public:
  virtual ~ParallelFor() = default;
  virtual void Run(size_t n, const std::function<void(size_t, size_t)>& body) const = 0;
};

// While alive, kernel calls made on this thread run their tiles through `pf` (null: oneTBB).
// Nests; other threads are unaffected.
class ScopedParallelFor {
 public:
  explicit ScopedParallelFor(const ParallelFor* pf);
  ~ScopedParallelFor();
  ScopedParallelFor(const ScopedParallelFor&) = delete;
  ScopedParallelFor& operator=(const ScopedParallelFor&) = delete;

 private:
  const ParallelFor* prev_;
};

struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled = true;  // true: AdamW; false: Adam (L2 added to the grad)
  bool amsgrad = false;
  int64_t step = 1;             // 1-based step number after increment (torch's state['step'])
  float inv_loss_scale = 1.0f;  // grads are multiplied by this first (1 = skip)
  float clip_factor = 1.0f;     // then by this (global-norm clip coefficient; 1 = skip)
  uint64_t rounding_seed = 0;   // bf16 state with stochastic rounding: the noise's key
};

// ---- Compressed state -------------------------------------------------------------------------
// The element format of Adam's m and v (config optimizer.state_dtype):
//   kF32   4 bytes per element (exact; the default).
//   kBF16  2 bytes: bf16, rounded to nearest even after every update (or stochastically:
//          StateFormat::stochastic, an unbiased rounding from a counter-based hash of
//          (AdamConfig::rounding_seed, element index): the same bits on every ISA).
//   kInt8  1 byte plus 4 bytes per block of `block` elements: blockwise dynamic quantization
//          (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022). Each block
//          keeps its absmax (fp32) and every element the index of the code nearest to
//          value / absmax in a 256-entry dynamic ("tree") map: signed for m, unsigned for v
//          (DynamicCode; the maps bitsandbytes' create_dynamic_map describes). Dequantized:
//          code[q] * absmax. Nearest: ties go to the code of smaller magnitude.
// Storage of n elements (StateBytes): kInt8 is the n code bytes, then ceil(n / block) fp32
// absmax values; blocks start at the span's first element, so a span whose blocks must not
// straddle two tensors starts each tensor on a block boundary (the session aligns them).
enum class StateDType : uint8_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };
std::string_view StateDTypeName(StateDType dtype);  // "fp32", "bf16", "int8"
// "fp32", "bf16", "int8"; else kInvalidArgument naming the accepted values.
StatusOr<StateDType> ParseStateDType(std::string_view name);

inline constexpr uint32_t kMinStateBlock = 64, kMaxStateBlock = 4096;

struct StateFormat {
  StateDType dtype = StateDType::kF32;
  uint32_t block = 256;     // kInt8: elements per absmax (a power of two in [64, 4096])
  bool stochastic = false;  // kBF16: stochastic rounding instead of round-to-nearest-even
  bool compressed() const { return dtype != StateDType::kF32; }
  bool operator==(const StateFormat& o) const {
    return dtype == o.dtype && block == o.block && stochastic == o.stochastic;
  }
};
// kInvalidArgument for a block outside [64, 4096] or not a power of two.
Status ValidateStateFormat(const StateFormat& format);
// Bytes of n elements of one state tensor in `format` (codes, then absmax for kInt8).
size_t StateBytes(const StateFormat& format, size_t n);
inline size_t StateBlocks(const StateFormat& format, size_t n) {
  return format.dtype == StateDType::kInt8 ? (n + format.block - 1) / format.block : 0;
}

// The 256 codes of the dynamic map, ascending: signed (m: 127 negative values, 0, 127
// positive values and 1) or unsigned (v: 0, 254 positive values and 1). The values are those
// of bitsandbytes' create_dynamic_map(signed, 7, 8), generated here from the description:
// for i in 0..6, the midpoints of linspace(0.1, 1, k + 1) scaled by 10^(i - 6), k = 2^i
// (signed, and their negations) or 2^(i + 1) (unsigned); plus 0 and 1.
const float* DynamicCode(bool is_signed);
// Index of the code nearest to x (|x| <= 1 after the absmax division; larger values take the
// extreme code, NaN a deterministic one): a bucket table over x's exponent and top 7 mantissa
// bits, then one comparison — no search.
uint8_t QuantizeToCode(float x, bool is_signed);

// One compressed state tensor: codes (kInt8: uint8; kBF16: bf16 as uint16) and, for kInt8,
// one absmax per block of the span.
struct StateRef {
  void* data = nullptr;
  float* absmax = nullptr;
};
// Blockwise quantization of n fp32 values into `out` (kInt8: codes and absmax; kBF16: bf16 with
// the format's rounding, element index i keyed by `seed`; kF32: a copy). `is_signed`: the map
// of m (true) or v (false). Dequantize is its inverse up to the codes' resolution.
void QuantizeState(const StateFormat& format, bool is_signed, const float* src, StateRef out,
                   size_t n, uint64_t seed = 0);
void DequantizeState(const StateFormat& format, bool is_signed, StateRef in, float* dst, size_t n);

struct AdamSpans {
  float* param = nullptr;           // fp32 master params, updated in place
  float* exp_avg = nullptr;         // m
  float* exp_avg_sq = nullptr;      // v
  float* max_exp_avg_sq = nullptr;  // amsgrad only, else nullptr
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* param_out = nullptr;  // optional low-precision copy of the updated param
  DType out_dtype = DType::kBF16;
  size_t n = 0;
  // Out of place: when set, the old values are read here and the new ones written to the
  // spans above (which then need not hold anything), each independently; null = in place.
  // An input either is its output or does not overlap it (nor any other output). Bit for bit
  // the in-place step's results. (The session's speculative updates write into scratch this
  // way instead of copying the state there first.) CPU kernels only.
  const float* param_in = nullptr;
  const float* exp_avg_in = nullptr;
  const float* exp_avg_sq_in = nullptr;
  const float* max_exp_avg_sq_in = nullptr;
  // Compressed state (state.compressed()): m and v are exp_avg_q / exp_avg_sq_q instead of
  // exp_avg / exp_avg_sq (unused then), read, updated and written back in the same pass (kInt8:
  // per block: dequantize, update every element, take the new absmax, requantize). In place
  // only (no *_in for them; param_in still works); no amsgrad. The result is the fp32 step's
  // on the dequantized state, with the new m and v rounded to the format (the param update
  // uses the new m and v before rounding, as bitsandbytes' 8-bit step does).
  StateFormat state = {};
  StateRef exp_avg_q = {}, exp_avg_sq_q = {};
};

void AdamStep(const AdamConfig& config, const AdamSpans& spans);

// Checks what AdamStep assumes (non-null spans, amsgrad buffer, step >= 1, betas in [0, 1),
// eps > 0, supported dtypes) and says what is wrong (kInvalidArgument). AdamStep itself only
// asserts; front-ends validate once per parameter group.
Status ValidateAdam(const AdamConfig& config, const AdamSpans& spans);

struct GradStats {
  double sq_norm = 0;     // sum of squares of the grads (as fp32 values, accumulated in double)
  bool overflow = false;  // any NaN/Inf
};
// The cheap separate reduction used for overflow detection and global-norm clipping.
GradStats GradNormAndOverflow(const void* grad, DType dtype, size_t n);

// The overflow-safe step of one chunk: runs GradNormAndOverflow and, only when the grads are
// all finite, AdamStep. With an overflow nothing is written (param, m, v, param_out untouched)
// and the returned stats say so; the caller skips the step everywhere and lowers its loss
// scale. (A global-norm clip needs the norm over all chunks first: call GradNormAndOverflow
// on each, then AdamStep with clip_factor.)
GradStats AdamStepUnlessOverflow(const AdamConfig& config, const AdamSpans& spans);

// torch.optim.SGD: d = g (+ wd * p); with momentum, buf = g on the first step, else
// buf = momentum * buf + (1 - dampening) * d; d = nesterov ? d + momentum * buf : buf;
// p -= lr * d. Grad unscaling/clipping and the low-precision copy as in AdamStep.
struct SgdConfig {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool first_step = true;  // momentum buffer not yet initialised (torch: buf is None)
  float inv_loss_scale = 1.0f;
  float clip_factor = 1.0f;
};

struct SgdSpans {
  float* param = nullptr;
  float* momentum_buf = nullptr;  // required when momentum != 0, else ignored
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* param_out = nullptr;
  DType out_dtype = DType::kBF16;
  size_t n = 0;
};

void SgdStep(const SgdConfig& config, const SgdSpans& spans);
Status ValidateSgd(const SgdConfig& config, const SgdSpans& spans);

// fp32 <-> bf16/fp16 casts (round-to-nearest-even).
void CastFromF32(const float* src, void* dst, DType dst_dtype, size_t n);
void CastToF32(const void* src, DType src_dtype, float* dst, size_t n);

std::string_view DTypeName(DType dtype);  // "f32", "bf16", "f16"
inline size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// Benchmark support: a pass with AdamStep's DRAM access pattern (reads a, b, c, d; writes a,
// b, c; same tiling and threads as the kernels) using the current ISA. Its bytes/s is the
// roofline the optimizer kernels are measured against.
void BandwidthProbe(float* a, float* b, float* c, const float* d, size_t n);

}  // namespace tiermem::kernels
