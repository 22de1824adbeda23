// AssignParamGroups (see param_groups.h). Checks run group by group, tensor by tensor, in the
// binding's order, so the first broken rule is the one reported.
#include "runtime/param_groups.h"

#include <string>

namespace tiermem::session {

StatusOr<std::vector<int>> AssignParamGroups(
    const std::vector<TensorSpec>& tensors,
    const std::optional<std::vector<std::vector<int64_t>>>& members) {
  std::vector<int> group_of(tensors.size(), -1);
  if (!members) {
    for (size_t i = 0; i < tensors.size(); ++i) group_of[i] = 0;
    return group_of;
  }
  for (size_t g = 0; g < members->size(); ++g) {
    const std::string where = "param_groups[" + std::to_string(g) + "]";
    for (const int64_t i : (*members)[g]) {
      if (i < 0 || static_cast<size_t>(i) >= tensors.size()) {
        return InvalidArgumentError(where + " holds a tensor that is not a parameter of the model");
      }
      const TensorSpec& t = tensors[static_cast<size_t>(i)];
      if (group_of[i] >= 0) {
        return InvalidArgumentError(where + ": parameter " + t.name +
                                    " appears in more than one group");
      }
      if (!t.trainable) {
        return InvalidArgumentError(where + ": parameter " + t.name +
                                    " is frozen (requires_grad=False)");
      }
      group_of[i] = static_cast<int>(g);
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].trainable && group_of[i] < 0) {
      return InvalidArgumentError("trainable parameter " + tensors[i].name +
                                  " is in no param group");
    }
    if (group_of[i] < 0) group_of[i] = 0;
  }
  return group_of;
}

}  // namespace tiermem::session
