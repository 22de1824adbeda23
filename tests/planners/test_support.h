// Shared helpers of the planners tests: a StatusIs matcher, a machine model, hand-made and
// random traces (fixed seeds; portable: only mt19937_64's specified output is used).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "planners/machine.h"
#include "planners/trace.h"

namespace tiermem::planners::testing {

MATCHER_P2(StatusIs, code, substring, "") {
  const Status& s = arg;
  if (s.code() != code) {
    *result_listener << "code is " << StatusCodeName(s.code()) << ": " << s.message();
    return false;
  }
  if (s.message().find(substring) == std::string::npos) {
    *result_listener << "message is: " << s.message();
    return false;
  }
  return true;
}

// 1 GB/s each way between host and device, 0.5 GB/s to and from NVMe, no latency; optimizer
// rates 1e9 (CPU) and 1e10 (device) elements/s.
inline MachineModel TestMachine(Bytes device, Bytes host, Bytes nvme = 0) {
  MachineModel m;
  m.budget = {device, host, nvme};
  auto set = [&m](TierKind a, TierKind b, double bw) {
    m.link[static_cast<int>(a)][static_cast<int>(b)] = LinkRate{bw, 0};
  };
  set(TierKind::kHost, TierKind::kDevice, 1e9);
  set(TierKind::kDevice, TierKind::kHost, 1e9);
  set(TierKind::kHost, TierKind::kNvme, 5e8);
  set(TierKind::kNvme, TierKind::kHost, 5e8);
  m.DeriveNvmeLinks();
  m.cpu_optim_elems_per_s = 1e9;
  m.device_optim_elems_per_s = 1e10;
  m.cpu_cores = 2;
  return m;
}

// Moments given as lists of chunk ids read on the device, `compute_ns` each.
inline Trace ReadOnlyTrace(uint32_t chunks, Bytes bytes,
                           const std::vector<std::vector<std::vector<ChunkId>>>& iterations,
                           uint64_t compute_ns = 1000000) {
  TraceBuilder b;
  const uint16_t k = b.KindIndex("param");
  for (ChunkId c = 0; c < chunks; ++c) {
    b.DeclareChunk(c, TraceChunk{bytes, Category::kParam, c, k, TierKind::kHost});
  }
  for (const auto& it : iterations) {
    b.BeginIteration();
    for (size_t m = 0; m < it.size(); ++m) {
      b.BeginMoment("m" + std::to_string(m), MomentKind::kOther);
      for (ChunkId c : it[m]) b.Access(c, AccessMode::kRead, TierKind::kDevice);
      b.EndMoment(compute_ns);
    }
  }
  auto t = b.Finish();
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : Trace();
}

struct RandomSpec {
  uint32_t chunks = 6;
  uint32_t moments = 16;  // eviction-only: moments per iteration
  uint32_t iterations = 2;
  bool identical = true;    // iterations repeat exactly
  bool uniform = true;      // equal chunk sizes
  uint32_t max_access = 3;  // chunks per moment (eviction-only)
  bool training = false;    // units fwd/bwd with grads, optimizer steps, activations
  uint32_t units = 4;       // training: units
};

inline uint64_t Uniform(std::mt19937_64& g, uint64_t n) { return g() % n; }

// Eviction-only (reads on the device) or training-shaped random traces.
inline Trace RandomTrace(uint64_t seed, const RandomSpec& s, Bytes unit_bytes = 1 << 20) {
  std::mt19937_64 g(seed);
  TraceBuilder b;
  const uint16_t kp = b.KindIndex("param");
  if (!s.training) {
    for (ChunkId c = 0; c < s.chunks; ++c) {
      const Bytes bytes = s.uniform ? unit_bytes : unit_bytes * (1 + Uniform(g, 3));
      b.DeclareChunk(c, TraceChunk{bytes, Category::kParam, c, kp, TierKind::kHost});
    }
    std::vector<std::vector<std::vector<ChunkId>>> its;
    for (uint32_t it = 0; it < s.iterations; ++it) {
      if (it > 0 && s.identical) {
        its.push_back(its[0]);
        continue;
      }
      std::vector<std::vector<ChunkId>> ms;
      for (uint32_t m = 0; m < s.moments; ++m) {
        std::vector<ChunkId> acc;
        const uint32_t n = 1 + static_cast<uint32_t>(Uniform(g, s.max_access));
        while (acc.size() < n && acc.size() < s.chunks) {
          const ChunkId c = static_cast<ChunkId>(Uniform(g, s.chunks));
          if (std::find(acc.begin(), acc.end(), c) == acc.end()) acc.push_back(c);
        }
        ms.push_back(acc);
      }
      its.push_back(ms);
    }
    for (const auto& it : its) {
      b.BeginIteration();
      for (size_t m = 0; m < it.size(); ++m) {
        b.BeginMoment("m" + std::to_string(m), MomentKind::kOther);
        for (ChunkId c : it[m]) b.Access(c, AccessMode::kRead, TierKind::kDevice);
        b.EndMoment(200000 + Uniform(g, 2000000));
      }
    }
  } else {
    // Training: each unit owns 1-2 groups of (param, grad, exp_avg, exp_avg_sq) chunks;
    // the first unit and the last share a group (tied weights).
    const uint16_t kg = b.KindIndex("grad"), km = b.KindIndex("exp_avg"),
                   kv = b.KindIndex("exp_avg_sq");
    MeasuredRates r;  // what the steps' compute times below were "measured" at
    r.cpu_optim_elems_per_s = 1e9;
    r.device_optim_elems_per_s = 1e10;
    b.SetRates(r);
    std::vector<std::vector<uint32_t>> unit_groups(s.units);
    uint32_t groups = 0;
    for (uint32_t u = 0; u < s.units; ++u) {
      const uint32_t n = 1 + static_cast<uint32_t>(Uniform(g, 2));
      for (uint32_t k = 0; k < n; ++k) unit_groups[u].push_back(groups++);
    }
    unit_groups[s.units - 1].push_back(unit_groups[0][0]);
    for (uint32_t gr = 0; gr < groups; ++gr) {
      const Bytes bytes = s.uniform ? unit_bytes : unit_bytes * (1 + Uniform(g, 2));
      b.DeclareChunk(4 * gr, TraceChunk{bytes, Category::kParam, gr, kp, TierKind::kHost});
      b.DeclareChunk(4 * gr + 1, TraceChunk{bytes, Category::kGrad, gr, kg, TierKind::kHost});
      b.DeclareChunk(4 * gr + 2, TraceChunk{bytes, Category::kOptimState, gr, km, TierKind::kHost});
      b.DeclareChunk(4 * gr + 3, TraceChunk{bytes, Category::kOptimState, gr, kv, TierKind::kHost});
    }
    std::vector<uint64_t> fwd_ns(s.units);
    std::vector<Bytes> saved(s.units), temp(s.units);
    for (uint32_t u = 0; u < s.units; ++u) {
      fwd_ns[u] = 300000 + Uniform(g, 1500000);
      saved[u] = unit_bytes / 4 * Uniform(g, 5);
      temp[u] = unit_bytes / 8 * Uniform(g, 3);
    }
    for (uint32_t it = 0; it < s.iterations; ++it) {
      b.BeginIteration();
      Bytes live = 0;
      for (uint32_t u = 0; u < s.units; ++u) {
        b.BeginMoment("fwd:" + std::to_string(u), MomentKind::kPreForward, u);
        for (uint32_t gr : unit_groups[u]) b.Access(4 * gr, AccessMode::kRead, TierKind::kDevice);
        live += saved[u];
        b.SetSavedBytes(saved[u]);
        b.SetActivationBytes(live + temp[u]);
        b.EndMoment(fwd_ns[u]);
      }
      std::vector<bool> touched(groups, false);
      for (uint32_t k = s.units; k-- > 0;) {
        b.BeginMoment("bwd:" + std::to_string(k), MomentKind::kPreBackward, k);
        for (uint32_t gr : unit_groups[k]) {
          b.Access(4 * gr, AccessMode::kRead, TierKind::kDevice);
          b.Access(4 * gr + 1, touched[gr] ? AccessMode::kReadWrite : AccessMode::kWrite,
                   TierKind::kDevice);
          touched[gr] = true;
        }
        b.SetActivationBytes(live + temp[k]);
        live -= saved[k];
        b.EndMoment(2 * fwd_ns[k]);
      }
      for (uint32_t gr = 0; gr < groups; ++gr) {
        b.BeginMoment("opt:" + std::to_string(gr), MomentKind::kOptimizerStep);
        b.Access(4 * gr + 1, AccessMode::kRead, TierKind::kHost);
        b.Access(4 * gr, AccessMode::kReadWrite, TierKind::kHost);
        b.Access(4 * gr + 2, AccessMode::kReadWrite, TierKind::kHost);
        b.Access(4 * gr + 3, AccessMode::kReadWrite, TierKind::kHost);
        b.SetWorkElems(unit_bytes / 4);
        b.EndMoment(unit_bytes / 4);  // 1 ns per element: the CPU rate of TestMachine
      }
    }
  }
  auto t = b.Finish();
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : Trace();
}

}  // namespace tiermem::planners::testing
