// AssignParamGroups (runtime/param_groups.h): the one rule both bindings use for optimizer
// param groups, and its messages (the Python package and the LibTorch API report these).
#include "runtime/param_groups.h"

#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::StatusIs;
using Members = std::vector<std::vector<int64_t>>;

const std::vector<TensorSpec> kTensors = {
    {"a", 4, true, 0}, {"frozen", 4, false, 0}, {"b", 4, true, 0}, {"c", 4, true, 0}};

TEST(ParamGroups, WithoutGroupsEveryTensorIsInGroupZero) {
  auto g = AssignParamGroups(kTensors, std::nullopt);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(*g, std::vector<int>({0, 0, 0, 0}));
}

TEST(ParamGroups, EachTrainableTensorGetsItsGroupAndFrozenOnesZero) {
  auto g = AssignParamGroups(kTensors, Members{{3}, {2, 0}});
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(*g, std::vector<int>({1, 0, 1, 0}));
}

TEST(ParamGroups, EveryBrokenRuleIsNamed) {
  EXPECT_THAT(AssignParamGroups(kTensors, Members{{0, 2, 3}, {kNotAModelTensor}}),
              StatusIs(StatusCode::kInvalidArgument,
                       "param_groups[1] holds a tensor that is not a parameter of the model"));
  EXPECT_THAT(AssignParamGroups(kTensors, Members{{0, 2, 3, 7}}),
              StatusIs(StatusCode::kInvalidArgument, "not a parameter of the model"));
  EXPECT_THAT(AssignParamGroups(kTensors, Members{{0, 2}, {3, 2}}),
              StatusIs(StatusCode::kInvalidArgument,
                       "param_groups[1]: parameter b appears in more than one group"));
  EXPECT_THAT(AssignParamGroups(kTensors, Members{{0, 0, 2, 3}}),
              StatusIs(StatusCode::kInvalidArgument, "parameter a appears in more than one"));
  EXPECT_THAT(AssignParamGroups(kTensors, Members{{0, 1, 2, 3}}),
              StatusIs(StatusCode::kInvalidArgument,
                       "param_groups[0]: parameter frozen is frozen (requires_grad=False)"));
  EXPECT_THAT(AssignParamGroups(kTensors, Members{{0, 3}}),
              StatusIs(StatusCode::kInvalidArgument,
                       "trainable parameter b is in no param group"));
  EXPECT_THAT(AssignParamGroups(kTensors, Members{}),
              StatusIs(StatusCode::kInvalidArgument, "trainable parameter a is in no param group"));
}

}  // namespace
}  // namespace tiermem::session
