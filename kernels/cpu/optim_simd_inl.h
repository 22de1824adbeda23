// Private to the ISA translation units: the kernel bodies written once over a vector-traits
// class V (V::kWidth lanes of fp32), instantiated by optim_avx2.cc and optim_avx512.cc.
//
// Everything here sits in an anonymous namespace on purpose: each ISA TU is compiled with
// different -m flags, so each must get its own private copy (a shared inline definition could
// be merged by the linker with another TU's and run AVX-512 code on an AVX2-only CPU).
//
// The element-wise bodies perform exactly the operations of optim_scalar.cc (see the formula
// at its top) so the results are bit-identical. The last partial vector of a range is copied
// into zero-padded stack buffers, run through the same vector body, and copied back, so tails
// need no masked loads (AVX2 has none for 16-bit data) and stay bit-identical too.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quant_tables.h"

namespace tiermem::kernels::internal {
namespace {  // NOLINT(build/namespaces): deliberate, see above

// Out dtype of the fused copy: none, or one of the DTypes.
enum class Out : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

template <class V, DType G>
inline typename V::F LoadGrad(const void* p, size_t i) {
  if constexpr (G == DType::kF32) return V::Load(static_cast<const float*>(p) + i);
  if constexpr (G == DType::kBF16) return V::LoadBf16(static_cast<const uint16_t*>(p) + i);
  if constexpr (G == DType::kF16) return V::LoadF16(static_cast<const uint16_t*>(p) + i);
}

// kStream: non-temporal store (the caller checked the alignment and fences afterwards).
template <class V, Out O, bool kStream = false>
inline void StoreOut(void* p, size_t i, typename V::F x) {
  if constexpr (O == Out::kF32) {
    if constexpr (kStream)
      V::Stream(static_cast<float*>(p) + i, x);
    else
      V::Store(static_cast<float*>(p) + i, x);
  } else if constexpr (O == Out::kBF16 || O == Out::kF16) {
    const typename V::H h = O == Out::kBF16 ? V::Bf16(x) : V::F16(x);
    if constexpr (kStream)
      V::StreamH(static_cast<uint16_t*>(p) + i, h);
    else
      V::StoreH(static_cast<uint16_t*>(p) + i, h);
  }
}

inline size_t OutSize(Out o) { return o == Out::kF32 ? 4 : 2; }

// Whether the main loop of a range starting at `begin` may use non-temporal stores into `out`:
// asked for, and every vector store lands on its natural alignment.
template <class V, Out O>
inline bool CanStream(bool wanted, const void* out, size_t begin) {
  if constexpr (O == Out::kNone) {
    return false;
  } else {
    const size_t vec_bytes = V::kWidth * OutSize(O);
    return wanted && (reinterpret_cast<uintptr_t>(out) + begin * OutSize(O)) % vec_bytes == 0;
  }
}

// AdamConsts broadcast once into registers. A local copy also matters for speed: the
// kernels' float stores could alias the float fields of a `const AdamConsts&`, which would
// force a reload and re-broadcast of every constant per vector.
template <class V>
struct AdamVecs {
  typename V::F ils, clip, l2, decay, b1c, b2, b2c, bc2, eps, nss;
  bool use_l2;
  explicit AdamVecs(const AdamConsts& c)
      : ils(V::Set1(c.inv_loss_scale)),
        clip(V::Set1(c.clip_factor)),
        l2(V::Set1(c.l2_decay)),
        decay(V::Set1(c.param_decay)),
        b1c(V::Set1(c.beta1_comp)),
        b2(V::Set1(c.beta2)),
        b2c(V::Set1(c.beta2_comp)),
        bc2(V::Set1(c.bc2_sqrt)),
        eps(V::Set1(c.eps)),
        nss(V::Set1(c.neg_step_size)),
        use_l2(c.use_l2) {}
};

template <class V, DType G, Out O, bool kAmsgrad>
struct AdamKernel {
  using F = typename V::F;
  // One vector at element i of the given arrays.
  // Reads the old values at the *_in pointers (the outputs themselves when in place).
  struct In {
    const float* p;
    const float* m;
    const float* v;
    const float* vm;
  };
  template <bool kStream = false>
  static inline void Body(const AdamVecs<V>& c, const In& in, float* param, float* m_p, float* v_p,
                          float* vm_p, const void* grad, void* out, size_t i) {
    F g = LoadGrad<V, G>(grad, i);
    g = V::Mul(g, c.ils);
    g = V::Mul(g, c.clip);
    F p = V::Load(in.p + i);
    if (c.use_l2) g = V::Fma(p, c.l2, g);
    p = V::Mul(p, c.decay);
    F m = V::Load(in.m + i);
    m = V::Fma(c.b1c, V::Sub(g, m), m);
    F v = V::Load(in.v + i);
    v = V::Fma(v, c.b2, V::Mul(V::Mul(c.b2c, g), g));
    F v_hat = v;
    if constexpr (kAmsgrad) {
      v_hat = V::Max(V::Load(in.vm + i), v);  // vm > v ? vm : v, as the reference
      V::Store(vm_p + i, v_hat);
    }
    const F denom = V::Add(V::Div(V::Sqrt(v_hat), c.bc2), c.eps);
    p = V::Fma(c.nss, V::Div(m, denom), p);
    V::Store(m_p + i, m);
    V::Store(v_p + i, v);
    V::Store(param + i, p);
    StoreOut<V, O, kStream>(out, i, p);
  }

