// Host mode's sizing (runtime/host_floor.h): tensors stay whole while the host room for
// NVMe-homed chunks in use fits the budget; below that, tensors larger than a chunk of the
// budget's share are split and their compute copies count in the budget; the refusal below
// that floor names the tensor that sets it, before any tier is built.
#include "runtime/host_floor.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "runtime/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

constexpr Bytes kMiB = Bytes{1} << 20;

// A 32,000-token vocabulary, 64 wide (a CI-sized Llama's embedding and head, fp32: 8.19 MB
// each) and two layers' worth of small tensors.
std::vector<TensorSpec> Vocab32k() {
  std::vector<TensorSpec> t;
  t.push_back({"model.embed_tokens.weight", 32000 * 64, true, 0, {32000, 64}});
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "self_attn.q_proj.weight", 64 * 64, true, 0, {64, 64}});
    t.push_back({p + "mlp.up_proj.weight", 128 * 64, true, 0, {128, 64}});
    t.push_back({p + "input_layernorm.weight", 64, true, 0, {64}});
  }
  t.push_back({"lm_head.weight", 32000 * 64, true, 0, {32000, 64}});
  return t;
}

std::vector<chunks::PackTensor> Packed(const std::vector<TensorSpec>& specs) {
  std::vector<chunks::PackTensor> out;
  for (const TensorSpec& s : specs) {
    chunks::PackTensor p;
    p.numel = s.numel;
    p.rows = s.shape.empty() ? 1 : static_cast<uint64_t>(s.shape[0]);
    out.push_back(p);
  }
  return out;
}

HostSizingInputs Fp32Training() {
  HostSizingInputs in;
  in.per_elem = 8;  // param + grad, fp32
  in.compute_esize = 4;
  in.align_elems = chunks::kAlignElems;
  in.trainable = true;
  in.nvme = true;
  return in;
}

TEST(HostFloor, WholeTensorsWhileTheirRoomFits) {
  const auto packed = Packed(Vocab32k());
  // 256 MiB: 7 chunks of the 8.19 MB head fit; nothing is split, no compute room.
  StatusOr<HostSizing> s = SizeHostChunks(packed, Fp32Training(), 256 * kMiB);
  ASSERT_THAT(s.status(), IsOk());
  EXPECT_FALSE(s->split);
  EXPECT_GE(s->chunk_elems, 32000u * 64);
  EXPECT_EQ(s->compute_room, 0u);
  EXPECT_EQ(s->room_tensor, -1);
  EXPECT_EQ(s->reserve, 7 * AlignUp(s->chunk_elems * 4, 4096));
  // Without NVMe there is no room to hold: whole at any budget.
  HostSizingInputs no_nvme = Fp32Training();
  no_nvme.nvme = false;
  s = SizeHostChunks(packed, no_nvme, 8 * kMiB);
  ASSERT_THAT(s.status(), IsOk());
  EXPECT_FALSE(s->split);
  EXPECT_EQ(s->need(), 0u);
}

// `enough` is the floor exactly: at it the sizing needs no more than it, one byte less needs
// more than that.
void ExpectTheFloorIsExact(const std::vector<chunks::PackTensor>& packed,
                           const HostSizingInputs& in, Bytes enough) {
  StatusOr<HostSizing> at = SizeHostChunks(packed, in, enough);
  ASSERT_THAT(at.status(), IsOk());
  EXPECT_LE(at->need(), enough);
  StatusOr<HostSizing> below = SizeHostChunks(packed, in, enough - 1);
  ASSERT_THAT(below.status(), IsOk());
  EXPECT_GT(below->need(), enough - 1);
}

