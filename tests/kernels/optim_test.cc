// CPU optimizer kernels: the scalar reference against independent formulas, every ISA variant
// against the scalar reference (bit-exact: the variants perform the same operations), casts
// exhaustively, overflow detection and the skipped step.
#include "kernels/cpu/optim.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/kernels/kernel_test_support.h"

namespace tiermem::kernels {
namespace {

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

// ---- every ISA variant against the scalar reference, bit for bit ------------------------------

// Random state for one Adam/SGD problem of n elements, laid out at an element offset so the
// spans start unaligned.
struct Problem {
  size_t n, off;
  std::vector<float> param, m, v, vm, buf;
  std::vector<unsigned char> grad;  // n elements of grad_dtype
  DType grad_dtype;

  Problem(size_t n_in, size_t off_in, DType gd, std::mt19937& rng)
      : n(n_in), off(off_in), grad_dtype(gd) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    param.resize(n + off);
    m.resize(n + off);
    v.resize(n + off);
    vm.resize(n + off);
    buf.resize(n + off);
    std::vector<float> g(n);
    for (size_t i = 0; i < n + off; ++i) {
      param[i] = normal(rng);
      m[i] = 0.1f * normal(rng);
      v[i] = 0.01f * std::fabs(normal(rng));
      vm[i] = (i % 3 == 0) ? v[i] * 2.0f : v[i] * 0.5f;  // amsgrad max taken both ways
      buf[i] = 0.1f * normal(rng);
    }
    for (size_t i = 0; i < n; ++i) g[i] = 1024.0f * normal(rng) * ((i % 7 == 0) ? 1e-3f : 1.0f);
    grad.resize((n + off) * DTypeSize(gd));
    IsaGuard guard;
    EXPECT_TRUE(SetKernelIsa(Isa::kScalar).ok());
    CastFromF32(g.data(), grad.data() + off * DTypeSize(gd), gd, n);
  }
  const void* g() const { return grad.data() + off * DTypeSize(grad_dtype); }
};

void ExpectBitEqual(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(Bits(a[i]), Bits(b[i])) << what << "[" << i << "]: " << a[i] << " vs " << b[i];
  }
}

// The in-place spans of `p` (its n elements at its offset); `out` < 0: no low-precision copy,
// else that DType's copy into `o` at the same element offset.
AdamSpans AdamSpansOf(Problem& p, std::vector<unsigned char>& o, int out) {
  AdamSpans s;
  s.param = p.param.data() + p.off;
  s.exp_avg = p.m.data() + p.off;
  s.exp_avg_sq = p.v.data() + p.off;
  s.max_exp_avg_sq = p.vm.data() + p.off;
  s.grad = p.g();
  s.grad_dtype = p.grad_dtype;
  if (out >= 0) {
    s.out_dtype = static_cast<DType>(out);
    s.param_out = o.data() + p.off * DTypeSize(s.out_dtype);
  }
  s.n = p.n;
  return s;
}

