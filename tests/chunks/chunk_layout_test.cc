#include "chunks/chunk_layout.h"

#include <gtest/gtest.h>


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

}  // namespace
}  // namespace tiermem::chunks
