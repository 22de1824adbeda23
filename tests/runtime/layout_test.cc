// The session's pure layout (runtime/layout.h), alone: no tier, no engine. Packing, the chunk
// size choice, the compressed-state split, sharding rounding, the byte counts and the host
// room the tier stack is sized for, with exact values.
#include "runtime/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::StatusIs;

// Only its address matters to LayOut (a sharded layout needs collectives).
class NoCollectives final : public Collectives {
 public:
  Status AllGather(const void*, void*, Bytes) override {
    return InternalError("not called by the layout");
  }
};

SessionConfig Sim(Bytes device = kMiB) {
  SessionConfig c;
  c.device_kind = DeviceKind::kSim;
  c.device_budget = device;
  return c;
}

TEST(Layout, PacksTrainableThenFrozenIntoGroupsOfTheirOwn) {
  SessionConfig c = Sim();
  c.chunk_size = 2048;
  auto l = LayOut(c, {{"w", 1500, true, 0}, {"frozen", 600, false, 0}, {"b", 400, true, 1}}, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->chunk_elems, 2048u);
  EXPECT_EQ(l->shard_elems, 2048u);
  EXPECT_EQ(l->shard_begin, 0u);
  ASSERT_EQ(l->groups.size(), 2u);
  // Trainable tensors first, in the given order, at aligned offsets (kAlignElems).
  EXPECT_EQ(l->tensors[0].group, 0u);
  EXPECT_EQ(l->tensors[0].offset, 0u);
  EXPECT_EQ(l->tensors[2].group, 0u);
  EXPECT_EQ(l->tensors[2].offset, 1504u);  // 1500 rounded up to 32
  EXPECT_EQ(l->tensors[2].opt_group, 1);
  EXPECT_EQ(l->tensors[1].group, 1u);
  EXPECT_FALSE(l->tensors[1].trainable);
  EXPECT_TRUE(l->groups[0].trainable);
  EXPECT_FALSE(l->groups[1].trainable);
  EXPECT_EQ(l->groups[0].used_elems, 1904u);
  EXPECT_EQ(l->groups[0].tensors, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(l->specs[1].name, "frozen");
  for (const ChunkGroup& g : l->groups) {
    for (ChunkId id : g.chunks) EXPECT_EQ(id, kNoChunk);  // no chunk exists yet
  }
  // fp32: no low-precision copy; frozen groups have no grads or optimizer state.
  EXPECT_FALSE(l->NeedsKind(0, ChunkKind::kParamLowp));
  EXPECT_TRUE(l->NeedsKind(0, ChunkKind::kExpAvgSq));
  EXPECT_TRUE(l->NeedsKind(1, ChunkKind::kParamFp32));
  EXPECT_FALSE(l->NeedsKind(1, ChunkKind::kGrad));
  EXPECT_EQ(l->ShardChunkBytes(0, ChunkKind::kGrad), 2048u * 4);
  // Model bytes: trainable fp32 params + grads + m + v, frozen params.
  EXPECT_EQ(l->model_bytes, (1500 + 400) * 16u + 600 * 4u);

  c.precision = Precision::kBf16;
  auto m = LayOut(c, {{"w", 1500, true, 0}, {"frozen", 600, false, 0}}, {});
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->NeedsKind(1, ChunkKind::kParamLowp));  // frozen: compute copy and master
  EXPECT_TRUE(m->NeedsKind(1, ChunkKind::kParamFp32));
  EXPECT_EQ(m->dtype(ChunkKind::kGrad), kernels::DType::kBF16);
  EXPECT_EQ(m->ShardChunkBytes(0, ChunkKind::kParamLowp), 2048u * 2);
  // bf16 params + grads, fp32 m, v and master; frozen: bf16 + fp32 master.
  EXPECT_EQ(m->model_bytes, 1500 * (2 + 2 + 8 + 4) + 600 * (2 + 4u));
}