const size_t kSizes[] = {1, 7, 15, 16, 17, 33, 100, 1000, 4099};
const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(Variants, AdamMatchesScalarBitForBit) {
  std::mt19937 rng(42);
  int checked = 0;
  for (Isa isa : SupportedIsas()) {
    if (isa == Isa::kScalar) continue;
    for (DType gd : kDTypes) {
      for (int out = -1; out < 3; ++out) {
        for (int variant = 0; variant < 4; ++variant) {
          const bool amsgrad = variant & 1, l2 = variant & 2;
          const size_t n = kSizes[(checked++) % std::size(kSizes)] + (rng() % 40);
          const size_t off = rng() % 16;
          Problem a(n, off, gd, rng);
          Problem b = a;
          AdamConfig c;
          c.lr = 1e-2f;
          c.weight_decay = 0.05f;
          c.decoupled = !l2;
          c.amsgrad = amsgrad;
          c.step = 1 + rng() % 50;
          c.inv_loss_scale = 1.0f / 1024;
          c.clip_factor = (variant == 3) ? 0.37f : 1.0f;
          std::vector<unsigned char> out_a((n + off) * 4, 0xAB), out_b = out_a;
          auto spans = [&](Problem& p, std::vector<unsigned char>& o) {
            return AdamSpansOf(p, o, out);
          };
          IsaGuard guard;
          ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
          ASSERT_TRUE(ValidateAdam(c, spans(a, out_a)).ok());
          AdamStep(c, spans(a, out_a));
          ASSERT_TRUE(SetKernelIsa(isa).ok());
          AdamStep(c, spans(b, out_b));
          SCOPED_TRACE(std::string(IsaName(isa)) + " grad " + std::string(DTypeName(gd)) +
                       " out " + std::to_string(out) + " variant " + std::to_string(variant) +
                       " n " + std::to_string(n) + " off " + std::to_string(off));
          ExpectBitEqual(a.param, b.param, "param");
          ExpectBitEqual(a.m, b.m, "exp_avg");
          ExpectBitEqual(a.v, b.v, "exp_avg_sq");
          ExpectBitEqual(a.vm, b.vm, "max_exp_avg_sq");
          ASSERT_EQ(out_a, out_b) << "param_out";  // incl. untouched bytes around the span
        }
      }
    }
  }
  if (SupportedIsas().size() == 1) GTEST_SKIP() << "this CPU has no SIMD variant";
}

// Out of place (AdamSpans::*_in): the same bits as the in-place step on every ISA, grad and
// out dtype, amsgrad or not, through ragged tails and the threaded large-call path; the inputs
// are left as they were; outputs start as garbage.
TEST(Variants, OutOfPlaceAdamEqualsInPlaceBitForBit) {
  std::mt19937 rng(17);
  int checked = 0;
  for (Isa isa : SupportedIsas()) {
    for (DType gd : kDTypes) {
      for (int out = -1; out < 3; ++out) {
        for (int variant = 0; variant < 2; ++variant) {
          const bool amsgrad = variant & 1;
          // Mostly small and ragged; every fourth one spans several tiles (threads, streaming).
          const size_t n = (checked++ % 4 == 3 ? 140000 : kSizes[checked % std::size(kSizes)]) +
                           rng() % 40;
          const size_t off = rng() % 16;
          Problem in_place(n, off, gd, rng);
          const Problem pristine = in_place;
          Problem inputs = in_place;
          Problem outputs = in_place;
          for (auto* v : {&outputs.param, &outputs.m, &outputs.v, &outputs.vm}) {
            for (float& x : *v) x = FromBits(0x7fc0dead);  // NaN garbage: must be overwritten
          }
          AdamConfig c;
          c.lr = 1e-2f;
          c.weight_decay = 0.05f;
          c.amsgrad = amsgrad;
          c.step = 1 + rng() % 50;
          c.inv_loss_scale = 1.0f / 1024;
          c.clip_factor = 0.37f;
          std::vector<unsigned char> out_a((n + off) * 4, 0xAB), out_b = out_a;
          auto spans = [&](Problem& p, std::vector<unsigned char>& o) {
            return AdamSpansOf(p, o, out);
          };
          IsaGuard guard;
          ASSERT_TRUE(SetKernelIsa(isa).ok());
          AdamStep(c, spans(in_place, out_a));
          AdamSpans oop = spans(outputs, out_b);
          oop.grad = inputs.g();
          oop.param_in = inputs.param.data() + off;
          oop.exp_avg_in = inputs.m.data() + off;
          oop.exp_avg_sq_in = inputs.v.data() + off;
          oop.max_exp_avg_sq_in = inputs.vm.data() + off;
          ASSERT_TRUE(ValidateAdam(c, oop).ok());
          AdamStep(c, oop);
          SCOPED_TRACE(std::string(IsaName(isa)) + " grad " + std::string(DTypeName(gd)) +
                       " out " + std::to_string(out) + " amsgrad " + std::to_string(amsgrad) +
                       " n " + std::to_string(n) + " off " + std::to_string(off));
          auto span_of = [&](const std::vector<float>& v) {
            return std::vector<float>(v.begin() + off, v.begin() + off + n);
          };
          ExpectBitEqual(span_of(in_place.param), span_of(outputs.param), "param");
          ExpectBitEqual(span_of(in_place.m), span_of(outputs.m), "exp_avg");
          ExpectBitEqual(span_of(in_place.v), span_of(outputs.v), "exp_avg_sq");
          if (amsgrad) ExpectBitEqual(span_of(in_place.vm), span_of(outputs.vm), "max_exp_avg_sq");
          ASSERT_EQ(out_a, out_b) << "param_out";
          // The inputs are untouched: what the in-place step started from.
          ExpectBitEqual(inputs.param, pristine.param, "param_in");
          ExpectBitEqual(inputs.m, pristine.m, "exp_avg_in");
          ExpectBitEqual(inputs.v, pristine.v, "exp_avg_sq_in");
          ExpectBitEqual(inputs.vm, pristine.vm, "max_exp_avg_sq_in");
        }
      }
    }
  }
  AdamSpans bad;
  float x = 0;
  bad.param = bad.exp_avg = bad.exp_avg_sq = &x;
  bad.grad = &x;
  bad.n = 1;
  bad.max_exp_avg_sq_in = &x;  // an amsgrad input without its output
  EXPECT_EQ(ValidateAdam(AdamConfig{}, bad).code(), StatusCode::kInvalidArgument);
}