TEST(HostFloor, ServingHoldsRoomForTheMostGroupsOneUnitPins) {
  EXPECT_EQ(HostReserveChunks(true), 7);    // one step's group (5) and 2 prefetched
  EXPECT_EQ(HostReserveChunks(true, 9), 7);
  EXPECT_EQ(HostReserveChunks(false), 6);   // the device minimum (4) and 2 prefetched
  EXPECT_EQ(HostReserveChunks(false, 3), 6);
  EXPECT_EQ(HostReserveChunks(false, 7), 9);
  // A served layer of 7 equal tensors, each a chunk group of its own at the share's chunk size.
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 7; ++i) specs.push_back({"w" + std::to_string(i), 1 << 20, false, 0});
  const auto packed = Packed(specs);
  HostSizingInputs in;
  in.per_elem = 4;
  in.compute_esize = 4;
  in.align_elems = chunks::kAlignElems;
  in.trainable = false;
  in.nvme = true;
  in.frozen.assign(7, true);
  StatusOr<HostSizing> bare = SizeHostChunks(packed, in, 128 * kMiB);
  ASSERT_THAT(bare.status(), IsOk());
  ASSERT_FALSE(bare->split);
  const Bytes chunk = AlignUp(bare->chunk_elems * 4, 4096);
  EXPECT_EQ(bare->reserve, 6 * chunk);
  in.units.assign(7, std::vector<int>{0});
  StatusOr<HostSizing> unit = SizeHostChunks(packed, in, 128 * kMiB);
  ASSERT_THAT(unit.status(), IsOk());
  EXPECT_EQ(unit->chunk_elems, bare->chunk_elems);
  EXPECT_EQ(unit->reserve, 9 * chunk);
  // The floor follows: the budget that is enough holds the 9 chunks at its own chunk size.
  StatusOr<Bytes> enough = SufficientHostBudget(packed, in);
  ASSERT_THAT(enough.status(), IsOk());
  ExpectTheFloorIsExact(packed, in, *enough);
  in.units.clear();
  StatusOr<Bytes> bare_enough = SufficientHostBudget(packed, in);
  ASSERT_THAT(bare_enough.status(), IsOk());
  EXPECT_LT(*bare_enough, *enough);
}

TEST(HostFloor, SplitsBelowTheWholeFloorAndCountsTheCopies) {
  const auto packed = Packed(Vocab32k());
  const HostSizingInputs in = Fp32Training();
  // 40 MiB: below 7 whole chunks of the head (58.5 MB), above the split floor.
  StatusOr<HostSizing> s = SizeHostChunks(packed, in, 40 * kMiB);
  ASSERT_THAT(s.status(), IsOk());
  EXPECT_TRUE(s->split);
  EXPECT_LE(s->chunk_elems * 4, 40 * kMiB / kHostChunkShare);
  // The embedding (index 0) and the head (the last) are equal: the first sets the room.
  EXPECT_EQ(s->room_tensor, 0);
  EXPECT_EQ(s->compute_room, 2u * 32000 * 64 * 4);  // its compute copy and its gradient
  // Its copy is assembled one piece's chunk pinned at a time: one chunk in the reserve.
  EXPECT_EQ(s->pinned_chunks, 1u);
  EXPECT_EQ(s->reserve, (7 + 1) * AlignUp(s->chunk_elems * 4, 4096));
  EXPECT_LE(s->need(), 40 * kMiB);
  // Served: one copy (no gradient) and 6 chunks.
  HostSizingInputs serve = in;
  serve.trainable = false;
  s = SizeHostChunks(packed, serve, 40 * kMiB);
  ASSERT_THAT(s.status(), IsOk());
  EXPECT_EQ(s->compute_room, 32000u * 64 * 4);
  EXPECT_EQ(s->reserve, (6 + 1) * AlignUp(s->chunk_elems * 4, 4096));
}

TEST(HostFloor, AFrozenSplitTensorCountsNoGradient) {
  const auto packed = Packed(Vocab32k());
  const size_t head = packed.size() - 1;
  // A LoRA-like run: the embedding frozen, the head trained (the head sets the room: 2 copies).
  HostSizingInputs in = Fp32Training();
  in.frozen.assign(packed.size(), false);
  in.frozen[0] = true;
  StatusOr<HostSizing> s = SizeHostChunks(packed, in, 40 * kMiB);
  ASSERT_THAT(s.status(), IsOk());
  ASSERT_TRUE(s->split);
  EXPECT_EQ(s->room_tensor, static_cast<int64_t>(head));
  EXPECT_EQ(s->compute_room, 2u * 32000 * 64 * 4);
  // Both frozen (others train): each split tensor's copy alone, no gradient; the reserve is
  // still a training step's (7 chunks + the pinned one).
  in.frozen[head] = true;
  s = SizeHostChunks(packed, in, 40 * kMiB);
  ASSERT_THAT(s.status(), IsOk());
  EXPECT_EQ(s->room_tensor, 0);
  EXPECT_EQ(s->compute_room, 32000u * 64 * 4);
  EXPECT_EQ(s->reserve, (7 + 1) * AlignUp(s->chunk_elems * 4, 4096));
  // And the floor follows: below the all-trainable one.
  StatusOr<Bytes> frozen_floor = SufficientHostBudget(packed, in);
  StatusOr<Bytes> trained_floor = SufficientHostBudget(packed, Fp32Training());
  ASSERT_THAT(frozen_floor.status(), IsOk());
  ASSERT_THAT(trained_floor.status(), IsOk());
  EXPECT_LT(*frozen_floor, *trained_floor);
}