TEST(Layout, FrozenTensorsExactInTheComputeDTypeKeepNoMaster) {
  SessionConfig c = Sim();
  c.chunk_size = 2048;
  c.precision = Precision::kBf16;
  TensorSpec exact{"exact", 600, false, 0};
  exact.values_in_compute_dtype = true;
  TensorSpec trained{"trained", 300, true, 0};
  trained.values_in_compute_dtype = true;  // ignored: it trains
  auto l = LayOut(c, {trained, exact, {"frozen", 500, false, 0}, exact}, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  // trained, then the frozen one with a master, then the two exact ones in a group of their own.
  ASSERT_EQ(l->groups.size(), 3u);
  EXPECT_EQ(l->tensors[0].group, 0u);
  EXPECT_EQ(l->tensors[2].group, 1u);
  EXPECT_EQ(l->tensors[1].group, 2u);
  EXPECT_EQ(l->tensors[3].group, 2u);
  EXPECT_FALSE(l->groups[0].compute_only);
  EXPECT_FALSE(l->groups[1].compute_only);
  EXPECT_TRUE(l->groups[2].compute_only);
  EXPECT_TRUE(l->NeedsKind(1, ChunkKind::kParamFp32));
  EXPECT_TRUE(l->NeedsKind(2, ChunkKind::kParamLowp));
  EXPECT_FALSE(l->NeedsKind(2, ChunkKind::kParamFp32));
  EXPECT_EQ(l->value_kind(1), ChunkKind::kParamFp32);
  EXPECT_EQ(l->value_kind(2), ChunkKind::kParamLowp);
  // bf16 + grad + m, v and master for the trained one; 6 bytes for the frozen one with a
  // master; 2 for the exact ones.
  EXPECT_EQ(l->model_bytes, 300 * (2 + 2 + 8 + 4) + 500 * (2 + 4u) + 2 * 600 * 2u);

  // fp32: nothing changes (the compute chunk is the fp32 one).
  c.precision = Precision::kFp32;
  auto f = LayOut(c, {exact, {"frozen", 500, false, 0}}, {});
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->groups.size(), 1u);
  EXPECT_FALSE(f->groups[0].compute_only);
  EXPECT_TRUE(f->NeedsKind(0, ChunkKind::kParamFp32));
  EXPECT_EQ(f->model_bytes, (600 + 500) * 4u);
}