  static void Run(const AdamConsts& consts, const AdamSpans& s, size_t begin, size_t end) {
    constexpr size_t W = V::kWidth;
    const AdamVecs<V> c(consts);
    float* const param = s.param;
    float* const m_p = s.exp_avg;
    float* const v_p = s.exp_avg_sq;
    float* const vm_p = s.max_exp_avg_sq;
    const void* const grad = s.grad;
    void* const out = s.param_out;
    const In in{s.param_in ? s.param_in : param, s.exp_avg_in ? s.exp_avg_in : m_p,
                s.exp_avg_sq_in ? s.exp_avg_sq_in : v_p,
                s.max_exp_avg_sq_in ? s.max_exp_avg_sq_in : vm_p};
    size_t i = begin;
    if (CanStream<V, O>(consts.stream_out, out, begin)) {
      for (; i + W <= end; i += W) Body<true>(c, in, param, m_p, v_p, vm_p, grad, out, i);
      _mm_sfence();  // order the non-temporal stores before whatever reads `out` next
    } else {
      for (; i + W <= end; i += W) Body(c, in, param, m_p, v_p, vm_p, grad, out, i);
    }
    const size_t rem = end - i;
    if (rem == 0) return;
    alignas(64) float p[W] = {}, m[W] = {}, v[W] = {}, vm[W] = {}, o[W] = {};
    alignas(64) unsigned char g[W * 4] = {};
    const size_t gsize = DTypeSize(G);
    std::memcpy(p, in.p + i, rem * 4);
    std::memcpy(m, in.m + i, rem * 4);
    std::memcpy(v, in.v + i, rem * 4);
    if constexpr (kAmsgrad) std::memcpy(vm, in.vm + i, rem * 4);
    std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gsize, rem * gsize);
    Body(c, In{p, m, v, vm}, p, m, v, vm, g, o, 0);
    std::memcpy(s.param + i, p, rem * 4);
    std::memcpy(s.exp_avg + i, m, rem * 4);
    std::memcpy(s.exp_avg_sq + i, v, rem * 4);
    if constexpr (kAmsgrad) std::memcpy(s.max_exp_avg_sq + i, vm, rem * 4);
    if constexpr (O != Out::kNone) {
      const size_t osize = O == Out::kF32 ? 4 : 2;
      std::memcpy(static_cast<unsigned char*>(s.param_out) + i * osize, o, rem * osize);
    }
  }
};

// ---- compressed state (optim_scalar.cc has the reference) -------------------------------------

// The update of one vector on fp32 values (no amsgrad): optim_scalar.cc's AdamElement.
template <class V>
inline void AdamVector(const AdamVecs<V>& c, typename V::F g, typename V::F& p, typename V::F& m,
                       typename V::F& v) {
  g = V::Mul(g, c.ils);
  g = V::Mul(g, c.clip);
  if (c.use_l2) g = V::Fma(p, c.l2, g);
  p = V::Mul(p, c.decay);
  m = V::Fma(c.b1c, V::Sub(g, m), m);
  v = V::Fma(v, c.b2, V::Mul(V::Mul(c.b2c, g), g));
  const typename V::F denom = V::Add(V::Div(V::Sqrt(v), c.bc2), c.eps);
  p = V::Fma(c.nss, V::Div(m, denom), p);
}

// Codes of W normalized values (QuantizeScalar, lane by lane).
template <class V>
inline typename V::I QuantizeVector(const QuantTables& t, typename V::F x, bool is_signed) {
  using I = typename V::I;
  const I bits = V::BitsOf(x);
  const I a = V::AndI(bits, V::Set1I(0x7FFFFFFF));
  I b = V::SubI(V::Srli16(a), V::Set1I(QuantTables::kBucketBase));
  b = V::MinI(V::MaxI(b, V::Set1I(0)), V::Set1I(QuantTables::kBuckets - 1));
  const I e = V::GatherI(t.bucket[is_signed ? 1 : 0], b);
  const I mask16 = V::Set1I(0xFFFF);
  const I k = V::AddI(V::Srli16(e), V::GreaterI(V::AndI(a, mask16), V::AndI(e, mask16)));
  if (!is_signed) return k;
  const I zero = V::Set1I(QuantTables::kZeroSigned);
  return V::SelectBySign(bits, V::SubI(zero, V::MinI(k, V::Set1I(127))), V::AddI(zero, k));
}

// Per block: dequantize and update every element (params written, new m and v kept in block
// buffers), then the new absmax, then requantize. Tails of a block (fewer than W elements)
// run the same vector body on zero-padded copies; only real lanes enter the absmax.
template <class V, DType G, Out O>
struct AdamInt8Kernel {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr size_t W = V::kWidth;

