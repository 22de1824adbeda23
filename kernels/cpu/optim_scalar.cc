// The scalar reference: the definition of every kernel's element-wise semantics.
//
// Per element of AdamStep, in this order and with these roundings (all fp32):
//   g  = float(grad) * inv_loss_scale * clip_factor     (two products, exact when 1)
//   g  = fma(p, wd, g)                                  (Adam / L2 only, when wd != 0)
//   p  = p * (1 - lr * wd)                              (AdamW; factor 1 otherwise: exact)
//   m  = fma(1 - beta1, g - m, m)                       (torch's lerp_(g, 1 - beta1))
//   v  = fma(v, beta2, ((1 - beta2) * g) * g)
//   vm = vm > v ? vm : v; v_hat = vm                    (amsgrad) else v_hat = v
//   d  = sqrt(v_hat) / sqrt(1 - beta2^step) + eps       (IEEE sqrt and division)
//   p  = fma(-lr / (1 - beta1^step), m / d, p)
//   out = round_to_nearest_even(p)                      (bf16 / fp16, if param_out)
// The SIMD variants perform the same operations (no reciprocal approximations, no
// contraction: kernel TUs build with -ffp-contract=off), so they match this bit for bit.
// bf16 rounding follows c10::BFloat16 (NaN -> 0x7FC0); fp16 follows c10::Half (IEEE RNE,
// subnormals kept, NaN -> sign | 0x7E00 for canonical NaNs).
//
// Compressed state (optim.h): the same per-element update on m and v read as
//   int8:  m = code_signed[q_m] * absmax_m(block),  v = code_unsigned[q_v] * absmax_v(block)
//   bf16:  m = float(m_bf16), v = float(v_bf16)
// and written back as
//   int8:  per block, after every element of it is updated: absmax = max |m| over the block
//          (both absmax NaN if any new m or v of the block is NaN), inv = absmax > 0 ?
//          1 / absmax : 0 (IEEE division), and q = QuantizeScalar(m * inv) (quant_tables.h);
//          v alike with the unsigned map
//   bf16:  round to nearest even (c10::BFloat16), or stochastically: NaN -> 0x7FC0, else the
//          top 16 bits of bits(m) + r, with r the low 16 (v: high 16) of NoiseBits(key, i),
//          i the element's index in the call's span.
// The param update uses the updated m and v before they are rounded.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quant_tables.h"

namespace tiermem::kernels::internal {
namespace {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToF32(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

inline uint16_t F32ToBf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = Bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u);  // quiet NaNs
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112u - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  return FromBits(bits);
}

// c10::detail::fp16_ieee_from_fp32_value.
inline uint16_t F32ToF16(float f) {
  const float scale_to_inf = FromBits(239u << 23);
  const float scale_to_zero = FromBits(17u << 23);
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = Bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = FromBits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = Bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float LoadAs(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0;
}

inline void StoreAs(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = F32ToBf16(v);
      return;
    case DType::kF16:
      static_cast<uint16_t*>(p)[i] = F32ToF16(v);
      return;
  }
}

inline uint16_t StochasticBf16(float f, uint32_t r16) {
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((Bits(f) + r16) >> 16);
}

// One element's update on fp32 values (the formula at the top), shared by every state format.
inline void AdamElement(const AdamConsts& c, float g, float& p, float& m, float& v) {
  g = g * c.inv_loss_scale;
  g = g * c.clip_factor;
  if (c.use_l2) g = std::fma(p, c.l2_decay, g);
  p = p * c.param_decay;
  m = std::fma(c.beta1_comp, g - m, m);
  v = std::fma(v, c.beta2, (c.beta2_comp * g) * g);
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = std::fma(c.neg_step_size, m / denom, p);
}

void AdamBf16State(const AdamConsts& c, const AdamSpans& s, size_t begin, size_t end) {
  const float* p_in = s.param_in ? s.param_in : s.param;
  auto* mq = static_cast<uint16_t*>(s.exp_avg_q.data);
  auto* vq = static_cast<uint16_t*>(s.exp_avg_sq_q.data);
  for (size_t i = begin; i < end; ++i) {
    float p = p_in[i], m = Bf16ToF32(mq[i]), v = Bf16ToF32(vq[i]);
    AdamElement(c, LoadAs(s.grad, s.grad_dtype, i), p, m, v);
    if (s.state.stochastic) {
      const uint32_t r = NoiseBits(c.rounding_key, static_cast<uint32_t>(i));
      mq[i] = StochasticBf16(m, r & 0xFFFFu);
      vq[i] = StochasticBf16(v, r >> 16);
    } else {
      mq[i] = F32ToBf16(m);
      vq[i] = F32ToBf16(v);
    }
    s.param[i] = p;
    if (s.param_out != nullptr) StoreAs(s.param_out, s.out_dtype, i, p);
  }
}

// The largest |x| of a block (exact, whatever the order).
float BlockMax(const float* x, size_t n) {
  float mx = 0.0f;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, std::fabs(x[i]));
  return mx;
}

