#include "layout/chunk_layout.h"

#include <gtest/gtest.h>

#include <algorithm>


namespace tiermem::chunks {
namespace {

TEST(PackTensors, KeepsOrderNeverStraddlesAndAligns) {
  // capacity 100: [40 @0][30 @64? no: 40 -> aligned 64, 64+30=94 fits][50 -> new chunk @0]
  auto l = PackTensors({40, 30, 50, 10}, 100);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->placements.size(), 4u);
  EXPECT_EQ(l->placements[0].group, 0u);
  EXPECT_EQ(l->placements[0].offset, 0u);
  EXPECT_EQ(l->placements[1].group, 0u);
  EXPECT_EQ(l->placements[1].offset, 64u);
  EXPECT_EQ(l->placements[2].group, 1u);
  EXPECT_EQ(l->placements[2].offset, 0u);
  EXPECT_EQ(l->placements[3].group, 1u);
  EXPECT_EQ(l->placements[3].offset, 64u);
  EXPECT_EQ(l->num_groups(), 2u);
  EXPECT_EQ(l->total_numel, 130u);
  EXPECT_EQ(l->waste_elems(), 200u - 130u);
  for (const Placement& p : l->placements) {
    EXPECT_LE(p.offset + p.numel, 100u);
    EXPECT_EQ(p.offset % kAlignElems, 0u);
  }
}

TEST(PackTensors, RejectsTensorLargerThanChunkNamingIt) {
  auto l = PackTensors({10, 500, 10}, 100);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("tensor 1 has 500 elements"), std::string::npos);
  EXPECT_FALSE(PackTensors({1}, 0).ok());
  EXPECT_FALSE(PackTensors({0}, 10).ok());
}

TEST(ChooseChunkElems, FindsZeroWasteSizeWhenOneExists) {
  // Four tensors of 1024: capacity 2048 (or 4096) wastes nothing; the smaller wins the tie.
  auto c = ChooseChunkElems({1024, 1024, 1024, 1024}, 1 << 20, 4, 2);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->waste_elems, 0u);
  EXPECT_EQ(c->chunk_elems, 1024u);
  EXPECT_EQ(c->num_groups, 4u);
}

TEST(ChooseChunkElems, ChoiceIsNoWorseThanLargestTensorSize) {
  std::vector<uint64_t> numels = {3000, 700, 700, 3000, 96, 96, 2900, 64};
  auto c = ChooseChunkElems(numels, 1 << 24, 4, 4);
  ASSERT_TRUE(c.ok());
  auto base = PackTensors(numels, 3000);
  ASSERT_TRUE(base.ok());
  EXPECT_LE(c->waste_elems, base->waste_elems());
  auto check = PackTensors(numels, c->chunk_elems);
  ASSERT_TRUE(check.ok());
  EXPECT_EQ(check->waste_elems(), c->waste_elems);
  EXPECT_GE(c->chunk_elems, 3000u);
  EXPECT_LE(c->chunk_elems * 4 * 4, uint64_t{1} << 24);
}

TEST(ChooseChunkElems, BudgetBelowMinimumNamesMinimumBytes) {
  // Largest tensor 1000 fp32 elements, 3 resident chunks: minimum 12000 bytes.
  auto c = ChooseChunkElems({1000, 10}, 11999, 4, 3);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("minimum of 12000 bytes"), std::string::npos)
      << c.status().message();
  EXPECT_EQ(MinimumDeviceBudget(1000, 4, 3), 12000u);
  EXPECT_TRUE(ChooseChunkElems({1000, 10}, 12000, 4, 3).ok());
}

// ---- pieces ---------------------------------------------------------------------------------

