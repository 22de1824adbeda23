// Speculative optimizer steps where the host is full (optimizer_overlap: backward, issue 43
// §1): the update goes copy-on-write to fresh NVMe regions in the backward and step() flips the
// homes (or drops it and runs the deferred update from the untouched old values). Bit-identical
// to optimizer_overlap "off" with clipping that triggers and that does not, accumulation, fp16
// overflow, and an NVMe tier too full for the speculative state (counted, still exact). Every
// test also checks the counters: the NVMe path must actually run where it is meant to.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "runtime/session.h"
#include "tests/runtime/session_test_common.h"
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using nlohmann::json;

using namespace session_tests;  // NOLINT: the split files' shared helpers

// Three groups (a | b | c+d) of 4 Ki elements, two optimizer param groups.
const std::vector<TensorSpec> kSpecs = {{"a", 4096, true, 0},
                                        {"b", 4096, true, 1},
                                        {"c", 2560, true, 0},
                                        {"d", 1536, true, 1}};

// A host budget the homes fill (m and v homed on NVMe, no free room for a host speculation),
// NVMe of `nvme_size` under `dir`.
std::unique_ptr<Session> MakeFull(const std::string& dir, const char* overlap,
                                  const char* precision, const std::string& nvme_size = "4MiB",
                                  int accumulation = 1) {
  return Make({{"device", "512KiB"},
               {"host", "224KiB"},
               {"chunk_size", 4096},
               {"gradient_clipping", 1.0},
               {"gradient_accumulation_steps", accumulation},
               {"precision", precision},
               {"optimizer_placement", "host"},
               {"optimizer_overlap", overlap},
               {"nvme", {{"path", dir}, {"size", nvme_size}}}},
              kSpecs);
}

class SessionInBackward : public ::testing::Test {
 protected:
  void SetUp() override {
    for (std::string& d : dirs_) d = TempDir();
  }
  void TearDown() override {
    for (auto& x : s_) x.reset();
    for (const std::string& d : dirs_) std::filesystem::remove_all(d);
  }
  // s_[0]: optimizer_overlap off; s_[1]: backward. Same initial values.
  void MakeBoth(const char* precision, const std::string& nvme_size = "4MiB",
                int accumulation = 1) {
    const char* overlap[2] = {"off", "backward"};
    for (int k = 0; k < 2; ++k) {
      s_[k] = MakeFull(dirs_[k], overlap[k], precision, nvme_size, accumulation);
      ASSERT_TRUE(s_[k]);
      ASSERT_EQ(s_[k]->layout().num_groups(), 3u);
      for (size_t t = 0; t < kSpecs.size(); ++t) {
        ASSERT_THAT(s_[k]->values().WriteParam(t, Random(kSpecs[t].numel, t).data()), IsOk());
      }
    }
  }
  const Session::SpeculationStats& Spec() const { return s_[1]->speculation_stats(); }

  std::string dirs_[2];
  std::unique_ptr<Session> s_[2];
};

TEST_F(SessionInBackward, TheHostIsFullOfHomesAndMAndVLiveOnNvme) {
  MakeBoth("fp32");
  for (size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(s_[1]->chunks().Home(g, ChunkKind::kExpAvg), TierKind::kNvme) << g;
    EXPECT_EQ(s_[1]->chunks().Home(g, ChunkKind::kExpAvgSq), TierKind::kNvme) << g;
  }
}