TEST(Variants, LargeCallWithStreamingStoresMatchesScalar) {
  // Big enough (>= 8 MiB of copy) for the non-temporal store path; the copy buffer aligned so
  // that path is really taken, plus an odd tail.
  std::mt19937 rng(17);
  const size_t n = (4u << 20) + 77;
  for (DType od : {DType::kBF16}) {  // the f32 copy shares the code path (and doubles the time)
    Problem a(n, 0, DType::kBF16, rng);
    Problem b = a;
    std::vector<unsigned char> oa(n * 4 + 128), ob(n * 4 + 128);
    auto aligned = [](std::vector<unsigned char>& v) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(v.data());
      return v.data() + ((64 - base % 64) % 64);
    };
    AdamConfig c;
    c.step = 3;
    c.weight_decay = 0.01f;
    auto spans = [&](Problem& p, unsigned char* out) {
      return AdamSpans{p.param.data(), p.m.data(), p.v.data(), nullptr, p.g(), DType::kBF16,
                       out, od, n};
    };
    IsaGuard guard;
    ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
    AdamStep(c, spans(a, aligned(oa)));
    for (Isa isa : SupportedIsas()) {
      if (isa == Isa::kScalar) continue;
      Problem bb = b;
      std::fill(ob.begin(), ob.end(), 0);
      ASSERT_TRUE(SetKernelIsa(isa).ok());
      AdamStep(c, spans(bb, aligned(ob)));
      ExpectBitEqual(a.param, bb.param, "param");
      ASSERT_EQ(std::memcmp(aligned(oa), aligned(ob), n * DTypeSize(od)), 0)
          << IsaName(isa) << " " << DTypeName(od);
    }
  }
}