// Every tensor's pieces cover it in order, each inside one chunk at an aligned offset, and no
// two pieces overlap.
void ExpectValid(const std::vector<PackTensor>& ts, const PieceLayout& l) {
  ASSERT_EQ(l.pieces.size(), ts.size());
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> spans(l.num_groups());
  for (size_t i = 0; i < ts.size(); ++i) {
    uint64_t next = 0;
    for (const Piece& p : l.pieces[i]) {
      EXPECT_EQ(p.begin, next) << "tensor " << i;
      EXPECT_EQ(p.numel % ts[i].row_elems(), 0u) << "whole rows";
      EXPECT_EQ(p.offset % kAlignElems, 0u);
      EXPECT_LE(p.offset + p.numel, l.chunk_elems);
      ASSERT_LT(p.group, l.num_groups());
      spans[p.group].push_back({p.offset, p.offset + p.numel});
      next += p.numel;
    }
    EXPECT_EQ(next, ts[i].numel) << "tensor " << i;
  }
  for (auto& s : spans) {
    std::sort(s.begin(), s.end());
    for (size_t k = 1; k < s.size(); ++k) EXPECT_LE(s[k - 1].second, s[k].first);
  }
}

TEST(PackPieces, TensorThatFitsIsWholeAndLargerOneIsSplitIntoRows) {
  // chunk 100: [40][a 300-element tensor of 10 rows of 30: 30 fills the rest of chunk 0 at 64?
  // no: 64 + 30 = 94 fits one row, then 3 rows per chunk][20]
  std::vector<PackTensor> ts = {{40, 1}, {300, 10}, {20, 1}};
  auto l = PackPieces(ts, 100);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ExpectValid(ts, *l);
  ASSERT_EQ(l->pieces[0].size(), 1u);
  ASSERT_EQ(l->pieces[1].size(), 4u);  // 1 row in chunk 0, then 3 + 3 + 3
  EXPECT_EQ(l->pieces[1][0].group, 0u);
  EXPECT_EQ(l->pieces[1][0].offset, 64u);
  EXPECT_EQ(l->pieces[1][0].numel, 30u);
  EXPECT_EQ(l->pieces[1][1].group, 1u);
  EXPECT_EQ(l->pieces[1][1].numel, 90u);
  EXPECT_EQ(l->pieces[1][3].group, 3u);
  EXPECT_EQ(l->pieces[1][3].begin, 210u);
  ASSERT_EQ(l->pieces[2].size(), 1u);
  EXPECT_EQ(l->pieces[2][0].group, 4u);  // 90 + 20 > 100 after alignment (96 + 20)
  EXPECT_EQ(l->total_numel, 360u);
  // Nothing larger than a chunk: the same layout as PackTensors.
  auto same = PackPieces({{40, 1}, {30, 3}, {50, 5}, {10, 1}}, 100);
  auto old = PackTensors({40, 30, 50, 10}, 100);
  ASSERT_TRUE(same.ok() && old.ok());
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_EQ(same->pieces[i].size(), 1u);
    EXPECT_EQ(same->pieces[i][0].group, old->placements[i].group);
    EXPECT_EQ(same->pieces[i][0].offset, old->placements[i].offset);
  }
}

TEST(PackPieces, RowLargerThanChunkIsAnErrorNamingTheTensor) {
  auto l = PackPieces({{10, 1}, {500, 2}}, 100);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("tensor 1 has rows of 250 elements"), std::string::npos)
      << l.status().message();
  EXPECT_FALSE(PackPieces({{10, 3}}, 100).ok());  // 3 rows do not divide 10 elements
}

TEST(PackPieces, FusedExpertsArePackedExpertByExpertOnePerChunk) {
  // A layer: attention (64), router (4 x 8), gate_up [4 experts, 2 x 8, 8] = 128 per expert,
  // down [4, 8, 8] = 64 per expert, then a norm (8). Item = 128 + 64 = 192 elements.
  std::vector<PackTensor> ts = {{64, 8}, {32, 4}, {512, 4, 0, -1}, {256, 4, 0, -1}, {8, 8}};
  auto item = LargestExpertItem(ts);
  ASSERT_TRUE(item.ok());
  EXPECT_EQ(*item, 192u);
  auto l = PackPieces(ts, 192);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ExpectValid(ts, *l);
  ASSERT_EQ(l->pieces[2].size(), 4u);
  ASSERT_EQ(l->pieces[3].size(), 4u);
  for (int e = 0; e < 4; ++e) {
    const Piece& gu = l->pieces[2][e];
    const Piece& dn = l->pieces[3][e];
    EXPECT_EQ(gu.expert, e);
    EXPECT_EQ(dn.expert, e);
    EXPECT_EQ(gu.group, dn.group) << "an expert's slices share a chunk";
    EXPECT_EQ(gu.group, 1u + e) << "one chunk per expert, after the dense chunk";
    EXPECT_EQ(gu.offset, 0u);
    EXPECT_EQ(dn.offset, 128u);
    EXPECT_EQ(gu.begin, 128u * e);
  }
  EXPECT_EQ(l->pieces[4][0].group, 5u);
  EXPECT_EQ(l->pieces[0][0].group, 0u);
  EXPECT_EQ(l->pieces[1][0].group, 0u);
}

