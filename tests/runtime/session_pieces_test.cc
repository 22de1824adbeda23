// Session with tensors larger than a chunk (split into pieces of whole rows) and expert sets:
// the layout, values, the optimizer step and checkpoints see whole tensors, bit for bit as a
// session whose chunks hold every tensor whole.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "runtime/session.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

std::unique_ptr<Session> Make(json config, std::vector<TensorSpec> specs) {
  return testing::MakeSession(std::move(config), std::move(specs));
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// Writes fp32 `g` into the tensor's grad pieces on the compute tier, as a binding does.
void SetGrad(Session& s, size_t t, const std::vector<float>& g) {
  for (const Piece& p : s.layout().place(t).pieces) {
    auto base = s.chunks().Acquire(p.group, ChunkKind::kGrad, s.placement().compute_tier());
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    if (s.layout().dtype(ChunkKind::kGrad) == kernels::DType::kF32) {
      std::memcpy(static_cast<float*>(*base) + p.offset, g.data() + p.begin, p.numel * 4);
    } else {
      kernels::CastFromF32(g.data() + p.begin, static_cast<char*>(*base) + p.offset * 2,
                           s.layout().dtype(ChunkKind::kGrad), p.numel);
    }
    ASSERT_THAT(s.chunks().Release(p.group, ChunkKind::kGrad, true), IsOk());
  }
  s.optimizer().SetHasGrad(t, true);
}

std::vector<float> Read(Session& s, size_t t, ChunkKind k = ChunkKind::kParamFp32) {
  std::vector<float> v(s.layout().place(t).numel);
  EXPECT_THAT(s.values().ReadTensor(t, k, v.data()), IsOk());
  return v;
}

// A 1000-element tensor, one of 8000 in 200 rows of 40, a small one.
const std::vector<TensorSpec> kSpecs = {{"a", 1000, true, 0, {100, 10}},
                                        {"big", 8000, true, 0, {200, 40}},
                                        {"c", 77, true, 0, {77}}};

TEST(SessionPieces, ATensorLargerThanAChunkIsSplitIntoRowsCoveringIt) {
  // fp32 training: 8 device bytes per element, 4 chunks: 64000 bytes = chunks of <= 2000.
  auto s = Make({{"device", 64000}}, kSpecs);
  ASSERT_TRUE(s);
  EXPECT_LE(s->layout().chunk_elems, 2000u);
  const TensorPlace& big = s->layout().place(1);
  ASSERT_GT(big.pieces.size(), 3u);
  EXPECT_TRUE(big.split());
  EXPECT_FALSE(s->layout().place(0).split());
  uint64_t next = 0;
  std::set<uint32_t> groups;
  for (const Piece& p : big.pieces) {
    EXPECT_EQ(p.begin, next);
    EXPECT_EQ(p.numel % 40, 0u) << "whole rows";
    EXPECT_LE(p.offset + p.numel, s->layout().chunk_elems);
    groups.insert(p.group);
    next += p.numel;
    // The group lists the piece.
    const ChunkGroup& g = s->layout().group(p.group);
    EXPECT_NE(std::find_if(g.pieces.begin(), g.pieces.end(),
                           [&](const PieceRef& r) {
                             return r.tensor == 1 && big.pieces[r.piece].begin == p.begin;
                           }),
              g.pieces.end());
    EXPECT_NE(std::find(g.tensors.begin(), g.tensors.end(), 1u), g.tensors.end());
  }
  EXPECT_EQ(next, 8000u);
  EXPECT_EQ(groups.size(), big.pieces.size());
  EXPECT_EQ(big.group, big.pieces[0].group);
  // The minimum follows the largest row (40 elements), not the largest tensor.
  EXPECT_EQ(s->layout().min_device_budget, 40u * 8 * 4);
}

TEST(SessionPieces, CompressedOptimizerStateCoversWholeTensorsAndSplitOnesKeepFp32) {
  // int8 state (block 256): the chunk is a multiple of the block; "a" stays whole and takes
  // the format, "big" is split and keeps fp32 state (warned), "c" is below state_min_elems.
  auto s = Make({{"device", 64000},
                 {"optimizer", {{"state_dtype", "int8"}, {"state_min_elems", 100}}}},
                kSpecs);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->layout().chunk_elems % 256, 0u);
  EXPECT_LE(s->layout().chunk_elems, 2000u);
  EXPECT_FALSE(s->layout().place(0).split());
  EXPECT_EQ(s->values().state_format(s->layout().place(0).group).dtype, kernels::StateDType::kInt8);
  ASSERT_TRUE(s->layout().place(1).split());
  for (const Piece& p : s->layout().place(1).pieces) {
    EXPECT_EQ(s->values().state_format(p.group).dtype, kernels::StateDType::kF32);
  }
  EXPECT_EQ(s->values().state_format(s->layout().place(2).group).dtype, kernels::StateDType::kF32);
  // Each group has one format: no int8 group holds a piece of the split tensor.
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    if (s->values().state_format(g).dtype != kernels::StateDType::kInt8) continue;
    for (uint32_t t : s->layout().group(g).tensors) EXPECT_EQ(t, 0u);
  }
}

