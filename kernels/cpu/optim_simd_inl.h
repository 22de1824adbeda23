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

#include <algorithm>
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

template <class V, Out O>
inline void StoreOut(void* p, size_t i, typename V::F x) {
  if constexpr (O == Out::kF32) V::Store(static_cast<float*>(p) + i, x);
  if constexpr (O == Out::kBF16) V::StoreBf16(static_cast<uint16_t*>(p) + i, x);
  if constexpr (O == Out::kF16) V::StoreF16(static_cast<uint16_t*>(p) + i, x);
}

template <class V, DType G, Out O, bool kAmsgrad>
struct AdamKernel {
  using F = typename V::F;
  // One vector at element i of the given arrays.
  static inline void Body(const AdamConsts& c, float* param, float* m_p, float* v_p, float* vm_p,
                          const void* grad, void* out, size_t i) {
    F g = LoadGrad<V, G>(grad, i);
    g = V::Mul(g, V::Set1(c.inv_loss_scale));
    g = V::Mul(g, V::Set1(c.clip_factor));
    F p = V::Load(param + i);
    if (c.use_l2) g = V::Fma(p, V::Set1(c.l2_decay), g);
    p = V::Mul(p, V::Set1(c.param_decay));
    F m = V::Load(m_p + i);
    m = V::Fma(V::Set1(c.beta1_comp), V::Sub(g, m), m);
    F v = V::Load(v_p + i);
    v = V::Fma(v, V::Set1(c.beta2), V::Mul(V::Mul(V::Set1(c.beta2_comp), g), g));
    F v_hat = v;
    if constexpr (kAmsgrad) {
      v_hat = V::Max(V::Load(vm_p + i), v);  // vm > v ? vm : v, as the reference
      V::Store(vm_p + i, v_hat);
    }
    const F denom = V::Add(V::Div(V::Sqrt(v_hat), V::Set1(c.bc2_sqrt)), V::Set1(c.eps));
    p = V::Fma(V::Set1(c.neg_step_size), V::Div(m, denom), p);
    V::Store(m_p + i, m);
    V::Store(v_p + i, v);
    V::Store(param + i, p);
    StoreOut<V, O>(out, i, p);
  }

  static void Run(const AdamConsts& c, const AdamSpans& s, size_t begin, size_t end) {
    constexpr size_t W = V::kWidth;
    size_t i = begin;
    for (; i + W <= end; i += W) {
      Body(c, s.param, s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, s.grad, s.param_out, i);
    }
    const size_t rem = end - i;
    if (rem == 0) return;
    alignas(64) float p[W] = {}, m[W] = {}, v[W] = {}, vm[W] = {}, o[W] = {};
    alignas(64) unsigned char g[W * 4] = {};
    const size_t gsize = DTypeSize(G);
    std::memcpy(p, s.param + i, rem * 4);
    std::memcpy(m, s.exp_avg + i, rem * 4);
    std::memcpy(v, s.exp_avg_sq + i, rem * 4);
    if constexpr (kAmsgrad) std::memcpy(vm, s.max_exp_avg_sq + i, rem * 4);
    std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gsize, rem * gsize);
    Body(c, p, m, v, vm, g, o, 0);
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
  static inline void Body(const SgdConsts& c, float* param, float* buf_p, const void* grad,
                          void* out, size_t i) {
    F g = LoadGrad<V, G>(grad, i);
    g = V::Mul(g, V::Set1(c.inv_loss_scale));
    g = V::Mul(g, V::Set1(c.clip_factor));
    F p = V::Load(param + i);
    if (c.use_wd) g = V::Fma(p, V::Set1(c.weight_decay), g);
    F d = g;
    if (c.use_momentum) {
      const F buf = c.first_step
                        ? g
                        : V::Fma(V::Load(buf_p + i), V::Set1(c.momentum),
                                 V::Mul(V::Set1(c.damp_comp), g));
      V::Store(buf_p + i, buf);
      d = c.nesterov ? V::Fma(buf, V::Set1(c.momentum), g) : buf;
    }
    p = V::Fma(d, V::Set1(c.neg_lr), p);
    V::Store(param + i, p);
    StoreOut<V, O>(out, i, p);
  }

  static void Run(const SgdConsts& c, const SgdSpans& s, size_t begin, size_t end) {
    constexpr size_t W = V::kWidth;
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