  // Running max |m|, max v and NaN lanes (of m or v) over a block's new values.
  struct Max {
    F m, v, nan;
  };

  // kPre: mb and vb already hold the code values of mq and vq (V::DequantBlock); else the
  // codes are looked up here.
  template <bool kPre>
  static inline void Body(const AdamVecs<V>& c, const QuantTables& t, F am, F av, const float* p_in,
                          float* param, const uint8_t* mq, const uint8_t* vq, const void* grad,
                          void* out, float* mb, float* vb, size_t i, Max& mx) {
    F p = V::Load(p_in + i);
    F m, v;
    if constexpr (kPre) {
      m = V::Mul(V::Load(mb), am);
      v = V::Mul(V::Load(vb), av);
    } else {
      m = V::Mul(V::GatherF(t.code[1], V::LoadU8(mq + i)), am);
      v = V::Mul(V::GatherF(t.code[0], V::LoadU8(vq + i)), av);
    }
    AdamVector<V>(c, LoadGrad<V, G>(grad, i), p, m, v);
    V::Store(param + i, p);
    StoreOut<V, O>(out, i, p);
    V::Store(mb, m);
    V::Store(vb, v);
    mx.m = V::Max(mx.m, V::Abs(m));
    mx.v = V::Max(mx.v, V::Abs(v));
    mx.nan = V::Or(mx.nan, V::Unordered2(m, v));
  }

  static void Quantize(const QuantTables& t, bool is_signed, const float* x, size_t n, float absmax,
                       uint8_t* q) {
    const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
    size_t j = 0;
    if constexpr (V::kFastQuantize) {
      if (t.fast_ok) j = V::QuantizeFast(t, is_signed, x, n, inv, q);  // whole vectors
    }
    const F vinv = V::Set1(inv);
    for (; j + W <= n; j += W) {
      V::StoreU8(q + j, QuantizeVector<V>(t, V::Mul(V::Load(x + j), vinv), is_signed));
    }
    for (; j < n; ++j) q[j] = QuantizeScalar(t, x[j] * inv, is_signed);
  }