TEST(Variants, SgdMatchesScalarBitForBit) {
  std::mt19937 rng(7);
  int k = 0;
  for (Isa isa : SupportedIsas()) {
    if (isa == Isa::kScalar) continue;
    for (DType gd : kDTypes) {
      for (int variant = 0; variant < 6; ++variant) {
        const size_t n = kSizes[(k++) % std::size(kSizes)] + rng() % 20;
        const size_t off = rng() % 16;
        Problem a(n, off, gd, rng);
        Problem b = a;
        SgdConfig c;
        c.lr = 0.05f;
        c.momentum = variant == 0 ? 0.0f : 0.9f;
        c.nesterov = variant == 2 || variant == 5;
        c.dampening = variant == 3 ? 0.1f : 0.0f;
        c.first_step = variant == 4;
        c.weight_decay = variant >= 4 ? 0.01f : 0.0f;
        c.inv_loss_scale = 0.5f;
        std::vector<uint16_t> out_a(n + off), out_b(n + off);
        auto spans = [&](Problem& p, std::vector<uint16_t>& o) {
          SgdSpans s;
          s.param = p.param.data() + off;
          s.momentum_buf = p.buf.data() + off;
          s.grad = p.g();
          s.grad_dtype = gd;
          s.param_out = o.data() + off;
          s.out_dtype = variant % 2 ? DType::kBF16 : DType::kF16;
          s.n = n;
          return s;
        };
        IsaGuard guard;
        ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
        ASSERT_TRUE(ValidateSgd(c, spans(a, out_a)).ok());
        SgdStep(c, spans(a, out_a));
        ASSERT_TRUE(SetKernelIsa(isa).ok());
        SgdStep(c, spans(b, out_b));
        SCOPED_TRACE(std::string(IsaName(isa)) + " variant " + std::to_string(variant));
        ExpectBitEqual(a.param, b.param, "param");
        ExpectBitEqual(a.buf, b.buf, "momentum_buf");
        ASSERT_EQ(out_a, out_b);
      }
    }
  }
}

TEST(Variants, CastsMatchScalarOnEveryBitPattern) {
  // All 65536 16-bit patterns to f32, and 2^20 f32 bit patterns (strided over the whole space
  // plus all around the bf16/f16 rounding boundaries) to 16 bits.
  std::vector<uint16_t> all16(65536);
  for (uint32_t i = 0; i < 65536; ++i) all16[i] = static_cast<uint16_t>(i);
  std::vector<float> f32;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) f32.push_back(FromBits(static_cast<uint32_t>(u)));
  for (uint32_t base : {0x3F800000u, 0x00000000u, 0x38800000u, 0x33800000u, 0x477FE000u,
                        0x7F7F0000u, 0x80800000u}) {
    for (uint32_t d = 0; d < 0x20000; ++d) f32.push_back(FromBits(base + d));
  }
  for (float special : {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, 65504.0f, 65520.0f}) {
    f32.push_back(special);
  }
  for (DType t : {DType::kBF16, DType::kF16}) {
    IsaGuard guard;
    ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
    std::vector<float> ref_to(all16.size());
    CastToF32(all16.data(), t, ref_to.data(), all16.size());
    std::vector<uint16_t> ref_from(f32.size());
    CastFromF32(f32.data(), ref_from.data(), t, f32.size());
    for (Isa isa : SupportedIsas()) {
      ASSERT_TRUE(SetKernelIsa(isa).ok());
      std::vector<float> to(all16.size());
      CastToF32(all16.data(), t, to.data(), all16.size());
      ExpectBitEqual(ref_to, to, "to_f32");
      std::vector<uint16_t> from(f32.size());
      CastFromF32(f32.data(), from.data(), t, f32.size());
      for (size_t i = 0; i < f32.size(); ++i) {
        ASSERT_EQ(ref_from[i], from[i]) << IsaName(isa) << " " << DTypeName(t) << " of 0x"
                                        << std::hex << Bits(f32[i]);
      }
    }
  }
}

TEST(Variants, GradNormMatchesScalar) {
  std::mt19937 rng(3);
  for (DType gd : kDTypes) {
    for (size_t n : {size_t{1}, size_t{15}, size_t{17}, size_t{1000}, size_t{100003}}) {
      Problem p(n, rng() % 16, gd, rng);
      IsaGuard guard;
      ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
      const GradStats ref = GradNormAndOverflow(p.g(), gd, n);
      ASSERT_GT(ref.sq_norm, 0);
      for (Isa isa : SupportedIsas()) {
        ASSERT_TRUE(SetKernelIsa(isa).ok());
        const GradStats st = GradNormAndOverflow(p.g(), gd, n);
        EXPECT_FALSE(st.overflow);
        // Exact products, different summation order: a few double ulps per term at most.
        EXPECT_NEAR(st.sq_norm, ref.sq_norm, ref.sq_norm * 1e-13) << IsaName(isa) << " n " << n;
      }
    }
  }
}

