// CUDA optimizer kernels against the CPU scalar reference (label gpu; skips without a device).
// The device step must equal the scalar reference bit for bit (same constants, _rn intrinsics),
// over many chunks (more than one launch batch), tails, every grad dtype and copy dtype,
// amsgrad and Adam-L2; the grad norm within summation rounding; overflow flagged.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/cpu/optim.h"
#include "kernels/cuda/optim_cuda.h"
#include "tests/support/gpu.h"

namespace tiermem::kernels {
namespace {

// Device copy of a host vector; freed by the owner.
template <typename T>
struct DevVec {
  explicit DevVec(const std::vector<T>& h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(1, n) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DevVec() { cudaFree(ptr); }
  std::vector<T> Get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  T* ptr = nullptr;
  size_t n;
};

std::vector<uint16_t> To16(const std::vector<float>& f, DType t) {
  std::vector<uint16_t> out(f.size());
  CastFromF32(f.data(), out.data(), t, f.size());
  return out;
}

TEST(CudaAdam, MultiChunkStepEqualsScalarReferenceBitForBit) {
  TIERMEM_REQUIRE_GPU();
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType od : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (int variant = 0; variant < 3; ++variant) {
        AdamConfig c;
        c.lr = 1e-2f;
        c.weight_decay = 0.05f;
        c.decoupled = variant != 1;
        c.amsgrad = variant == 2;
        c.step = 7;
        c.inv_loss_scale = 1.0f / 512;
        c.clip_factor = 0.8f;
        const size_t chunks = 37;  // > one launch batch of 32
        std::vector<size_t> ns(chunks);
        size_t total = 0;
        for (auto& n : ns) total += (n = 1 + rng() % 3000);
        std::vector<float> p(total), m(total), v(total), vm(total), g(total);
        for (size_t i = 0; i < total; ++i) {
          p[i] = normal(rng);
          m[i] = 0.1f * normal(rng);
          v[i] = 0.01f * std::fabs(normal(rng));
          vm[i] = i % 2 ? 2 * v[i] : 0.5f * v[i];
          g[i] = 300.0f * normal(rng);
        }
        std::vector<uint16_t> g16 = gd == DType::kF32 ? std::vector<uint16_t>() : To16(g, gd);
        DevVec<float> dp(p), dm(m), dv(v), dvm(vm), dg(g), dout(std::vector<float>(total, 0));
        DevVec<uint16_t> dg16(g16.empty() ? std::vector<uint16_t>(1) : g16);
        std::vector<cuda::AdamChunk> list(chunks);
        size_t off = 0;
        for (size_t k = 0; k < chunks; ++k) {
          auto& ch = list[k];
          ch.param = dp.ptr + off;
          ch.exp_avg = dm.ptr + off;
          ch.exp_avg_sq = dv.ptr + off;
          ch.max_exp_avg_sq = dvm.ptr + off;
          ch.grad = gd == DType::kF32 ? static_cast<const void*>(dg.ptr + off)
                                      : static_cast<const void*>(dg16.ptr + off);
          ch.param_out = od == DType::kF32 ? static_cast<void*>(dout.ptr + off)
                                           : static_cast<void*>(reinterpret_cast<uint16_t*>(dout.ptr) + off);
          ch.n = ns[k];
          off += ns[k];
        }
        ASSERT_TRUE(cuda::AdamStepMulti(c, list.data(), chunks, gd, od, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        // CPU reference on the same data as one span (element-wise: chunking is irrelevant).
        std::vector<float> ref_out(total, 0);
        AdamSpans s{p.data(), m.data(), v.data(), vm.data(),
                    gd == DType::kF32 ? static_cast<const void*>(g.data()) : g16.data(), gd,
                    ref_out.data(), od, total};
        AdamStep(c, s);
        SCOPED_TRACE(std::string(DTypeName(gd)) + " -> " + std::string(DTypeName(od)) +
                     " variant " + std::to_string(variant));
        auto same = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
          ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << what;
        };
        same(dp.Get(), p, "param");
        same(dm.Get(), m, "exp_avg");
        same(dv.Get(), v, "exp_avg_sq");
        if (c.amsgrad) same(dvm.Get(), vm, "max_exp_avg_sq");
        const size_t out_bytes = total * DTypeSize(od);
        std::vector<float> got_out = dout.Get();
        ASSERT_EQ(std::memcmp(got_out.data(), ref_out.data(), out_bytes), 0) << "param_out";
      }
    }
  }
}

// Compressed state (int8 blocks of 64, 256 and 4096, bf16 nearest and stochastic): the device
// step equals the CPU scalar reference bit for bit — params, copies, codes and absmax.
TEST(CudaAdam, CompressedStateEqualsScalarReferenceBitForBit) {
  TIERMEM_REQUIRE_GPU();
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const StateFormat formats[] = {{StateDType::kInt8, 64}, {StateDType::kInt8, 256},
                                 {StateDType::kInt8, 4096}, {StateDType::kBF16, 256, false},
                                 {StateDType::kBF16, 256, true}};
  for (const StateFormat& f : formats) {
    for (DType gd : {DType::kF32, DType::kBF16}) {
      const size_t n = 100003;  // blocks end mid-way
      std::vector<float> p(n), m(n), v(n), g(n);
      for (size_t i = 0; i < n; ++i) {
        p[i] = normal(rng);
        m[i] = 1e-3f * normal(rng);
        v[i] = 1e-6f * std::fabs(normal(rng));
        g[i] = 1e-2f * normal(rng) * (i % 101 == 0 ? 50.0f : 1.0f);
      }
      const bool int8 = f.dtype == StateDType::kInt8;
      const size_t es = int8 ? 1 : 2;
      std::vector<uint8_t> mq(n * es), vq(n * es);
      std::vector<float> ma(StateBlocks(f, n) + 1), va(ma.size());
      QuantizeState(f, true, m.data(), {mq.data(), ma.data()}, n, 1);
      QuantizeState(f, false, v.data(), {vq.data(), va.data()}, n, 2);
      std::vector<uint16_t> g16 = gd == DType::kF32 ? std::vector<uint16_t>(1) : To16(g, gd);
      DevVec<float> dp(p), dg(g), dma(ma), dva(va);
      DevVec<uint8_t> dmq(mq), dvq(vq);
      DevVec<uint16_t> dg16(g16), dout(std::vector<uint16_t>(n, 0));
      AdamConfig c;
      c.lr = 1e-2f;
      c.weight_decay = 0.01f;
      c.step = 5;
      c.clip_factor = 0.7f;
      c.rounding_seed = 99;
      AdamSpans ds;
      ds.param = dp.ptr;
      ds.grad = gd == DType::kF32 ? static_cast<const void*>(dg.ptr) : dg16.ptr;
      ds.grad_dtype = gd;
      ds.param_out = dout.ptr;
      ds.out_dtype = DType::kBF16;
      ds.n = n;
      ds.state = f;
      ds.exp_avg_q = {dmq.ptr, int8 ? dma.ptr : nullptr};
      ds.exp_avg_sq_q = {dvq.ptr, int8 ? dva.ptr : nullptr};
      ASSERT_TRUE(cuda::AdamStepCompressed(c, ds, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      AdamSpans hs = ds;  // the same step on the host copies
      std::vector<uint16_t> out(n, 0);
      hs.param = p.data();
      hs.grad = gd == DType::kF32 ? static_cast<const void*>(g.data()) : g16.data();
      hs.param_out = out.data();
      hs.exp_avg_q = {mq.data(), int8 ? ma.data() : nullptr};
      hs.exp_avg_sq_q = {vq.data(), int8 ? va.data() : nullptr};
      AdamStep(c, hs);
      const std::string what = std::string(StateDTypeName(f.dtype)) + " block " +
                               std::to_string(f.block) + " stochastic " +
                               std::to_string(f.stochastic) + " grad " + std::string(DTypeName(gd));
      EXPECT_EQ(dp.Get(), p) << what;
      EXPECT_EQ(dout.Get(), out) << what;
      EXPECT_EQ(dmq.Get(), mq) << what;
      EXPECT_EQ(dvq.Get(), vq) << what;
      EXPECT_EQ(dma.Get(), ma) << what;
      EXPECT_EQ(dva.Get(), va) << what;
    }
  }
}

TEST(CudaGradNorm, MatchesCpuAndFlagsOverflow) {
  TIERMEM_REQUIRE_GPU();
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> a(100003), b(77);
  for (auto& x : a) x = normal(rng);
  for (auto& x : b) x = 10 * normal(rng);
  DevVec<float> da(a), db(b);
  const void* grads[] = {da.ptr, db.ptr};
  const size_t ns[] = {a.size(), b.size()};
  auto st = cuda::GradNormAndOverflowMulti(grads, ns, 2, DType::kF32, nullptr);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  const double want = GradNormAndOverflow(a.data(), DType::kF32, a.size()).sq_norm +
                      GradNormAndOverflow(b.data(), DType::kF32, b.size()).sq_norm;
  EXPECT_NEAR(st->sq_norm, want, want * 1e-12);
  EXPECT_FALSE(st->overflow);
  b[40] = INFINITY;
  DevVec<float> dbad(b);
  const void* grads2[] = {da.ptr, dbad.ptr};
  st = cuda::GradNormAndOverflowMulti(grads2, ns, 2, DType::kF32, nullptr);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->overflow);
  std::vector<uint16_t> h = To16(a, DType::kBF16);
  h[5] = 0x7FC0;  // NaN
  DevVec<uint16_t> dh(h);
  const void* grads3[] = {dh.ptr};
  st = cuda::GradNormAndOverflowMulti(grads3, ns, 1, DType::kBF16, nullptr);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->overflow);
}

TEST(CudaCast, EqualsCpuCastsOnAllPatterns) {
  TIERMEM_REQUIRE_GPU();
  ASSERT_TRUE(SetKernelIsa(Isa::kScalar).ok());
  std::vector<float> f;
  for (uint64_t u = 0; u < (1ull << 32); u += 65537) {
    float x;
    const uint32_t bits = static_cast<uint32_t>(u);
    std::memcpy(&x, &bits, 4);
    f.push_back(x);
  }
  std::vector<uint16_t> all16(65536);
  for (uint32_t i = 0; i < 65536; ++i) all16[i] = static_cast<uint16_t>(i);
  for (DType t : {DType::kBF16, DType::kF16}) {
    DevVec<float> df(f);
    DevVec<uint16_t> dout(std::vector<uint16_t>(f.size()));
    ASSERT_TRUE(cuda::CastFromF32(df.ptr, dout.ptr, t, f.size(), nullptr).ok());
    EXPECT_EQ(dout.Get(), To16(f, t)) << DTypeName(t);
    DevVec<uint16_t> d16(all16);
    DevVec<float> dback(std::vector<float>(65536));
    ASSERT_TRUE(cuda::CastToF32(d16.ptr, t, dback.ptr, 65536, nullptr).ok());
    std::vector<float> ref(65536);
    CastToF32(all16.data(), t, ref.data(), 65536);
    std::vector<float> got = dback.Get();
    for (uint32_t i = 0; i < 65536; ++i) {
      if (std::isnan(ref[i])) {
        EXPECT_TRUE(std::isnan(got[i]));  // NaN payloads are not part of the contract
      } else {
        ASSERT_EQ(std::memcmp(&got[i], &ref[i], 4), 0) << DTypeName(t) << " 0x" << std::hex << i;
      }
    }
  }
}

TEST(CudaAdam, BadArgumentsAreInvalidArgument) {
  // Validation happens before any CUDA call: runs without a GPU too.
  cuda::AdamChunk ch;
  ch.n = 10;  // null pointers
  AdamConfig c;
  EXPECT_EQ(cuda::AdamStepMulti(c, &ch, 1, DType::kF32, DType::kBF16, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::AdamStepMulti(c, nullptr, 3, DType::kF32, DType::kBF16, nullptr).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem::kernels