  static void Run(const AdamConsts& consts, const AdamSpans& s, size_t begin, size_t end) {
    const AdamVecs<V> c(consts);
    const QuantTables& t = *consts.tables;
    const float* p_in = s.param_in ? s.param_in : s.param;
    auto* mq = static_cast<uint8_t*>(s.exp_avg_q.data);
    auto* vq = static_cast<uint8_t*>(s.exp_avg_sq_q.data);
    const size_t block = s.state.block;
    alignas(64) float mb[kMaxStateBlock], vb[kMaxStateBlock];
    const bool pre = V::HasDequantBlock();
    for (size_t b0 = begin; b0 < end; b0 += block) {
      const size_t n = std::min(block, end - b0), blk = b0 / block;
      const F am = V::Set1(s.exp_avg_q.absmax[blk]), av = V::Set1(s.exp_avg_sq_q.absmax[blk]);
      Max mx{V::Set1(0.0f), V::Set1(0.0f), V::Set1(0.0f)};
      size_t j = 0;
      if (pre) {
        // The block's code values first (whole vectors; a tail runs the lookup in Body).
        const size_t nv = n / W * W;
        V::DequantBlock(t, true, mq + b0, nv, mb);
        V::DequantBlock(t, false, vq + b0, nv, vb);
        for (; j + W <= n; j += W) {
          Body<true>(c, t, am, av, p_in, s.param, mq, vq, s.grad, s.param_out, mb + j, vb + j,
                     b0 + j, mx);
        }
      } else {
        for (; j + W <= n; j += W) {
          Body<false>(c, t, am, av, p_in, s.param, mq, vq, s.grad, s.param_out, mb + j, vb + j,
                      b0 + j, mx);
        }
      }
      float max_m = V::HMax(mx.m), max_v = V::HMax(mx.v);
      bool nan = V::AnyBits(mx.nan);
      if (j < n) {
        const size_t rem = n - j, i = b0 + j, gsize = DTypeSize(G);
        alignas(64) float p[W] = {}, o[W] = {};
        alignas(64) uint8_t qm[W] = {}, qv[W] = {};
        alignas(64) unsigned char g[W * 4] = {};
        std::memcpy(p, p_in + i, rem * 4);
        std::memcpy(qm, mq + i, rem);
        std::memcpy(qv, vq + i, rem);
        std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gsize, rem * gsize);
        alignas(64) float tm[W], tv[W];
        Max unused{V::Set1(0.0f), V::Set1(0.0f), V::Set1(0.0f)};
        Body<false>(c, t, am, av, p, p, qm, qv, g, o, tm, tv, 0, unused);
        std::memcpy(mb + j, tm, rem * 4);
        std::memcpy(vb + j, tv, rem * 4);
        std::memcpy(s.param + i, p, rem * 4);
        if constexpr (O != Out::kNone) {
          const size_t osize = OutSize(O);
          std::memcpy(static_cast<unsigned char*>(s.param_out) + i * osize, o, rem * osize);
        }
        for (size_t r = 0; r < rem; ++r) {  // the real lanes only (order-free: exact)
          nan = nan || std::isnan(tm[r]) || std::isnan(tv[r]);
          max_m = std::max(max_m, std::fabs(tm[r]));
          max_v = std::max(max_v, std::fabs(tv[r]));
        }
      }
      const float q_nan = std::numeric_limits<float>::quiet_NaN();
      s.exp_avg_q.absmax[blk] = nan ? q_nan : max_m;
      s.exp_avg_sq_q.absmax[blk] = nan ? q_nan : max_v;
      Quantize(t, true, mb, n, s.exp_avg_q.absmax[blk], mq + b0);
      Quantize(t, false, vb, n, s.exp_avg_sq_q.absmax[blk], vq + b0);
    }
  }
};

template <class V, DType G, Out O>
struct AdamBf16StateKernel {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr size_t W = V::kWidth;

  // NoiseBits(key, i + lane) for each lane.
  static inline I Noise(I key, size_t i) {
    I x = V::XorI(V::AddI(V::Set1I(static_cast<int>(static_cast<uint32_t>(i))), V::Iota()), key);
    x = V::XorI(x, V::Srli16(x));
    x = V::MulLoI(x, V::Set1I(static_cast<int>(0x7feb352du)));
    x = V::XorI(x, V::Srli15(x));
    x = V::MulLoI(x, V::Set1I(static_cast<int>(0x846ca68bu)));
    return V::XorI(x, V::Srli16(x));
  }