// The spans of a Problem built at offset 3 with bf16 grads, and a bf16 copy into `out`.
AdamSpans Bf16Spans(Problem& p, std::vector<uint16_t>& out, size_t n) {
  AdamSpans s;
  s.param = p.param.data() + 3;
  s.exp_avg = p.m.data() + 3;
  s.exp_avg_sq = p.v.data() + 3;
  s.grad = p.g();
  s.grad_dtype = DType::kBF16;
  s.param_out = out.data();
  s.n = n;
  return s;
}

TEST(Threads, ResultsDoNotDependOnThreadCount) {
  const int saved = KernelThreads();
  std::mt19937 rng(11);
  const size_t n = 3 * 32768 + 123;  // several tiles and a tail
  Problem a(n, 3, DType::kBF16, rng);
  Problem b = a;
  AdamConfig c;
  c.step = 5;
  auto spans = [&](Problem& p, std::vector<uint16_t>& o) { return Bf16Spans(p, o, n); };
  std::vector<uint16_t> oa(n), ob(n);
  SetKernelThreads(1);
  const GradStats g1 = GradNormAndOverflow(a.g(), DType::kBF16, n);
  AdamStep(c, spans(a, oa));
  SetKernelThreads(4);
  EXPECT_EQ(KernelThreads(), 4);
  const GradStats g4 = GradNormAndOverflow(b.g(), DType::kBF16, n);
  AdamStep(c, spans(b, ob));
  SetKernelThreads(saved);
  EXPECT_EQ(g1.sq_norm, g4.sq_norm);  // fixed tiles, summed in tile order
  ExpectBitEqual(a.param, b.param, "param");
  ExpectBitEqual(a.v, b.v, "exp_avg_sq");
  EXPECT_EQ(oa, ob);
}

// A caller's pool (ScopedParallelFor, as the torch binding passes torch's intra-op threads):
// runs the ranges it is given on its own threads, last range first, and counts what it ran.
class CountingPool final : public ParallelFor {
 public:
  void Run(size_t n, const std::function<void(size_t, size_t)>& body) const override {
    ++calls;
    std::vector<std::thread> threads;
    const size_t half = n / 2;
    threads.emplace_back([&] { body(half, n); });
    threads.emplace_back([&] { body(0, half); });
    for (std::thread& t : threads) t.join();
    tiles += n;
  }
  mutable std::atomic<int> calls{0};
  mutable std::atomic<size_t> tiles{0};
};

TEST(Threads, ACallersPoolRunsTheSameTilesOnThisThreadOnly) {
  std::mt19937 rng(12);
  const size_t n = 5 * 32768 + 77;
  Problem a(n, 3, DType::kBF16, rng);
  Problem b = a;
  AdamConfig c;
  c.step = 3;
  auto spans = [&](Problem& p, std::vector<uint16_t>& o) { return Bf16Spans(p, o, n); };
  std::vector<uint16_t> oa(n), ob(n);
  const GradStats ga = GradNormAndOverflow(a.g(), DType::kBF16, n);  // oneTBB
  AdamStep(c, spans(a, oa));
  CountingPool pool;
  GradStats gb;
  {
    ScopedParallelFor scope(&pool);
    gb = GradNormAndOverflow(b.g(), DType::kBF16, n);
    AdamStep(c, spans(b, ob));
    // Another thread's calls do not use it.
    std::thread other([&] { GradNormAndOverflow(b.g(), DType::kBF16, n); });
    other.join();
    {
      ScopedParallelFor none(nullptr);  // nests: oneTBB again inside
      GradNormAndOverflow(b.g(), DType::kBF16, n);
    }
  }
  GradNormAndOverflow(b.g(), DType::kBF16, n);  // the scope ended
  EXPECT_EQ(pool.calls.load(), 2);
  EXPECT_EQ(pool.tiles.load(), 2 * ((n + 32767) / 32768));
  EXPECT_EQ(ga.sq_norm, gb.sq_norm);
  ExpectBitEqual(a.param, b.param, "param");
  ExpectBitEqual(a.m, b.m, "exp_avg");
  ExpectBitEqual(a.v, b.v, "exp_avg_sq");
  EXPECT_EQ(oa, ob);
}

