// AVX2 + FMA + F16C variant: 8 fp32 lanes. Built with -mavx2 -mfma -mf16c; optim.cc calls it
// only when CPUID reports those features.
#include <immintrin.h>

#include "kernels/cpu/optim_simd_inl.h"

namespace tiermem::kernels::internal {
namespace {

// Packs eight 32-bit lanes holding 16-bit values into eight uint16 (no saturation happens).
inline __m128i Pack16(__m256i r) {
  const __m256i p = _mm256_packus_epi32(r, r);  // [r0..3 r0..3 | r4..7 r4..7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

struct V256 {
  static constexpr size_t kWidth = 8;
  using F = __m256;
  using D = __m256d;
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F LoadBf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreBf16(uint16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Pack16(r));
  }
  static void StoreF16(uint16_t* p, F x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // NaN -> sign | 0x7E00 whatever the payload (c10::Half).
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan_val = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
        _mm256_set1_epi32(0x7E00));
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i nan16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(nan32, nan32), 0x08);
    h = _mm_blendv_epi8(h, Pack16(nan_val), _mm256_castsi256_si128(nan16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static F Set1(float v) { return _mm256_set1_ps(v); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }  // a > b ? a : b
  static D ZeroD() { return _mm256_setzero_pd(); }
  static D AddD(D a, D b) { return _mm256_add_pd(a, b); }
  static void SqAccumulate(F g, D& a0, D& a1) {
    const D lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
    const D hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);  // a float squared is exact in double: fma == mul + add
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  static double HSum(D a) {
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
};

}  // namespace

const KernelTable& Avx2Table() {
  static const KernelTable table = MakeTable<V256>(Isa::kAvx2);
  return table;
}

}  // namespace tiermem::kernels::internal