TEST_F(SessionInBackward, CopyOnWriteToNvmeIsBitIdenticalWithClippingOnAndOff) {
  // Clipping at 1.0: gradients of scale 0.1 clip (norm ~ 10), of 0.003 do not (~ 0.3). In
  // every precision (bf16: the rounded compute copy and the fp32 master go through NVMe too;
  // fp16: an overflowing step drops every speculation and is skipped).
  for (const char* precision : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    MakeBoth(precision);
    const bool fp16 = std::string(precision) == "fp16";
    for (int it = 0; it < 8; ++it) {
      SCOPED_TRACE("iteration " + std::to_string(it));
      SpecIt o;
      o.announced = o.hyper = {{1e-2 / (it + 1), 0.9, 0.99, 1e-8, 0.01},
                               {3e-3, 0.8, 0.95, 1e-6, 0.1}};
      o.grad_scale = it % 3 == 1 ? 0.1f : 0.003f;  // clipped at 1, 4, 7
      o.overflow = fp16 && it == 5;
      std::vector<std::vector<float>> seen[2];
      StepResult r[2];
      for (int k = 0; k < 2; ++k) {
        // Reads between the backward and step() see the values before the step.
        if (it == 3) o.between = [&seen, k](Session& x) { seen[k] = TrainingState(x); };
        r[k] = SpecIteration(*s_[k], it, o);
      }
      EXPECT_EQ(seen[0], seen[1]);
      EXPECT_EQ(r[0].clip_coef, r[1].clip_coef);
      EXPECT_EQ(r[0].skipped, r[1].skipped);
      EXPECT_EQ(r[0].skipped, o.overflow);
      if (!o.overflow) {
        EXPECT_EQ(r[0].clip_coef < 1.0f, it % 3 == 1) << r[0].grad_norm;
      }
      EXPECT_EQ(TrainingState(*s_[0]), TrainingState(*s_[1]));
      // Nothing in flight once step() decided.
      EXPECT_EQ(Spec().nvme_bytes_in_flight, 0u);
    }
    const Session::SpeculationStats& st = Spec();
    // Two of three groups per backward from the second iteration (group 0's gradient
    // completes at the last moment), all of them on NVMe: 7 x 2. Dropped: the clipped steps
    // (iterations 1, 4, 7 after the first: 3 x 2 less the first's none) and the overflow.
    EXPECT_EQ(st.speculated, 14u);
    EXPECT_EQ(st.speculated_nvme, 14u);
    EXPECT_EQ(st.speculated_host, 0u);
    EXPECT_EQ(st.no_room, 0u);
    EXPECT_EQ(st.dropped, 6u + (fp16 ? 2u : 0u));
    EXPECT_EQ(st.committed + st.dropped, st.speculated);
    EXPECT_GT(st.committed, 0u);
    // Every output chunk of a group in flight at once: at least one group's p, m and v.
    const Bytes group_bytes = 4096 * (fp16 || std::string(precision) == "bf16" ? 14 : 12);
    EXPECT_GE(st.nvme_bytes_peak, group_bytes);
    EXPECT_LE(st.nvme_bytes_peak, 2 * group_bytes);
    EXPECT_GT(st.prefetched, 0u);  // m and v read ahead in the backward
    EXPECT_EQ(s_[0]->speculation_stats().speculated, 0u);
  }
}

TEST_F(SessionInBackward, CopyOnWriteToNvmeIsBitIdenticalWithAccumulation) {
  MakeBoth("fp32", "4MiB", /*accumulation=*/2);
  for (int it = 0; it < 12; ++it) {
    SCOPED_TRACE("micro-step " + std::to_string(it));
    SpecIt o;
    o.announced = o.hyper = {{1e-2, 0.9, 0.99, 1e-8, 0.01}, {3e-3, 0.8, 0.95, 1e-6, 0.1}};
    o.grad_scale = it % 6 == 3 ? 0.1f : 0.002f;  // the window of micro-steps 2, 3 clips
    StepResult r[2];
    for (int k = 0; k < 2; ++k) r[k] = SpecIteration(*s_[k], it, o);
    EXPECT_EQ(r[0].applied, it % 2 == 1);
    EXPECT_EQ(r[0].applied, r[1].applied);
    EXPECT_EQ(r[0].clip_coef, r[1].clip_coef);
    EXPECT_EQ(TrainingState(*s_[0]), TrainingState(*s_[1]));
  }
  const Session::SpeculationStats& st = Spec();
  EXPECT_GT(st.speculated_nvme, 0u);
  EXPECT_GT(st.committed, 0u);
  EXPECT_GT(st.dropped, 0u);  // the clipped windows
  EXPECT_EQ(st.no_room, 0u);
  EXPECT_EQ(st.committed + st.dropped, st.speculated);
}

TEST_F(SessionInBackward, AnNvmeTierTooFullForTheSpeculativeStateFallsBackExactly) {
  // NVMe room for the homes (128 KiB: 128 KiB fails to create) and 16 KiB more: one group's
  // p, m and v (48 KiB) do not fit beside them.
  MakeBoth("fp32", "144KiB");
  for (int it = 0; it < 4; ++it) {
    SpecIt o;
    o.announced = o.hyper = {GroupHyper{}, GroupHyper{}};
    o.grad_scale = 0.003f;
    StepResult r[2];
    for (int k = 0; k < 2; ++k) r[k] = SpecIteration(*s_[k], it, o);
    EXPECT_EQ(TrainingState(*s_[0]), TrainingState(*s_[1]));
  }
  const Session::SpeculationStats& st = Spec();
  EXPECT_EQ(st.speculated, 0u);
  EXPECT_GT(st.no_room, 0u);
  EXPECT_EQ(st.nvme_bytes_peak, 0u);
}

}  // namespace
}  // namespace tiermem::session