  static inline void Body(const AdamVecs<V>& c, bool stochastic, I key, const float* p_in,
                          float* param, uint16_t* mq, uint16_t* vq, const void* grad, void* out,
                          size_t i, size_t noise_i) {
    F p = V::Load(p_in + i);
    F m = V::LoadBf16(mq + i);
    F v = V::LoadBf16(vq + i);
    AdamVector<V>(c, LoadGrad<V, G>(grad, i), p, m, v);
    if (stochastic) {
      const I r = Noise(key, noise_i);
      V::StoreH(mq + i, V::Bf16Stochastic(m, V::AndI(r, V::Set1I(0xFFFF))));
      V::StoreH(vq + i, V::Bf16Stochastic(v, V::Srli16(r)));
    } else {
      V::StoreH(mq + i, V::Bf16(m));
      V::StoreH(vq + i, V::Bf16(v));
    }
    V::Store(param + i, p);
    StoreOut<V, O>(out, i, p);
  }

  static void Run(const AdamConsts& consts, const AdamSpans& s, size_t begin, size_t end) {
    const AdamVecs<V> c(consts);
    const I key = V::Set1I(static_cast<int>(consts.rounding_key));
    const bool st = s.state.stochastic;
    const float* p_in = s.param_in ? s.param_in : s.param;
    auto* mq = static_cast<uint16_t*>(s.exp_avg_q.data);
    auto* vq = static_cast<uint16_t*>(s.exp_avg_sq_q.data);
    size_t i = begin;
    for (; i + W <= end; i += W) Body(c, st, key, p_in, s.param, mq, vq, s.grad, s.param_out, i, i);
    const size_t rem = end - i;
    if (rem == 0) return;
    alignas(64) float p[W] = {}, o[W] = {};
    alignas(64) uint16_t m[W] = {}, v[W] = {};
    alignas(64) unsigned char g[W * 4] = {};
    const size_t gsize = DTypeSize(G);
    std::memcpy(p, p_in + i, rem * 4);
    std::memcpy(m, mq + i, rem * 2);
    std::memcpy(v, vq + i, rem * 2);
    std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gsize, rem * gsize);
    Body(c, st, key, p, p, m, v, g, o, 0, i);
    std::memcpy(s.param + i, p, rem * 4);
    std::memcpy(mq + i, m, rem * 2);
    std::memcpy(vq + i, v, rem * 2);
    if constexpr (O != Out::kNone) {
      const size_t osize = OutSize(O);
      std::memcpy(static_cast<unsigned char*>(s.param_out) + i * osize, o, rem * osize);
    }
  }
};

template <class V, DType G, Out O>
struct SgdKernel {
  using F = typename V::F;
  struct Vecs {  // see AdamVecs
    F ils, clip, wd, mom, damp, neg_lr;
    bool use_wd, use_momentum, first_step, nesterov;
    explicit Vecs(const SgdConsts& c)
        : ils(V::Set1(c.inv_loss_scale)),
          clip(V::Set1(c.clip_factor)),
          wd(V::Set1(c.weight_decay)),
          mom(V::Set1(c.momentum)),
          damp(V::Set1(c.damp_comp)),
          neg_lr(V::Set1(c.neg_lr)),
          use_wd(c.use_wd),
          use_momentum(c.use_momentum),
          first_step(c.first_step),
          nesterov(c.nesterov) {}
  };
  static inline void Body(const Vecs& c, float* param, float* buf_p, const void* grad, void* out,
                          size_t i) {
    F g = LoadGrad<V, G>(grad, i);
    g = V::Mul(g, c.ils);
    g = V::Mul(g, c.clip);
    F p = V::Load(param + i);
    if (c.use_wd) g = V::Fma(p, c.wd, g);
    F d = g;
    if (c.use_momentum) {
      const F buf = c.first_step ? g : V::Fma(V::Load(buf_p + i), c.mom, V::Mul(c.damp, g));
      V::Store(buf_p + i, buf);
      d = c.nesterov ? V::Fma(buf, c.mom, g) : buf;
    }
    p = V::Fma(d, c.neg_lr, p);
    V::Store(param + i, p);
    StoreOut<V, O>(out, i, p);
  }