TEST(Layout, ATensorLargerThanAChunkIsSplitIntoRows) {
  SessionConfig c = Sim();
  c.chunk_size = 1024;
  TensorSpec big{"big", 3000, true, 0, {6, 500}};
  auto l = LayOut(c, {big}, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const TensorPlace& p = l->tensors[0];
  ASSERT_TRUE(p.split());
  uint64_t covered = 0;
  for (const Piece& piece : p.pieces) {
    EXPECT_EQ(piece.numel % 500, 0u);  // whole rows
    EXPECT_LE(piece.numel, 1024u);
    covered += piece.numel;
  }
  EXPECT_EQ(covered, 3000u);
  EXPECT_EQ(p.pieces.size(), 3u);  // two rows a chunk
}

TEST(Layout, ChoosesTheChunkSizeForTheBudgetAndNamesTheMinimum) {
  SessionConfig c = Sim(kMiB);
  const std::vector<TensorSpec> specs = {{"a", 10000, true, 0}, {"b", 3000, true, 0}};
  auto l = LayOut(c, specs, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  std::vector<chunks::PackTensor> packed(2);
  packed[0].numel = 10000;
  packed[1].numel = 3000;
  auto want = chunks::ChooseChunkElems(packed, kMiB, 8, kMinResidentChunks);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(l->chunk_elems, want->chunk_elems);
  // The minimum: kMinResidentChunks fp32 param + grad chunks of the largest tensor.
  EXPECT_EQ(l->min_device_budget, chunks::MinimumDeviceBudget(10000, 8, kMinResidentChunks));

  EXPECT_THAT(LayOut(Sim(4096), {{"big", 100000, true, 0}}, {}),
              StatusIs(StatusCode::kResourceExhausted, "minimum"));
  SessionConfig fixed = Sim(kMiB);
  fixed.chunk_size = 1 << 20;
  EXPECT_THAT(LayOut(fixed, {{"w", 10, true, 0}}, {}),
              StatusIs(StatusCode::kResourceExhausted, "for chunk_size=1048576"));

  // Host mode: no device minimum; chunks sized for 1/kHostChunkShare of the host budget.
  SessionConfig host;
  host.device_kind = DeviceKind::kHost;
  host.host_budget = 32 * kMiB;
  auto h = LayOut(host, specs, {});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->min_device_budget, 0u);
  auto hwant = chunks::ChooseChunkElems(packed, 8 * (32 * kMiB / kHostChunkShare), 8,
                                        kMinResidentChunks);
  ASSERT_TRUE(hwant.ok());
  EXPECT_EQ(h->chunk_elems, hwant->chunk_elems);
}

TEST(Layout, BadTensorsAndShardingAreRefused) {
  const SessionConfig c = Sim();
  EXPECT_THAT(LayOut(c, {}, {}), StatusIs(StatusCode::kInvalidArgument, "no parameters"));
  EXPECT_THAT(LayOut(c, {{"empty", 0, true, 0}}, {}),
              StatusIs(StatusCode::kInvalidArgument, "empty"));
  EXPECT_THAT(LayOut(c, {{"g", 10, true, -1}}, {}),
              StatusIs(StatusCode::kInvalidArgument, "negative param group"));
  EXPECT_THAT(LayOut(c, {{"s", 10, true, 0, {3, 4}}}, {}),
              StatusIs(StatusCode::kInvalidArgument, "shape of 12 elements"));
  EXPECT_THAT(LayOut(c, {{"w", 10, true, 0}}, Sharding{2, 2, nullptr}),
              StatusIs(StatusCode::kInvalidArgument, "rank 2 of a world of 2"));
  EXPECT_THAT(LayOut(c, {{"w", 10, true, 0}}, Sharding{2, 0, nullptr}),
              StatusIs(StatusCode::kInvalidArgument, "needs its collectives"));
}

TEST(Layout, CompressedStateTakesTheLargeWholeTensorsOnBlockBoundaries) {
  SessionConfig c = Sim();
  c.chunk_size = 4096;
  c.optimizer_state.format.dtype = kernels::StateDType::kInt8;
  c.optimizer_state.format.block = 256;
  c.optimizer_state.min_elems = 1000;
  // "big" (5000) is split across chunks, "small" below min_elems: both keep fp32 state.
  auto l = LayOut(c,
                  {{"a", 1100, true, 0},
                   {"small", 100, true, 0},
                   {"b", 1000, true, 0},
                   {"big", 5000, true, 0, {10, 500}},
                   {"f", 50, false, 0}},
                  {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const ChunkGroup& ga = l->groups[l->tensors[0].group];
  EXPECT_EQ(ga.state, c.optimizer_state.format);
  EXPECT_EQ(l->tensors[0].group, 0u);  // compressed groups come first
  EXPECT_EQ(l->tensors[2].group, 0u);
  EXPECT_EQ(l->tensors[2].offset, 1280u);  // 1100 rounded up to the 256-element block
  for (size_t t : {1u, 3u}) {
    EXPECT_FALSE(l->groups[l->tensors[t].group].state.compressed()) << t;
    EXPECT_NE(l->tensors[t].group, 0u) << t;
  }
  EXPECT_FALSE(l->groups[l->tensors[4].group].trainable);
  // int8 m and v: one byte per element and a float per block.
  EXPECT_EQ(l->ShardChunkBytes(0, ChunkKind::kExpAvg), kernels::StateBytes(ga.state, 4096));
  EXPECT_EQ(l->ShardChunkBytes(0, ChunkKind::kExpAvg), 4096u + 16 * 4);

  c.chunk_size = 4096 + 32;  // not whole blocks
  EXPECT_THAT(LayOut(c, {{"a", 1100, true, 0}}, {}),
              StatusIs(StatusCode::kInvalidArgument, "not a multiple of optimizer.state_block"));
}

TEST(Layout, ShardingRoundsEveryChunkToEqualAlignedShards) {
  NoCollectives coll;
  SessionConfig c = Sim();
  c.chunk_size = 1000;
  auto l = LayOut(c, {{"w", 900, true, 0}}, Sharding{3, 2, &coll});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->chunk_elems, 1152u);  // 1000 up to a multiple of 3 x kShardAlignElems
  EXPECT_EQ(l->shard_elems, 384u);
  EXPECT_EQ(l->shard_begin, 768u);
  EXPECT_EQ(l->ShardChunkBytes(0, ChunkKind::kParamFp32), 384u * 4);
  // int8 state: whole blocks in every shard.
  c.optimizer_state.format.dtype = kernels::StateDType::kInt8;
  c.optimizer_state.format.block = 256;
  c.chunk_size = 1024;
  auto q = LayOut(c, {{"w", 900, true, 0}}, Sharding{3, 0, &coll});
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->chunk_elems, 1536u);  // a multiple of 3 x 256
  EXPECT_EQ(q->shard_elems, 512u);
  // Sharded, no tensor may be split.
  c.optimizer_state = {};
  c.chunk_size = 256;
  EXPECT_THAT(LayOut(c, {{"big", 2000, true, 0, {10, 200}}}, Sharding{2, 0, &coll}),
              StatusIs(StatusCode::kResourceExhausted, "keeps every tensor whole"));
}

TEST(Layout, HostRoomIsCountedInChunksOfTheLargestKind) {
  SessionConfig c = Sim();
  c.chunk_size = 1000;  // fp32 chunks of 4000 bytes: 4096 page-aligned
  const std::vector<TensorSpec> train = {{"w", 900, true, 0}};
  const std::vector<TensorSpec> serve = {{"w", 900, false, 0}};
  auto room = [&](const SessionConfig& cfg, const std::vector<TensorSpec>& specs) {
    auto l = LayOut(cfg, specs, {});
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return HostRoomFor(*l, cfg);
  };
  // Without NVMe nothing is kept back.
  EXPECT_EQ(room(c, train).host_reserve, 0u);
  EXPECT_EQ(room(c, train).chunk_bytes, 4000u);
  c.nvme_size = kGiB;
  c.host_reserve = 100;
  EXPECT_EQ(room(c, train).host_reserve, kStepGroupChunks * 4096 + 100);
  EXPECT_EQ(room(c, serve).host_reserve, kServingReadChunks * 4096 + 100);
  SessionConfig h = c;
  h.device_kind = DeviceKind::kHost;
  EXPECT_EQ(room(h, train).host_reserve, (kStepGroupChunks + kPrefetchedChunks) * 4096 + 100);
  EXPECT_EQ(room(h, serve).host_reserve, (kMinResidentChunks + kPrefetchedChunks) * 4096 + 100);
  // Prefault the whole host budget when the model is larger than it.
  c.host_budget = 900 * 16;
  EXPECT_EQ(room(c, train).host_prefault, 0u);  // exactly the budget: it fits
  c.host_budget = 900 * 16 - 1;
  EXPECT_EQ(room(c, train).host_prefault, 900 * 16 - 1u);
  EXPECT_EQ(room(c, train).host_homes_first, 0u);
}

TEST(Layout, AServedMixtureOfExpertsHomesItsDenseGroupsFirst) {
  SessionConfig c = Sim();
  c.chunk_size = 1024;
  c.nvme_size = kGiB;
  c.precision = Precision::kBf16;
  const std::vector<TensorSpec> specs = {
      {"dense", 1000, false, 0},
      {"e0", 1000, false, 0, {}, 0, 0},
      {"e1", 1000, false, 0, {}, 0, 1},
  };
  auto l = LayOut(c, specs, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->groups.size(), 3u);
  EXPECT_TRUE(l->dense_first());
  EXPECT_EQ(l->expert_group, (std::vector<uint8_t>{0, 1, 1}));
  // The dense group's bf16 and fp32 chunks, page-aligned at the fp32 size.
  EXPECT_EQ(HostRoomFor(*l, c).host_homes_first, 2 * 4096u);
  // Training never homes dense groups first.
  std::vector<TensorSpec> train = specs;
  for (TensorSpec& t : train) t.trainable = true;
  auto t = LayOut(c, train, {});
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->dense_first());
  EXPECT_EQ(HostRoomFor(*t, c).host_homes_first, 0u);
}

