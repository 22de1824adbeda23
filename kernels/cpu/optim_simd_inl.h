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
#include <cstdint>
#include <cstring>

#include "kernels/cpu/kernel_table.h"

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
    if constexpr (kStream) V::Stream(static_cast<float*>(p) + i, x);
    else V::Store(static_cast<float*>(p) + i, x);
  } else if constexpr (O == Out::kBF16 || O == Out::kF16) {
    const typename V::H h = O == Out::kBF16 ? V::Bf16(x) : V::F16(x);
    if constexpr (kStream) V::StreamH(static_cast<uint16_t*>(p) + i, h);
    else V::StoreH(static_cast<uint16_t*>(p) + i, h);
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
      : ils(V::Set1(c.inv_loss_scale)), clip(V::Set1(c.clip_factor)), l2(V::Set1(c.l2_decay)),
        decay(V::Set1(c.param_decay)), b1c(V::Set1(c.beta1_comp)), b2(V::Set1(c.beta2)),
        b2c(V::Set1(c.beta2_comp)), bc2(V::Set1(c.bc2_sqrt)), eps(V::Set1(c.eps)),
        nss(V::Set1(c.neg_step_size)), use_l2(c.use_l2) {}
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
  static inline void Body(const AdamVecs<V>& c, const In& in, float* param, float* m_p,
                          float* v_p, float* vm_p, const void* grad, void* out, size_t i) {
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

template <class V, DType G, Out O>
struct SgdKernel {
  using F = typename V::F;
  struct Vecs {  // see AdamVecs
    F ils, clip, wd, mom, damp, neg_lr;
    bool use_wd, use_momentum, first_step, nesterov;
    explicit Vecs(const SgdConsts& c)
        : ils(V::Set1(c.inv_loss_scale)), clip(V::Set1(c.clip_factor)),
          wd(V::Set1(c.weight_decay)), mom(V::Set1(c.momentum)), damp(V::Set1(c.damp_comp)),
          neg_lr(V::Set1(c.neg_lr)), use_wd(c.use_wd), use_momentum(c.use_momentum),
          first_step(c.first_step), nesterov(c.nesterov) {}
  };
  static inline void Body(const Vecs& c, float* param, float* buf_p, const void* grad,
                          void* out, size_t i) {
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

template <class V, DType G, bool kAms>
void AdamByOut(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  if (s.param_out == nullptr) return AdamKernel<V, G, Out::kNone, kAms>::Run(c, s, b, e);
  switch (s.out_dtype) {
    case DType::kF32: return AdamKernel<V, G, Out::kF32, kAms>::Run(c, s, b, e);
    case DType::kBF16: return AdamKernel<V, G, Out::kBF16, kAms>::Run(c, s, b, e);
    case DType::kF16: return AdamKernel<V, G, Out::kF16, kAms>::Run(c, s, b, e);
  }
}

template <class V, bool kAms>
void AdamByGrad(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  switch (s.grad_dtype) {
    case DType::kF32: return AdamByOut<V, DType::kF32, kAms>(c, s, b, e);
    case DType::kBF16: return AdamByOut<V, DType::kBF16, kAms>(c, s, b, e);
    case DType::kF16: return AdamByOut<V, DType::kF16, kAms>(c, s, b, e);
  }
}

template <class V>
void AdamT(const AdamConsts& c, const AdamSpans& s, size_t b, size_t e) {
  if (s.max_exp_avg_sq != nullptr) return AdamByGrad<V, true>(c, s, b, e);
  AdamByGrad<V, false>(c, s, b, e);
}

template <class V, DType G>
void SgdByOut(const SgdConsts& c, const SgdSpans& s, size_t b, size_t e) {
  if (s.param_out == nullptr) return SgdKernel<V, G, Out::kNone>::Run(c, s, b, e);
  switch (s.out_dtype) {
    case DType::kF32: return SgdKernel<V, G, Out::kF32>::Run(c, s, b, e);
    case DType::kBF16: return SgdKernel<V, G, Out::kBF16>::Run(c, s, b, e);
    case DType::kF16: return SgdKernel<V, G, Out::kF16>::Run(c, s, b, e);
  }
}

template <class V>
void SgdT(const SgdConsts& c, const SgdSpans& s, size_t b, size_t e) {
  switch (s.grad_dtype) {
    case DType::kF32: return SgdByOut<V, DType::kF32>(c, s, b, e);
    case DType::kBF16: return SgdByOut<V, DType::kBF16>(c, s, b, e);
    case DType::kF16: return SgdByOut<V, DType::kF16>(c, s, b, e);
  }
}

template <class V>
double SqSumDispatch(const void* grad, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::kF32: return SqSumT<V, DType::kF32>(grad, b, e);
    case DType::kBF16: return SqSumT<V, DType::kBF16>(grad, b, e);
    case DType::kF16: return SqSumT<V, DType::kF16>(grad, b, e);
  }
  return 0;
}

template <class V>
void CastFromDispatch(const float* src, void* dst, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::kF32: return CastFromT<V, Out::kF32>(src, dst, b, e);
    case DType::kBF16: return CastFromT<V, Out::kBF16>(src, dst, b, e);
    case DType::kF16: return CastFromT<V, Out::kF16>(src, dst, b, e);
  }
}

template <class V>
void CastToDispatch(const void* src, DType t, float* dst, size_t b, size_t e) {
  switch (t) {
    case DType::kF32: return CastToT<V, DType::kF32>(src, dst, b, e);
    case DType::kBF16: return CastToT<V, DType::kBF16>(src, dst, b, e);
    case DType::kF16: return CastToT<V, DType::kF16>(src, dst, b, e);
  }
}

template <class V>
KernelTable MakeTable(Isa isa) {
  return KernelTable{isa,           AdamT<V>,          SgdT<V>,   SqSumDispatch<V>,
                     CastFromDispatch<V>, CastToDispatch<V>, ProbeT<V>};
}

}  // namespace
}  // namespace tiermem::kernels::internal
