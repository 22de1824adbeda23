// Compressed optimizer state (kernels/cpu/state_format.cc, the compressed paths of AdamStep):
// the dynamic code maps, nearest-code quantization against a brute-force search, the bulk
// conversions, the compressed step against the fp32 step on the dequantized state, and every
// ISA variant against the scalar reference bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/optim.h"
#include "kernels/cpu/quant_tables.h"
#include "tests/kernels/kernel_test_support.h"

namespace tiermem::kernels {
namespace {

// The nearest code by exhaustive search over the map, distances in double (exact for floats
// of these magnitudes); ties go to the code of smaller magnitude.
uint8_t NearestBruteForce(float x, bool is_signed) {
  const float* code = DynamicCode(is_signed);
  int best = -1;
  double best_d = 0;
  for (int i = 0; i < 256; ++i) {
    if (is_signed && x < 0 && code[i] == 1.0f) continue;  // negatives never take +1
    const double d = std::fabs(static_cast<double>(x) - code[i]);
    if (best < 0 || d < best_d ||
        (d == best_d && std::fabs(code[i]) < std::fabs(code[best]))) {
      best = i;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(DynamicCode, MapsHaveTheDescribedShape) {
  for (bool s : {true, false}) {
    const float* c = DynamicCode(s);
    for (int i = 1; i < 256; ++i) EXPECT_LT(c[i - 1], c[i]) << "ascending, distinct at " << i;
    EXPECT_EQ(c[255], 1.0f);
  }
  const float* sc = DynamicCode(true);
  EXPECT_EQ(sc[127], 0.0f);
  for (int j = 0; j < 127; ++j) EXPECT_EQ(sc[128 + j], -sc[126 - j]) << j;
  // The extremes of the description: 10^-6 * mean(0.1, 1) and 10^0 * the last of 64 means.
  EXPECT_EQ(sc[128], static_cast<float>(0.55e-6));
  EXPECT_FLOAT_EQ(sc[254], static_cast<float>((0.1 + 0.9 * 63.0 / 64 + 1.0) / 2));
  const float* uc = DynamicCode(false);
  EXPECT_EQ(uc[0], 0.0f);
  EXPECT_EQ(uc[1], static_cast<float>(0.325e-6));
  EXPECT_FLOAT_EQ(uc[254], static_cast<float>((0.1 + 0.9 * 127.0 / 128 + 1.0) / 2));
}

TEST(DynamicCode, QuantizeIsTheNearestCodeEverywhere) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 1.5f, -7.0f, 1e-30f, -1e-30f,
                           std::numeric_limits<float>::denorm_min(), 1e-7f, 1.2e-7f};
  for (bool s : {true, false}) {
    const float* c = DynamicCode(s);
    for (int i = 0; i < 256; ++i) {
      // Each code, its neighbours, and the exact midpoints to the next code and around them.
      for (int d = -3; d <= 3; ++d) xs.push_back(FromBits(Bits(c[i]) + d));
      if (i < 255) {
        const float mid = static_cast<float>((static_cast<double>(c[i]) + c[i + 1]) / 2);
        for (int d = -3; d <= 3; ++d) xs.push_back(FromBits(Bits(mid) + d));
      }
    }
  }
  // Every bucket boundary (exponent and top 7 mantissa bits) from 2^-24 to 2.
  for (uint32_t hi = (127 - 24) << 7; hi <= (128u << 7); ++hi) {
    for (int d = -1; d <= 1; ++d) xs.push_back(FromBits((hi << 16) + d));
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> e(-24.0f, 0.0f);
  for (int i = 0; i < 200000; ++i) xs.push_back(std::exp2(e(rng)) * (i % 2 ? 1.0f : -1.0f));
  size_t checked = 0;
  for (float x : xs) {
    for (bool s : {true, false}) {
      if (!s && std::signbit(x) && x != 0.0f) continue;  // v >= 0
      const float ax = std::fabs(x) > 1.0f ? std::copysign(1.0f, x) : x;  // clamped, as used
      ASSERT_EQ(QuantizeToCode(x, s), NearestBruteForce(ax, s))
          << "x = " << x << " (bits " << std::hex << Bits(x) << ") signed " << s;
      ++checked;
    }
  }
  EXPECT_GT(checked, 300000u);
  // NaN takes a code deterministically (never a crash or an out-of-range index).
  EXPECT_EQ(QuantizeToCode(std::nanf(""), true), QuantizeToCode(std::nanf(""), true));
}

TEST(StateFormat, SizesNamesAndValidation) {
  StateFormat f;
  EXPECT_EQ(StateBytes(f, 1000), 4000u);
  f.dtype = StateDType::kBF16;
  EXPECT_EQ(StateBytes(f, 1000), 2000u);
  f.dtype = StateDType::kInt8;
  EXPECT_EQ(StateBytes(f, 1000), 1000u + 4 * 4);  // ceil(1000 / 256) absmax
  f.block = 64;
  EXPECT_EQ(StateBytes(f, 1024), 1024u + 16 * 4);
  EXPECT_TRUE(ValidateStateFormat(f).ok());
  for (uint32_t bad : {0u, 32u, 100u, 8192u}) {
    f.block = bad;
    EXPECT_EQ(ValidateStateFormat(f).code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(*ParseStateDType("int8"), StateDType::kInt8);
  EXPECT_EQ(*ParseStateDType("bf16"), StateDType::kBF16);
  EXPECT_EQ(*ParseStateDType("fp32"), StateDType::kF32);
  StatusOr<StateDType> bad = ParseStateDType("int4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("int4"), std::string::npos);
  EXPECT_EQ(StateDTypeName(StateDType::kInt8), "int8");
}

TEST(StateFormat, Int8RoundTripIsNearestCodeTimesAbsmax) {
  StateFormat f{StateDType::kInt8, 256};
  const size_t n = 1000;  // 3 full blocks and a partial one
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1e-3f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  std::fill(x.begin() + 512, x.begin() + 768, 0.0f);  // an all-zero block
  std::vector<uint8_t> q(n);
  std::vector<float> absmax(StateBlocks(f, n)), back(n);
  QuantizeState(f, true, x.data(), {q.data(), absmax.data()}, n);
  DequantizeState(f, true, {q.data(), absmax.data()}, back.data(), n);
  const float* code = DynamicCode(true);
  for (size_t b = 0; b < absmax.size(); ++b) {
    float mx = 0;
    for (size_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) mx = std::max(mx, std::fabs(x[i]));
    EXPECT_EQ(absmax[b], mx) << b;
  }
  for (size_t i = 0; i < n; ++i) {
    const float a = absmax[i / 256];
    const float inv = a > 0 ? 1.0f / a : 0.0f;
    ASSERT_EQ(q[i], NearestBruteForce(x[i] * inv, true)) << i;
    ASSERT_EQ(back[i], code[q[i]] * a) << i;
    if (x[i] == 0.0f) {
      EXPECT_EQ(back[i], 0.0f) << i;
    }
  }
  // The block's extreme value: exact when positive (code 1); within 0.8% when negative.
  for (size_t b = 0; b < absmax.size(); ++b) {
    if (absmax[b] == 0) continue;
    for (size_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) {
      if (std::fabs(x[i]) == absmax[b]) {
        if (x[i] > 0) {
          EXPECT_EQ(back[i], x[i]);
        } else {
          EXPECT_NEAR(back[i], x[i], 0.008 * absmax[b]);
        }
      }
    }
  }
}

TEST(StateFormat, Bf16RoundTripRoundsToNearestEvenOrStochastically) {
  const size_t n = 4096;
  std::vector<float> x(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (float& v : x) v = d(rng);
  StateFormat f{StateDType::kBF16};
  std::vector<uint16_t> q(n), rne(n);
  QuantizeState(f, true, x.data(), {q.data(), nullptr}, n);
  CastFromF32(x.data(), rne.data(), DType::kBF16, n);
  EXPECT_EQ(q, rne);
  // Stochastic: each value rounds to one of its two neighbours, unbiased on average.
  f.stochastic = true;
  const float value = FromBits(0x3F800000 + 0x4000);  // 1 + a quarter of a bf16 ulp
  std::vector<float> same(n, value);
  double sum = 0;
  for (uint64_t seed = 0; seed < 64; ++seed) {
    QuantizeState(f, true, same.data(), {q.data(), nullptr}, n, seed);
    for (uint16_t h : q) {
      ASSERT_TRUE(h == 0x3F80 || h == 0x3F81) << std::hex << h;
      sum += FromBits(static_cast<uint32_t>(h) << 16);
    }
  }
  EXPECT_NEAR(sum / (64.0 * n), value, 2e-5);  // the bias of rounding to nearest is 7.8e-3 * 0.25
}

// A compressed step's inputs: random params, grads and state in `format`.
struct Case {
  StateFormat format;
  size_t n = 0;
  DType grad_dtype = DType::kF32;
  bool out = false;
  std::vector<float> p, g32;
  std::vector<uint16_t> g16;
  std::vector<uint8_t> mq, vq;  // codes: bytes (int8) or bf16 halves
  std::vector<float> ma, va;
  std::vector<uint16_t> o;

  Case(StateFormat f, size_t n_, DType gd, bool out_, uint32_t seed)
      : format(f), n(n_), grad_dtype(gd), out(out_), p(n_), g32(n_), o(n_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> m(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g32[i] = d(rng) * 1e-2f * (i % 97 == 0 ? 100.0f : 1.0f);
      m[i] = d(rng) * 1e-3f;
      v[i] = std::fabs(d(rng)) * 1e-6f;
    }
    if (n > 600) {  // a block of zeros (fresh state) and one with a huge gradient outlier
      std::fill(m.begin() + 256, m.begin() + 512, 0.0f);
      std::fill(v.begin() + 256, v.begin() + 512, 0.0f);
    }
    if (gd != DType::kF32) {
      g16.resize(n);
      CastFromF32(g32.data(), g16.data(), gd, n);
    }
    const size_t es = format.dtype == StateDType::kInt8 ? 1 : 2;
    mq.resize(n * es);
    vq.resize(n * es);
    ma.resize(StateBlocks(format, n) + 1);
    va.resize(ma.size());
    QuantizeState(format, true, m.data(), {mq.data(), ma.data()}, n, 11);
    QuantizeState(format, false, v.data(), {vq.data(), va.data()}, n, 12);
    if (format.dtype == StateDType::kInt8) {
      // Every code of both maps is dequantized (the first 256 elements hold codes 0..255).
      for (size_t i = 0; i < std::min<size_t>(n, 256); ++i) {
        mq[i] = static_cast<uint8_t>(i);
        vq[i] = static_cast<uint8_t>(255 - i);
      }
    }
  }
  AdamSpans Spans() {
    AdamSpans s;
    s.param = p.data();
    s.grad = grad_dtype == DType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
    s.grad_dtype = grad_dtype;
    if (out) {
      s.param_out = o.data();
      s.out_dtype = DType::kBF16;
    }
    s.n = n;
    s.state = format;
    s.exp_avg_q = {mq.data(), format.dtype == StateDType::kInt8 ? ma.data() : nullptr};
    s.exp_avg_sq_q = {vq.data(), format.dtype == StateDType::kInt8 ? va.data() : nullptr};
    return s;
  }
};

AdamConfig Config() {
  AdamConfig c;
  c.lr = 1e-2f;
  c.weight_decay = 0.01f;
  c.step = 7;
  c.clip_factor = 0.5f;
  c.rounding_seed = 0x1234567890ull;
  return c;
}

// The compressed step is the fp32 step on the dequantized state, its new m and v quantized.
TEST(CompressedStep, EqualsTheFp32StepOnTheDequantizedState) {
  IsaGuard guard;
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  for (StateFormat f : {StateFormat{StateDType::kInt8, 256}, StateFormat{StateDType::kInt8, 64},
                        StateFormat{StateDType::kBF16}}) {
    Case c(f, 1000, DType::kF32, true, 5);
    const size_t n = c.n;
    std::vector<float> m(n), v(n);
    DequantizeState(f, true, {c.mq.data(), c.ma.data()}, m.data(), n);
    DequantizeState(f, false, {c.vq.data(), c.va.data()}, v.data(), n);
    std::vector<float> p_ref = c.p;
    std::vector<uint16_t> o_ref(n);
    AdamSpans ref;
    ref.param = p_ref.data();
    ref.exp_avg = m.data();
    ref.exp_avg_sq = v.data();
    ref.grad = c.g32.data();
    ref.param_out = o_ref.data();
    ref.n = n;
    AdamStep(Config(), ref);
    AdamStep(Config(), c.Spans());
    EXPECT_EQ(c.p, p_ref) << StateDTypeName(f.dtype);
    EXPECT_EQ(c.o, o_ref);
    const size_t es = f.dtype == StateDType::kInt8 ? 1 : 2;
    std::vector<uint8_t> mq(n * es), vq(n * es);
    std::vector<float> ma(StateBlocks(f, n) + 1), va(ma.size());
    QuantizeState(f, true, m.data(), {mq.data(), ma.data()}, n);
    QuantizeState(f, false, v.data(), {vq.data(), va.data()}, n);
    EXPECT_EQ(c.mq, mq) << StateDTypeName(f.dtype) << " block " << f.block;
    EXPECT_EQ(c.vq, vq);
    EXPECT_EQ(c.ma, ma);
    EXPECT_EQ(c.va, va);
  }
}

bool HasAvx512() {
  IsaGuard guard;
  return SetKernelIsa(Isa::kAvx512).ok();
}

// The AVX-512 requantizer (segment tables, quant_tables.h) against QuantizeScalar on a dense
// sweep of every float (both signs, NaN, Inf, subnormals, above 1) and at every threshold.
TEST(Int8Kernels, Avx512QuantizerEqualsScalarOnADenseSweep) {
  const internal::QuantTables& t = internal::GetQuantTables();
  EXPECT_TRUE(t.fast_ok) << "the segment tables failed their exactness check: gathers only";
  if (!HasAvx512()) GTEST_SKIP() << "no AVX-512";
  std::vector<float> xs;
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 251) xs.push_back(FromBits(static_cast<uint32_t>(b)));
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < 256; ++i) {
      for (int d = -3; d <= 3; ++d) {
        xs.push_back(FromBits(Bits(t.code[s][i]) + d));
        xs.push_back(-FromBits(Bits(t.code[s][i]) + d));
      }
      if (i == 255) continue;
      // Around the midpoint to the next code: where a threshold lies, ties and all.
      const float mid = static_cast<float>((static_cast<double>(t.code[s][i]) + t.code[s][i + 1]) / 2);
      for (int d = -3; d <= 3; ++d) {
        xs.push_back(FromBits(Bits(mid) + d));
        xs.push_back(-FromBits(Bits(mid) + d));
      }
    }
  }
  for (uint32_t hi = 0; hi < 0x8000u; ++hi) {  // every bucket edge (exponent, 7 mantissa bits)
    for (int d = -2; d <= 1; ++d) xs.push_back(FromBits((hi << 16) + d));
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, std::nanf(""), -std::nanf(""),
                  std::numeric_limits<float>::denorm_min(), 0x1p-31f, -0x1p-31f, 0x1.fffffep-32f}) {
    xs.push_back(x);
  }
  while (xs.size() % 16 != 0) xs.push_back(0.5f);
  std::vector<uint8_t> q(xs.size());
  for (bool is_signed : {true, false}) {
    for (float absmax : {1.0f, 3.0f, 0.0f}) {  // 1 / 3 rounds; 0: everything times 0
      internal::Avx512QuantizeForTest(is_signed, xs.data(), xs.size(), absmax, q.data());
      const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
      for (size_t i = 0; i < xs.size(); ++i) {
        ASSERT_EQ(q[i], internal::QuantizeScalar(t, xs[i] * inv, is_signed))
            << "x = " << xs[i] << " (bits " << std::hex << Bits(xs[i]) << ") signed "
            << is_signed << " absmax " << absmax;
      }
    }
  }
}

// The byte-permute code lookup (AVX512-VBMI) gives every code's value at every position.
TEST(Int8Kernels, VbmiDequantizeGivesEveryCodeAnywhere) {
  if (!HasAvx512() || !internal::Avx512VbmiActive()) GTEST_SKIP() << "no AVX512-VBMI";
  const internal::QuantTables& t = internal::GetQuantTables();
  std::mt19937 rng(5);
  for (size_t n : {16u, 48u, 64u, 80u, 256u, 4096u}) {
    std::vector<uint8_t> q(n);
    for (int round = 0; round < 8; ++round) {
      for (size_t i = 0; i < n; ++i) q[i] = static_cast<uint8_t>(round < 4 ? (i * 7 + round) : rng());
      for (bool is_signed : {true, false}) {
        std::vector<float> out(n, -1.0f);
        internal::Avx512DequantizeForTest(is_signed, q.data(), n, out.data());
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(Bits(out[i]), Bits(t.code[is_signed ? 1 : 0][q[i]])) << n << " " << i;
        }
      }
    }
  }
}

// Restores the AVX-512 int8 step's use of VBMI after a test turned it off.
struct VbmiGuard {
  ~VbmiGuard() { internal::SetAvx512VbmiAllowed(true); }
};

TEST(CompressedStep, EveryVariantMatchesScalarBitForBit) {
  IsaGuard guard;
  VbmiGuard vbmi_guard;
  const std::vector<StateFormat> formats = {
      {StateDType::kInt8, 256}, {StateDType::kInt8, 64}, {StateDType::kInt8, 4096},
      {StateDType::kBF16, 256, false}, {StateDType::kBF16, 256, true}};
  // Tails (not a multiple of 8 or 16, nor of the block), one tile, several tiles.
  for (size_t n : {1u, 13u, 255u, 1000u, 4099u, 70001u}) {
    for (const StateFormat& f : formats) {
      for (DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (bool out : {false, true}) {
          ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
          Case ref(f, n, gd, out, 9);
          AdamStep(Config(), ref.Spans());
          for (Isa isa : SupportedIsas()) {
            // AVX-512 twice: byte-permute lookups (where the CPU has VBMI), then gathers.
            for (bool vbmi : {true, false}) {
              if (isa == Isa::kScalar || (!vbmi && isa != Isa::kAvx512)) continue;
              internal::SetAvx512VbmiAllowed(vbmi);
              ASSERT_TRUE(SetKernelIsa(isa).ok());
              Case c(f, n, gd, out, 9);
              AdamStep(Config(), c.Spans());
              const std::string what = std::string(IsaName(isa)) + " vbmi " +
                                       std::to_string(vbmi) + " " +
                                       std::string(StateDTypeName(f.dtype)) + " block " +
                                       std::to_string(f.block) + " n " + std::to_string(n) +
                                       " stochastic " + std::to_string(f.stochastic);
              ASSERT_EQ(c.p, ref.p) << what;
              ASSERT_EQ(c.mq, ref.mq) << what;
              ASSERT_EQ(c.vq, ref.vq) << what;
              ASSERT_EQ(c.ma, ref.ma) << what;
              ASSERT_EQ(c.va, ref.va) << what;
              ASSERT_EQ(c.o, ref.o) << what;
            }
          }
        }
      }
    }
  }
}

TEST(CompressedStep, NonFiniteGradsPoisonTheirBlockVisibly) {
  IsaGuard guard;
  for (Isa isa : SupportedIsas()) {
    ASSERT_TRUE(SetKernelIsa(isa).ok());
    Case c({StateDType::kInt8, 256}, 1000, DType::kF32, false, 2);
    c.g32[300] = std::numeric_limits<float>::quiet_NaN();
    AdamStep(Config(), c.Spans());
    EXPECT_TRUE(std::isnan(c.p[300])) << IsaName(isa);
    EXPECT_TRUE(std::isnan(c.ma[1])) << "the NaN's block absmax says so";
    EXPECT_FALSE(std::isnan(c.ma[0]));
    EXPECT_FALSE(std::isnan(c.ma[2]));
    std::vector<float> m(1000);
    DequantizeState(c.format, true, {c.mq.data(), c.ma.data()}, m.data(), 1000);
    EXPECT_TRUE(std::isnan(m[256]) && std::isnan(m[511]));
    EXPECT_FALSE(std::isnan(m[255]) || std::isnan(m[512]));
  }
}

TEST(CompressedStep, OutOfPlaceParamsEqualInPlace) {
  IsaGuard guard;
  for (Isa isa : SupportedIsas()) {
    ASSERT_TRUE(SetKernelIsa(isa).ok());
    Case a({StateDType::kInt8, 256}, 5000, DType::kBF16, true, 4);
    Case b({StateDType::kInt8, 256}, 5000, DType::kBF16, true, 4);
    AdamStep(Config(), a.Spans());
    const std::vector<float> p_in = b.p;
    std::fill(b.p.begin(), b.p.end(), -1.0f);
    AdamSpans s = b.Spans();
    s.param_in = p_in.data();
    AdamStep(Config(), s);
    EXPECT_EQ(a.p, b.p) << IsaName(isa);
    EXPECT_EQ(a.mq, b.mq);
    EXPECT_EQ(a.o, b.o);
  }
}

TEST(CompressedStep, ThreadCountDoesNotChangeResults) {
  IsaGuard guard;
  const int saved = KernelThreads();
  Case a({StateDType::kInt8, 256}, 200000, DType::kF32, false, 8);
  Case b({StateDType::kInt8, 256}, 200000, DType::kF32, false, 8);
  SetKernelThreads(1);
  AdamStep(Config(), a.Spans());
  SetKernelThreads(2);
  AdamStep(Config(), b.Spans());
  SetKernelThreads(saved);
  EXPECT_EQ(a.p, b.p);
  EXPECT_EQ(a.mq, b.mq);
  EXPECT_EQ(a.va, b.va);
}

TEST(CompressedStep, ValidationNamesWhatIsWrong) {
  Case c({StateDType::kInt8, 256}, 100, DType::kF32, false, 1);
  AdamSpans s = c.Spans();
  s.exp_avg_q.absmax = nullptr;
  Status st = ValidateAdam(Config(), s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("absmax"), std::string::npos) << st.message();
  s = c.Spans();
  AdamConfig ams = Config();
  ams.amsgrad = true;
  EXPECT_EQ(ValidateAdam(ams, s).code(), StatusCode::kInvalidArgument);
  s.state.block = 100;
  EXPECT_EQ(ValidateAdam(Config(), s).code(), StatusCode::kInvalidArgument);
  s = c.Spans();
  float m_in = 0;
  s.exp_avg_in = &m_in;
  EXPECT_EQ(ValidateAdam(Config(), s).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateAdam(Config(), c.Spans()).ok());
}

}  // namespace
}  // namespace tiermem::kernels