// ---- semantics against double-precision references of torch's formulas -----------------------

struct RefAdam {
  std::vector<double> p, m, v, vm;
};

// torch.optim.Adam / AdamW (maximize=False) in double, one step.
void RefAdamStep(RefAdam& r, const std::vector<float>& g, const AdamConfig& c) {
  const double b1 = c.beta1, b2 = c.beta2, lr = c.lr, wd = c.weight_decay;
  const double bc1 = 1 - std::pow(b1, c.step), bc2 = 1 - std::pow(b2, c.step);
  for (size_t i = 0; i < r.p.size(); ++i) {
    double gi = static_cast<double>(g[i]) * c.inv_loss_scale * c.clip_factor;
    if (c.decoupled) {
      r.p[i] *= 1 - lr * wd;
    } else {
      gi += wd * r.p[i];
    }
    r.m[i] = b1 * r.m[i] + (1 - b1) * gi;
    r.v[i] = b2 * r.v[i] + (1 - b2) * gi * gi;
    double vh = r.v[i];
    if (c.amsgrad) {
      r.vm[i] = std::max(r.vm[i], r.v[i]);
      vh = r.vm[i];
    }
    r.p[i] -= lr / bc1 * r.m[i] / (std::sqrt(vh) / std::sqrt(bc2) + c.eps);
  }
}

TEST(Semantics, AdamAndAdamWAndAmsgradTrackDoubleReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = 257;
  for (Isa isa : SupportedIsas()) {
    for (int variant = 0; variant < 3; ++variant) {
      IsaGuard guard;
      ASSERT_TRUE(SetKernelIsa(isa).ok());
      AdamConfig c;
      c.lr = 1e-2f;
      c.weight_decay = 0.1f;
      c.decoupled = variant != 1;
      c.amsgrad = variant == 2;
      std::vector<float> p(n), m(n, 0), v(n, 0), vm(n, 0), g(n);
      for (auto& x : p) x = normal(rng);
      RefAdam r{std::vector<double>(p.begin(), p.end()), std::vector<double>(n, 0),
                std::vector<double>(n, 0), std::vector<double>(n, 0)};
      for (int step = 1; step <= 20; ++step) {
        for (auto& x : g) x = normal(rng);
        c.step = step;
        AdamSpans s{p.data(), m.data(), v.data(), vm.data(), g.data(), DType::kF32,
                    nullptr, DType::kBF16, n};
        AdamStep(c, s);
        RefAdamStep(r, g, c);
      }
      double max_rel = 0;
      for (size_t i = 0; i < n; ++i) {
        // fp32 state vs a double reference: error measured against max(|p|, 1), i.e. in ulps
        // of the parameter scale. (AdamW vs Adam-L2 differ by lr * wd * p = 1e-3 per step.)
        max_rel = std::max(max_rel, std::fabs(p[i] - r.p[i]) / std::max(1.0, std::fabs(r.p[i])));
      }
      EXPECT_LT(max_rel, 1e-6) << IsaName(isa) << " variant " << variant;
    }
  }
}

TEST(Semantics, SgdMomentumAndNesterovTrackDoubleReference) {
  for (Isa isa : SupportedIsas()) {
    for (bool nesterov : {false, true}) {
      IsaGuard guard;
      ASSERT_TRUE(SetKernelIsa(isa).ok());
      const size_t n = 37;
      std::vector<float> p(n), buf(n), g(n);
      std::vector<double> rp(n), rb(n);
      for (size_t i = 0; i < n; ++i) rp[i] = p[i] = 0.1f * static_cast<float>(i) - 1.0f;
      SgdConfig c;
      c.lr = 0.1f;
      c.momentum = 0.9f;
      c.weight_decay = 0.01f;
      c.nesterov = nesterov;
      for (int step = 0; step < 10; ++step) {
        for (size_t i = 0; i < n; ++i) g[i] = std::sin(0.3f * static_cast<float>(i + step));
        c.first_step = step == 0;
        SgdStep(c, SgdSpans{p.data(), buf.data(), g.data(), DType::kF32, nullptr, DType::kBF16, n});
        for (size_t i = 0; i < n; ++i) {
          double d = g[i] + static_cast<double>(c.weight_decay) * rp[i];
          rb[i] = step == 0 ? d : c.momentum * rb[i] + d;
          d = nesterov ? d + c.momentum * rb[i] : rb[i];
          rp[i] -= static_cast<double>(c.lr) * d;
        }
      }
      for (size_t i = 0; i < n; ++i) {
        EXPECT_NEAR(p[i], rp[i], 1e-5 * std::max(1.0, std::fabs(rp[i]))) << i;
      }
    }
  }
}