  static void Run(const SgdConsts& consts, const SgdSpans& s, size_t begin, size_t end) {
    constexpr size_t W = V::kWidth;
    const Vecs c(consts);
    size_t i = begin;
    for (; i + W <= end; i += W) Body(c, s.param, s.momentum_buf, s.grad, s.param_out, i);
    const size_t rem = end - i;
    if (rem == 0) return;
    alignas(64) float p[W] = {}, b[W] = {}, o[W] = {};
    alignas(64) unsigned char g[W * 4] = {};
    const size_t gsize = DTypeSize(G);
    std::memcpy(p, s.param + i, rem * 4);
    if (c.use_momentum) std::memcpy(b, s.momentum_buf + i, rem * 4);
    std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gsize, rem * gsize);
    Body(c, p, b, g, o, 0);
    std::memcpy(s.param + i, p, rem * 4);
    if (c.use_momentum) std::memcpy(s.momentum_buf + i, b, rem * 4);
    if constexpr (O != Out::kNone) {
      const size_t osize = O == Out::kF32 ? 4 : 2;
      std::memcpy(static_cast<unsigned char*>(s.param_out) + i * osize, o, rem * osize);
    }
  }
};

template <class V, DType G>
double SqSumT(const void* grad, size_t begin, size_t end) {
  constexpr size_t W = V::kWidth;
  typename V::D a0 = V::ZeroD(), a1 = V::ZeroD();
  size_t i = begin;
  for (; i + W <= end; i += W) V::SqAccumulate(LoadGrad<V, G>(grad, i), a0, a1);
  if (i < end) {
    alignas(64) unsigned char g[W * 4] = {};
    const size_t gsize = DTypeSize(G);
    std::memcpy(g, static_cast<const unsigned char*>(grad) + i * gsize, (end - i) * gsize);
    V::SqAccumulate(LoadGrad<V, G>(g, 0), a0, a1);  // zero padding adds 0
  }
  return V::HSum(V::AddD(a0, a1));
}

template <class V, Out O>
void CastFromT(const float* src, void* dst, size_t begin, size_t end) {
  constexpr size_t W = V::kWidth;
  size_t i = begin;
  for (; i + W <= end; i += W) StoreOut<V, O>(dst, i, V::Load(src + i));
  if (i < end) {
    alignas(64) float s[W] = {};
    alignas(64) unsigned char o[W * 4] = {};
    const size_t osize = O == Out::kF32 ? 4 : 2;
    std::memcpy(s, src + i, (end - i) * 4);
    StoreOut<V, O>(o, 0, V::Load(s));
    std::memcpy(static_cast<unsigned char*>(dst) + i * osize, o, (end - i) * osize);
  }
}

template <class V, DType G>
void CastToT(const void* src, float* dst, size_t begin, size_t end) {
  constexpr size_t W = V::kWidth;
  size_t i = begin;
  for (; i + W <= end; i += W) V::Store(dst + i, LoadGrad<V, G>(src, i));
  if (i < end) {
    alignas(64) unsigned char s[W * 4] = {};
    alignas(64) float o[W] = {};
    const size_t gsize = DTypeSize(G);
    std::memcpy(s, static_cast<const unsigned char*>(src) + i * gsize, (end - i) * gsize);
    V::Store(o, LoadGrad<V, G>(s, 0));
    std::memcpy(dst + i, o, (end - i) * 4);
  }
}

template <class V>
void ProbeT(float* a, float* b, float* c, const float* d, size_t begin, size_t end) {
  constexpr size_t W = V::kWidth;
  size_t i = begin;
  for (; i + W <= end; i += W) {
    const typename V::F x = V::Load(d + i);
    V::Store(a + i, V::Add(V::Load(a + i), x));
    V::Store(b + i, V::Add(V::Load(b + i), x));
    V::Store(c + i, V::Add(V::Load(c + i), x));
  }
  for (; i < end; ++i) {
    a[i] += d[i];
    b[i] += d[i];
    c[i] += d[i];
  }
}

// ---- runtime dtype -> template dispatch ------------------------------------------------------

template <template <class, DType, Out> class K, class V, DType G>
void StateByOut(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  if (s.param_out == nullptr) return K<V, G, Out::kNone>::Run(c, s, b, e);
  switch (s.out_dtype) {
    case DType::kF32:
      return K<V, G, Out::kF32>::Run(c, s, b, e);
    case DType::kBF16:
      return K<V, G, Out::kBF16>::Run(c, s, b, e);
    case DType::kF16:
      return K<V, G, Out::kF16>::Run(c, s, b, e);
  }
}