bool AnyNan(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return true;
  }
  return false;
}

// The codes of a block whose absmax is `absmax`.
void QuantizeBlock(const QuantTables& t, bool is_signed, const float* x, size_t n, float absmax,
                   uint8_t* q) {
  const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
  for (size_t i = 0; i < n; ++i) q[i] = QuantizeScalar(t, x[i] * inv, is_signed);
}

void AdamInt8State(const AdamConsts& c, const AdamSpans& s, size_t begin, size_t end) {
  const QuantTables& t = *c.tables;
  const float* p_in = s.param_in ? s.param_in : s.param;
  auto* mq = static_cast<uint8_t*>(s.exp_avg_q.data);
  auto* vq = static_cast<uint8_t*>(s.exp_avg_sq_q.data);
  const size_t block = s.state.block;
  float mb[kMaxStateBlock], vb[kMaxStateBlock];
  for (size_t b0 = begin; b0 < end; b0 += block) {
    const size_t n = std::min(block, end - b0), blk = b0 / block;
    const float am = s.exp_avg_q.absmax[blk], av = s.exp_avg_sq_q.absmax[blk];
    for (size_t j = 0; j < n; ++j) {
      const size_t i = b0 + j;
      float p = p_in[i], m = t.code[1][mq[i]] * am, v = t.code[0][vq[i]] * av;
      AdamElement(c, LoadAs(s.grad, s.grad_dtype, i), p, m, v);
      mb[j] = m;
      vb[j] = v;
      s.param[i] = p;
      if (s.param_out != nullptr) StoreAs(s.param_out, s.out_dtype, i, p);
    }
    // A NaN among the block's new m or v makes both absmax NaN: the block stays visibly bad.
    const bool nan = AnyNan(mb, n) || AnyNan(vb, n);
    const float q_nan = std::numeric_limits<float>::quiet_NaN();
    s.exp_avg_q.absmax[blk] = nan ? q_nan : BlockMax(mb, n);
    s.exp_avg_sq_q.absmax[blk] = nan ? q_nan : BlockMax(vb, n);
    QuantizeBlock(t, true, mb, n, s.exp_avg_q.absmax[blk], mq + b0);
    QuantizeBlock(t, false, vb, n, s.exp_avg_sq_q.absmax[blk], vq + b0);
  }
}

void Adam(const AdamConsts& c, const AdamSpans& s, size_t begin, size_t end) {
  if (s.state.dtype == StateDType::kInt8) return AdamInt8State(c, s, begin, end);
  if (s.state.dtype == StateDType::kBF16) return AdamBf16State(c, s, begin, end);
  // The old values: at the *_in spans when out of place, else at the outputs.
  const float* p_in = s.param_in ? s.param_in : s.param;
  const float* m_in = s.exp_avg_in ? s.exp_avg_in : s.exp_avg;
  const float* v_in = s.exp_avg_sq_in ? s.exp_avg_sq_in : s.exp_avg_sq;
  const float* vm_in = s.max_exp_avg_sq_in ? s.max_exp_avg_sq_in : s.max_exp_avg_sq;
  for (size_t i = begin; i < end; ++i) {
    float g = LoadAs(s.grad, s.grad_dtype, i);
    g = g * c.inv_loss_scale;
    g = g * c.clip_factor;
    float p = p_in[i];
    if (c.use_l2) g = std::fma(p, c.l2_decay, g);
    p = p * c.param_decay;
    float m = m_in[i];
    m = std::fma(c.beta1_comp, g - m, m);
    float v = v_in[i];
    v = std::fma(v, c.beta2, (c.beta2_comp * g) * g);
    float v_hat = v;
    if (s.max_exp_avg_sq != nullptr) {
      const float vm = vm_in[i];
      v_hat = vm > v ? vm : v;
      s.max_exp_avg_sq[i] = v_hat;
    }
    const float denom = std::sqrt(v_hat) / c.bc2_sqrt + c.eps;
    p = std::fma(c.neg_step_size, m / denom, p);
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = v;
    s.param[i] = p;
    if (s.param_out != nullptr) StoreAs(s.param_out, s.out_dtype, i, p);
  }
}