TEST(SessionPieces, BelowTheLargestRowTheBudgetIsRefusedNamingThePiece) {
  auto c = ParseConfig({{"device", 40 * 8 * 4 - 1}, {"device_kind", "sim"}}, MapEnv({}));
  ASSERT_TRUE(c.ok());
  EXPECT_THAT(Session::Create(*c, kSpecs),
              StatusIs(StatusCode::kResourceExhausted,
                       "chunks holding the largest piece a unit needs at once: a row of 40 "
                       "elements of tensor 1"));
  // ... and names that tensor.
  EXPECT_THAT(Session::Create(*c, kSpecs),
              StatusIs(StatusCode::kResourceExhausted, "tensor 1 is 'big' (200 x 40)"));
  auto ok = ParseConfig({{"device", 40 * 8 * 4}, {"device_kind", "sim"}}, MapEnv({}));
  EXPECT_THAT(Session::Create(*ok, kSpecs).status(), IsOk());
}

// The same values, gradients and steps in a session that splits `big` and in one that holds it
// whole: parameters, m, v and step counts are bit-equal; checkpoints load across them.
TEST(SessionPieces, SplitTensorsStepAndCheckpointBitForBitLikeWholeOnes) {
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    auto whole = Make({{"device", "4MiB"}, {"precision", precision}}, kSpecs);
    auto split = Make({{"device", 64000}, {"precision", precision}, {"chunk_size", 1000}},
                      kSpecs);
    ASSERT_TRUE(whole && split);
    ASSERT_FALSE(whole->layout().place(1).split());
    ASSERT_TRUE(split->layout().place(1).split());
    for (size_t t = 0; t < kSpecs.size(); ++t) {
      const std::vector<float> v = Random(kSpecs[t].numel, 10 + t);
      ASSERT_THAT(whole->values().WriteParam(t, v.data()), IsOk());
      ASSERT_THAT(split->values().WriteParam(t, v.data()), IsOk());
      EXPECT_EQ(Read(*split, t), v);
    }
    GroupHyper h;
    h.lr = 1e-2;
    h.weight_decay = 0.1;
    for (int step = 0; step < 3; ++step) {
      for (Session* s : {whole.get(), split.get()}) {
        ASSERT_THAT(s->optimizer().ZeroGrad().status(), IsOk());
        for (size_t t = 0; t < kSpecs.size(); ++t) {
          if (step == 1 && t == 1) continue;  // `big` has no gradient this step: not stepped
          SetGrad(*s, t, Random(kSpecs[t].numel, 100 * step + t));
        }
        ASSERT_THAT(s->optimizer().Step({h}).status(), IsOk());
      }
    }
    for (size_t t = 0; t < kSpecs.size(); ++t) {
      EXPECT_EQ(Read(*split, t), Read(*whole, t)) << kSpecs[t].name;
      EXPECT_EQ(Read(*split, t, ChunkKind::kExpAvg), Read(*whole, t, ChunkKind::kExpAvg));
      EXPECT_EQ(Read(*split, t, ChunkKind::kExpAvgSq), Read(*whole, t, ChunkKind::kExpAvgSq));
      EXPECT_EQ(split->values().step_count(t), whole->values().step_count(t));
    }
    EXPECT_EQ(split->values().step_count(1), 2);
    // A checkpoint of the split session loads into the whole one and back.
    char tmpl[] = "/tmp/tiermem-pieces-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    const std::string path = std::string(tmpl) + "/ck.safetensors";
    ASSERT_THAT(split->SaveCheckpoint(path), IsOk());
    auto fresh = Make({{"device", "4MiB"}, {"precision", precision}}, kSpecs);
    ASSERT_THAT(fresh->LoadCheckpoint(path), IsOk());
    for (size_t t = 0; t < kSpecs.size(); ++t) {
      EXPECT_EQ(Read(*fresh, t), Read(*split, t));
      EXPECT_EQ(Read(*fresh, t, ChunkKind::kExpAvgSq), Read(*split, t, ChunkKind::kExpAvgSq));
      EXPECT_EQ(fresh->values().step_count(t), split->values().step_count(t));
    }
    ASSERT_THAT(whole->SaveCheckpoint(path), IsOk());
    auto back = Make({{"device", 64000}, {"precision", precision}, {"chunk_size", 1000}},
                     kSpecs);
    ASSERT_THAT(back->LoadCheckpoint(path), IsOk());
    EXPECT_EQ(Read(*back, 1), Read(*whole, 1));
    std::filesystem::remove_all(tmpl);
  }
}