// ---- overflow: the step is skipped and nothing is written --------------------------------------

TEST(Overflow, OneBadGradSkipsTheStepAndTouchesNothing) {
  std::mt19937 rng(9);
  for (Isa isa : SupportedIsas()) {
    for (DType gd : kDTypes) {
      for (float bad : {NAN, INFINITY, -INFINITY}) {
        IsaGuard guard;
        ASSERT_TRUE(SetKernelIsa(isa).ok());
        const size_t n = 1000;
        Problem p(n, 0, gd, rng);
        const size_t where = rng() % n;
        // Put one non-finite element in the grad (in its own dtype).
        float badf = bad;
        CastFromF32(&badf, p.grad.data() + where * DTypeSize(gd), gd, 1);
        Problem before = p;
        std::vector<uint16_t> out(n, 0x1234);
        AdamConfig c;
        AdamSpans s{p.param.data(), p.m.data(), p.v.data(), nullptr, p.g(), gd,
                    out.data(), DType::kBF16, n};
        const GradStats st = AdamStepUnlessOverflow(c, s);
        EXPECT_TRUE(st.overflow) << IsaName(isa) << " " << DTypeName(gd) << " " << bad;
        ExpectBitEqual(p.param, before.param, "param");
        ExpectBitEqual(p.m, before.m, "exp_avg");
        ExpectBitEqual(p.v, before.v, "exp_avg_sq");
        EXPECT_EQ(out, std::vector<uint16_t>(n, 0x1234));
        // And a finite grad steps.
        float fine = 1.0f;
        CastFromF32(&fine, p.grad.data() + where * DTypeSize(gd), gd, 1);
        EXPECT_FALSE(AdamStepUnlessOverflow(c, s).overflow);
        EXPECT_NE(Bits(p.param[where]), Bits(before.param[where]));
      }
    }
  }
}

// ---- bad input ---------------------------------------------------------------------------------

TEST(Validation, BadInputIsInvalidArgument) {
  float x = 0;
  AdamSpans s{&x, &x, &x, nullptr, &x, DType::kF32, nullptr, DType::kBF16, 1};
  AdamConfig c;
  EXPECT_TRUE(ValidateAdam(c, s).ok());
  c.amsgrad = true;
  EXPECT_EQ(ValidateAdam(c, s).code(), StatusCode::kInvalidArgument);
  c.amsgrad = false;
  c.step = 0;
  EXPECT_EQ(ValidateAdam(c, s).code(), StatusCode::kInvalidArgument);
  c.step = 1;
  c.beta2 = 1.0f;
  EXPECT_EQ(ValidateAdam(c, s).code(), StatusCode::kInvalidArgument);
  c.beta2 = 0.999f;
  s.exp_avg = nullptr;
  EXPECT_EQ(ValidateAdam(c, s).code(), StatusCode::kInvalidArgument);
  SgdConfig sc;
  sc.momentum = 0.9f;
  EXPECT_EQ(ValidateSgd(sc, SgdSpans{&x, nullptr, &x, DType::kF32, nullptr, DType::kBF16, 1}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseIsa("avx9").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseIsa("scalar"), Isa::kScalar);
  EXPECT_EQ(SetKernelIsa(static_cast<Isa>(9)).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem::kernels
