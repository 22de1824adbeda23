// AVX-512 (F, BW, VL, DQ) variant: 16 fp32 lanes. Built with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mfma -mf16c; optim.cc calls it only when CPUID reports those features.
// bf16 rounding is done in integer arithmetic (c10::BFloat16's RNE, NaN -> 0x7FC0) rather than
// with AVX512-BF16's vcvtneps2bf16, which flushes subnormal inputs to zero and keeps NaN
// payloads, and would therefore differ from the reference and from torch on those values.
// GCC 12 warns about _mm512_undefined_*() inside its own intrinsics (GCC bug 105593); clang
// has no such warning (and would warn about the unknown group).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "kernels/cpu/optim_simd_inl.h"

namespace tiermem::kernels::internal {
namespace {

struct V512 {
  static constexpr size_t kWidth = 16;
  using F = __m512;
  using D = __m512d;
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  using H = __m256i;  // 16 x 16-bit
  static H Bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  static H F16(F x) {
    const H h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // NaN -> sign | 0x7E00 whatever the payload (c10::Half).
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i nan_val = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
        _mm512_set1_epi32(0x7E00));
    return _mm256_mask_mov_epi16(h, nan, _mm512_cvtepi32_epi16(nan_val));
  }
  static void StoreH(uint16_t* p, H h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  // Non-temporal stores: p must be aligned to the vector size (64 bytes for F, 32 for H).
  static void Stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void StreamH(uint16_t* p, H h) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }  // a > b ? a : b
  static D ZeroD() { return _mm512_setzero_pd(); }
  static D AddD(D a, D b) { return _mm512_add_pd(a, b); }
  static void SqAccumulate(F g, D& a0, D& a1) {
    const D lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    const D hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(g, 1));
    a0 = _mm512_fmadd_pd(lo, lo, a0);  // a float squared is exact in double: fma == mul + add
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  static double HSum(D a) { return _mm512_reduce_add_pd(a); }
  // ---- compressed state: 32-bit integer lanes, gathers, byte codes ----
  using I = __m512i;
  static I BitsOf(F x) { return _mm512_castps_si512(x); }
  static I Set1I(int v) { return _mm512_set1_epi32(v); }
  static I Iota() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
  static I AndI(I a, I b) { return _mm512_and_si512(a, b); }
  static I XorI(I a, I b) { return _mm512_xor_si512(a, b); }
  static I AddI(I a, I b) { return _mm512_add_epi32(a, b); }
  static I SubI(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I MulLoI(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I MinI(I a, I b) { return _mm512_min_epi32(a, b); }
  static I MaxI(I a, I b) { return _mm512_max_epi32(a, b); }
  static I Srli15(I a) { return _mm512_srli_epi32(a, 15); }
  static I Srli16(I a) { return _mm512_srli_epi32(a, 16); }
  static I GreaterI(I a, I b) {  // 1/0
    return _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(a, b), _mm512_set1_epi32(1));
  }
  static I SelectBySign(I bits, I neg, I pos) {
    return _mm512_mask_blend_epi32(_mm512_movepi32_mask(bits), pos, neg);
  }
  static F GatherF(const float* table, I idx) { return _mm512_i32gather_ps(idx, table, 4); }
  static I GatherI(const uint32_t* table, I idx) { return _mm512_i32gather_epi32(idx, table, 4); }
  static I LoadU8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreU8(uint8_t* p, I codes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(codes));
  }
  static F Abs(F x) { return _mm512_abs_ps(x); }
  static F Or(F a, F b) { return _mm512_or_ps(a, b); }
  static F Unordered2(F a, F b) {
    return _mm512_castsi512_ps(_mm512_movm_epi32(_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q)));
  }
  static bool AnyBits(F x) { return _mm512_movepi32_mask(_mm512_castps_si512(x)) != 0; }
  static float HMax(F x) { return _mm512_reduce_max_ps(x); }
  // The top 16 bits of bits(x) + r (r < 2^16); NaN -> 0x7FC0.
  static H Bf16Stochastic(F x, I r) {
    __m512i v = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    v = _mm512_mask_mov_epi32(v, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(v);
  }
};

}  // namespace

const KernelTable& Avx512Table() {
  static const KernelTable table = MakeTable<V512>(Isa::kAvx512);
  return table;
}

}  // namespace tiermem::kernels::internal