TEST(HostFloor, TheFloorIsUnderThreeTimesTheLargestTensorAndExact) {
  const auto packed = Packed(Vocab32k());
  const HostSizingInputs in = Fp32Training();
  StatusOr<Bytes> enough = SufficientHostBudget(packed, in);
  ASSERT_THAT(enough.status(), IsOk());
  const Bytes largest = 32000 * 64 * 4;
  EXPECT_GE(*enough, 2 * largest);
  // 2 T / (1 - 8/32): the copy and its gradient, and 8 chunks of about the budget's share.
  EXPECT_LE(*enough, 2 * largest * 32 / 24);
  ExpectTheFloorIsExact(packed, in, *enough);
  // Below the whole-tensor floor of 7 chunks of the head.
  EXPECT_LT(*enough, 7 * largest);
}

std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-floor-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

StatusOr<std::unique_ptr<Session>> Create(const json& host, const std::string& nvme) {
  json config = {{"device_kind", "host"},
                 {"host", host},
                 {"nvme", {{"size", "64MiB"}, {"path", nvme}}}};
  TIERMEM_ASSIGN_OR_RETURN(SessionConfig c, ParseConfig(config, MapEnv({})));
  return Session::Create(c, Vocab32k());
}

TEST(HostFloor, ASessionBelowTheWholeFloorSplitsAndKeepsTheCopiesOutOfTheHostTier) {
  const std::string nvme = TempDir();
  StatusOr<std::unique_ptr<Session>> s = Create("40MiB", nvme);
  ASSERT_THAT(s.status(), IsOk());
  Session& sess = **s;
  const size_t head = sess.layout().num_tensors() - 1;
  EXPECT_TRUE(sess.layout().place(head).split());
  EXPECT_TRUE(sess.layout().place(0).split());
  EXPECT_FALSE(sess.layout().place(1).split());
  // The host tier holds the budget less the head's compute copy and gradient.
  StatusOr<chunks::EngineStats> st = sess.Stats();
  ASSERT_THAT(st.status(), IsOk());
  EXPECT_EQ(st->tiers[static_cast<int>(TierKind::kHost)].capacity,
            40 * kMiB - 2u * 32000 * 64 * 4);
  sess.Close();
  std::filesystem::remove_all(nvme);
}

TEST(HostFloor, TheRefusalNamesTheTensorAndTheBudgetThatIsEnough) {
  const std::string nvme = TempDir();
  StatusOr<std::unique_ptr<Session>> s = Create("12MiB", nvme);
  ASSERT_THAT(s.status(), StatusIs(StatusCode::kResourceExhausted, "is split across chunks"));
  const std::string msg = s.status().message();
  EXPECT_NE(msg.find("host budget of 12.00 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'model.embed_tokens.weight' (32000 x 64, fp32)"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("its contiguous compute copy and its gradient"), std::string::npos) << msg;
  StatusOr<Bytes> enough = SufficientHostBudget(Packed(Vocab32k()), Fp32Training());
  ASSERT_THAT(enough.status(), IsOk());
  EXPECT_NE(msg.find("a host budget of " + FormatBytes(*enough) + " (" + std::to_string(*enough) +
                     " bytes) is enough"),
            std::string::npos)
      << msg;
  // ... and it is: a session at that budget is created; one byte less is refused, needing it.
  StatusOr<std::unique_ptr<Session>> at = Create(*enough, nvme);
  ASSERT_THAT(at.status(), IsOk());
  (*at)->Close();
  StatusOr<std::unique_ptr<Session>> below = Create(*enough - 1, nvme);
  ASSERT_THAT(below.status(), StatusIs(StatusCode::kResourceExhausted, "is split across chunks"));
  StatusOr<HostSizing> sized = SizeHostChunks(Packed(Vocab32k()), Fp32Training(), *enough - 1);
  ASSERT_THAT(sized.status(), IsOk());
  EXPECT_NE(below.status().message().find("(" + std::to_string(*enough - 1) +
                                          " bytes) is below the minimum of " +
                                          FormatBytes(sized->need()) + " (" +
                                          std::to_string(sized->need()) + " bytes)"),
            std::string::npos)
      << below.status().message();
  std::filesystem::remove_all(nvme);
}

}  // namespace
}  // namespace tiermem::session