TEST(Layout, EachUnitsGroupsComeFromTheTensorsThatNameIt) {
  SessionConfig c = Sim();
  c.chunk_size = 1000;
  const std::vector<TensorSpec> specs = {
      {"tied", 900, false, 0, {}, -1, -1, {0, 1}},          // g0, in both units
      {"b", 900, false, 0, {}, -1, -1, {0}},                // g1
      {"big", 2000, false, 0, {4, 500}, -1, -1, {1}},       // split: g2, g3
      {"none", 900, false, 0},                              // g4, no unit
      {"e0", 900, false, 0, {}, 0, 0, {1}},                 // expert 0: g5
      {"e1", 1800, false, 0, {2, 900}, 0, 1, {1}},          // expert 1: g6, g7
  };
  auto l = LayOut(c, specs, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->groups.size(), 8u);
  ASSERT_EQ(l->units.size(), 2u);
  EXPECT_EQ(l->units[0].groups, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(l->units[0].pin_groups, (std::vector<uint32_t>{0, 1}));
  EXPECT_TRUE(l->units[0].experts.empty());
  // A split tensor's groups are the unit's, but its pieces are pinned one at a time.
  EXPECT_EQ(l->units[1].groups, (std::vector<uint32_t>{0, 2, 3}));
  EXPECT_EQ(l->units[1].pin_groups, (std::vector<uint32_t>{0}));
  EXPECT_EQ(l->units[1].experts, (std::vector<std::vector<uint32_t>>{{5}, {6, 7}}));
  EXPECT_EQ(MostPinGroups(l->units), 2u);
  // No units named: none.
  std::vector<TensorSpec> bare = specs;
  for (TensorSpec& t : bare) t.units.clear();
  auto b = LayOut(c, bare, {});
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->units.empty());
  EXPECT_EQ(MostPinGroups(b->units), 0u);
}