TEST(SessionPieces, ExpertSetsGiveEachExpertChunksOfItsOwn) {
  // A MoE layer: attention weight, router, fused gate_up [4, 16, 8] and down [4, 8, 8], then
  // a ModuleList-style set of 3 experts with two tensors each, then a norm.
  std::vector<TensorSpec> specs = {{"attn", 256, true, 0, {16, 16}},
                                   {"router", 32, true, 0, {4, 8}},
                                   {"gate_up", 512, true, 0, {4, 16, 8}, 0, -1},
                                   {"down", 256, true, 0, {4, 8, 8}, 0, -1}};
  for (int e = 0; e < 3; ++e) {
    specs.push_back({"w1." + std::to_string(e), 64, true, 0, {8, 8}, 1, e});
    specs.push_back({"w2." + std::to_string(e), 64, true, 0, {8, 8}, 1, e});
  }
  specs.push_back({"norm", 8, true, 0, {8}});
  auto s = Make({{"device", "1MiB"}}, specs);
  ASSERT_TRUE(s);
  // The chunk holds the largest expert (a gate_up row of 128 + a down row of 64), though the
  // budget allows far more; the 256-element attention weight is split into rows.
  EXPECT_EQ(s->layout().chunk_elems, 192u);
  EXPECT_TRUE(s->layout().place(0).split());
  // Every piece of an expert-set tensor sits in a group holding only that expert's pieces.
  std::set<uint32_t> expert_groups;
  for (size_t t = 2; t + 1 < specs.size(); ++t) {
    const TensorPlace& tp = s->layout().place(t);
    EXPECT_EQ(tp.pieces.size(), specs[t].expert < 0 ? 4u : 1u) << specs[t].name;
    for (const Piece& p : tp.pieces) {
      const int want = specs[t].expert < 0 ? static_cast<int>(p.begin / (p.numel)) : specs[t].expert;
      EXPECT_EQ(p.expert, want) << specs[t].name;
      expert_groups.insert(p.group);
      for (const PieceRef& r : s->layout().group(p.group).pieces) {
        EXPECT_EQ(specs[r.tensor].expert_set, specs[t].expert_set) << specs[t].name;
        EXPECT_EQ(s->layout().place(r.tensor).pieces[r.piece].expert, p.expert) << specs[t].name;
      }
    }
  }
  EXPECT_EQ(expert_groups.size(), 4u + 3u);  // one chunk per expert
  // Values of an expert-set tensor read and write whole.
  const std::vector<float> v = Random(512, 5);
  ASSERT_THAT(s->values().WriteParam(2, v.data()), IsOk());
  EXPECT_EQ(Read(*s, 2), v);
  // A fused expert tensor needs its shape (its first dimension indexes the experts).
  auto c = ParseConfig({{"device", "1MiB"}, {"device_kind", "sim"}}, MapEnv({}));
  EXPECT_THAT(Session::Create(*c, {{"gate_up", 512, true, 0, {}, 0, -1}}),
              StatusIs(StatusCode::kInvalidArgument, "without a shape"));
  EXPECT_THAT(Session::Create(*c, {{"a", 64, true, 0, {4, 16}, 0, -1},
                                   {"b", 60, true, 0, {5, 12}, 0, -1}}),
              StatusIs(StatusCode::kInvalidArgument, "expert set 0"));
}

}  // namespace
}  // namespace tiermem::session
