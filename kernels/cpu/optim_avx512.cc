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

#include <atomic>
#include <cstring>

#include "kernels/cpu/optim_simd_inl.h"

namespace tiermem::kernels::internal {
namespace {

// AVX512-VBMI (byte permutes) is not among this file's -m flags: only DequantCodesVbmi uses it,
// compiled for it by its target attribute (never inlined into code for other CPUs), and run
// only when CPUID reports it and the tests have not turned it off.
std::atomic<bool>& VbmiAllowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

bool CpuHasVbmi() {
  static const bool has = __builtin_cpu_supports("avx512vbmi");
  return has;
}

// The code values of q[0, n) (n a multiple of 16) of map s, 64 at a time: per byte plane of
// the 256 floats (4 registers each), two 128-entry byte permutes and a blend by the code's top
// bit; then the planes are interleaved into floats. The unpacks interleave within 128-bit
// lanes, so the codes are first permuted (a 4 x 4 transpose of their dwords) to make the
// floats come out in order.
__attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) void DequantCodesVbmi(
    const QuantTables& t, int s, const uint8_t* q, size_t n, float* out) {
  __m512i pl[4][4];
  for (int p = 0; p < 4; ++p) {
    for (int r = 0; r < 4; ++r) pl[p][r] = _mm512_load_si512(t.plane[s][p] + 64 * r);
  }
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  alignas(64) uint8_t qt[64] = {};
  alignas(64) float ot[64];
  // (A loop, not a lambda: a lambda would not inherit the target attribute.)
  for (size_t i = 0; i < n; i += 64) {
    const bool tail = i + 64 > n;
    const uint8_t* src = q + i;
    float* dst = out + i;
    if (tail) {
      std::memcpy(qt, q + i, n - i);
      src = qt;
      dst = ot;
    }
    const __m512i c = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(src));
    const __mmask64 top = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int p = 0; p < 4; ++p) {
      const __m512i lo = _mm512_permutex2var_epi8(pl[p][0], c, pl[p][1]);
      const __m512i hi = _mm512_permutex2var_epi8(pl[p][2], c, pl[p][3]);
      b[p] = _mm512_mask_blend_epi8(top, lo, hi);
    }
    const __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]), h01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]), h23 = _mm512_unpackhi_epi8(b[2], b[3]);
    _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(l01, l23));
    _mm512_storeu_si512(dst + 16, _mm512_unpackhi_epi16(l01, l23));
    _mm512_storeu_si512(dst + 32, _mm512_unpacklo_epi16(h01, h23));
    _mm512_storeu_si512(dst + 48, _mm512_unpackhi_epi16(h01, h23));
    if (tail) std::memcpy(out + i, ot, (n - i) * 4);
  }
}

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
    const __m512i nan_val =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
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
  // ---- int8 state without gathers (quant_tables.h) ----
  static bool HasDequantBlock() {
    return CpuHasVbmi() && VbmiAllowed().load(std::memory_order_relaxed);
  }
  static void DequantBlock(const QuantTables& t, bool is_signed, const uint8_t* q, size_t n,
                           float* out) {
    DequantCodesVbmi(t, is_signed ? 1 : 0, q, n, out);
  }
  static constexpr bool kFastQuantize = true;
  // The codes of x[0, n) * inv by the segment tables, whole vectors (returns how many
  // elements); a vector with a lane in the uncertain window takes the bucket table instead.
  static size_t QuantizeFast(const QuantTables& t, bool is_signed, const float* x, size_t n,
                             float inv, uint8_t* q) {
    const int s = is_signed ? 1 : 0;
    const __m512i base_lo = _mm512_load_si512(t.seg_base[s]);
    const __m512i base_hi = _mm512_load_si512(t.seg_base[s] + 16);
    const __m512i split_lo = _mm512_load_si512(t.seg_split[s]);
    const __m512i split_hi = _mm512_load_si512(t.seg_split[s] + 16);
    const __m512 mul = _mm512_load_ps(t.seg_mul[s]);
    const __m512 add = _mm512_load_ps(t.seg_add[s]);
    const __m512i hi = _mm512_load_si512(t.seg_hi[s]);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i min_bits = _mm512_set1_epi32(static_cast<int>(QuantTables::kFastMinBits));
    const __m512i max_bits = _mm512_set1_epi32(static_cast<int>(QuantTables::kFastMaxBits));
    const __m512i window = _mm512_set1_epi32(static_cast<int>(QuantTables::kFastWindow));
    const __m512i one = _mm512_set1_epi32(1), c254 = _mm512_set1_epi32(254);
    const __m512i zero = _mm512_setzero_si512();
    const F vinv = _mm512_set1_ps(inv);
    size_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const F xs = _mm512_mul_ps(_mm512_loadu_ps(x + j), vinv);
      const __m512i bits = _mm512_castps_si512(xs);
      // |x| clamped to [2^-31, 1]; NaN (any sign) and Inf become 1, as in the bucket table.
      __m512i a = _mm512_min_epu32(_mm512_and_si512(bits, abs_mask), max_bits);
      a = _mm512_max_epi32(a, min_bits);
      const __m512i e = _mm512_srli_epi32(a, 23);  // the permutes read its low 5 bits
      const __m512i base = _mm512_permutex2var_epi32(base_lo, e, base_hi);
      const __m512i split = _mm512_permutex2var_epi32(split_lo, e, split_hi);
      const __m512i seg = _mm512_mask_add_epi32(base, _mm512_cmpgt_epi32_mask(a, split), base, one);
      const F pos = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_permutexvar_ps(seg, mul),
                                    _mm512_permutexvar_ps(seg, add));
      const __m512i tv = _mm512_cvttps_epi32(pos);
      __m512i k = _mm512_min_epi32(_mm512_srli_epi32(tv, QuantTables::kFastShift),
                                   _mm512_permutexvar_epi32(seg, hi));
      if (is_signed) {  // k = 127 + the half map's code; negative x: 127 - min(code, 127)
        k = _mm512_mask_sub_epi32(k, _mm512_movepi32_mask(bits), c254, k);
        k = _mm512_max_epi32(k, zero);
      }
      if (__builtin_expect(_mm512_testn_epi32_mask(tv, window) != 0, 0)) {
        k = QuantizeVector<V512>(t, xs, is_signed);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(k));
    }
    return j;
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

void SetAvx512VbmiAllowed(bool allowed) { VbmiAllowed().store(allowed); }
bool Avx512VbmiActive() { return V512::HasDequantBlock(); }

void Avx512QuantizeForTest(bool is_signed, const float* x, size_t n, float absmax, uint8_t* q) {
  AdamInt8Kernel<V512, DType::kF32, Out::kNone>::Quantize(GetQuantTables(), is_signed, x, n, absmax,
                                                          q);
}

void Avx512DequantizeForTest(bool is_signed, const uint8_t* q, size_t n, float* out) {
  DequantCodesVbmi(GetQuantTables(), is_signed ? 1 : 0, q, n, out);
}

const KernelTable& Avx512Table() {
  static const KernelTable table = MakeTable<V512>(Isa::kAvx512);
  return table;
}

}  // namespace tiermem::kernels::internal