TEST(Layout, ServingInHostModeKeepsRoomForTheMostGroupsOneUnitPins) {
  SessionConfig c = Sim();
  c.device_kind = DeviceKind::kHost;
  c.chunk_size = 1000;  // fp32 chunks of 4000 bytes: 4096 page-aligned
  c.nvme_size = kGiB;
  // A decoder layer of 7 tensors of a chunk each (q, k, v, o, gate, up, down), and a head.
  std::vector<TensorSpec> serve;
  for (int i = 0; i < 7; ++i) serve.push_back({"layer." + std::to_string(i), 900, false, 0});
  serve.push_back({"head", 900, false, 0});
  auto room = [&](const std::vector<TensorSpec>& specs) {
    auto l = LayOut(c, specs, {});
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return HostRoomFor(*l, c).host_reserve;
  };
  // Without units: the device minimum's chunks and the prefetched ones.
  EXPECT_EQ(room(serve), (kMinResidentChunks + kPrefetchedChunks) * 4096);
  for (int i = 0; i < 7; ++i) serve[i].units = {0};
  serve[7].units = {1};
  EXPECT_EQ(room(serve), (7 + kPrefetchedChunks) * 4096);
  // Units of fewer groups than the device minimum keep its room.
  for (int i = 0; i < 7; ++i) serve[i].units = {i % 2};
  EXPECT_EQ(room(serve), (kMinResidentChunks + kPrefetchedChunks) * 4096);
  // Training holds one step's group however large the units.
  std::vector<TensorSpec> train = serve;
  for (TensorSpec& t : train) {
    t.trainable = true;
    t.units = {0};
  }
  EXPECT_EQ(room(train), (kStepGroupChunks + kPrefetchedChunks) * 4096);
}

TEST(Layout, AnswersItsFactsTheSessionUsedToForward) {
  NoCollectives coll;
  SessionConfig c = Sim();
  c.chunk_size = 1000;
  c.precision = Precision::kBf16;
  auto l = LayOut(c, {{"w", 900, true, 0}, {"frozen", 600, false, 0}}, Sharding{2, 1, &coll});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->num_tensors(), 2u);
  EXPECT_EQ(l->num_groups(), 2u);
  EXPECT_EQ(l->spec(1).name, "frozen");
  EXPECT_EQ(l->place(1).group, 1u);
  EXPECT_FALSE(l->group(1).trainable);
  EXPECT_EQ(l->world, 2);
  EXPECT_EQ(l->rank, 1);
  EXPECT_TRUE(l->sharded());
  EXPECT_EQ(l->compute_element_size(), 2u);  // bf16
  EXPECT_EQ(l->compute_kind(), ChunkKind::kParamLowp);
  EXPECT_FALSE(l->has_kind(0, ChunkKind::kParamLowp));  // no chunk created yet
  // Every chunk on this rank (shards of 1024 / 2 = 512 elements): the trainable group's bf16
  // params and grads, fp32 master, m and v; the frozen one's bf16 params and fp32 master.
  EXPECT_EQ(l->chunk_elems, 1024u);
  EXPECT_EQ(l->total_chunk_bytes(), 512u * (2 + 2 + 4 + 4 + 4) + 512u * (2 + 4));
}

