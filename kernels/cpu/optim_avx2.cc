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
  using H = __m128i;  // 8 x 16-bit
  static H Bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return Pack16(r);
  }
  static H F16(F x) {
    const H h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // NaN -> sign | 0x7E00 whatever the payload (c10::Half).
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan_val =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                        _mm256_set1_epi32(0x7E00));
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i nan16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(nan32, nan32), 0x08);
    return _mm_blendv_epi8(h, Pack16(nan_val), _mm256_castsi256_si128(nan16));
  }
  static void StoreH(uint16_t* p, H h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  // Non-temporal stores: p must be aligned to the vector size (32 bytes for F, 16 for H).
  static void Stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void StreamH(uint16_t* p, H h) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), h); }
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
  // ---- compressed state: 32-bit integer lanes, gathers, byte codes ----
  using I = __m256i;
  static I BitsOf(F x) { return _mm256_castps_si256(x); }
  static I Set1I(int v) { return _mm256_set1_epi32(v); }
  static I Iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I AndI(I a, I b) { return _mm256_and_si256(a, b); }
  static I XorI(I a, I b) { return _mm256_xor_si256(a, b); }
  static I AddI(I a, I b) { return _mm256_add_epi32(a, b); }
  static I SubI(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I MulLoI(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I MinI(I a, I b) { return _mm256_min_epi32(a, b); }
  static I MaxI(I a, I b) { return _mm256_max_epi32(a, b); }
  static I Srli15(I a) { return _mm256_srli_epi32(a, 15); }
  static I Srli16(I a) { return _mm256_srli_epi32(a, 16); }
  static I GreaterI(I a, I b) { return _mm256_srli_epi32(_mm256_cmpgt_epi32(a, b), 31); }  // 1/0
  // Lane by lane: `neg` where `bits` has its sign bit set, else `pos`.
  static I SelectBySign(I bits, I neg, I pos) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(pos), _mm256_castsi256_ps(neg),
                                                _mm256_castsi256_ps(bits)));
  }
  static F GatherF(const float* table, I idx) { return _mm256_i32gather_ps(table, idx, 4); }
  static I GatherI(const uint32_t* table, I idx) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), idx, 4);
  }
  static I LoadU8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreU8(uint8_t* p, I codes) {  // lanes hold 0..255
    const __m128i h = Pack16(codes);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(h, h));
  }
  // int8 state: the codes are gathered in the step's body and quantized through the bucket
  // table (AVX2 has no two-register permutes; gathers win here).
  static constexpr bool kFastQuantize = false;
  static bool HasDequantBlock() { return false; }
  static void DequantBlock(const QuantTables&, bool, const uint8_t*, size_t, float*) {}
  static F Abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static F Or(F a, F b) { return _mm256_or_ps(a, b); }
  static F Unordered2(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
  static bool AnyBits(F x) { return _mm256_movemask_ps(x) != 0; }
  static float HMax(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  // The top 16 bits of bits(x) + r (r < 2^16); NaN -> 0x7FC0.
  static H Bf16Stochastic(F x, I r) {
    __m256i v = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7FC0), nan);
    return Pack16(v);
  }
};

}  // namespace

const KernelTable& Avx2Table() {
  static const KernelTable table = MakeTable<V256>(Isa::kAvx2);
  return table;
}

}  // namespace tiermem::kernels::internal