template <template <class, DType, Out> class K, class V>
void StateByGrad(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  switch (s.grad_dtype) {
    case DType::kF32:
      return StateByOut<K, V, DType::kF32>(c, s, b, e);
    case DType::kBF16:
      return StateByOut<K, V, DType::kBF16>(c, s, b, e);
    case DType::kF16:
      return StateByOut<K, V, DType::kF16>(c, s, b, e);
  }
}

template <class V, DType G, bool kAms>
void AdamByOut(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  if (s.param_out == nullptr) return AdamKernel<V, G, Out::kNone, kAms>::Run(c, s, b, e);
  switch (s.out_dtype) {
    case DType::kF32:
      return AdamKernel<V, G, Out::kF32, kAms>::Run(c, s, b, e);
    case DType::kBF16:
      return AdamKernel<V, G, Out::kBF16, kAms>::Run(c, s, b, e);
    case DType::kF16:
      return AdamKernel<V, G, Out::kF16, kAms>::Run(c, s, b, e);
  }
}

template <class V, bool kAms>
void AdamByGrad(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  switch (s.grad_dtype) {
    case DType::kF32:
      return AdamByOut<V, DType::kF32, kAms>(c, s, b, e);
    case DType::kBF16:
      return AdamByOut<V, DType::kBF16, kAms>(c, s, b, e);
    case DType::kF16:
      return AdamByOut<V, DType::kF16, kAms>(c, s, b, e);
  }
}

template <class V>
void AdamT(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  if (s.state.dtype == StateDType::kInt8) return StateByGrad<AdamInt8Kernel, V>(c, s, b, e);
  if (s.state.dtype == StateDType::kBF16) return StateByGrad<AdamBf16StateKernel, V>(c, s, b, e);
  if (s.max_exp_avg_sq != nullptr) return AdamByGrad<V, true>(c, s, b, e);
  AdamByGrad<V, false>(c, s, b, e);
}

template <class V, DType G>
void SgdByOut(const SgdConsts& c, const SgdSpans& s, size_t b, size_t e) {
  if (s.param_out == nullptr) return SgdKernel<V, G, Out::kNone>::Run(c, s, b, e);
  switch (s.out_dtype) {
    case DType::kF32:
      return SgdKernel<V, G, Out::kF32>::Run(c, s, b, e);
    case DType::kBF16:
      return SgdKernel<V, G, Out::kBF16>::Run(c, s, b, e);
    case DType::kF16:
      return SgdKernel<V, G, Out::kF16>::Run(c, s, b, e);
  }
}

template <class V>
void SgdT(const SgdConsts& c, const SgdSpans& s, size_t b, size_t e) {
  switch (s.grad_dtype) {
    case DType::kF32:
      return SgdByOut<V, DType::kF32>(c, s, b, e);
    case DType::kBF16:
      return SgdByOut<V, DType::kBF16>(c, s, b, e);
    case DType::kF16:
      return SgdByOut<V, DType::kF16>(c, s, b, e);
  }
}

template <class V>
double SqSumDispatch(const void* grad, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::kF32:
      return SqSumT<V, DType::kF32>(grad, b, e);
    case DType::kBF16:
      return SqSumT<V, DType::kBF16>(grad, b, e);
    case DType::kF16:
      return SqSumT<V, DType::kF16>(grad, b, e);
  }
  return 0;
}

template <class V>
void CastFromDispatch(const float* src, void* dst, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::kF32:
      return CastFromT<V, Out::kF32>(src, dst, b, e);
    case DType::kBF16:
      return CastFromT<V, Out::kBF16>(src, dst, b, e);
    case DType::kF16:
      return CastFromT<V, Out::kF16>(src, dst, b, e);
  }
}

template <class V>
void CastToDispatch(const void* src, DType t, float* dst, size_t b, size_t e) {
  switch (t) {
    case DType::kF32:
      return CastToT<V, DType::kF32>(src, dst, b, e);
    case DType::kBF16:
      return CastToT<V, DType::kBF16>(src, dst, b, e);
    case DType::kF16:
      return CastToT<V, DType::kF16>(src, dst, b, e);
  }
}

template <class V>
KernelTable MakeTable(Isa isa) {
  return KernelTable{
      isa, AdamT<V>, SgdT<V>, SqSumDispatch<V>, CastFromDispatch<V>, CastToDispatch<V>, ProbeT<V>};
}

}  // namespace
}  // namespace tiermem::kernels::internal