TEST(Layout, AUnitPinsItsComputeChunksAndItsLargestExpertsBeyondThem) {
  SessionConfig c = Sim();
  c.chunk_size = 1000;  // fp32 chunks of 4000 bytes
  const std::vector<TensorSpec> specs = {
      {"tied", 900, false, 0, {}, -1, -1, {0, 1}},  // g0
      {"b", 900, false, 0, {}, -1, -1, {0}},        // g1
      {"c", 900, false, 0, {}, -1, -1, {1}},        // g2
      {"e0", 900, false, 0, {}, 0, 0, {1}},         // expert 0: g3
      {"e1", 1800, false, 0, {2, 900}, 0, 1, {1}},  // expert 1: g4, g5
  };
  auto l = LayOut(c, specs, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->chunk_elems, 1000u);
  EXPECT_EQ(l->UnitComputeBytes({0, 1}).value(), 2 * 4000u);
  // The largest expert beyond the unit's groups: expert 1's two groups (g0 is not counted
  // twice).
  EXPECT_EQ(l->UnitComputeBytes({0, 2}, {{3}, {4, 5}, {0}}).value(), 4 * 4000u);
  EXPECT_EQ(l->UnitComputeBytes({0, 2}, {{0, 3}}).value(), 3 * 4000u);  // g0 is the unit's
  EXPECT_THAT(l->UnitComputeBytes({9}), StatusIs(StatusCode::kOutOfRange, "chunk group 9"));
  const Layout::UnitNeed need = l->ServingMinimum();
  EXPECT_EQ(need.unit, 1);
  EXPECT_EQ(need.bytes, 4 * 4000u);  // g0, g2 and expert 1's g4, g5
  std::vector<TensorSpec> bare = specs;
  for (TensorSpec& t : bare) t.units.clear();
  auto b = LayOut(c, bare, {});
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ServingMinimum().unit, -1);
  EXPECT_EQ(b->ServingMinimum().bytes, 0u);
}

TEST(Placement, IsDerivedOnceFromTheConfigTheLayoutAndTheHomes) {
  SessionConfig c = Sim(100000);
  c.chunk_size = 1000;
  c.host_budget = 500000;
  auto l = LayOut(c, {{"w", 900, true, 0}}, {});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->num_groups(), 1u);
  ASSERT_EQ(l->chunk_elems, 1000u);
  const Placement p = PlaceOn(*l, c, /*every_home_on_host=*/false);
  EXPECT_FALSE(p.cuda());
  EXPECT_FALSE(p.host_compute());
  EXPECT_EQ(p.compute_tier(), TierKind::kDevice);
  EXPECT_EQ(p.compute_budget, 100000u);  // the device's, wherever the homes are
  // fp32 params, grads, m and v of one group.
  EXPECT_EQ(p.total_chunk_bytes, 4 * 1000 * 4u);
  EXPECT_TRUE(p.compute_tier_holds_every_chunk());
  // A group's compute and grad chunks, full: 2 x chunk_elems x 4.
  const Bytes group = 2 * l->chunk_elems * 4;
  EXPECT_TRUE(p.holds_grad_chunks());  // one group fits the budget
  EXPECT_EQ(p.ActivationCap(1), 100000 - 2 * group);
  EXPECT_EQ(p.ActivationCap(100), 0u);
  EXPECT_EQ(p.RecentFullChunks(1), 3u);  // 2 x 1 + 1, below a quarter of the budget's chunks
  EXPECT_EQ(p.RecentFullChunks(100), 100000 / (4 * l->chunk_elems * 4));
  // A budget below one group's compute and grad chunks holds none (unless sharded).
  SessionConfig small = c;
  small.device_budget = group - 1;
  EXPECT_FALSE(PlaceOn(*l, small, false).holds_grad_chunks());
  EXPECT_FALSE(PlaceOn(*l, small, false).compute_tier_holds_every_chunk());
  // Host mode: the host is the compute tier; its budget counts only when every chunk is
  // homed there.
  SessionConfig h = c;
  h.device_kind = DeviceKind::kHost;
  const Placement ph = PlaceOn(*l, h, true);
  EXPECT_TRUE(ph.host_compute());
  EXPECT_EQ(ph.compute_tier(), TierKind::kHost);
  EXPECT_EQ(ph.compute_budget, 500000u);
  EXPECT_EQ(PlaceOn(*l, h, false).compute_budget, 0u);
  EXPECT_EQ(ph.RecentFullChunks(100), 500000 / (4 * l->chunk_elems * 4));
  SessionConfig cu = c;
  cu.device_kind = DeviceKind::kCuda;
  EXPECT_TRUE(PlaceOn(*l, cu, false).cuda());
}

}  // namespace
}  // namespace tiermem::session