void Sgd(const SgdConsts& c, const SgdSpans& s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float g = LoadAs(s.grad, s.grad_dtype, i);
    g = g * c.inv_loss_scale;
    g = g * c.clip_factor;
    float p = s.param[i];
    if (c.use_wd) g = std::fma(p, c.weight_decay, g);
    float d = g;
    if (c.use_momentum) {
      float buf = c.first_step ? g : std::fma(s.momentum_buf[i], c.momentum, c.damp_comp * g);
      s.momentum_buf[i] = buf;
      d = c.nesterov ? std::fma(buf, c.momentum, g) : buf;
    }
    p = std::fma(d, c.neg_lr, p);
    s.param[i] = p;
    if (s.param_out != nullptr) StoreAs(s.param_out, s.out_dtype, i, p);
  }
}

double SqSum(const void* grad, DType dtype, size_t begin, size_t end) {
  double sum = 0;
  for (size_t i = begin; i < end; ++i) {
    const double g = LoadAs(grad, dtype, i);
    sum += g * g;
  }
  return sum;
}

void CastFrom(const float* src, void* dst, DType dst_dtype, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) StoreAs(dst, dst_dtype, i, src[i]);
}

void CastTo(const void* src, DType src_dtype, float* dst, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) dst[i] = LoadAs(src, src_dtype, i);
}

void Probe(float* a, float* b, float* c, const float* d, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float x = d[i];
    a[i] += x;
    b[i] += x;
    c[i] += x;
  }
}

}  // namespace

void QuantizeStateRange(const StateFormat& f, bool is_signed, const float* src, StateRef out,
                        uint32_t key, size_t begin, size_t end) {
  switch (f.dtype) {
    case StateDType::kF32:
      std::memcpy(static_cast<float*>(out.data) + begin, src + begin, (end - begin) * 4);
      return;
    case StateDType::kBF16: {
      auto* q = static_cast<uint16_t*>(out.data);
      for (size_t i = begin; i < end; ++i) {
        const uint32_t r = NoiseBits(key, static_cast<uint32_t>(i));
        q[i] = f.stochastic ? StochasticBf16(src[i], is_signed ? r & 0xFFFFu : r >> 16)
                            : F32ToBf16(src[i]);
      }
      return;
    }
    case StateDType::kInt8: {
      const QuantTables& t = GetQuantTables();
      for (size_t b0 = begin; b0 < end; b0 += f.block) {
        const size_t n = std::min<size_t>(f.block, end - b0);
        float& absmax = out.absmax[b0 / f.block];
        absmax =
            AnyNan(src + b0, n) ? std::numeric_limits<float>::quiet_NaN() : BlockMax(src + b0, n);
        QuantizeBlock(t, is_signed, src + b0, n, absmax, static_cast<uint8_t*>(out.data) + b0);
      }
      return;
    }
  }
}

void DequantizeStateRange(const StateFormat& f, bool is_signed, StateRef in, float* dst,
                          size_t begin, size_t end) {
  switch (f.dtype) {
    case StateDType::kF32:
      std::memcpy(dst + begin, static_cast<const float*>(in.data) + begin, (end - begin) * 4);
      return;
    case StateDType::kBF16:
      for (size_t i = begin; i < end; ++i) dst[i] = Bf16ToF32(static_cast<uint16_t*>(in.data)[i]);
      return;
    case StateDType::kInt8: {
      const float* code = GetQuantTables().code[is_signed ? 1 : 0];
      const auto* q = static_cast<const uint8_t*>(in.data);
      for (size_t i = begin; i < end; ++i) dst[i] = code[q[i]] * in.absmax[i / f.block];
      return;
    }
  }
}

const KernelTable& ScalarTable() {
  static const KernelTable table{Isa::kScalar, Adam, Sgd, SqSum, CastFrom, CastTo, Probe};
  return table;
}

}  // namespace tiermem::kernels::internal
