// Optimizer param groups: the rule that says which group each trainable tensor belongs to,
// checked in one place for both bindings (the Python package's param_groups= and the LibTorch
// API's ParamGroup list), with the same messages.
//
// Rules: every tensor a group lists is one of the model's tensors, trainable, and listed once
// (in one group, once); every trainable tensor is in a group. Without groups, one group holds
// every trainable tensor.
//
// Thread-safety: a pure function.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "base/status.h"
#include "runtime/session.h"

namespace tiermem::session {

// Stands in `members` for a tensor a group lists that is not one of the model's.
inline constexpr int64_t kNotAModelTensor = -1;

// `members[g]`: the tensors group g lists, as indices into `tensors` (or kNotAModelTensor),
// in the binding's order; nullopt: the default single group. Returns each tensor's group
// (frozen tensors: 0), for TensorSpec::opt_group. kInvalidArgument naming the group and the
// tensor when a rule is broken:
//   "param_groups[G] holds a tensor that is not a parameter of the model"
//   "param_groups[G]: parameter NAME appears in more than one group"
//   "param_groups[G]: parameter NAME is frozen (requires_grad=False)"
//   "trainable parameter NAME is in no param group"
StatusOr<std::vector<int>> AssignParamGroups(
    const std::vector<TensorSpec>& tensors,
    const std::optional<std::vector<std::vector<int64_t>>>& members);

}  // namespace tiermem::session