TEST(PackPieces, ModuleListExpertsAndItemsLargerThanAChunk) {
  // Per-expert tensors (expert index given): 3 experts of two tensors (w1 64, w2 64).
  std::vector<PackTensor> ts;
  for (int e = 0; e < 3; ++e) {
    ts.push_back({64, 8, 7, e});
    ts.push_back({64, 8, 7, e});
  }
  auto l = PackPieces(ts, 128);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ExpectValid(ts, *l);
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(l->pieces[2 * e][0].group, static_cast<uint32_t>(e));
    EXPECT_EQ(l->pieces[2 * e + 1][0].group, static_cast<uint32_t>(e));
    EXPECT_EQ(l->pieces[2 * e][0].expert, e);
  }
  // An item larger than the chunk goes piece by piece (rows split as any tensor's).
  auto small = PackPieces(ts, 64);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ExpectValid(ts, *small);
  // Inconsistent sets are refused.
  EXPECT_FALSE(PackPieces({{64, 4, 0, -1}, {60, 5, 0, -1}}, 1000).ok());
  EXPECT_FALSE(PackPieces({{64, 4, 0, -1}, {16, 1, 0, 4}}, 1000).ok());
}

TEST(ChooseChunkElemsPieces, SplitsOnlyWhenTheBudgetCannotHoldTheLargestTensor) {
  // 4 tensors; the largest is 8000 elements in 100 rows. 4 B/elem, 4 resident chunks.
  std::vector<PackTensor> ts = {{1000, 10}, {8000, 50}, {1000, 10}, {500, 5}};
  // Room for 4 chunks of the largest tensor: the numel search, nothing split.
  auto big = ChooseChunkElems(ts, 4 * 4 * 8000, 4, 4);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_GE(big->chunk_elems, 8000u);
  // A quarter of that: chunks of at most 2000 elements, the largest tensor in pieces.
  auto small = ChooseChunkElems(ts, 4 * 4 * 2000, 4, 4);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_LE(small->chunk_elems, 2000u);
  EXPECT_GE(small->chunk_elems, 1000u);
  auto l = PackPieces(ts, small->chunk_elems);
  ASSERT_TRUE(l.ok());
  ExpectValid(ts, *l);
  EXPECT_GT(l->pieces[1].size(), 1u);
  // Below 4 chunks of the largest row (160 elements = 2560 bytes): refused, naming the piece.
  auto none = ChooseChunkElems(ts, 2559, 4, 4);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("minimum of 2560 bytes"), std::string::npos)
      << none.status().message();
  EXPECT_NE(none.status().message().find("a row of 160 elements of tensor 1"),
            std::string::npos);
  EXPECT_TRUE(ChooseChunkElems(ts, 2560, 4, 4).ok());
}

TEST(ChooseChunkElemsPieces, ExpertSetsGetAChunkPerExpert) {
  std::vector<PackTensor> ts = {{64, 8}, {32, 4}, {512, 4, 0, -1}, {256, 4, 0, -1}, {8, 8}};
  auto c = ChooseChunkElems(ts, 1 << 20, 4, 4);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->chunk_elems, 192u);  // the expert item, though the budget allows far more
  // A budget below 4 items but above 4 rows: smaller chunks, an expert's slices apart.
  auto tight = ChooseChunkElems(ts, 4 * 4 * 150, 4, 4);
  ASSERT_TRUE(tight.ok()) << tight.status().ToString();
  EXPECT_EQ(tight->chunk_elems, 150u);
}

}  // namespace
}  // namespace tiermem::chunks
